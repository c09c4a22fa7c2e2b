"""Timeline: Chrome trace events of every collective and ring round, merged over ranks.

`comm.start_timeline(path)` (or GPURING_TIMELINE=path with `gpuring.init()`) starts recording
on every rank; `comm.stop_timeline()` (or `close()`) gathers each rank's events over the control
plane and rank 0 writes one JSON file that chrome://tracing and https://ui.perfetto.dev open.
Each rank is a process track (pid = rank) with two threads: collectives (tid 0: name, bytes,
dtype, seq) and rounds (tid 1: one event per round of the plan). Times are microseconds since
the barrier at start. While recording, the rounds of a collective run one `Engine.run` call
each so each round can be timed; on CUDA those times are the host's enqueue times.
When no timeline runs, a collective pays one attribute check.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from .algorithms.plan import RoundPlan


class _OneRound(Protocol):
    """What the timeline needs of a round it runs: its plan, as the only one of `rounds`."""

    @property
    def rounds(self) -> tuple[RoundPlan, ...]: ...


_Round = TypeVar("_Round", bound=_OneRound)

__all__ = ["Timeline", "write_trace"]

_COLLECTIVES, _ROUNDS = 0, 1


class Timeline:
    """Events of this rank, recorded from `start` (nanoseconds of `time.perf_counter_ns`)."""

    def __init__(self, path: str, rank: int):
        self.path = path
        self.rank = rank
        self.events: list[dict[str, Any]] = []
        self.start = time.perf_counter_ns()

    def _now(self) -> float:
        return (time.perf_counter_ns() - self.start) / 1000.0

    def _add(self, name: str, tid: int, begin: float, args: dict[str, Any]) -> None:
        self.events.append({"name": name, "ph": "X", "pid": self.rank, "tid": tid,
                            "ts": begin, "dur": self._now() - begin, "args": args})

    def record(self, name: str, seq: int, x: Any, op: Any, rounds: Sequence[_Round],
               run: Callable[[_Round], None]) -> None:
        """Run collective `name` #`seq` (input `x`, None for a barrier) one round at a time,
        `run(round)` each, and record the collective and every round (a round's `rounds`
        holds its one plan)."""
        begin = self._now()
        try:
            for i, one in enumerate(rounds):
                start = self._now()
                run(one)
                self._add(f"{name} round {i}", _ROUNDS, start,
                          {"seq": seq, "round": i, "channels": len(one.rounds[0].channels)})
        finally:
            self._add(name, _COLLECTIVES, begin,
                      {"bytes": 0 if x is None else int(x.nbytes),
                       "dtype": "-" if x is None else str(x.dtype), "seq": seq,
                       "op": getattr(op, "value", str(op)), "rounds": len(rounds)})


    def now(self) -> float:
        """The timeline's clock: microseconds since its start."""
        return self._now()

    def message(self, name: str, begin: float, nbytes: int, dtype: str) -> None:
        """Record a message (posted at `begin`, of the clock `now`, complete now) as an
        event of the collectives' track."""
        self._add(name, _COLLECTIVES, begin, {"bytes": nbytes, "dtype": dtype})

    @contextlib.contextmanager
    def span(self, name: str, x: Any) -> Iterator[None]:
        """Record the block as an event `name` of the collectives' track (a message, whose
        rounds run on its pair's channel), with `x`'s size and dtype."""
        begin = self._now()
        try:
            yield
        finally:
            self._add(name, _COLLECTIVES, begin, {"bytes": int(x.nbytes), "dtype": str(x.dtype)})


def write_trace(path: str, per_rank: list[list[dict[str, Any]]]) -> None:
    """Write every rank's events as one trace file, with a named track per rank."""
    events: list[dict[str, Any]] = []
    for rank, rank_events in enumerate(per_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank,
                       "args": {"sort_index": rank}})
        for tid, label in ((_COLLECTIVES, "collectives"), (_ROUNDS, "rounds")):
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                           "args": {"name": label}})
        events.extend(rank_events)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
