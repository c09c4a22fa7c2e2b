"""The scheduler's programs, on a device that only records them: which waits a round makes."""

from __future__ import annotations

from typing import Any

import pytest

from gpuring._engine import Engine
from gpuring._errors import GpuringError
from gpuring._ops import ReduceOp
from gpuring.algorithms.collectives import plan_collective
from gpuring.algorithms.plan import Signal, Wait
from gpuring.devices._program import group_writes
from gpuring.devices.base import Capabilities, WaitI, WriteI


class _Stream:
    def wait_event(self, event: Any) -> None:
        raise AssertionError("a blocking device orders nothing with events")

    def synchronize(self) -> None:
        pass


class _Device:
    """Blocking, and compiles a program into a runner that notes what it ran."""

    blocking = True
    fused_max_ranks = 0
    default_chunk_bytes = 1 << 14

    def __init__(self) -> None:
        self.ran: list[tuple[tuple[Any, ...], int]] = []

    def capabilities(self, handles: Any) -> Capabilities:
        return Capabilities()

    def caller_event(self) -> None:
        return None

    def alloc(self, nbytes: int) -> object:
        return object()

    def export(self, mem: object) -> int:
        return 0

    def open(self, handle: int) -> object:
        return object()

    def seal(self, mem: object) -> None:
        pass

    def create_stream(self, *, inline: bool = False) -> _Stream:
        return _Stream()

    def compile(self, program: tuple[Any, ...], dtype: str, op: ReduceOp, stream: Any) -> Any:
        return lambda inp, out, seq: self.ran.append((program, seq))


class _Control:
    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def exchange(self, what: str, value: Any, timeout: float) -> list[Any]:
        return [value] * self.size

    def barrier(self, timeout: float, what: str) -> None:
        pass


def _credits(program: tuple[Any, ...]) -> int:
    return sum(isinstance(i, WaitI) and i.tag[1] == "buffer credit" for i in program)


def _launch(engine: Engine, kind: str, count: int, channels: int = 1) -> Any:
    rounds = plan_collective(kind, engine.size, engine.rank, count, itemsize=4,
                             capacity_bytes=1 << 16, chunk_bytes=1 << 14, channels=channels,
                             one_shot_bytes=4096)
    return engine.prepare(rounds, dtype="float32", itemsize=4, op=ReduceOp.SUM,
                          inline=channels == 1)


def _run(engine: Engine, device: _Device, launch: Any) -> list[int]:
    """The credit waits of each round `launch` ran."""
    device.ran.clear()
    engine.run(launch, None, None, "test", 1)
    return [_credits(program) for program, _ in device.ran]


def test_a_round_after_one_that_heard_every_rank_skips_its_credits() -> None:
    """A one-shot all_reduce waits for every other rank's piece: the next round on the same
    stream knows every rank finished the round before, and waits for no credit."""
    device = _Device()
    engine = Engine(device, _Control(0, 3), capacity_bytes=1 << 16, timeout=1.0)  # type: ignore[arg-type]
    small = _launch(engine, "all_reduce", 64)  # one-shot: hears ranks 1 and 2
    assert small.hears_all == (True,)
    ring = _launch(engine, "all_reduce", 3 * 16384)  # 3 ranks: a ring hears its left only
    assert not any(ring.hears_all) and len(ring.rounds) == 3
    assert _run(engine, device, ring) == [0, 0, 3]  # rounds 1 and 2: no buffer used before
    assert _run(engine, device, small) == [3]  # after a ring round: nothing known
    assert _run(engine, device, small) == [0]
    assert _run(engine, device, small) == [0]
    assert _run(engine, device, ring) == [0, 3, 3]  # after the one-shot, then none known
    wide = _launch(engine, "all_reduce", 64, channels=2)  # channel streams: nothing known
    device.ran.clear()
    engine.run(wide, None, None, "test", 1)
    assert _run(engine, device, small) == [3]


def test_two_ranks_every_round_hears_the_other() -> None:
    device = _Device()
    engine = Engine(device, _Control(1, 2), capacity_bytes=1 << 16, timeout=1.0)  # type: ignore[arg-type]
    ring = _launch(engine, "all_reduce", 2 * 16384)  # several rounds of a 2-rank ring
    assert len(ring.rounds) > 1 and all(ring.hears_all)
    wide = _launch(engine, "all_reduce", 64, channels=2)
    for _ in range(3):  # rounds on channel streams: nothing known after them
        engine.run(wide, None, None, "test", 1)
    assert _run(engine, device, ring) == [2] + [0] * (len(ring.rounds) - 1)


def test_consecutive_writes_of_one_value_are_grouped() -> None:
    device = _Device()
    engine = Engine(device, _Control(0, 4), capacity_bytes=1 << 16, timeout=1.0)  # type: ignore[arg-type]
    _run(engine, device, _launch(engine, "all_reduce", 64))
    (program, _), = device.ran
    steps = group_writes(program)
    groups = [s for s in steps if isinstance(s, tuple) and s and isinstance(s[0], WriteI)]
    # the piece for the three readers, and DONE to all four ranks: one step each
    assert [len(g) for g in groups] == [3, 4]
    assert sum(isinstance(i, WriteI) for i in program) == 7


