"""What every rank runs: for each op and size, time and check gpuring and the peers."""

from __future__ import annotations

import os
import platform
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from . import report
from .data import corrupt, count_wrong, expected_for_rank, make_input, tolerance
from .metrics import (
    OUT_OF_PLACE,
    REDUCING,
    Memory,
    align_bytes,
    bus_factor,
    copy_repeats,
    group_memories,
    placements,
    plan_count,
    rank_traffic,
    required_traffic,
    shared_floor,
    size_series,
)
from .peers import select_peers
from .progress import Output, stream_path_from_env
from .systems import Buffers, Gpuring, System, Unsupported, make_buffers
from .timing import Backend, cuda_backend, host_backend, time_calls, time_loop

__all__ = ["Settings", "run", "CORRUPT_ENV"]

#: testing hook: with "1", rank 0 spoils one element of every checked result
CORRUPT_ENV = "GPURING_BENCH_CORRUPT"


@dataclass
class Settings:
    """Everything one `gpuring bench` run needs (sizes in bytes)."""

    collective: str = "all_reduce"
    min_bytes: int = 8
    max_bytes: int = 64 << 20
    factor: int = 2
    iters: int = 20
    warmup: int = 5
    average: int = 1  # nccl-tests' -a: 0 rank 0, 1 average, 2 minimum, 3 maximum
    per_iteration: bool = False
    check_iters: int = 1
    ops: list[str] = field(default_factory=lambda: ["sum"])
    dtype: str = "float32"
    root: int = 0
    device: str = "cpu"
    peers: list[str] = field(default_factory=list)
    chunk_bytes: int | None = None
    channels: int | None = None
    json: str | None = None
    csv: str | None = None
    plot: str | None = None
    membw_bytes: int = 128 << 20


def combine_ranks(seconds: np.ndarray, average: int) -> float:
    """The ranks' times as one, as nccl-tests' -a: 0 rank 0's, 1 the average, 2 the
    minimum, 3 the maximum."""
    if average == 0:
        return float(seconds[0])
    if average == 1:
        return float(seconds.mean())
    return float(seconds.min() if average == 2 else seconds.max())


def _human(size: int) -> str:
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if size >= 1 << shift and size % (1 << shift) == 0:
            return f"{size >> shift}{unit}"
    return f"{size}B"


