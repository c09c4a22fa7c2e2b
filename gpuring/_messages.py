"""Point-to-point messages of NumPy arrays: the engine that matches, moves and completes them
(`Messages`), one per communicator, with no thread and no communicator per pair.

Lanes. A rank reaches each peer of its node through the peer's inbox (`_mailbox`: a ring of
records per sender in shared memory, set up once when the communicator is made), and the
peers of other nodes through MPI (`transports.mpi_messages`; the ranks must then come from
`mpiexec`). A message to itself goes straight to the matching.

Protocol. A message of at most `eager_bytes` goes eagerly: header and data in one record,
one copy into the receiver's inbox, no round trip; the send is complete once it is written.
A larger one is announced (RTS) and its data waits for the receiver. Once matched, the
receiver copies it straight from the sender's array and says so (FIN): one copy, where the
array lies in registered memory (`Communicator.empty`, which every peer maps), or by
cross-memory attach (`_cma`, probed once per peer). Else it asks for the data (CTS) and the
sender streams it in pieces of a quarter of the ring (pipelined: the receiver copies one out
while the sender writes the next).

Matching (MPI's rules). A message matches the first receive posted for its source (or for
any source) and tag; a receive matches the first message that arrived from its source (or
from any) with its tag. Messages between two ranks arrive in the order sent, so messages of
one pair and tag are received in that order (non-overtaking). An eager message no receive
waits for is copied out of the ring and kept (`unexpected`), so that the ring keeps flowing
and a later message of another tag can be received first. The receive buffer needs room, not
the same shape: the same dtype, at most as many elements; a message that differs is refused
on both ranks (`CollectiveMismatchError`: the receive raises it, and the sender's send, or,
where the send completed already, the sender's next point-to-point call, or `synchronize()`).

Progress. Nothing moves between calls: every wait, `done()`, post and `synchronize()` makes
progress on every lane (writes what waits for room, reads what arrived), so that the
operations of any number of ranks, posted in any order, complete. Waits are bounded: they end
on the communicator's failure (a peer that died or gave up, `abort()`), a peer that left while
this rank waits for it, or the timeout without progress (`CollectiveTimeoutError` naming the
peer); any of these breaks the communicator, as a collective's failure does.

Groups (`group()`, `batch`): the operations listed in a group are posted together when it
ends, so that no rank's listing order matters (posting never blocks).
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from . import _cma, _failures
from ._cuda_messages import CudaArrival, CudaMessages, GpuMessages
from ._errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    GpuringError,
    PeerFailureError,
)
from ._failures import State, in_context
from ._mailbox import (
    CTS,
    DATA,
    EAGER,
    FIN,
    GPU_DETACHED,
    GPU_RTS,
    NACK,
    RTS,
    Header,
    ShmLane,
)
from ._message_lanes import Lanes, Parts, set_up
from ._message_ops import (
    ATTACHED,
    AWAITING,
    EAGERLY,
    QUEUED,
    REGISTERED,
    STAGED,
    STREAMING,
    TAGS,
    MessageWork,
    Recv,
    Send,
    dtype_names,
)
from ._status import process_alive

if TYPE_CHECKING:
    from ._registry import Registry
    from ._timeline import Timeline
    from .rendezvous.base import ControlPlane

__all__ = ["Messages", "MessagePath"]

log = logging.getLogger("gpuring")

#: seconds a wait polls without a pause, then yields the processor, before it starts to
#: sleep (a peer that runs answers within microseconds; where ranks outnumber processors,
#: polling keeps the one it waits for from running, hence the short first stretch)
_BUSY, _SPIN = 1e-3, 1e-2
#: the busy stretch where this node runs more ranks than it has processors
_BUSY_CROWDED = 2e-5
#: seconds between a wait's checks for failures (and for peers that left)
_CHECK_EVERY = 0.02
#: where a registered array lies, as an RTS record's payload: registration, offset
_WHERE = struct.Struct("<qq")
_TAGS = TAGS
_OPEN = State.OPEN
#: the dtypes messages were checked with so far, by dtype (`_message_ops.dtype_bytes`)
_DTYPES = dtype_names()


class MessagePath(Protocol):
    """What the engine reads of its communicator's call path (`CallPath`)."""

    rank: int
    size: int
    life: Any
    registry: Registry
    @property
    def timeline(self) -> Timeline | None: ...
    #: devices a failure aborts besides the engines' (the GPU of CuPy messages goes there)
    devices: list[Any]
    #: per kind of device: whether the ranks map each other's memory (once decided)
    mappable: dict[str, bool]

    @property
    def watchdog(self) -> Any: ...

    def ensure_watchdog(self) -> None: ...


