"""One rank's measurements: a system's time at one size and placement (checked apart from the
timed calls), its overlap with compute, the warm-up, and the memories' copy bandwidth that
sets the floor. Every method is collective: every rank calls it, in the same order."""

from __future__ import annotations

import math
import os
import platform
import time
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import report
from .data import corrupt, count_wrong, make_input, tolerance
from .metrics import (
    MESSAGES_PER_CALL,
    Memory,
    bus_factor,
    copy_repeats,
    group_memories,
    plan_count,
    rank_traffic,
    required_traffic,
    shared_floor,
)
from .options import Settings
from .stats import Summary, combine_ranks, per_iteration
from .systems import Arena, Buffers, System, Unsupported, make_buffers
from .timing import Backend, blocking, rotating, time_calls, time_loop

__all__ = ["Case", "Measurer", "CORRUPT_ENV", "OFF_CACHE_SETS", "COPY_SAMPLES", "fastest"]

#: testing hook: with "1", rank 0 spoils one element of every checked result
CORRUPT_ENV = "GPURING_BENCH_CORRUPT"
#: the most buffer sets --off-cache rotates over
OFF_CACHE_SETS = 1024
#: samples of the copy bandwidth each time it is measured (`Measurer.memories_at`,
#: `Measurer.bandwidth`): a memory's bandwidth is the fastest of them
COPY_SAMPLES = 2


def fastest(samples: list[list[Memory]]) -> list[Memory]:
    """Each memory's best bandwidth over `samples` (each a list of the same memories, as
    `group_memories` makes them): the most the memory showed it can move. A sample slowed by
    something else running then (another process, a page fault, a frequency change) would
    set a floor the memory does not have, and efficiencies above 100 %."""
    best: dict[str, Memory] = {}
    for sample in samples:
        for m in sample:
            if m.name not in best or m.GBps > best[m.name].GBps:
                best[m.name] = Memory(m.name, list(m.ranks), m.GBps)
    return list(best.values())


@dataclass(frozen=True)
class Case:
    """What one line of the table measures."""

    collective: str
    size: int
    dtype: str
    op: str
    root: int


