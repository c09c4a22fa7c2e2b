"""The engine: binds a plan to memory and enqueues it on device streams (`Engine`), and what it
prepares for one collective (`Launch`).

It knows the device interface and the plan vocabulary, nothing of NumPy or CUDA. One `Engine`
per device owns that device's communication buffer, the peers' mapped buffers and the streams.

Buffer layout of every rank (the same on all ranks, n ranks):

    [inbox: DONE[q] for every rank q, READY[c][q] per channel c and rank q, ADDRESS[2] | the
     device's region for one-operation all_reduces (if it has them) | half 0: RS, AG |
     half 1: RS, AG]

Flags live with the rank that waits on them: the inbox holds exactly the words this rank's
streams wait on, and a producer writes into its readers' inboxes through their mapped
buffers. READY[c][q] counts the pieces rank q published on channel c for this rank to read;
DONE[q] is the last round rank q finished. So every pending wait of a rank is on its own
memory, and an abort can release them all with local writes: a dead peer never leaves a
stream blocked on a word only that peer could write.

Round `seq` (1, 2, ... across all collectives) uses half `seq % 2`. Flag values are absolute:
READY = seq << 32 | piece index, DONE = seq; both only grow, so nothing is ever reset. Before a
round writes its half it waits until every rank's DONE >= seq - 2, i.e. every rank has finished
reading that half from two rounds ago (the write-after-read hazard across rounds). Those
waits are left out where they are known to hold: when the round before, on the same (inline)
stream, waited for a piece of every other rank, each of them had started that round, so had
finished the one before it (each rank runs its rounds in order).

A collective whose peers reach each other's arrays where they lie, by cross-memory attach
(`attached`: every rank may, `Capabilities.attach_refused`), runs a registered round over
them (`RoundPlan.registered`) as over registered memory: each rank writes where its input
and output lie into its ADDRESS words before the round signals that it entered, and its
peers read them there, once they saw that signal, at each access (`Device.attach`). A rank
writes them again only at its next such collective, after every peer that reads it said it
finished: they never change under a reader.

A small collective on a device that offers it (`Capabilities.fused_bytes`) is one operation on the
caller's stream instead (`Device.prepare_fused`, prepared once): no round, no event to
order the caller, its flags and counters the device's own, in its region. Consecutive
collectives of a rank never overlap: each waits for the one before where it runs on another
stream.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ._errors import CollectiveTimeoutError, GpuringError, PeerFailureError, RegistrationError
from ._failures import Unraised
from ._ops import ReduceOp
from .algorithms.plan import BUF, IN, ChannelPlan, Copy, Loc, Reduce, ReduceN, RoundPlan, Wait
from .devices.base import (
    Arg,
    CopyI,
    Device,
    Event,
    Flag,
    FlagWaitAborted,
    FlagWaitTimeout,
    FusedOp,
    Instruction,
    Memory,
    ReduceI,
    ReduceNI,
    Runner,
    Span,
    Stream,
    WaitI,
    WriteI,
    open_peer,
)
from .rendezvous.base import ControlPlane

__all__ = ["Engine", "Launch", "PeerArrays", "MAX_CHANNELS"]

class PeerArrays(NamedTuple):
    """A rank's input and output of a collective on registered memory, mapped here (None:
    not registered)."""

    inp: Span | None
    out: Span | None


class Launch:
    """A collective prepared for one engine: its rounds, the dtype and op, whether it runs on
    the inline stream, and (for that stream) its runners, compiled on the first run. Made by
    `Engine.prepare`, run by `Engine.run` as often as the collective is called."""

    __slots__ = (
        "_per_round",
        "attached",
        "channel_runners",
        "collective",
        "divisor",
        "dtype",
        "engine",
        "fused",
        "fused_op",
        "hears_all",
        "inline",
        "itemsize",
        "op",
        "peers",
        "root",
        "rounds",
        "runners",
    )

    def __init__(self, engine: Engine, rounds: tuple[RoundPlan, ...], dtype: str,
                 itemsize: int, op: ReduceOp, inline: bool, fused: bool = False,
                 collective: str = "all_reduce", root: int = 0,
                 peers: tuple[PeerArrays, ...] = (), attached: bool = False):
        self.engine = engine
        #: every rank's registered input and output, mapped here, which registered rounds
        #: read (`RoundPlan.registered`); empty for collectives on plain arrays
        self.peers = peers
        #: `peers` are the ranks' plain arrays, reached by cross-memory attach: each run
        #: publishes where this rank's lie first (see the module's docstring)
        self.attached = attached
        #: the collective runs as one operation on the caller's stream, not in rounds: `fused_op`
        #: (set by `Engine.prepare`)
        self.fused = fused
        self.fused_op: FusedOp | None = None
        self.collective = collective
        self.root = root
        self.rounds = rounds
        self.dtype = dtype
        self.itemsize = itemsize
        self.op = op
        self.divisor = engine.size if op is ReduceOp.AVG else 1
        self.inline = inline
        #: inline runners, per channel, of (round, buffer half (seq parity), credits known
        #: (see `Engine.run`)), each compiled on its first use (compiling them at every call
        #: cost 1,325 more Python opcodes, 1,754 -> 3,079, on a 256 KiB all_reduce of 2 ranks
        #: on the CUDA simulator: `bench/host_cost.py --size 256K --without runners`)
        self.runners: dict[tuple[int, int, bool], tuple[Runner, ...]] = {}
        #: the other launches' runners, of (round, channel, buffer half), each compiled on its
        #: first use and kept as long as the launch (compiling them at every call cost 2,494
        #: more opcodes, 2,770 -> 5,264, with GPURING_CHANNELS=2 in the same bench)
        self.channel_runners: dict[tuple[int, int, int], Runner] = {}
        #: per round: whether its (one) channel waits for a piece of every other rank
        self.hears_all = tuple(
            len(plan.channels) == 1 and {o.peer for o in plan.channels[0]
                                         if isinstance(o, Wait)} == set(range(engine.size))
            - {engine.rank} for plan in rounds)
        self._per_round: tuple[Launch, ...] | None = None

    def per_round(self) -> tuple[Launch, ...]:
        """One launch per round (the timeline runs and times them one by one); a fused launch
        is one step."""
        if self.fused:
            return (self,)
        if self._per_round is None:
            self._per_round = tuple(Launch(self.engine, (plan,), self.dtype, self.itemsize,
                                           self.op, self.inline, collective=self.collective,
                                           root=self.root, peers=self.peers,
                                           attached=self.attached)
                                    for plan in self.rounds)
        return self._per_round


MAX_CHANNELS = 32
_PAGE = 4096
_SEQ_SHIFT = 32
_MAX_SEQ = 1 << 31  # READY = seq << 32 | piece must stay below 2^63


class Engine:
    """Communication resources of one device, and the enqueueing of rounds on them."""

    def __init__(self, device: Device, control: ControlPlane, *, capacity_bytes: int,
                 timeout: float, fused_limit: int = 0):
        """`fused_limit`: the largest input (bytes) of a collective to run as one operation
        where the device can (GPURING_FUSED_BYTES; the same on every rank)."""
        self.device = device
        self.rank = control.rank
        self.size = control.size
        self.capacity = capacity_bytes
        self.timeout = timeout
        self._seq = 0
        self._last: Event | None = None
        #: the stream `_last` was recorded on: work queued there later runs after it anyway
        self._last_stream: Stream | None = None
        #: the round after which the inline stream knows every rank finished the round
        #: before it (-1: none; see `run`)
        self._heard_all = -1
        self._streams: list[Stream] = []
        #: the caller's stream that last captured a one-kernel collective
        self._captured_on: Stream | None = None
        self._inline = device.create_stream(inline=True)
        # the inbox: DONE per rank, READY per channel and rank, this rank's ADDRESS words;
        # then the device's region for one-operation all_reduces; data starts on a new page
        self._address_offset = 8 * self.size * (1 + MAX_CHANNELS)
        self._flag_bytes = -(-(self._address_offset + 16) // _PAGE) * _PAGE
        region = (device.fused_region_bytes(fused_limit)
                  if 1 < self.size <= device.fused_max_ranks else 0)
        self._data_offset = self._flag_bytes + -(-region // _PAGE) * _PAGE
        local = device.alloc(self._data_offset + 4 * capacity_bytes)
        handles = control.exchange("setup (buffer handles)", device.export(local), timeout)
        self._mems: list[Memory] = [
            local if r == self.rank else open_peer(device, h, r) for r, h in enumerate(handles)]
        capabilities = device.capabilities(handles)
        # (the barrier after mapping, with rank 0's ring order for every rank: each rank's
        # device chose one from what it sees, which need not be alike everywhere; and
        # whether every rank may reach its peers' arrays by cross-memory attach)
        refused = capabilities.attach_refused if capabilities.attach else \
            f"{type(device).__name__} reaches no peer's array where it lies"
        said = control.exchange("setup (buffers mapped)", (capabilities.ring, refused),
                                timeout)
        rings = [ring for ring, _ in said]
        device.seal(local)
        self._handles = tuple(handles)
        #: why the ranks do not reach each other's arrays by cross-memory attach (the first
        #: rank that may not, and why; the same on every rank), or None: they do
        self.attach_refused: str | None = next(
            (f"rank {r}: {why}" for r, (_, why) in enumerate(said) if why is not None), None)
        #: whether a call said so in the log already (or need not: the device has none)
        self.attach_told = not capabilities.attach
        #: the largest input (bytes) of a collective that runs as one operation (0: none)
        self.fused_bytes = min(capabilities.fused_bytes, fused_limit) if region else 0
        #: the collectives that run as one operation, and those a CUDA graph can record
        self.fused_kinds = capabilities.fused_kinds
        self.graph_kinds = capabilities.graph_kinds
        #: the ranks in the order the ring and the chains visit them (empty: rank order)
        self.ring: tuple[int, ...] = tuple(rings[0])
        #: the piece size where the user set none
        self.default_chunk_bytes = (capacity_bytes if capabilities.whole_pieces
                                    else device.default_chunk_bytes)
        self._regions = tuple(Span(mem, self._flag_bytes, region) for mem in self._mems)
        # where this rank waits for each rank's DONE, and where it tells each rank its own
        self._done_from = [Flag(local, self._done_offset(q)) for q in range(self.size)]
        self._done_to = [Flag(mem, self._done_offset(self.rank)) for mem in self._mems]

    def attached_peers(self, nbytes: int) -> tuple[PeerArrays, ...]:
        """Every rank's input and output of `nbytes` in a collective on plain arrays, reached
        by cross-memory attach (this rank's own are the call's arguments: left out)."""
        if self.attach_refused is not None:
            raise GpuringError(f"the ranks reach no peer's array: {self.attach_refused}")

        def array(q: int, word: int) -> Span:
            mem = self.device.attach(q, self._handles[q], self._mems[q],
                                     self._address_offset + word, nbytes)
            return Span(mem, 0, nbytes)

        return tuple(PeerArrays(None, None) if q == self.rank else
                     PeerArrays(array(q, 0), array(q, 8)) for q in range(self.size))

    def _done_offset(self, producer: int) -> int:
        return 8 * producer

    def _ready_offset(self, channel: int, producer: int) -> int:
        return 8 * ((1 + channel) * self.size + producer)

    def _stream(self, c: int) -> Stream:
        while len(self._streams) <= c:
            self._streams.append(self.device.create_stream())
        return self._streams[c]

    def prepare(self, rounds: tuple[RoundPlan, ...], *, dtype: str, itemsize: int,
                op: ReduceOp, inline: bool, fused: bool = False, collective: str = "all_reduce",
                root: int = 0, nbytes: int = 0, peers: tuple[PeerArrays, ...] = (),
                attached: bool = False) -> Launch:
        """`rounds` of `collective` ready to run on this engine (`inline`: on one stream, in
        the calling thread where the device can; `fused`: one of `fused_kinds` with an input
        of `nbytes`, at most `fused_bytes`, run as one operation instead of `rounds`; `peers`:
        every rank's registered arrays, which registered rounds read, or, `attached`, its
        plain arrays (`attached_peers`; inline only))."""
        if attached and not (inline and peers and not fused):
            raise ValueError("a collective on attached arrays runs inline, on their peers")
        if fused and (collective not in self.fused_kinds or not 0 < nbytes <= self.fused_bytes):
            raise ValueError(f"this engine runs no {collective} of {nbytes} bytes as one "
                             "operation")
        if any(plan.registered for plan in rounds) and len(peers) != self.size:
            raise ValueError("a registered round needs every rank's arrays")
        launch = Launch(self, rounds, dtype, itemsize, op, inline, fused, collective, root,
                        peers, attached)
        if fused:
            launch.fused_op = self.device.prepare_fused(
                collective, self._regions, self.rank, root, dtype, op, launch.divisor, nbytes)
        return launch

    def prepare_captured(self, launch: Launch, nbytes: int) -> Launch | None:
        """What a CUDA graph records of `launch` (from `prepare`, of an input of `nbytes`):
        the launch itself where it runs as one operation that can be captured; else (it runs
        in rounds, or in a form a graph cannot record) a launch of the device's form for
        graphs, one operation or one per piece of the device's region
        (`Device.prepare_fused`'s `graph`); None where this engine's graphs cannot record
        the collective."""
        if launch.fused and launch.fused_op is not None and launch.fused_op.capturable:
            return launch
        if launch.collective not in self.graph_kinds or nbytes <= 0 or \
                self._regions[self.rank].nbytes <= 0:
            return None
        graph = Launch(self, (), launch.dtype, launch.itemsize, launch.op, inline=True,
                       fused=True, collective=launch.collective, root=launch.root)
        graph.fused_op = self.device.prepare_fused(
            launch.collective, self._regions, self.rank, launch.root, launch.dtype, launch.op,
            launch.divisor, nbytes, graph=True)
        return graph

    def bind(self, launch: Launch, in_mem: Memory, out_mem: Memory | None) -> Any:
        """A fused launch's operands for these memories (`FusedOp.bind`: they hold no array,
        so a call that comes again with the same arrays may keep them)."""
        assert launch.fused_op is not None
        return launch.fused_op.bind(out_mem or in_mem, in_mem)  # a reduce off root writes nothing

    def run(self, launch: Launch, in_mem: Memory | None, out_mem: Memory | None, name: str,
            collective_seq: int, bound: Any = None) -> Event | None:
        """Enqueue `launch` after the work already on the caller's stream, and order the
        caller's stream after it. Blocking devices return once the result is complete;
        others return an event that completes with the collective. `name` and
        `collective_seq` name the collective in errors. A fused launch runs `bound` (from
        `bind`), else the memories bound now."""
        if launch.fused:
            if bound is None:
                assert in_mem is not None
                bound = self.bind(launch, in_mem, out_mem)
            return self.run_fused(launch, bound, name, collective_seq)
        finished = self._run_rounds(launch, in_mem, out_mem, name, collective_seq,
                                    self.device.caller_event())
        if finished is not None:
            self.device.order_caller_after(finished)
        return finished

    def run_fused(self, launch: Launch, bound: Any, name: str,
                  collective_seq: int) -> Event | None:
        """`run` of a fused launch's operands `bound`: the collective as one operation on the
        caller's stream, after this engine's previous collective where that ran on another
        stream.

        While the stream captures a graph, the operation is recorded there, with no event
        (the host could never wait for it), and None is returned. A rank's one-kernel
        collectives must never run at once (they share the device's counters), and nothing
        here sees when a graph is launched: the capturing stream must already be ordered
        after the communicator's earlier collectives (the warm-up call on it, or a
        synchronize), each replay after the collectives before it, and the collectives after
        a replay after it (on its stream, or after a synchronize), as any work on a stream.
        Two streams of one capture are refused (their kernels would be parallel nodes of the
        graph)."""
        fused_op = launch.fused_op
        assert fused_op is not None
        stream = self.device.caller_stream()
        try:  # (a form that cannot be captured was refused under capture before the call)
            if fused_op.capturable and stream.capturing():
                other = self._captured_on
                if other is not None and other is not stream and other.capturing():
                    raise GpuringError(
                        f"{name} #{collective_seq} is captured on a second stream while another "
                        "stream's capture holds one already: capture the communicator's "
                        "collectives on one stream")
                self._captured_on = stream
                return fused_op.run(stream, bound, captured=True)
            if self._last is not None and self._last_stream is not stream:
                stream.wait_event(self._last)
            finished = fused_op.run(stream, bound)
            assert finished is not None  # (only a captured run has no event)
            self._last, self._last_stream = finished, stream
        except FlagWaitTimeout as exc:
            raise self._timeout_error(exc, name, collective_seq) from None
        except FlagWaitAborted as exc:
            raise self._aborted_error(exc, name, collective_seq) from None
        return self._last

    def _timeout_error(self, exc: FlagWaitTimeout, name: str,
                       collective_seq: int) -> CollectiveTimeoutError:
        peer, what = exc.tag
        return CollectiveTimeoutError(
            f"{name} #{collective_seq} timed out after {self.timeout} s on rank {self.rank} "
            f"waiting for rank {peer} ({what}); that rank is stalled, dead, or called a "
            f"different collective", collective=name, seq=collective_seq, peer=peer)

    def _aborted_error(self, exc: FlagWaitAborted, name: str,
                       collective_seq: int) -> PeerFailureError:
        return PeerFailureError(
            f"{name} #{collective_seq} aborted on rank {self.rank}: {exc.reason}",
            collective=name, seq=collective_seq)

    def _run_rounds(self, launch: Launch, in_mem: Memory | None, out_mem: Memory | None,
                    name: str, collective_seq: int, after: Event | None) -> Event | None:
        """Enqueue every round of `launch`, after `after` if given (see `run`)."""
        rounds = launch.rounds
        if self._seq + len(rounds) >= _MAX_SEQ:
            raise GpuringError("this communicator has run 2^31 rounds, the most its flags can "
                               "count; close it and call gpuring.init() again")
        # after the caller's queued work, and after this engine's previous collective (on
        # devices that do not block, streams of consecutive collectives are otherwise unordered;
        # the stream that collective ended on needs no wait: it runs its work in order)
        last, last_stream = self._last, self._last_stream

        def waits_for(stream: Stream) -> list[Event]:
            return [e for e in (after, None if stream is last_stream else last)
                    if e is not None]

        try:
            if not rounds:  # an empty array: nothing to enqueue, the last event still stands
                return None if self.device.blocking else self._last
            if launch.inline:  # one stream (in this thread where the device can): latency path
                for event in waits_for(self._inline):
                    self._inline.wait_event(event)
                if launch.attached:  # where this call's arrays lie, before it enters
                    self._publish(in_mem, out_mem)
                runners = launch.runners
                for r, hears_all in enumerate(launch.hears_all):
                    self._seq += 1
                    seq = self._seq
                    # A round that waited on a piece of every other rank (round seq - 1, on
                    # this stream) saw each of them start that round, so finish the one
                    # before: the buffer credits of this round (every rank done with round
                    # seq - 2) are known, and its waits for them are left out; so are those
                    # of the first two rounds (no round before them used the buffers).
                    known = seq <= 2 or self._heard_all == seq - 1
                    key = (r, seq & 1, known)
                    for runner in runners.get(key) or self._compile_inline(launch, key):
                        runner(in_mem, out_mem, seq)
                    self._heard_all = seq if hears_all else -1
                return self._finish([self._inline])
            self._heard_all = -1
            used: list[Stream] = []
            for r, plan in enumerate(rounds):
                self._seq += 1
                seq = self._seq
                streams = [self._stream(c) for c in range(len(plan.channels))]
                for stream in streams:
                    if stream not in used:
                        used.append(stream)
                        for event in waits_for(stream):
                            stream.wait_event(event)
                for c, stream in enumerate(streams):
                    runner = launch.channel_runners.get((r, c, seq & 1)) or self._runner(
                        launch, r, c, seq & 1, stream)
                    runner(in_mem, out_mem, seq)
                if len(streams) > 1:  # DONE once every channel's reads are complete
                    first = streams[0]
                    for other in streams[1:]:
                        first.wait_event(other.record())
                    first.write_flags(self._done_to, seq)
            return self._finish(used)
        except FlagWaitTimeout as exc:
            raise self._timeout_error(exc, name, collective_seq) from None
        except FlagWaitAborted as exc:
            raise self._aborted_error(exc, name, collective_seq) from None
        except PeerFailureError as exc:  # (a peer's memory the device could not reach)
            if exc.collective is not None:
                raise
            raise PeerFailureError(f"{name} #{collective_seq} on rank {self.rank}: {exc}",
                                   peer=exc.peer, collective=name, seq=collective_seq,
                                   job_peer=exc.job_peer) from None

    def _publish(self, in_mem: Memory | None, out_mem: Memory | None) -> None:
        """Write where this rank's input and output lie into its ADDRESS words (on the inline
        stream: after the collectives before, before the rounds' signals)."""
        local, device = self._mems[self.rank], self.device
        for k, mem in enumerate((in_mem, out_mem if out_mem is not None else in_mem)):
            if mem is not None:
                self._inline.write_flag(Flag(local, self._address_offset + 8 * k),
                                        device.address(mem))

    def _finish(self, used: list[Stream]) -> Event | None:
        """Blocking devices: wait for the streams (the first error wins, a timeout before an
        abort it caused). Others: one event for all of them, remembered for the next call."""
        if self.device.blocking:
            self._wait_for(used)
            return None
        first = used[0]
        for other in used[1:]:
            first.wait_event(other.record())
        self._last, self._last_stream = first.record(), first
        return self._last

    def synchronize(self) -> None:
        """Block the host until everything enqueued so far has completed; raise the root
        cause of a failure (see `_wait_for`)."""
        own = [self._inline, *self._streams]
        if self._last is not None and self._last_stream not in own:  # on a caller's stream
            self._inline.wait_event(self._last)
        self._wait_for(own)

    def _wait_for(self, streams: list[Stream]) -> None:
        """Wait for every stream. Once one fails the device is aborted, so that the others
        end at once instead of waiting out their own timeouts; then the root cause is raised:
        a timeout before the aborts it caused, else the first error."""
        errors: list[BaseException] = []
        for stream in streams:
            try:
                stream.synchronize()
            except BaseException as exc:
                if not errors:
                    self.device.abort(f"rank {self.rank}: {exc}")
                errors.append(exc)
        if errors:
            timeouts = [e for e in errors if isinstance(e, FlagWaitTimeout)]
            raise (timeouts or errors)[0]

    def _compile_inline(self, launch: Launch,
                        key: tuple[int, int, bool]) -> tuple[Runner, ...]:
        """The inline stream's runners of round `key[0]` of `launch` for buffer half `key[1]`,
        without its credit waits where `key[2]`: compiled once, kept by the launch."""
        r, parity, known = key
        plan = launch.rounds[r]
        runners = tuple(self._compile(launch, plan, c, parity, self._inline,
                                      c == len(plan.channels) - 1, credits=not known)
                        for c in range(len(plan.channels)))
        launch.runners[key] = runners
        return runners

    def _compile(self, launch: Launch, plan: RoundPlan, c: int, parity: int, stream: Stream,
                 with_done: bool, *, credits: bool = True) -> Runner:
        program = self._program(plan.channels[c], c, parity, launch.itemsize, launch.divisor,
                                with_done, credits=credits and not plan.registered,
                                peers=launch.peers)
        return self.device.compile(program, launch.dtype, launch.op, stream)

    def _runner(self, launch: Launch, r: int, c: int, parity: int, stream: Stream) -> Runner:
        """The runner of channel `c` of round `r` of `launch` on `stream` (a channel's own),
        compiled now and kept with the launch."""
        plan = launch.rounds[r]
        runner = launch.channel_runners[(r, c, parity)] = self._compile(
            launch, plan, c, parity, stream, len(plan.channels) == 1)
        return runner

    def _program(self, ops: ChannelPlan, c: int, parity: int, itemsize: int, divisor: int,
                 with_done: bool, *, credits: bool = True,
                 peers: tuple[PeerArrays, ...] = ()) -> tuple[Instruction, ...]:
        """Device instructions for one channel of a round: plan locations become spans of
        the buffers and of the peers' registered arrays (`peers`; this rank's input and
        output stay arguments), relative flag values stay relative. Without `credits` the
        round does not wait for the buffer credits (known already, or no buffer is used)."""
        base = self._data_offset + parity * 2 * self.capacity
        mems = self._mems
        local = mems[self.rank]
        me = self.rank

        def operand(loc: Loc, length: int) -> Span | Arg:
            nbytes = length * itemsize
            if loc.space == BUF:
                offset = base + loc.region * self.capacity + loc.offset * itemsize
                return Span(mems[loc.rank], offset, nbytes)
            if loc.rank in (-1, me):
                return Arg(0 if loc.space == IN else 1, loc.offset * itemsize, nbytes)
            array = peers[loc.rank].inp if loc.space == IN else peers[loc.rank].out
            if array is None:
                raise ValueError(f"rank {loc.rank}'s {'input' if loc.space == IN else 'output'}"
                                 " is not registered memory")
            return Span(array.mem, array.offset + loc.offset * itemsize, nbytes)

        # Credit: every rank, this one included (its other channels), has finished round
        # seq - 2, which used the buffer half this round is about to write.
        program: list[Instruction] = [WaitI(flag, -2, 0, (peer, "buffer credit"))
                                      for peer, flag in enumerate(self._done_from)
                                      if credits]
        for o in ops:
            if isinstance(o, Copy):
                program.append(CopyI(operand(o.dst, o.length), operand(o.src, o.length)))
            elif isinstance(o, Reduce):
                program.append(ReduceI(operand(o.dst, o.length), operand(o.a, o.length),
                                       operand(o.b, o.length), divisor if o.last else 1))
            elif isinstance(o, ReduceN):
                program.append(ReduceNI(operand(o.dst, o.length),
                                        tuple(operand(s, o.length) for s in o.srcs),
                                        divisor if o.last else 1))
            elif isinstance(o, Wait):
                program.append(WaitI(Flag(local, self._ready_offset(c, o.peer)), o.value,
                                     _SEQ_SHIFT, (o.peer, f"piece {o.value} on channel {c}")))
            else:
                program += [WriteI(Flag(mems[reader], self._ready_offset(c, self.rank)), o.value,
                                   _SEQ_SHIFT) for reader in o.readers]
        if with_done:
            program += [WriteI(flag, 0, 0) for flag in self._done_to]
        return tuple(program)

    def register(self, control: ControlPlane, nbytes: int) -> tuple[Memory, ...]:
        """Registered memory: `nbytes` of this device that every rank maps, made with every
        rank at once (each rank's, in rank order; this rank's is its own allocation). It is
        freed with the device: a user array made over it keeps its own share alive."""
        device = self.device
        local: Memory | None = None
        try:  # a rank that cannot allocate says so: every rank raises, and goes on
            local = device.alloc(max(nbytes, 1))
            mine: Any = device.export(local)
        except (GpuringError, OSError, MemoryError) as exc:
            mine = f"rank {self.rank}: {exc}"
        handles = control.exchange("registration (handles)", mine, self.timeout)
        failed = [h for h in handles if isinstance(h, str)]
        if failed:  # (what the others allocated stays with the device until it closes)
            raise RegistrationError(f"registered memory of {nbytes} bytes could not be "
                                    f"allocated: {'; '.join(failed)}")
        assert local is not None
        mems = tuple(local if r == self.rank else open_peer(device, h, r)
                     for r, h in enumerate(handles))
        control.barrier(self.timeout, "registration (mapped)")
        device.seal(local)
        return mems

    def close(self, control: ControlPlane, *, orderly: bool) -> None:
        """Free this engine. On a device whose peers map our memory through the driver (GPU),
        every rank first finishes its work and unmaps its peers, then all meet, and only then
        free: no peer ever reads freed memory. After a failure (or when that meeting fails)
        the device is aborted instead, which ends its streams' work at once; the memory that
        peers may still read is then kept, everything else freed."""
        device = self.device
        peers_may_read = False
        if not device.blocking and self.size > 1:
            kept = Unraised()
            with kept.step():
                if not orderly:
                    raise GpuringError("the communicator failed")
                self.synchronize()
                device.detach_peers()
                control.barrier(min(self.timeout, 60.0), "close()")
            if kept.error is not None:
                device.abort(f"closed after a failure ({kept.error})")
                peers_may_read = True
        device.close(peers_may_read=peers_may_read)