def _processors() -> int:
    """The processors this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class _Pending(NamedTuple):
    """What a wait waits for: the operation (None: a fast path's, which has none), its name,
    the rank it waits for (None: any) and what has not happened, in words."""

    name: str
    peer: int | None
    op: Send | Recv | None
    what: str


class _Arrival:
    """A message that came before any receive matched it: an eager one's data (copied out
    of the ring), or a larger one's announcement."""

    __slots__ = ("count", "data", "dtype", "kind", "mode", "msg", "nbytes", "source", "tag",
                 "where")

    def __init__(self, source: int, header: Header, data: Any):
        self.source = source
        self.kind = header.kind
        self.mode = header.aux
        self.msg = header.msg
        self.tag = header.a
        self.count = header.b
        self.nbytes = header.c
        self.dtype = header.dtype.rstrip(b"\0")
        self.data = data  #: an eager message's bytes, an RTS's payload


class Messages:
    """The point-to-point messages of one communicator (made with it, on every rank at once:
    the ranks of one node map each other's inboxes then)."""

    def __init__(self, path: MessagePath, control: ControlPlane, transport: str,
                 timeout: float, *, setup: bool = True):
        self.path = path
        self.control = control
        self.rank, self.size = control.rank, control.size
        self.timeout = timeout
        self.lock = threading.RLock()
        found = set_up(control, transport, timeout, path.ensure_watchdog) \
            if self.size > 1 and setup else Lanes()
        self.lanes = found.lanes
        self._shm = found.shm  #: the lanes polled for records, in rank order
        self._near_of = found.near  #: the lanes of the peers of this node
        self._pids = found.pids  #: the process of each peer of this node
        #: whether this rank may read each peer's memory directly (`_cma`)
        self._attach = found.attach
        self._unreachable = found.unreachable  #: why a peer cannot be messaged
        self._mpi = found.mpi
        self._device = found.device
        self.eager_bytes = found.eager_bytes
        self._ring_bytes = found.ring_bytes
        self._parts = found.parts
        self._outbox: dict[int, collections.deque[Any]] = collections.defaultdict(
            collections.deque)
        self._busy: dict[int, None] = {}  #: peers whose outbox holds something, in order
        self._posted: list[Recv] = []  #: receives no message matched yet, in posting order
        self._unexpected: list[_Arrival] = []  #: messages no receive matched yet
        self._streams: dict[tuple[int, int], Recv] = {}  #: (peer, msg) -> its receive
        self._awaiting: dict[tuple[int, int], Send] = {}  #: (peer, msg) -> its send
        self._numbers = [0] * self.size  #: messages posted to each rank so far
        self._refused: list[GpuringError] = []  #: refusals of sends that had completed
        self._group: list[Send | Recv] | None = None  #: the open group's operations
        #: messages take the general path: a group is open, or a refusal waits to be raised
        self._held = False
        self._depth = 0
        self.operations = 0  #: operations posted so far (the numbers in their errors)
        self.moves = 0  #: progress passes that moved something (waits measure idleness by it)
        self.transport = transport
        #: the host's side of CuPy messages (their GPU part is made on first use)
        self.gpu = GpuMessages(self, self._make_gpu)
        #: how long a wait polls without a pause: short where this node's ranks outnumber
        #: its processors (polling would keep the rank waited for from running)
        self.busy_seconds = _BUSY if control.local_size <= _processors() else _BUSY_CROWDED

    def parts(self) -> Parts:
        """What closing the communicator closes of its messages (it holds nothing of the
        communicator: its finalizer keeps it)."""
        return self._parts

    def _make_gpu(self) -> CudaMessages:
        """The GPU part of CuPy messages (on their first use)."""
        if not self._near_of:
            raise GpuringError("CuPy messages travel between ranks of one node, and this "
                               "rank has no peer on its node")
        made = CudaMessages(self.control, self._near_of, self.timeout, self._ring_bytes)
        self._parts.gpu.append(made)
        self.path.devices.append(made.device)  # (a failure of the communicator aborts it)
        return made

    def gpu_reaches(self, peer: int | None) -> bool:
        """Whether CuPy messages to or from `peer` (None: any) take the GPU path (the ranks
        of this node, with their GPUs mapping each other's memory)."""
        if self.transport == "nccl" or self.path.mappable.get("cuda") is False:
            return False
        return peer is None or peer in self._near_of

    # -- posting -------------------------------------------------------------------------
    def check(self, name: str) -> None:
        """Before a verb: the communicator must be usable, and a refusal of one of this
        rank's sends that completed before it was refused is raised now."""
        path = self.path
        if path.life.state is not State.OPEN:
            path.life.check(name, self.operations + 1)
        if self._refused:
            with self.lock:
                if self._refused:
                    error = self._refused.pop(0)
                    self._held = bool(self._refused) or self._group is not None
                    raise error

    def lane_for(self, peer: int) -> Any:
        lane = self.lanes.get(peer)
        if lane is None and peer != self.rank:
            raise GpuringError(self._unreachable.get(
                peer, f"rank {self.rank} has no way to message rank {peer}"))
        return lane

    def post(self, op: Send | Recv) -> MessageWork:
        """Start `op` (a group's operations start when the group ends)."""
        work = MessageWork(self, op)
        self.operations += 1
        timeline = self.path.timeline
        if timeline is not None:
            op.begin = timeline.now()
        if self._group is not None:
            self._group.append(op)
            return work
        with self.lock:
            if isinstance(op, Send):
                if op.cuda:
                    op.msg = self._number(op.peer)
                    self.gpu.post_send(op)
                else:
                    self._post_send(op)
            elif op.cuda:
                self.gpu.post_recv(op)
            else:
                self._post_recv(op)
        return work

    def _number(self, peer: int) -> int:
        """The next message number to `peer`."""
        msg = self._numbers[peer]
        self._numbers[peer] = msg + 1
        return msg

    def _post_send(self, op: Send) -> None:
        peer = op.peer
        op.msg = self._numbers[peer]
        self._numbers[peer] += 1
        if peer == self.rank:  # a copy, matched at once
            header = Header(EAGER, 0, 0, op.msg, op.tag, op.count, op.nbytes, op.dtype)
            self._finish(op)
            self._arrived(peer, header, bytes(op.data))
            return
        if op.nbytes > self.eager_bytes:
            op.mode = STAGED
            found = None
            if peer in self._pids and self.path.registry:
                found = self.path.registry.find("cpu", op.array)
            if found is not None:
                op.mode, op.where = REGISTERED, _WHERE.pack(*found)
            elif peer in self._pids:  # where the receiver may read it here, it does
                op.mode, op.where = ATTACHED, _WHERE.pack(int(op.array.ctypes.data), 0)
        box = self._outbox[peer]
        box.append(op)
        if len(box) == 1:
            self._busy[peer] = None
            self._push(peer)

    def _post_recv(self, op: Recv) -> None:
        for i, arrival in enumerate(self._unexpected):
            if arrival.tag == op.tag and (op.src is None or op.src == arrival.source):
                del self._unexpected[i]
                self._deliver(arrival, op, arrival.data)
                return
        self._posted.append(op)

    # -- the fast paths of small messages between two ranks of a node --------------------
    def send_small(self, x: Any, dst: Any, tag: Any) -> bool:
        """`send` of a small NumPy array to a peer of this node where nothing waits to go
        there before it: written now, one copy, no operation made; False where the call
        takes the general path (anything else, including arguments to check)."""
        if type(dst) is not int or type(tag) is not int or not -_TAGS <= tag < _TAGS:
            return False
        lane = self._near_of.get(dst)
        path = self.path
        if lane is None or self._held or dst in self._busy or path.timeline is not None \
                or path.life.state is not _OPEN:
            return False
        dtype = _DTYPES.get(x.dtype)
        if dtype is None:
            return False
        try:
            data = memoryview(x).cast("B")
        except (TypeError, ValueError):  # (not C-contiguous, empty, ...)
            return False
        if len(data) > self.eager_bytes:
            return False
        with self.lock:
            msg = self._numbers[dst]
            if not lane.put(EAGER, msg, tag, x.size, len(data), dtype, data):
                return False
            self._numbers[dst] = msg + 1
        self.operations += 1
        return True

    def recv_small(self, out: Any, src: Any, tag: Any) -> int | None:
        """`recv` from a peer of this node where no other receive is pending and no message
        waits unmatched: the next record from it, copied straight into `out` if it is a small
        message with this tag that fits; its element count, or None where the call takes the
        general path (anything else: nothing of the message was consumed then)."""
        if type(src) is not int or type(tag) is not int:
            return None
        lane = self._near_of.get(src)
        path = self.path
        if lane is None or self._held or self._posted or self._unexpected or \
                path.timeline is not None or path.life.state is not _OPEN:
            return None
        dtype = _DTYPES.get(out.dtype)
        if dtype is None or not out.flags.writeable:
            return None
        try:
            data = memoryview(out).cast("B")
        except (TypeError, ValueError):
            return None
        capacity = out.size
        with self.lock:
            got = lane.take_eager(tag, dtype, capacity, data)
        if got == -1:  # not yet: wait for it, making progress with the rest meanwhile
            others = len(self._shm) > 1 or self._mpi is not None
            found = [-1]

            def ready() -> bool:
                found[0] = lane.take_eager(tag, dtype, capacity, data)
                if found[0] != -1:
                    return True
                if self._busy or others:
                    self._progress()
                    if self._unexpected:  # (its record went the general way)
                        found[0] = -2
                        return True
                return False

            self._loop(ready, lambda: _Pending(
                f"recv from rank {src} (tag {tag})", src, None,
                f"no message with tag {tag} came from rank {src}"))
            got = found[0]
        if got < 0:
            return None
        self.operations += 1
        return got

    # -- groups --------------------------------------------------------------------------
    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """The operations posted inside start together when the outermost group ends (none
        if it ends by an exception: their works fail with it)."""
        if self._depth == 0:
            self._group = []
            self._held = True
        self._depth += 1
        try:
            yield
        except BaseException as exc:
            self._depth -= 1
            if self._depth == 0:
                ops, self._group = self._group or [], None
                self._held = bool(self._refused)
                for op in ops:
                    self._fail(op, GpuringError(f"{op.name} was not posted: its group ended "
                                                f"with {type(exc).__name__}: {exc}"))
            raise
        self._depth -= 1
        if self._depth == 0:
            ops, self._group = self._group or [], None
            self._held = bool(self._refused)
            with self.lock:
                for op in ops:
                    if isinstance(op, Send) and not op.cuda:
                        self._post_send(op)
                for op in ops:
                    if isinstance(op, Recv) and not op.cuda:
                        self._post_recv(op)
                sends = [op for op in ops if isinstance(op, Send) and op.cuda]
                receives = [op for op in ops if isinstance(op, Recv) and op.cuda]
                for op in sends:
                    op.msg = self._number(op.peer)
            if sends or receives:
                self.gpu.run_group(sends, receives)

    # -- progress ------------------------------------------------------------------------
    def poll(self, op: Send | Recv | None = None) -> None:
        """Make progress once (`Work.done()`); a CuPy receive `op` is queued now where its
        header came."""
        with self.lock:
            self._progress()
        if isinstance(op, Recv) and op.cuda:
            self.gpu.ready_now(op)

    # -- what the CuPy messages ask of this engine (`_cuda_messages.HostEngine`) --------------
    def send_record(self, peer: int, kind: int, msg: int, a: int, b: int, c: int,
                    dtype: bytes, payload: bytes, name: str, wait: bool = True) -> None:
        """Write a record into `peer`'s ring before returning (`wait`; else it may stay
        queued here): where the ring is full, make progress until the peer took enough
        (nothing else would write it once the caller goes on to work that makes no progress
        here, such as a collective)."""
        record = (kind, msg, a, b, c, dtype, payload, len(payload))
        box = self._outbox[peer]
        with self.lock:
            box.append(record)
            if len(box) == 1:
                self._busy[peer] = None
                self._push(peer)
            if not wait or not any(item is record for item in box):
                return
        self.wait_until(lambda: not any(item is record for item in box), name, peer,
                        f"rank {peer} took nothing from its full ring from this rank")

    def refuse(self, peer: int, msg: int, text: str,
               differences: dict[str, dict[int, Any]]) -> None:
        """Tell `peer` that this rank refused its message `msg`, and why."""
        body = json.dumps({"text": f"rank {self.rank} received it: {text}",
                           "differences": differences}).encode()
        with self.lock:
            self._send_control(peer, NACK, msg, body)

    def wait_until(self, ready: Callable[[], bool], name: str, peer: int | None,
                   what: str) -> None:
        """Make progress until `ready()` (under the lock), as a wait does."""
        progress = self._progress

        def moved() -> bool:
            progress()
            return ready()

        self._loop(moved, lambda: _Pending(name, peer, None, what))

    def finish(self, op: Send | Recv) -> None:
        self._finish(op)

    def fail(self, op: Send | Recv, error: BaseException) -> None:
        self._fail(op, error)

    def _progress(self) -> bool:
        """Push and pull every lane once; whether anything moved (counted in `moves`)."""
        did = False
        if self._busy:
            for peer in list(self._busy):
                did = self._push(peer) or did
        for lane in self._shm:
            if lane.waiting():
                did = self._pull(lane) or did
        if self._mpi is not None:
            did = self._mpi.poll(self._record) or did
        if did:
            self.moves += 1
        return did

    def _pull(self, lane: ShmLane) -> bool:
        peer = lane.peer
        while True:
            got = lane.take()
            if got is None:
                break
            header, payload = got
            self._record(peer, header, payload)
            lane.skip(header)
            if header.kind == DATA:  # its room back at once: the sender writes the next
                lane.release()  # piece while this rank copies out the one after
        lane.release()
        return True

    def _push(self, peer: int) -> bool:
        """Write what waits for `peer` while its lane has room; whether anything moved."""
        box = self._outbox[peer]
        lane = self.lanes[peer]
        did = False
        while box:
            item = box[0]
            if isinstance(item, tuple):
                if not lane.put(*item):
                    break
            elif item.state == QUEUED:
                if item.mode == EAGERLY:
                    if not lane.put(EAGER, item.msg, item.tag, item.count, item.nbytes,
                                    item.dtype, item.data):
                        break
                    self._finish(item)
                else:
                    if not lane.put(RTS, item.msg, item.tag, item.count, item.nbytes,
                                    item.dtype, item.where, aux=item.mode):
                        break
                    item.state = AWAITING
                    self._awaiting[(peer, item.msg)] = item
            else:
                before = item.sent
                if not self._stream(lane, item):
                    did = did or item.sent != before
                    break
            box.popleft()
            did = True
        if not box:
            self._busy.pop(peer, None)
        return did

    def _stream(self, lane: Any, op: Send) -> bool:
        """Hand `op`'s data (asked for by its receiver) to `lane`; whether all of it went."""
        if not lane.records_data:
            op.sent = op.nbytes
            return bool(lane.stream(op.data, lambda: self._finish(op)))
        piece, data = lane.piece, op.data
        while op.sent < op.nbytes:
            n = min(piece, op.nbytes - op.sent)
            if not lane.put(DATA, op.msg, op.sent, 0, n, b"", data[op.sent:op.sent + n]):
                return False
            op.sent += n
        self._finish(op)
        return True

    def _send_control(self, peer: int, kind: int, msg: int, payload: bytes | None = None
                      ) -> None:
        """Queue a record that answers message `msg` of `peer` (CTS, FIN, NACK)."""
        box = self._outbox[peer]
        box.append((kind, msg, 0, 0, 0 if payload is None else len(payload), b"", payload))
        if len(box) == 1:
            self._busy[peer] = None
            self._push(peer)

    # -- records that arrived --------------------------------------------------------------
    def _record(self, peer: int, header: Header, payload: memoryview) -> None:
        kind = header.kind
        if kind == EAGER or kind == RTS:
            self._arrived(peer, header, payload)
        elif kind == GPU_RTS:
            arrival = CudaArrival(peer, header.msg, header.a, header.b, header.c,
                                  header.dtype.rstrip(b"\0"),
                                  json.loads(bytes(payload[:header.aux]).decode()))
            if arrival.handle is not None:
                self.gpu.handles_from.add(peer)
            self.gpu.arrivals.append(arrival)
        elif kind == GPU_DETACHED:
            self.gpu.detached.add(peer)
        elif kind == DATA:
            op = self._streams[(peer, header.msg)]
            start = header.a
            op.data[start:start + header.c] = payload[:header.c]
            op.got += header.c
            if op.got >= op.nbytes:
                del self._streams[(peer, header.msg)]
                self._finish(op)
        elif kind == CTS:
            send = self._awaiting.pop((peer, header.msg))
            send.state = STREAMING
            box = self._outbox[peer]
            box.append(send)
            self._busy[peer] = None
        elif kind == FIN:
            self._finish(self._awaiting.pop((peer, header.msg)))
        elif kind == NACK:
            refusal = json.loads(bytes(payload[:header.c]).decode())
            pending = self._awaiting.pop((peer, header.msg), None)
            error = CollectiveMismatchError(
                f"{'a send' if pending is None else pending.name} on rank {self.rank} was "
                f"refused: {refusal['text']}",
                differences={k: {int(r): v for r, v in d.items()}
                             for k, d in refusal["differences"].items()})
            if pending is not None:
                self._fail(pending, error)
            else:
                self._refused.append(error)
                self._held = True

    def _arrived(self, peer: int, header: Header, payload: Any) -> None:
        """An eager message or an announcement from `peer`: to the first receive posted for
        it, else kept until one is."""
        tag = header.a
        for i, op in enumerate(self._posted):
            if op.tag == tag and (op.src is None or op.src == peer):
                del self._posted[i]
                self._deliver(_Arrival(peer, header, None), op, payload)
                return
        if header.kind == EAGER:
            payload = bytes(payload[:header.c])
        else:
            payload = bytes(payload[:_WHERE.size]) if header.aux in (REGISTERED, ATTACHED) \
                else None
        self._unexpected.append(_Arrival(peer, header, payload))

    def _deliver(self, arrival: _Arrival, op: Recv, payload: Any) -> None:
        """Receive `arrival` (`payload`: its eager data, or where its data lies) with `op`."""
        peer = arrival.source
        op.source, op.count, op.nbytes = peer, arrival.count, arrival.nbytes
        refusal = self.refusal(arrival, op)
        if refusal is not None:
            text, differences = refusal
            self._fail(op, CollectiveMismatchError(f"{op.name} on rank {self.rank}: {text}",
                                                   differences=differences))
            if peer != self.rank:
                body = json.dumps({"text": f"rank {self.rank} received it: {text}",
                                   "differences": differences}).encode()
                self._send_control(peer, NACK, arrival.msg, body)
            return
        nbytes = arrival.nbytes
        if arrival.kind == EAGER:
            op.data[:nbytes] = payload[:nbytes]
            op.got = nbytes
            self._finish(op)
        elif arrival.mode == REGISTERED:
            ident, offset = _WHERE.unpack(bytes(payload[:_WHERE.size]))
            mem = self.path.registry.memory(ident, peer)
            op.data[:nbytes] = mem.view(offset, nbytes, "u1")  # type: ignore[attr-defined]
            op.got = nbytes
            self._finish(op)
            self._send_control(peer, FIN, arrival.msg)
        elif arrival.mode == ATTACHED and self._attach.get(peer):
            address, _ = _WHERE.unpack(bytes(payload[:_WHERE.size]))
            try:
                _cma.read(self._pids[peer], address, op.out, nbytes)
            except OSError as exc:  # refused now (or gone: then its failure comes)
                log.info("gpuring: rank %d reads no more from rank %d directly (%s); its "
                         "messages come in pieces", self.rank, peer, exc)
                self._attach[peer] = False
                self._deliver(arrival, op, None)  # (staged instead)
                return
            op.got = nbytes
            self._finish(op)
            self._send_control(peer, FIN, arrival.msg)
        else:
            lane = self.lanes[peer]
            if isinstance(lane, ShmLane):  # the data comes in DATA records
                self._streams[(peer, arrival.msg)] = op
            else:
                lane.expect(op.data[:nbytes], lambda: self._finish(op))
            self._send_control(peer, CTS, arrival.msg)

    def refusal(self, arrival: Any, op: Recv
                ) -> tuple[str, dict[str, dict[int, Any]]] | None:
        """Why `op` cannot take `arrival` (its dtype differs, or it has no room), if so."""
        peer, me = arrival.source, self.rank
        theirs, mine = arrival.dtype.decode(), op.dtype.decode()
        what = (f"rank {peer}'s message (tag {arrival.tag}) is {arrival.count} x {theirs}, "
                f"the buffer {op.capacity} x {mine}")
        if theirs != mine:
            return f"{what}: the dtypes differ", {"dtype": {peer: theirs, me: mine}}
        if arrival.count > op.capacity:
            return (f"{what}: the message is larger than the buffer",
                    {"count": {peer: arrival.count, me: op.capacity}})
        return None

    # -- completion ----------------------------------------------------------------------
    def _finish(self, op: Send | Recv) -> None:
        op.finished = True
        if op.begin is not None:
            timeline = self.path.timeline
            if timeline is not None:
                nbytes = op.nbytes
                timeline.message(op.name, op.begin, nbytes,
                                 (op.dtype if isinstance(op.dtype, bytes) else b"").decode())

    def _fail(self, op: Send | Recv, error: BaseException) -> None:
        op.error = error
        op.finished = True

    # -- waiting -------------------------------------------------------------------------
    def wait(self, ops: Sequence[Send | Recv], timeout: float | None = None) -> None:
        """Make progress until every one of `ops` has completed or failed (`timeout`: the
        caller's bound, TimeoutError once past; the operations go on)."""
        group = self._group
        if group is not None and any(op is g for g in group for op in ops):
            raise GpuringError("a message of a group is posted when the group ends: wait "
                               "for it after the `with comm.group():` block")
        for op in ops:  # a CuPy receive is queued now, once its header came
            if isinstance(op, Recv) and op.cuda and not op.finished:
                self.gpu.resolve(op)
        progress = self._progress

        def ready() -> bool:
            progress()
            return all(op.finished for op in ops)

        self._loop(ready, lambda: self._pending(ops), timeout)

    def _loop(self, ready: Callable[[], bool], pending: Callable[[], _Pending],
              timeout: float | None = None) -> None:
        """Call `ready()` (under the lock) until it says True: busy at first (a message
        from a running peer comes within microseconds), then yielding the processor, then
        sleeping a little longer each time; every few tens of milliseconds checking for
        failures (`pending()`: what the wait waits for, in words). Bounded by the timeout
        without progress, and by the caller's `timeout` (TimeoutError)."""
        lock = self.lock
        with lock:
            if ready():
                return
        start = last = time.monotonic()
        check_at = start + _CHECK_EVERY
        busy = self.busy_seconds
        busy_until, spin_until = start + busy, start + _SPIN
        delay = 1e-5
        moves = self.moves
        while True:
            with lock:
                if ready():
                    return
            now = time.monotonic()
            if self.moves != moves:
                moves, last, delay = self.moves, now, 1e-5
                busy_until, spin_until = now + busy, now + _SPIN
            if now >= check_at:
                check_at = now + _CHECK_EVERY
                if self._check_failures(pending(), ready):
                    return
            if timeout is not None and now - start > timeout:
                raise TimeoutError(f"{pending().name} did not complete within {timeout} s; "
                                   "it is still pending, call wait() again")
            if now - last > self.timeout:
                self._timed_out(pending())
            if now < busy_until:
                continue
            if now < spin_until:
                os.sched_yield()
            else:
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)

    def _pending(self, ops: Sequence[Send | Recv]) -> _Pending:
        """What the first of `ops` that has not completed waits for."""
        op = next((o for o in ops if not o.finished), ops[0])
        if isinstance(op, Send):
            peer: int | None = op.peer
            what = (f"rank {peer} consumed none of its inbox" if op.state == QUEUED else
                    f"rank {peer} did not receive it")
        else:
            peer = op.source if op.source is not None else op.src
            whom = "any rank" if peer is None else f"rank {peer}"
            what = (f"the rest of its data from {whom} did not come" if op.source is not None
                    else f"no message with tag {op.tag} came from {whom}")
        return _Pending(op.name, peer, op, what)

    def _check_failures(self, pending: _Pending, ready: Callable[[], bool]) -> bool:
        """Raise, as the pending operation's error, a failure of the communicator, or a
        peer that died or left while it waits for it; True where what the peer did before
        it went makes the wait `ready()` after all."""
        name, peer, op = pending.name, pending.peer, pending.op
        life = self.path.life
        if life.state is not State.OPEN:
            self._raise(op, self._cause(name))
        notice = self._control_notice()
        if notice is not None:
            self._give_up(pending, in_context(notice, name, self.operations, self.rank))
        watched = [peer] if peer is not None else [q for q in range(self.size)
                                                     if q != self.rank]
        gone = []
        for q in watched:
            pid = self._pids.get(q)
            if pid is not None and not process_alive(pid):
                gone.append((q, f"rank {q} (pid {pid}) is gone"))
        left = self._left()
        gone += [(q, f"rank {q} closed its communicator") for q in watched if q in left]
        if gone and len(gone) == len(watched):
            with self.lock:  # what it sent before it went is taken first
                if ready():
                    return True
            peer_gone, why = self._first_gone(gone)
            self._give_up(pending, PeerFailureError(
                f"{name} on rank {self.rank}: {why} while this rank waited for it",
                peer=peer_gone))
        return False

    def _first_gone(self, gone: list[tuple[int, str]]) -> tuple[int, str]:
        """Of the peers gone while a wait from any rank waited, the root cause the status
        board names (a peer that gave up because of another, and then ended, names that
        one); else the first."""
        watchdog = self.path.watchdog
        trouble = None if watchdog is None or len(gone) < 2 else watchdog.board.troubled_peer()
        if trouble is not None:
            why = dict(gone)
            peer, _, _, culprit = trouble
            for q in (culprit, peer):
                if q in why:
                    return q, why[q]
        return gone[0]

    def _control_notice(self) -> GpuringError | None:
        if self._mpi is None:
            return None
        return self.control.failure_notice()

    def _left(self) -> set[int]:
        watchdog = self.path.watchdog
        if watchdog is None:
            return set()
        return {q for q in watchdog.board.left_before(1 << 62)}

    def _cause(self, name: str) -> GpuringError:
        """The error of a call `name` once the communicator failed or closed."""
        life = self.path.life
        if life.cause is not None and life.state is State.FAILED:
            error = in_context(life.cause, name, self.operations, self.rank)
            life.raised(error)
            return error
        if life.state is State.CLOSED:
            return CommunicatorClosedError("the communicator is closed; call gpuring.init() "
                                           "for a new one")
        broken = life.error or life.cause
        return CommunicatorClosedError(
            f"{name}: the communicator failed earlier and can no longer be used "
            f"({str(broken) or repr(broken)}); close it and call gpuring.init() again")

    def _timed_out(self, pending: _Pending) -> None:
        peer = pending.peer
        error = CollectiveTimeoutError(
            f"{pending.name} timed out after {self.timeout} s on rank {self.rank}: "
            f"{pending.what}; that rank is stalled, dead, or never posts the matching "
            "operation", peer=peer)
        self._give_up(pending, error, culprit=-1 if peer is None else peer)

    def _give_up(self, pending: _Pending, error: GpuringError, culprit: int | None = None
                 ) -> None:
        """This rank cannot go on: the communicator breaks (the peers learn it: from the
        status board where there is one, which names the rank it timed out on, else from
        the control plane)."""
        if self.path.watchdog is None:
            culprit = None
        _failures.give_up(self.path, error, pending.name, culprit)  # type: ignore[arg-type]
        self._raise(pending.op, error)

    def _raise(self, op: Send | Recv | None, error: BaseException) -> None:
        if op is not None:
            with self.lock:
                self._fail(op, error)
        raise error

    def leave(self) -> None:
        """At close, before the communicator's own steps: the GPU part of the messages
        lets its peers go (`GpuMessages.leave`)."""
        if self.gpu.made() is not None or self.gpu.handles_from:
            self.gpu.leave(orderly=self.path.life.state is State.OPEN)

    # -- queries ---------------------------------------------------------------------------
    def progress_now(self) -> None:
        """`synchronize()`'s part: make progress once, and raise a refusal of a send that
        had completed."""
        with self.lock:
            self._progress()
        self.gpu.synchronize()
        self.check("synchronize")

