"""CuPy messages between the ranks of one node, queued on the caller's stream: no thread, no
communicator per pair, one stream (so no hardware queue that two streams share can hold one
half of an exchange up behind the other, whatever CUDA_DEVICE_MAX_CONNECTIONS says).

Data. Each rank has an outbox on its GPU (`CudaDevice` memory that its peers open with CUDA
IPC): per peer, `SLOTS` slots of `slot_bytes`. A message travels in pieces of at most a
slot: the sender's stream copies piece p into its slot p % SLOTS for that peer (a local
copy), the receiver's stream copies it out of the sender's slot into the receive buffer (a
read of the peer's memory). Pieces are counted per pair and direction, in the order sent.

Flags. The counters the streams wait for and write live in the host inboxes of the message
engine (`_mailbox`: GPU_READY[q] the pieces rank q published for this rank, GPU_FREED[q] the
pieces of this rank's that q consumed), registered with CUDA so that the GPU reads and writes
them: the sender's stream waits until the receiver freed the slot (GPU_FREED >= p + 1 -
SLOTS), copies, and raises GPU_READY in the receiver's inbox to p + 1; the receiver's stream
waits for GPU_READY >= t + 1, copies, and raises GPU_FREED in the sender's inbox to t + 1.
Every word a stream waits on lies in its own rank's inbox, so an abort releases every wait
with local writes; a wait the host sees satisfied already (it reads the word) is not queued.

Matching. A message's header (the tag, dtype, element count, its first piece and its piece
count, and where the sender's outbox is) goes as a record of the host message engine when the
send is posted; the receiver matches it on the host, in the order the sender posted them
(NCCL's rule: CuPy messages between two ranks are received in the order sent, a tag that
differs is a mismatch), and then queues the copies. So a receive is queued when it is waited
for (`Work.wait()`, `recv`) or when its group ends, on the stream current then; its host
waits until the sender posted the message. A group queues its sends' and receives' pieces
interleaved by piece number (per pair and direction: the same number on both ranks), a
number's sends first, on one stream: each piece waits only for a piece of a lower number, or
for the peer's send of the same number, so no order of posting in the ranks' groups can
deadlock their streams.
"""

from __future__ import annotations

import collections
import ctypes
import json
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from ._errors import CollectiveMismatchError, GpuringError
from ._mailbox import GPU_DETACHED, GPU_RTS, ShmLane
from ._message_ops import Recv, Send

if TYPE_CHECKING:
    from .devices.cuda import CudaDevice, CudaMemory
    from .rendezvous.base import ControlPlane

__all__ = ["CudaMessages", "GpuMessages", "CudaArrival", "HostEngine", "SLOTS",
           "interleaved"]

#: slots of each peer's outbox
SLOTS = 4
#: bytes of a slot where GPURING_MESSAGE_BYTES sets none
_SLOT_BYTES = 1 << 20
#: cudaHostRegisterPortable | cudaHostRegisterMapped
_REGISTER_FLAGS = 1 | 2


class CudaArrival:
    """The header of a CuPy message from `source`, as its record carried it."""

    __slots__ = ("count", "dtype", "first", "handle", "msg", "nbytes", "offset", "pieces",
                 "slot_bytes", "source", "tag")

    def __init__(self, source: int, msg: int, tag: int, count: int, nbytes: int,
                 dtype: bytes, body: dict[str, Any]):
        self.source, self.msg, self.tag, self.count, self.nbytes = \
            source, msg, tag, count, nbytes
        self.dtype = dtype
        self.first = int(body["first"])
        self.pieces = int(body["pieces"])
        self.slot_bytes = int(body["slot_bytes"])
        self.offset = int(body["offset"])  #: where the sender's slots for this rank start
        self.handle = body.get("handle")


class _Peer:
    """What this rank keeps of one peer: its lane, its outbox here once opened, the pieces
    sent to it and taken from it so far, and the flags' words."""

    __slots__ = ("announced", "lane", "opened", "out_offset", "sent", "taken")

    def __init__(self, lane: ShmLane, out_offset: int):
        self.lane = lane
        self.out_offset = out_offset  #: where this rank's outbox for the peer starts
        self.opened: CudaMemory | None = None  #: the peer's outbox (for this rank), mapped
        self.announced = False  #: the peer was told where this rank's outbox is
        self.sent = 0
        self.taken = 0