class _Event:
    def __init__(self, stream: _Caller):
        self.stream = stream
        self.done = False

    def query(self) -> bool:
        return self.done


class _Caller:
    """A stream that notes what is enqueued on it."""

    def __init__(self, log: list[tuple[str, Any]]):
        self.log = log
        self.captures = False

    def capturing(self) -> bool:
        return self.captures

    def record(self) -> _Event:
        self.log.append(("record", self))
        return _Event(self)

    def wait_event(self, event: _Event) -> None:
        self.log.append(("wait", self))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self))


class _Direct:
    """A prepared one-operation collective that notes where it runs."""

    capturable = True

    def __init__(self, kind: str):
        self.kind = kind

    def bind(self, out: Any, inp: Any) -> tuple[Any, Any]:
        return out, inp

    def run(self, stream: _Caller, operands: Any, *, captured: bool = False
            ) -> _Event | None:
        """Enqueued, and the event recorded after it (none under capture)."""
        stream.log.append(("captured" if captured else self.kind, stream))
        return None if captured else stream.record()


class _FusedDevice(_Device):
    """Not blocking, with a one-operation all_reduce on the caller's stream."""

    blocking = False
    fused_max_ranks = 8
    fused_max_bytes = 1024

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, Any]] = []
        self.inline = _Caller(self.log)
        self.callers = [_Caller(self.log), _Caller(self.log)]
        self.current = self.callers[0]

    def fused_region_bytes(self, limit: int) -> int:
        return 4096

    def capabilities(self, handles: Any) -> Capabilities:
        return Capabilities(self.fused_max_bytes, whole_pieces=True,
                        fused_kinds=frozenset({"all_reduce"}),
                        graph_kinds=frozenset({"all_reduce"}))

    def caller_stream(self) -> _Caller:
        return self.current

    def prepare_fused(self, kind: str, regions: Any, rank: int, root: int, dtype: str,
                       op: ReduceOp, divisor: int, nbytes: int) -> _Direct:
        return _Direct(kind)

    def capturing(self) -> bool:
        return self.current.captures

    def caller_event(self) -> None:
        raise AssertionError("a fused all_reduce needs no event on the caller's stream")

    def create_stream(self, *, inline: bool = False) -> Any:
        return self.inline


class _Mem:
    nbytes = 64


def test_a_fused_all_reduce_is_one_operation_on_the_callers_stream() -> None:
    """One operation and one record on the caller's stream; a wait for the previous
    collective only where that ran on another stream; synchronize waits for it too."""
    device = _FusedDevice()
    engine = Engine(device, _Control(1, 4), capacity_bytes=1 << 16, timeout=1.0,  # type: ignore[arg-type]
                    fused_limit=4096)
    assert engine.fused_bytes == 1024
    assert engine.default_chunk_bytes == 1 << 16  # whole pieces: the buffer region's size
    assert engine._data_offset - engine._flag_bytes == 4096  # the region, before the data
    launch = engine.prepare((), dtype="float32", itemsize=4, op=ReduceOp.SUM, inline=True,
                            fused=True, nbytes=64)
    first, second = device.callers
    engine.run(launch, _Mem(), _Mem(), "all_reduce", 1)  # type: ignore[arg-type]
    engine.run(launch, _Mem(), _Mem(), "all_reduce", 2)  # type: ignore[arg-type]
    assert device.log == [("all_reduce", first), ("record", first)] * 2
    device.log.clear()
    device.current = second
    engine.run(launch, _Mem(), _Mem(), "all_reduce", 3)  # type: ignore[arg-type]
    assert device.log == [("wait", second), ("all_reduce", second), ("record", second)]
    device.log.clear()
    engine.synchronize()
    assert device.log == [("wait", device.inline), ("synchronize", device.inline)]


def test_a_fused_all_reduce_under_capture_records_no_event() -> None:
    """While the caller's stream captures a graph: the operation only, no event (the host
    could never wait for it), nothing for the watchdog; refused, with nothing enqueued, on a
    second stream while the first still captures (their kernels would run at once)."""
    device = _FusedDevice()
    engine = Engine(device, _Control(0, 2), capacity_bytes=1 << 16, timeout=1.0,  # type: ignore[arg-type]
                    fused_limit=4096)
    launch = engine.prepare((), dtype="float32", itemsize=4, op=ReduceOp.SUM, inline=True,
                            fused=True, nbytes=64)
    first, second = device.callers
    engine.run(launch, _Mem(), _Mem(), "all_reduce", 1)  # type: ignore[arg-type]
    device.log.clear()
    first.captures = True
    assert engine.run(launch, _Mem(), _Mem(), "all_reduce", 2) is None  # type: ignore[arg-type]
    assert device.log == [("captured", first)]
    device.log.clear()
    device.current = second
    second.captures = True
    with pytest.raises(GpuringError, match="on one stream"):
        engine.run(launch, _Mem(), _Mem(), "all_reduce", 3)  # type: ignore[arg-type]
    assert device.log == []
    first.captures = False  # that capture ended: another stream may capture now
    assert engine.run(launch, _Mem(), _Mem(), "all_reduce", 3) is None  # type: ignore[arg-type]
    assert device.log == [("captured", second)]