class Measurer:
    def __init__(self, s: Settings, comm: Any, backend: Backend):
        self.s, self.comm, self.backend = s, comm, backend
        self.n, self.rank = comm.size, comm.rank
        self.corrupt = os.environ.get(CORRUPT_ENV, "") == "1"
        self.notes: dict[str, str] = {}
        self._memories_at: dict[int, list[list[Memory]]] = {}  # size: every sample
        self._cache = backend.cache_bytes()
        self.arena: Arena | None = None  # -R 1: registered memory the arrays are carved from

    def register_arena(self, cases: list[Case]) -> None:
        """Make the registered memory every measurement's arrays come from (-R 1): enough
        for the largest of `cases` (every rank at once)."""
        nbytes = max((Arena.bytes_for(c.size, self.sets(c)) for c in cases), default=0)
        self.arena = Arena(self.comm, max(nbytes, Arena.ALIGN), self.backend.name)

    def gather(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(self.comm.all_gather(np.ascontiguousarray(values, np.float64)))

    # -- inputs -------------------------------------------------------------------------
    def source(self, case: Case, rank: int) -> np.ndarray:
        """Rank `rank`'s input for `case` (the same on every rank that makes it)."""
        itemsize = np.dtype(case.dtype).itemsize
        count = plan_count(case.collective, self.n, case.size, itemsize)
        salt = zlib.crc32(f"{case.collective} {case.op} {case.size} {case.dtype}".encode())
        return make_input(rank, count, case.dtype, salt=salt)

    def sets(self, case: Case) -> int:
        """How many buffer sets the timed calls rotate over: one, or with --off-cache enough
        for twice the largest cache (at most OFF_CACHE_SETS: the smallest sizes still fit,
        and the floor table says so)."""
        if not self.s.off_cache or case.collective == "barrier":
            return 1
        per_set = 3 * max(case.size, 1)  # input and output, all_gather's out n/(n-1) x
        return max(1, min(OFF_CACHE_SETS, math.ceil(2 * self._cache / per_set)))

    # -- one measurement ----------------------------------------------------------------
    def measure(self, system: System, case: Case, placement: str, expected: np.ndarray | None,
                repeat: int) -> report.Result | None:
        """`system`'s time for `case` in `placement`, combined over the ranks, checked."""
        s, kind = self.s, case.collective
        try:
            self._rewind()
            all_buffers = [self._buffers(case, placement) for _ in range(self.sets(case))]
            calls = [system.call(kind, b, case.op, case.root) for b in all_buffers]
            for b in all_buffers:
                b.steady(kind, case.op)
        except Unsupported as exc:
            self.notes.setdefault(f"{system.name} {kind} {case.op}", f"{system.name}: {exc}")
            return None
        fn = rotating(calls)
        if s.blocking:
            fn = blocking(fn, self.backend, system.sync)
        if s.graph_launches:
            try:
                launch = self.backend.graph(fn, s.iters)
            except Exception as exc:  # the same on every rank: a call or a capture refused
                self.notes.setdefault(f"{system.name} {kind} graph",
                                      f"{system.name}: not captured into a CUDA graph "
                                      f"({type(exc).__name__}: {str(exc)[:160]})")
                self.backend.synchronize()
                return None
            times = np.array([time_loop(launch, iters=s.graph_launches, backend=self.backend,
                                        sync=system.sync) / s.iters])
        elif s.per_iteration:
            times = time_calls(fn, iters=s.iters, warmup=1, backend=self.backend,
                               sync=system.sync)
        else:
            times = np.array([time_loop(fn, iters=s.iters, backend=self.backend,
                                        sync=system.sync)])
        times = times / MESSAGES_PER_CALL.get(kind, 1)  # (a ping-pong's: per message)
        checked = calls[0]
        if s.graph_launches and s.check_iters:  # what is checked is a graph's result (a
            checked = self.backend.graph(calls[0], 1)  # collective may run otherwise there)
        schedule = system.schedule()  # (after a call: barriers run between the timed ones)
        wrong = self.check(checked, all_buffers[0], system, case, expected)
        cost = self.host_cost(system, calls[0])
        ops, host_s = (-1.0, -1.0) if cost is None else cost
        table = self.gather(np.append(times, [host_s, ops, -1.0 if wrong is None else wrong]))
        times_of = table[:, :-3]
        wrongs = table[:, -1]
        ops_of = table[:, -2]
        host_of = table[:, -3]
        extra: dict[str, Any] = {}
        if s.per_iteration:
            it = per_iteration(times_of)
            t, fastest, slowest = it.p50, it.fastest, it.max
            extra = {"p99_us": it.p99 * 1e6,
                     "rank_p99_us": [v * 1e6 for v in it.rank_p99],
                     "rank_max_us": [v * 1e6 for v in it.rank_max]}
            rank_s = np.array(it.rank_p50)
        else:
            rank_s = times_of[:, 0]
            t, fastest, slowest = (combine_ranks(rank_s, s.average), float(rank_s.min()),
                                   float(rank_s.max()))
        itemsize = np.dtype(case.dtype).itemsize
        per_rank = kind in ("all_gather", "reduce_scatter")
        algbw = case.size / t / 1e9 if t > 0 else 0.0
        return report.Result(
            system=system.name, collective=kind, size=case.size,
            count=case.size // itemsize // (self.n if per_rank else 1), type=case.dtype,
            redop=case.op, root=case.root if kind in ("broadcast", "reduce") else -1,
            placement=placement, ranks=self.n, time_us=t * 1e6, min_us=fastest * 1e6,
            max_us=slowest * 1e6, algbw_GBps=algbw, busbw_GBps=algbw * bus_factor(kind, self.n),
            wrong=None if wrongs.min() < 0 else int(wrongs.sum()),
            rank_us=(rank_s * 1e6).tolist(), repeat=repeat, sets=len(calls),
            driver_calls=None if ops_of.min() < 0 else float(ops_of.max()),
            host_us=None if host_of.min() < 0 else float(host_of.max()) * 1e6,
            schedule=schedule, **extra)

    def host_cost(self, system: System, fn: Any, calls: int = 4) -> tuple[float, float] | None:
        """(driver calls, host seconds) per call of `fn` on this rank: `System.operations`
        and the wall time of `calls` calls in a row, which on a GPU only enqueue (the
        device is synchronized after). None where the system does not count its calls, or
        on the CPU. Collective: every rank makes the calls."""
        if self.backend.name != "cuda" or system.operations() is None:
            return None
        before = system.operations()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        took = time.perf_counter() - start
        self.backend.synchronize()
        return ((system.operations() or 0) - (before or 0)) / calls, took / calls

    def _buffers(self, case: Case, placement: str) -> Buffers:
        if case.collective == "barrier":
            return Buffers(None, None, np.empty(0), self.backend, placement)
        return make_buffers(case.collective, placement, self.source(case, self.rank),
                            rank=self.rank, root=case.root, n=self.n, backend=self.backend,
                            arena=self.arena)

    def _rewind(self) -> None:
        """Before a measurement's arrays are made: registered ones reuse the arena."""
        if self.arena is not None:
            self.arena.rewind()

    def check(self, fn: Any, buffers: Buffers, system: System, case: Case,
              expected: np.ndarray | None) -> int | None:
        """Wrong elements of this rank's result over -c checked calls; None when nothing
        was checked."""
        if not self.s.check_iters or case.collective == "barrier":
            return None
        wrong = 0
        rtol = tolerance(case.dtype, self.n)
        for _ in range(self.s.check_iters):
            buffers.reset()
            self.backend.synchronize()
            system.sync()
            fn()
            self.backend.synchronize()
            if buffers.out is None or expected is None:
                continue
            got = self.backend.to_host(buffers.out)
            if self.corrupt and self.rank == 0:
                got = got.copy()
                corrupt(got)
            wrong += count_wrong(got, expected, rtol)
        return wrong

    # -- overlap with compute -----------------------------------------------------------
    def overlap(self, system: System, case: Case, placement: str) -> dict[str, Any] | None:
        """How much of `system`'s collective hides behind compute (--overlap), as OSU's
        non-blocking benchmarks define it: the collective's non-blocking form started and
        waited for at once (`pure`), compute sized to take about as long, then each of `-n`
        iterations starts the collective, computes and waits (`both`); overlap = 100 x (1 -
        (both - compute) / pure), at least 0: 100 % when the collective cost nothing beside
        the compute, 0 % when it all came on top."""
        s = self.s
        try:
            self._rewind()
            buffers = self._buffers(case, placement)
            start = system.overlap(case.collective, buffers, case.op, case.root)
        except Unsupported as exc:
            self.notes.setdefault(f"{system.name} overlap", f"{system.name} --overlap: {exc}")
            return None

        def pure() -> None:
            start()()

        pure_s = time_loop(pure, iters=s.iters, backend=self.backend, sync=system.sync)
        unit = self.backend.compute(1 << 20)
        unit_s = time_loop(unit, iters=5, backend=self.backend, sync=system.sync)
        # every rank computes as long as the slowest rank's estimate asks
        passes = int(self.gather(np.array([max(1.0, pure_s / max(unit_s, 1e-9))])).max())

        def compute() -> None:
            for _ in range(passes):
                unit()

        def both() -> None:
            wait = start()
            compute()
            wait()

        compute_s = time_loop(compute, iters=s.iters, backend=self.backend, sync=system.sync)
        both_s = time_loop(both, iters=s.iters, backend=self.backend, sync=system.sync)
        table = self.gather(np.array([pure_s, compute_s, both_s])) * 1e6
        pure_us, compute_us, both_us = (combine_ranks(table[:, i], s.average)
                                        for i in range(3))
        overlap = max(0.0, 100.0 * (1.0 - (both_us - compute_us) / pure_us)) if pure_us else 0.0
        return {"system": system.name, "collective": case.collective, "size": case.size,
                "type": case.dtype, "redop": case.op, "root": case.root,
                "placement": placement, "pure_us": pure_us, "compute_us": compute_us,
                "both_us": both_us, "overlap_pct": overlap, "compute_passes": passes}

    # -- warm-up and the floor ----------------------------------------------------------
    def warm_up(self, systems: list[System], cases: list[Case]) -> None:
        """nccl-tests' warm-up: `-w` untimed calls of each system in each placement at every
        size of `cases` (one dtype, op and root), before they are measured (results are not
        checked here; `measure` checks its own)."""
        if not self.s.warmup:
            return
        for system in systems:
            for case in cases:
                for placement in system.placements(case.collective):
                    try:
                        self._rewind()
                        buffers = self._buffers(case, placement)
                        fn = system.call(case.collective, buffers, case.op, case.root)
                    except Unsupported:
                        continue
                    buffers.steady(case.collective, case.op)
                    for _ in range(self.s.warmup):
                        fn()
                    self.backend.synchronize()
            system.sync()

    def _copies(self, nbytes: int, repeats: int) -> tuple[np.ndarray, list[Memory]]:
        """Every rank copies `nbytes` `repeats` times in a row, all at once. Returns each
        rank's (node, memory, bytes moved, seconds) and the memories: ranks whose arrays
        share one (all of a node's on the CPU, those on one GPU for CUDA) are grouped, and
        each memory's bandwidth is the bytes its ranks copied / the longest of their times
        (`group_memories`)."""
        moved, seconds = self.backend.copy_seconds(nbytes, repeats, self.comm.barrier)
        node = zlib.crc32(platform.node().encode())
        table = self.gather(np.array([node, self.backend.memory_of(self.comm.local_rank),
                                      moved, seconds]))
        keys = [(int(row[0]), int(row[1])) for row in table]
        return table, group_memories(keys, table[:, 2].tolist(), table[:, 3].tolist(),
                                     self.backend.name)

    def bandwidth(self) -> dict[str, Any]:
        """The memories' bandwidth on `membw_bytes` copies (the header's figure): the fastest
        of `COPY_SAMPLES` samples, per memory and per rank."""
        repeats = 5
        samples = [self._copies(self.s.membw_bytes, repeats) for _ in range(COPY_SAMPLES)]
        per_rank = np.max([table[:, 2] / table[:, 3] / 1e9 for table, _ in samples], axis=0)
        memories = fastest([found for _, found in samples])
        what = "CuPy device copy" if self.backend.name == "cuda" else "NumPy copy"
        return {"GBps_per_rank": float(per_rank.mean()), "per_rank": per_rank.tolist(),
                "memories": [{"memory": m.name, "ranks": m.ranks, "GBps": m.GBps}
                             for m in memories],
                "cache_bytes": self._cache,
                "method": f"{what} of {self.s.membw_bytes >> 20} MiB, {repeats} in a row, on "
                          "every rank at once, read + write counted, the fastest of "
                          f"{COPY_SAMPLES} samples; a memory's GBps = the bytes all ranks "
                          "sharing it copied / the longest of their times; per_rank = each "
                          "rank's bytes / its own time"}

    def memories_at(self, size: int) -> list[Memory]:
        """The memories' bandwidth at one size, sampled again: `COPY_SAMPLES` times, every
        rank copies `size` bytes (a working set of 2 x size, as a collective's input and
        output) `copy_repeats(size)` times in a row, all ranks at once. The runner samples
        before and after each size's measurements, in every repeat; what is returned (and
        what the floor uses, `memories_known`) is each memory's fastest sample at this size
        so far."""
        samples = self._memories_at.setdefault(size, [])
        for _ in range(COPY_SAMPLES):
            samples.append(self._copies(max(size, 8), copy_repeats(size))[1])
        return fastest(samples)

    def memories_known(self, size: int) -> list[Memory]:
        """Each memory's fastest sample at `size` so far (empty before `memories_at(size)`
        ran)."""
        return fastest(self._memories_at.get(size, []))

    def floor(self, gp: Summary, memories: list[Memory]) -> report.Floor | None:
        """The memory-bandwidth floor of gpuring's line `gp`: the bytes the collective must
        move on every rank (`required_traffic`) summed over the ranks that share a memory,
        over that memory's bandwidth at this size (`memories_at`), for the most loaded
        memory (`shared_floor`). The bytes gpuring's own plan moves are given beside it."""
        usable = [m for m in memories if m.GBps > 0]
        if self.n < 2 or not usable or gp.size == 0:
            return None
        traffic = required_traffic(gp.collective, self.n, gp.size, root=gp.root)
        seconds, memory = shared_floor(traffic, usable)
        floor_us = seconds * 1e6
        busiest = max(traffic)
        config = self.comm.config
        plan = max(rank_traffic(
            gp.collective, self.n, gp.size, np.dtype(gp.type).itemsize, root=max(gp.root, 0),
            buffer_bytes=getattr(config, "buffer_bytes", None) or 16 << 20,
            one_shot_bytes=getattr(config, "one_shot_bytes", 64 << 10),
            avg=gp.redop == "avg", registered=self.s.registered))
        efficiency = 100.0 * floor_us / gp.time_us if gp.time_us else 0.0
        return report.Floor(size=gp.size, redop=gp.redop, traffic_bytes=busiest,
                            traffic_over_size=busiest / gp.size, floor_us=floor_us,
                            time_us=gp.time_us, efficiency_pct=efficiency,
                            memory=memory.name, ranks_sharing=len(memory.ranks),
                            memory_bytes=sum(traffic[r] for r in memory.ranks),
                            memory_GBps=memory.GBps, placement=gp.placement,
                            beats_floor=efficiency > 100.0, plan_bytes=plan,
                            in_cache=self.in_cache(Case(gp.collective, gp.size, gp.type,
                                                        gp.redop, gp.root)),
                            type=gp.type, root=gp.root)

    def in_cache(self, case: Case) -> bool:
        """Whether the data the timed calls rotate over (input and output, 2 x size per
        set) fits in the largest cache."""
        return 2 * case.size * self.sets(case) <= self._cache