class CudaMessages:
    """The CuPy messages of one communicator with the peers of its node (`lanes`: the host
    message engine's), made on the first CuPy message (the GPU: `device_slot`'s)."""

    def __init__(self, control: ControlPlane, lanes: dict[int, ShmLane], timeout: float,
                 ring_bytes: int):
        from .devices.cuda import CudaDevice, CudaMemory

        self.rank = control.rank
        self.device: CudaDevice = CudaDevice(local_rank=control.device_slot, timeout=timeout,
                                             announce=control.rank == 0)
        self._memory = CudaMemory
        self.slot_bytes = max(4096, min(_SLOT_BYTES, ring_bytes))
        runtime = self._runtime()
        attributes = self.device.gpu.attributes
        if not attributes.get("CanUseHostPointerForRegisteredMem", 1):
            raise GpuringError("this GPU cannot address registered host memory by its host "
                               "address: CuPy messages between ranks of a node need it")
        self._registered: list[int] = []
        self._keep = False
        inbox = next(iter(lanes.values())).inbox
        with self.device.scope():
            for mem in [inbox.mem] + [lane.their_inbox for lane in lanes.values()]:
                address = int(mem.u8.ctypes.data)
                runtime.hostRegister(address, mem.nbytes, _REGISTER_FLAGS)
                self._registered.append(address)
        peers = sorted(lanes)
        per_peer = SLOTS * self.slot_bytes
        self.outbox = self.device.alloc(per_peer * len(peers))
        self.handle = tuple(self.device.export(self.outbox))
        self._peers = {q: _Peer(lanes[q], i * per_peer) for i, q in enumerate(peers)}
        self._inbox_address = int(inbox.mem.u8.ctypes.data)
        self._inbox = inbox

    @staticmethod
    def _runtime() -> Any:
        from .devices._cuda_driver import cupy_module

        return cupy_module().cuda.runtime

    def announced_to(self) -> set[int]:
        """The peers told where this rank's outbox is (they may have mapped it)."""
        return {q for q, state in self._peers.items() if state.announced}

    def detach(self) -> None:
        """Close the mappings of the peers' outboxes (once this rank's streams are idle)."""
        for state in self._peers.values():
            state.opened = None
        self.device.detach_peers()

    def keep(self) -> None:
        """A peer may still map this rank's outbox: closing keeps it allocated."""
        self._keep = True

    def close(self) -> None:
        """Unregister the inboxes and free the outbox, unless a peer may still map it (the
        device waits for its streams). Idempotent."""
        self.device.close(peers_may_read=self._keep)
        runtime = self._runtime()
        for address in self._registered:
            try:
                runtime.hostUnregister(address)
            except Exception:  # (closing anyway)
                pass
        self._registered = []

    # -- the words ------------------------------------------------------------------------
    def _flags(self, peer: int) -> tuple[Any, Any, Any, Any, ctypes.c_uint64, ctypes.c_uint64]:
        """(ready here, freed here, ready there, freed there) as flags, and the two words of
        this rank's inbox as host values."""
        from .devices.base import Flag

        inbox, state = self._inbox, self._peers[peer]
        mine = self._inbox_address
        theirs = int(state.lane.their_inbox.u8.ctypes.data)
        here = self._memory(mine, inbox.mem.nbytes, "local")
        there = self._memory(theirs, inbox.mem.nbytes, "peer")
        ready_here = Flag(here, inbox.gpu_ready_offset(peer))
        freed_here = Flag(here, inbox.gpu_freed_offset(peer))
        ready_there = Flag(there, inbox.gpu_ready_offset(self.rank))
        freed_there = Flag(there, inbox.gpu_freed_offset(self.rank))
        return (ready_here, freed_here, ready_there, freed_there,
                ctypes.c_uint64.from_address(mine + ready_here.offset),
                ctypes.c_uint64.from_address(mine + freed_here.offset))

    # -- sending ----------------------------------------------------------------------------
    def announce(self, op: Send) -> dict[str, Any]:
        """Reserve `op`'s pieces to its peer; the body of its header record."""
        state = self._peers[op.peer]
        pieces = max(1, -(-op.nbytes // self.slot_bytes))
        body: dict[str, Any] = {"first": state.sent, "pieces": pieces,
                                "slot_bytes": self.slot_bytes, "offset": state.out_offset}
        if not state.announced:  # (JSON: the IPC handle's bytes in hex)
            body["handle"] = [v.hex() if isinstance(v, bytes) else v for v in self.handle]
            state.announced = True
        state.sent += pieces
        return body

    def queue_send(self, op: Send, body: dict[str, Any], piece: int | None = None) -> Any:
        """Queue `op`'s pieces (one of them: `piece`) on the caller's stream; that
        stream."""
        stream = self.device.caller_stream()
        x = self.device.wrap(op.array)
        state = self._peers[op.peer]
        _, freed_here, ready_there, _, _, freed_value = self._flags(op.peer)
        from .devices.base import Span

        first, pieces, size = body["first"], body["pieces"], self.slot_bytes
        for i in range(pieces) if piece is None else (piece,):
            p = first + i
            need = p + 1 - SLOTS
            if need > 0 and freed_value.value < need:
                stream.wait_flag(freed_here, need, (op.peer, f"a free slot for piece {p}"))
            n = max(0, min(size, op.nbytes - i * size))
            if n:
                stream.copy(Span(self.outbox, state.out_offset + (p % SLOTS) * size, n),
                            Span(x, i * size, n))
            stream.write_flag(ready_there, p + 1)
        return stream

    # -- receiving --------------------------------------------------------------------------
    def open_outbox(self, arrival: CudaArrival) -> None:
        """Map the sender's outbox where its header says where it is (its first)."""
        state = self._peers[arrival.source]
        if arrival.handle is not None and state.opened is None:
            fields = list(arrival.handle)
            fields[-1] = bytes.fromhex(fields[-1])  # (CudaHandle's last field: the IPC handle)
            state.opened = self.device.open(tuple(fields))  # type: ignore[assignment]

    def queue_receive(self, op: Recv, arrival: CudaArrival, copy: bool,
                      piece: int | None = None) -> Any:
        """Queue the pieces of `arrival` (one of them: `piece`) on the caller's stream: into
        `op`'s buffer where `copy`, else only taken (a refused message frees its slots);
        that stream."""
        from .devices.base import Span

        state = self._peers[arrival.source]
        if state.opened is None:
            raise GpuringError(f"rank {arrival.source}'s outbox is unknown here: its first "
                               "message did not say where it is")
        stream = self.device.caller_stream()
        out = self.device.wrap(op.out) if copy else None
        ready_here, _, _, freed_there, ready_value, _ = self._flags(arrival.source)
        size = arrival.slot_bytes
        for i in range(arrival.pieces) if piece is None else (piece,):
            t = arrival.first + i
            if ready_value.value < t + 1:
                stream.wait_flag(ready_here, t + 1, (arrival.source, f"piece {t}"))
            n = max(0, min(size, arrival.nbytes - i * size))
            if n and out is not None:
                stream.copy(Span(out, i * size, n),
                            Span(state.opened, arrival.offset + (t % SLOTS) * size, n))
            stream.write_flag(freed_there, t + 1)
        state.taken = arrival.first + arrival.pieces
        return stream


def interleaved(sends: Sequence[tuple[Any, int, int]],
                receives: Sequence[tuple[Any, int, int]]) -> list[tuple[str, Any, int]]:
    """A group's pieces in an order that never deadlocks (`sends`, `receives`: (operation,
    first piece, piece count), pieces numbered per pair and direction): by piece number, a
    number's sends before its receives. A send's piece waits for its peer's receive of a
    lower number (a free slot), a receive's piece for its peer's send of the same number:
    every wait is for something earlier in that order, which the peers' groups follow too."""
    order = [(first + i, 0, n, ("send", op, i))
             for n, (op, first, count) in enumerate(sends) for i in range(count)]
    order += [(first + i, 1, n, ("receive", op, i))
              for n, (op, first, count) in enumerate(receives) for i in range(count)]
    return [entry[3] for entry in sorted(order, key=lambda e: e[:3])]


class HostEngine(Protocol):
    """What the CuPy messages ask of the host message engine (`_messages.Messages`)."""

    rank: int

    def send_record(self, peer: int, kind: int, msg: int, a: int, b: int, c: int,
                    dtype: bytes, payload: bytes, name: str, wait: bool = True) -> None: ...

    def refuse(self, peer: int, msg: int, text: str,
               differences: dict[str, dict[int, Any]]) -> None: ...

    def refusal(self, arrival: Any, op: Recv) -> tuple[str, dict[str, dict[int, Any]]] | None: ...

    def wait_until(self, ready: Callable[[], bool], name: str, peer: int | None,
                   what: str) -> None: ...

    def finish(self, op: Send | Recv) -> None: ...

    def fail(self, op: Send | Recv, error: BaseException) -> None: ...


class GpuMessages:
    """The host's side of CuPy messages: their headers out, the peers' headers in
    (`arrivals`, in the order they came), receives matched in the order they were posted,
    and what each queues on the GPU (`CudaMessages`, made on first use by `make`)."""

    def __init__(self, engine: HostEngine, make: Callable[[], CudaMessages]):
        self._engine = engine
        self._make = make
        self._device: CudaMessages | None = None
        #: headers of CuPy messages from the peers, in the order they came
        self.arrivals: list[CudaArrival] = []
        #: receives posted and not yet queued, in posting order
        self._pending: collections.deque[Recv] = collections.deque()
        #: the streams messages were queued on (`synchronize` waits for them)
        self._streams: dict[int, Any] = {}
        #: the peers that told this rank where their outbox is, and those that said they
        #: closed their mappings of this rank's (GPU_DETACHED)
        self.handles_from: set[int] = set()
        self.detached: set[int] = set()

    @property
    def device(self) -> CudaMessages:
        if self._device is None:
            self._device = self._make()
        return self._device

    def made(self) -> CudaMessages | None:
        return self._device

    # -- sends --------------------------------------------------------------------------------
    def announce(self, op: Send) -> dict[str, Any]:
        """Reserve `op`'s pieces and send its header."""
        body = self.device.announce(op)
        self._engine.send_record(op.peer, GPU_RTS, op.msg, op.tag, op.count, op.nbytes,
                                 op.dtype, json.dumps(body).encode(), op.name)
        return body

    def post_send(self, op: Send) -> None:
        body = self.announce(op)
        self._note(self.device.queue_send(op, body))
        self._engine.finish(op)

    # -- receives -------------------------------------------------------------------------------
    def post_recv(self, op: Recv) -> None:
        self._pending.append(op)

    def resolve(self, op: Recv) -> None:
        """Queue the receives posted before `op`, and `op` (the host waits for the headers
        they match)."""
        while self._pending and not op.finished:
            first = self._pending.popleft()
            self._queue(first, self._match(first), None)

    def ready_now(self, op: Recv) -> bool:
        """`Work.done()` of a receive: queue it now where it is the next to match and its
        header came; whether it is queued (or failed)."""
        if not op.finished and self._pending and self._pending[0] is op and \
                self._find(op) is not None:
            self.resolve(op)
        return op.finished

    def run_group(self, sends: Sequence[Send], receives: Sequence[Recv]) -> None:
        """A group's CuPy messages: every header out, every header in, then the pieces of
        all of them queued interleaved (`interleaved`)."""
        bodies = {id(op): self.announce(op) for op in sends}
        matched: list[tuple[Recv, CudaArrival, bool]] = []
        self._pending.extend(receives)
        for op in receives:
            while self._pending:
                first = self._pending.popleft()
                arrival = self._match(first)
                copy = self._check(first, arrival)
                if first in receives:
                    matched.append((first, arrival, copy))
                else:  # (posted before the group: queued before it)
                    self._queue(first, arrival, None)
                if first is op:
                    break
        device = self.device
        order = interleaved([(op, bodies[id(op)]["first"], bodies[id(op)]["pieces"])
                             for op in sends],
                            [((op, arrival, copy), arrival.first, arrival.pieces)
                             for op, arrival, copy in matched])
        for kind, what, piece in order:
            if kind == "send":
                self._note(device.queue_send(what, bodies[id(what)], piece))
            else:
                receive, arrival, copy = what
                self._note(device.queue_receive(receive, arrival, copy, piece))
        for sent in sends:
            self._engine.finish(sent)
        for receive, _, copy in matched:
            if copy:
                self._engine.finish(receive)

    def _find(self, op: Recv) -> int | None:
        """The index in `arrivals` of the header `op` matches: the first from its source
        (from any rank where it has none)."""
        for i, arrival in enumerate(self.arrivals):
            if op.src is None or arrival.source == op.src:
                return i
        return None

    def _match(self, op: Recv) -> CudaArrival:
        """The header `op` matches, once it came (the host waits)."""
        found: list[int] = []

        def ready() -> bool:
            index = self._find(op)
            if index is not None:
                found.append(index)
                return True
            return False

        whom = "any rank" if op.src is None else f"rank {op.src}"
        self._engine.wait_until(ready, op.name, op.src,
                                f"{whom} posted no CuPy message for it")
        return self.arrivals.pop(found[0])

    def _check(self, op: Recv, arrival: CudaArrival) -> bool:
        """Whether `op` takes `arrival` (else it fails, on both ranks: the sender hears of
        it, and the pieces are only freed)."""
        op.source, op.count, op.nbytes = arrival.source, arrival.count, arrival.nbytes
        refusal = self._engine.refusal(arrival, op)
        if refusal is None and arrival.tag != op.tag:
            refusal = (f"rank {arrival.source}'s next CuPy message has tag {arrival.tag}, "
                       f"this receive {op.tag} (CuPy messages between two ranks are "
                       "received in the order sent)",
                       {"tag": {arrival.source: arrival.tag, self._engine.rank: op.tag}})
        if refusal is None:
            self.device.open_outbox(arrival)
            return True
        text, differences = refusal
        self._engine.fail(op, CollectiveMismatchError(
            f"{op.name} on rank {self._engine.rank}: {text}", differences=differences))
        self._engine.refuse(arrival.source, arrival.msg, text, differences)
        self.device.open_outbox(arrival)
        return False

    def _queue(self, op: Recv, arrival: CudaArrival, piece: int | None) -> None:
        copy = self._check(op, arrival)
        self._note(self.device.queue_receive(op, arrival, copy, piece))
        if copy:
            self._engine.finish(op)

    # -- waiting for the GPU ----------------------------------------------------------------------
    def _note(self, stream: Any) -> None:
        self._streams[id(stream)] = stream

    def leave(self, orderly: bool) -> None:
        """At close: close the mappings of the peers' outboxes and say so to every peer that
        told this rank where its outbox is; then (`orderly`: no failure so far) wait until
        every peer this rank told where its outbox is said the same, so that freeing it
        frees memory nobody maps. Where that cannot be known, the outbox is kept."""
        device = self._device
        if device is not None:
            try:
                self.synchronize()
            except Exception:
                orderly = False
            device.detach()
        for peer in sorted(self.handles_from):
            try:
                self._engine.send_record(peer, GPU_DETACHED, 0, 0, 0, 0, b"", b"", "close",
                                         wait=orderly)
            except Exception:  # (that peer is gone or stalled: it may still map the outbox)
                orderly = False
        if device is None:
            return
        told = device.announced_to()
        if not orderly:
            device.keep()
            return
        try:
            self._engine.wait_until(lambda: told <= self.detached, "close", None,
                                    "a peer did not close its mappings of this rank's "
                                    "GPU outbox")
        except Exception:
            device.keep()

    def synchronize(self) -> None:
        """Wait for the streams messages were queued on (bounded by the device's timeout);
        raise what the device says went wrong."""
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.synchronize()
        if self._device is not None:
            self._device.device.check()