class _Bench:
    def __init__(self, s: Settings, comm: Any, backend: Backend, out: Output):
        self.s, self.comm, self.backend, self.out = s, comm, backend, out
        self.n, self.rank = comm.size, comm.rank
        self.itemsize = np.dtype(s.dtype).itemsize
        self.corrupt = os.environ.get(CORRUPT_ENV, "") == "1"
        self.notes: dict[str, str] = {}
        self._memories_at: dict[int, list[Memory]] = {}

    def gather(self, values: np.ndarray) -> np.ndarray:
        return np.asarray(self.comm.all_gather(np.ascontiguousarray(values, np.float64)))

    def _copies(self, nbytes: int, repeats: int) -> tuple[np.ndarray, list[Memory]]:
        """Every rank copies `nbytes` `repeats` times in a row, all at once (collective).
        Returns each rank's (node, memory, bytes moved, seconds) and the memories: ranks whose
        arrays share one (all of a node's on the CPU, those on one GPU for CUDA) are grouped,
        and each memory's bandwidth is the bytes its ranks copied / the longest of their
        times (`group_memories`)."""
        moved, seconds = self.backend.copy_seconds(nbytes, repeats, self.comm.barrier)
        node = zlib.crc32(platform.node().encode())
        table = self.gather(np.array([node, self.backend.memory_of(self.comm.local_rank),
                                      moved, seconds]))
        keys = [(int(row[0]), int(row[1])) for row in table]
        return table, group_memories(keys, table[:, 2].tolist(), table[:, 3].tolist(),
                                     self.backend.name)

    def bandwidth(self) -> dict[str, Any]:
        """The memories' bandwidth on `membw_bytes` copies (the header's figure)."""
        repeats = 5
        table, memories = self._copies(self.s.membw_bytes, repeats)
        per_rank = table[:, 2] / table[:, 3] / 1e9
        what = "CuPy device copy" if self.backend.name == "cuda" else "NumPy copy"
        return {"GBps_per_rank": float(per_rank.mean()), "per_rank": per_rank.tolist(),
                "memories": [{"memory": m.name, "ranks": m.ranks, "GBps": m.GBps}
                             for m in memories],
                "method": f"{what} of {self.s.membw_bytes >> 20} MiB, {repeats} in a row, on "
                          "every rank at once, read + write counted; a memory's GBps = the "
                          "bytes all ranks sharing it copied / the longest of their times; "
                          "per_rank = each rank's bytes / its own time"}

    def memories_at(self, size: int) -> list[Memory]:
        """The memories' bandwidth at one size (collective: every rank calls it, in the same
        order): every rank copies `size` bytes (a working set of 2 x size, as a collective's
        input and output) `copy_repeats(size)` times in a row, all ranks at once. Remembered
        per size."""
        if size not in self._memories_at:
            self._memories_at[size] = self._copies(max(size, 8), copy_repeats(size))[1]
        return self._memories_at[size]

    def measure(self, system: System, kind: str, placement: str, op: str, size: int,
                source: np.ndarray, expected: np.ndarray | None) -> report.Result | None:
        s = self.s
        try:
            buffers = make_buffers(kind, placement, source, rank=self.rank, root=s.root,
                                   n=self.n, backend=self.backend)
            fn = system.call(kind, buffers, op, s.root)
        except Unsupported as exc:
            self.notes.setdefault(f"{system.name} {kind} {op}", f"{system.name}: {exc}")
            return None
        if s.per_iteration:
            times = time_calls(fn, iters=s.iters, warmup=1, backend=self.backend,
                               sync=system.sync)
            mine = np.array([np.median(times), np.percentile(times, 99), times.min(),
                             times.max()])
        else:
            per_call = time_loop(fn, iters=s.iters, backend=self.backend, sync=system.sync)
            mine = np.array([per_call, per_call, per_call, per_call])
        wrong = self.check(fn, buffers, system, expected)
        table = self.gather(np.append(mine, wrong))
        rank_s = table[:, 0]
        if s.per_iteration:
            t = float(rank_s.max())
            p99: float | None = float(table[:, 1].max()) * 1e6
        else:
            t = float(combine_ranks(rank_s, s.average))
            p99 = None
        algbw = size / t / 1e9 if t > 0 else 0.0
        return report.Result(
            system=system.name, collective=kind, size=size,
            count=size // self.itemsize, type=s.dtype, redop=op, root=s.root if kind in
            ("broadcast", "reduce") else -1, placement=placement, ranks=self.n,
            time_us=t * 1e6, min_us=float(table[:, 2].min()) * 1e6,
            max_us=float(table[:, 3].max()) * 1e6, algbw_GBps=algbw,
            busbw_GBps=algbw * bus_factor(kind, self.n), wrong=int(table[:, -1].sum()),
            rank_us=(rank_s * 1e6).tolist(), p99_us=p99)

    def warm_up(self, systems: list[System], kind: str, sizes: list[int]) -> None:
        """nccl-tests' warm-up: `-w` untimed calls of each system at every size, before the
        first measurement (results are not checked here; `measure` checks its own)."""
        if not self.s.warmup:
            return
        for system in systems:
            for size in sizes:
                count = plan_count(kind, self.n, size, self.itemsize)
                source = make_input(self.rank, count, self.s.dtype, salt=size)
                wanted = system.placement(kind)
                placement = wanted if wanted is not None else placements(kind)[0]
                try:
                    buffers = make_buffers(kind, placement, source, rank=self.rank,
                                           root=self.s.root, n=self.n, backend=self.backend)
                    fn = system.call(kind, buffers, self.s.ops[0] if kind in REDUCING
                                     else "none", self.s.root)
                except Unsupported:
                    continue
                for _ in range(self.s.warmup):
                    fn()
                self.backend.synchronize()
            system.sync()

    def check(self, fn: Any, buffers: Buffers, system: System,
              expected: np.ndarray | None) -> int:
        wrong = 0
        rtol = tolerance(self.s.dtype, self.n)
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

    def floor(self, gp: report.Result, op: str,
              memories: list[Memory]) -> report.Floor | None:
        """The memory-bandwidth floor of `gp`: the bytes the collective must move on every
        rank (`required_traffic`) summed over the ranks that share a memory, over that
        memory's bandwidth at this size (`memories_at`), for the most loaded memory
        (`shared_floor`). The bytes gpuring's own plan moves are given beside it."""
        usable = [m for m in memories if m.GBps > 0]
        if self.n < 2 or not usable:
            return None
        traffic = required_traffic(gp.collective, self.n, gp.size, root=self.s.root)
        seconds, memory = shared_floor(traffic, usable)
        floor_us = seconds * 1e6
        busiest = max(traffic)
        config = self.comm.config
        plan = max(rank_traffic(
            gp.collective, self.n, gp.size, self.itemsize, root=self.s.root,
            buffer_bytes=getattr(config, "buffer_bytes", 16 << 20),
            one_shot_bytes=getattr(config, "one_shot_bytes", 64 << 10), avg=op == "avg"))
        efficiency = 100.0 * floor_us / gp.time_us if gp.time_us else 0.0
        return report.Floor(size=gp.size, redop=op, traffic_bytes=busiest,
                            traffic_over_size=busiest / gp.size, floor_us=floor_us,
                            time_us=gp.time_us, efficiency_pct=efficiency,
                            memory=memory.name, ranks_sharing=len(memory.ranks),
                            memory_bytes=sum(traffic[r] for r in memory.ranks),
                            memory_GBps=memory.GBps, placement=gp.placement,
                            beats_floor=efficiency > 100.0, plan_bytes=plan)