class _Closing(_Device):
    """Not blocking (as a GPU): notes what closing does, in order, in `calls`."""

    blocking = False
    fused_max_ranks = 0

    def __init__(self, calls: list[str]) -> None:
        super().__init__()
        self.calls = calls

    def detach_peers(self) -> None:
        self.calls.append("unmap the peers")

    def abort(self, reason: str) -> None:
        self.calls.append("abort")

    def close(self, *, peers_may_read: bool) -> None:
        self.calls.append(f"free (peers may read: {peers_may_read})")


class _Meeting(_Control):
    def __init__(self, rank: int, size: int, calls: list[str]) -> None:
        super().__init__(rank, size)
        self.calls = calls

    def barrier(self, timeout: float, what: str) -> None:
        self.calls.append(f"meet the peers ({what})")


@pytest.mark.parametrize("orderly", [True, False], ids=["orderly", "after_a_failure"])
def test_close_frees_only_once_every_rank_unmapped_its_peers(orderly: bool) -> None:
    """On a device whose peers map this rank's memory (a GPU), an orderly close unmaps the
    peers and then meets every rank before freeing anything, so no peer reads freed memory;
    after a failure it meets nobody (a peer may be dead), aborts the device and keeps what
    peers may still read."""
    calls: list[str] = []
    control = _Meeting(1, 2, calls)
    engine = Engine(_Closing(calls), control, capacity_bytes=1 << 16, timeout=1.0)  # type: ignore[arg-type]
    engine.close(control, orderly=orderly)  # type: ignore[arg-type]
    assert calls == (["unmap the peers", "meet the peers (close())",
                      "free (peers may read: False)"] if orderly else
                     ["abort", "free (peers may read: True)"])


class _Ranked(_Device):
    """Memory that says whose it is: ("memory of rank", r)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def alloc(self, nbytes: int) -> object:
        return ("memory of rank", self.rank)

    def export(self, mem: object) -> int:
        return self.rank

    def open(self, handle: int) -> object:
        return ("memory of rank", handle)


class _Handles(_Control):
    """Hands each rank every rank's buffer handle (its rank, as _Ranked exports it)."""

    def exchange(self, what: str, value: Any, timeout: float) -> list[Any]:
        return list(range(self.size)) if what == "setup (buffer handles)" else \
            super().exchange(what, value, timeout)


def test_flags_say_what_the_plan_says() -> None:
    """The flag protocol (gpuring/_engine.py's layout: DONE[q] at word q of a rank's inbox,
    READY[c][q] at word (1 + c) * size + q): a plan's Signal of piece count v becomes a write
    of seq << 32 | v into each reader's READY word for (channel, this rank), in the plan's
    order; its Wait for v from a peer, a wait for seq << 32 | v on this rank's own READY word
    for (channel, peer); a round ends writing seq into every rank's DONE word for this rank.
    Here on a 3-rank ring of several rounds of several pieces (test_plan.py checks what the
    plans' flags mean)."""
    rank, size = 1, 3
    device = _Ranked(rank)
    engine = Engine(device, _Handles(rank, size), capacity_bytes=1 << 16, timeout=1.0)  # type: ignore[arg-type]
    launch = _launch(engine, "all_reduce", size * 16384 + 5)
    assert len(launch.rounds) > 1
    engine.run(launch, None, None, "test", 1)
    ready = 8 * size  # READY[0][q] at ready + 8 * q
    for plan, (program, seq) in zip(launch.rounds, device.ran, strict=True):
        (ops,) = plan.channels
        wanted: list[tuple[Any, ...]] = []
        for op in ops:
            if isinstance(op, Signal):
                wanted += [("READY", reader, ready + 8 * rank, op.value, 32)
                           for reader in op.readers]
            elif isinstance(op, Wait):
                wanted.append(("wait", rank, ready + 8 * op.peer, op.value, 32))
        wanted += [("DONE", q, 8 * rank, 0, 0) for q in range(size)]
        assert sum(isinstance(o, Signal) for o in ops) > 1  # several pieces
        got = [("wait" if isinstance(i, WaitI) else "READY" if i.shift else "DONE",
                i.flag.mem[1], i.flag.offset, i.rel, i.shift) for i in program
               if isinstance(i, WriteI) or (isinstance(i, WaitI) and i.shift)]
        assert got == wanted, f"round {seq}"