def run(s: Settings) -> int:
    """Run the benchmark on this rank; returns 1 on every rank when any result was wrong, 2 on
    every rank when a rank lacks what the options need (checked before measuring)."""
    import gpuring

    from .preflight import check_ranks

    with gpuring.init() as comm:  # an error on its way out is not masked by close()
        if not check_ranks(s, comm):
            return 2
        backend = cuda_backend() if s.device == "cuda" else host_backend()
        backend.use_device(comm.local_rank)
        out = Output(comm.rank == 0, stream_path_from_env())
        peers: list[System] = []
        try:
            return _run(s, comm, backend, out, peers)
        finally:
            for peer in peers:
                peer.close()
            out.close()


def _run(s: Settings, comm: Any, backend: Backend, out: Output, peers: list[System]) -> int:
    from .machine import describe

    bench = _Bench(s, comm, backend, out)
    n, rank, kind = comm.size, comm.rank, s.collective
    found, peer_notes = select_peers(s.peers, comm, s.device)
    peers.extend(found)
    systems: list[System] = [Gpuring(comm, s.chunk_bytes, s.channels), *peers]
    ops = s.ops if kind in REDUCING else ["none"]
    sizes = size_series(s.min_bytes, s.max_bytes, s.factor, align_bytes(kind, n, bench.itemsize))
    settings = {**asdict(s), "ranks": n, "ops": ops, "sizes": sizes}
    machine = describe() if rank == 0 else {}
    bandwidth = bench.bandwidth()
    for line in report.header_lines(machine, settings, bandwidth):
        out.line(line)
    for line in report.table_header():
        out.line(line)
    results: list[report.Result] = []
    floors: list[report.Floor] = []
    files = _Files(s, settings, machine, bandwidth, active=rank == 0)
    files.save(results, floors, peer_notes, complete=False)
    total, done = len(ops) * len(sizes) * len(systems), 0
    bench.warm_up(systems, kind, sizes)
    for op in ops:
        for size_index, size in enumerate(sizes):
            count = plan_count(kind, n, size, bench.itemsize)
            salt = zlib.crc32(f"{kind} {op} {size} {s.dtype}".encode())

            def make(r: int, count: int = count, salt: int = salt) -> np.ndarray:
                return make_input(r, count, s.dtype, salt=salt)

            source = make(rank)
            expected = (expected_for_rank(kind, op, make, n, rank, s.root)
                        if s.check_iters else None)
            row: dict[str, report.Result] = {}
            # systems take turns going first from one size to the next
            for system in systems if size_index % 2 == 0 else systems[::-1]:
                out.progress(done, total, f"{kind} {op} {_human(size)} {system.name}")
                wanted = system.placement(kind)
                for placement in placements(kind) if wanted is None else (wanted,):
                    result = bench.measure(system, kind, placement, op, size, source, expected)
                    if result is not None:
                        results.append(result)
                        if system.name == "gpuring":
                            row[placement] = result
                done += 1
            memories = bench.memories_at(size) if n > 1 else []  # every rank, in step
            if row:
                out.line(report.table_row(row))
                gp = row.get(OUT_OF_PLACE) or next(iter(row.values()))
                floor = bench.floor(gp, op, memories)
                if floor is not None:
                    floors.append(floor)
            files.save(results, floors, peer_notes + list(bench.notes.values()),
                       complete=False)
    out.progress(total, total, "done")
    mine = [r for r in results if r.system == "gpuring"]
    for line in report.footer_lines(mine):
        out.line(line)
    notes = peer_notes + list(bench.notes.values())
    if s.peers or bench.notes:
        for line in report.peer_lines(notes, results):
            out.line(line)
    for line in report.floor_lines(bandwidth, floors):
        out.line(line)
    files.finish(results, floors, notes, out)
    return 1 if sum(r.wrong for r in results) else 0


class _Files:
    """Rank 0's --json and --csv, rewritten whole (`report.replace_file`) before the first
    size, after every size with "complete": false, and at the end with "complete": true: a
    run stopped part-way (a timeout) leaves every finished size in files a reader can parse.
    The plot is drawn at the end only."""

    def __init__(self, s: Settings, settings: dict[str, Any], machine: dict[str, Any],
                 bandwidth: dict[str, Any], *, active: bool):
        self.s, self.settings, self.machine, self.bandwidth = s, settings, machine, bandwidth
        self.active = active

    def save(self, results: list[report.Result], floors: list[report.Floor],
             notes: list[str], *, complete: bool) -> None:
        if not self.active:
            return
        if self.s.json:
            report.write_json(self.s.json, report.to_json(
                settings=self.settings, machine=self.machine, bandwidth=self.bandwidth,
                peers=notes, results=results, floors=floors, complete=complete))
        if self.s.csv:
            report.write_csv(self.s.csv, results, floors)

    def finish(self, results: list[report.Result], floors: list[report.Floor],
               notes: list[str], out: Output) -> None:
        if not self.active:
            return
        s = self.s
        self.save(results, floors, notes, complete=True)
        if s.json:
            out.line(f"# JSON written to {s.json}")
        if s.csv:
            out.line(f"# CSV written to {s.csv}")
        if s.plot:
            title = (f"gpuring bench {s.collective}, {self.settings['ranks']} ranks, "
                     f"{s.device}, {s.dtype}")
            out.line(report.plot(s.plot, results, title))
