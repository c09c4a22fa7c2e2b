"""What every rank runs: for each repeat, dtype, op, root and size, time and check gpuring
and the peers in every placement; then the summary over repeats, the floor and the files."""

from __future__ import annotations

import datetime
import functools
import os
import sys
from dataclasses import asdict
from typing import Any

import numpy as np

from . import files, report
from .data import expected_for_rank
from .measure import CORRUPT_ENV, Case, Measurer
from .metrics import (
    OUT_OF_PLACE,
    REDUCING,
    ROOTED,
    align_bytes,
    size_series,
)
from .options import Settings
from .peers import select_peers
from .progress import Output, stream_path_from_env
from .stats import Summary, combine_ranks, summarize
from .systems import Gpuring, GpuringPersistent, System
from .timing import Backend, cuda_backend, host_backend

__all__ = ["Settings", "run", "CORRUPT_ENV", "combine_ranks", "cases_of"]


def cases_of(s: Settings, n: int) -> list[list[Case]]:
    """The sweep's lines, grouped by dtype, op and root (the table's blocks), sizes rising."""
    kind = s.collective
    if kind == "barrier":
        return [[Case(kind, 0, s.dtypes[0], "none", -1)]]
    ops = s.ops if kind in REDUCING else ["none"]
    roots = s.roots if kind in ROOTED else [-1]
    blocks = []
    for dtype in s.dtypes:
        itemsize = np.dtype(dtype).itemsize
        sizes = size_series(s.min_bytes, s.max_bytes, s.factor, align_bytes(kind, n, itemsize),
                            step=s.step_bytes)
        for op in ops:
            for root in roots:
                blocks.append([Case(kind, size, dtype, op, root) for size in sizes])
    return blocks


def run(s: Settings) -> int:
    """Run the benchmark on this rank; returns 1 on every rank when any result was wrong, 2 on
    every rank when a rank lacks what the options need (checked before measuring)."""
    import gpuring

    from .preflight import check_ranks

    with gpuring.init() as comm:  # an error on its way out is not masked by close()
        if not check_ranks(s, comm):
            return 2
        if _launcher() == "one process":  # (said after the preflight's problems, if any)
            print("gpuring bench: no --ranks and no launcher (gpuring run, mpiexec): "
                  "measuring 1 rank in this process; pass --ranks N for N ranks",
                  file=sys.stderr, flush=True)
        if not s.roots:  # -r all
            s.roots = list(range(comm.size))
        if any(r >= comm.size for r in s.roots):
            if comm.rank == 0:
                print(f"gpuring bench: -r {s.roots[0]} is not a rank of this job's "
                      f"{comm.size}", file=sys.stderr, flush=True)
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


def _in_force(comm: Any, device: str, registered: bool) -> dict[str, Any]:
    """The settings the collectives run with (the device's defaults where none is set), and
    every GPURING_ setting the environment sets."""
    from .. import settings as declared
    from ..devices import device_class

    config = comm.config
    devices = device_class(device)
    values = {
        "chunk_bytes": comm.chunk_bytes_for(device),
        "channels": config.channels or devices.default_channels,
        "buffer_bytes": config.buffer_bytes or devices.default_buffer_bytes,
        "one_shot_bytes": config.one_shot_bytes, "transport": config.transport,
        "algorithm": config.algorithm, "deterministic": config.deterministic,
        "timeout": config.timeout, "verify": config.verify, "registered": registered}
    return {"config": values,
            "environment": {k: v for k, v in sorted(os.environ.items())
                            if k in declared.SETTINGS}}


def _run(s: Settings, comm: Any, backend: Backend, out: Output, peers: list[System]) -> int:
    from .machine import describe

    m = Measurer(s, comm, backend)
    n, rank = comm.size, comm.rank
    found, peer_notes = select_peers(s.peers, comm, s.device)
    peers.extend(found)
    systems: list[System] = [Gpuring(comm, s.chunk_bytes, s.channels), *peers]
    if s.persistent:
        systems.insert(1, GpuringPersistent(comm, s.chunk_bytes, s.channels))
    blocks = cases_of(s, n)
    cases = [c for block in blocks for c in block]
    comm.all_reduce(backend.to_device(np.ones(1, np.float32)))  # the engine, for _in_force
    settings = {**asdict(s), "ranks": n, "sizes": sorted({c.size for c in cases}),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "launcher": _launcher(),
                "in_force": _in_force(comm, s.device, s.registered)}
    machine = describe() if rank == 0 else {}
    if s.registered:
        m.register_arena(cases)
    bandwidth = m.bandwidth()
    for line in report.header_lines(machine, settings, bandwidth):
        out.line(line)
    results: list[report.Result] = []
    overlaps: list[dict[str, Any]] = []
    files = _Files(s, settings, machine, bandwidth, active=rank == 0)
    files.save(results, [], peer_notes, overlaps, complete=False)
    total, done = s.repeats * len(cases) * len(systems), 0
    for repeat in range(s.repeats):
        if s.repeats > 1:
            out.line(f"# repeat {repeat + 1} of {s.repeats}")
        for line in report.table_header():
            out.line(line)
        for block in blocks:
            m.warm_up(systems, block)
            for index, case in enumerate(block):
                expected = None
                if s.check_iters and case.collective != "barrier":
                    expected = expected_for_rank(case.collective, case.op,
                                                 functools.partial(m.source, case), n, rank,
                                                 case.root)
                if n > 1 and case.size:  # the copy bandwidth around the size: before it
                    m.memories_at(case.size)  # and after it, every rank in step
                row: dict[str, report.Result] = {}
                # systems take turns going first from one size to the next
                for system in systems if (index + repeat) % 2 == 0 else systems[::-1]:
                    out.progress(done, total, f"{case.collective} {case.op} "
                                              f"{report.size_label(case.size)} {system.name}")
                    for placement in system.placements(case.collective):
                        result = m.measure(system, case, placement, expected, repeat)
                        if result is None:
                            continue
                        results.append(result)
                        if system.name == "gpuring":
                            row[placement] = result
                    if s.overlap and repeat == 0:  # one placement: the first it offers
                        found_overlap = m.overlap(system, case,
                                                  system.placements(case.collective)[0])
                        if found_overlap is not None:
                            overlaps.append(found_overlap)
                    done += 1
                if n > 1 and case.size:
                    m.memories_at(case.size)  # every rank, in step
                if row:
                    out.line(report.table_row(row))
                if files.active:  # rank 0 writes the files as the run goes
                    files.save(results, _floors(m, summarize(results)),
                               peer_notes + list(m.notes.values()), overlaps, complete=False)
    out.progress(total, total, "done")
    summary = summarize(results)
    floors = _floors(m, summary)
    notes = peer_notes + list(m.notes.values())
    for line in (report.footer_lines(results) + report.schedule_lines(results)
                 + report.driver_lines(results)):
        out.line(line)
    if s.repeats > 1:
        for line in report.repeat_lines(summary):
            out.line(line)
    if s.peers or s.persistent or m.notes:
        for line in report.peer_lines(notes, summary):
            out.line(line)
    if overlaps:
        for line in report.overlap_lines(overlaps):
            out.line(line)
    if s.collective != "barrier":
        for line in report.floor_lines(bandwidth, floors):
            out.line(line)
    files.finish(results, floors, notes, overlaps, out)
    return 1 if any(r.wrong for r in results) else 0


def _floors(m: Measurer, summary: list[Summary]) -> list[report.Floor]:
    """The floor of gpuring's out-of-place line (else its in-place one) at every size
    measured so far, from the median over repeats."""
    mine: dict[tuple[Any, ...], Summary] = {}
    for row in summary:
        if row.system != "gpuring":
            continue
        key = (row.size, row.type, row.redop, row.root)
        if key not in mine or row.placement == OUT_OF_PLACE:
            mine[key] = row
    floors = []
    for row in mine.values():
        floor = m.floor(row, m.memories_known(row.size))
        if floor is not None:
            floors.append(floor)
    return floors


def _launcher() -> str:
    from ..rendezvous.mpi import launched_by_mpi
    from ..rendezvous.store import ENV_ADDR

    if os.environ.get(ENV_ADDR):
        return "gpuring run"
    return "mpiexec" if launched_by_mpi() else "one process"


class _Files:
    """Rank 0's --json and --csv, rewritten whole (`files.replace_file`) before the first
    size, after every size with "complete": false, and at the end with "complete": true: a
    run stopped part-way (a timeout) leaves every finished size in files a reader can parse.
    The plot is drawn at the end only."""

    def __init__(self, s: Settings, settings: dict[str, Any], machine: dict[str, Any],
                 bandwidth: dict[str, Any], *, active: bool):
        self.s, self.settings, self.machine, self.bandwidth = s, settings, machine, bandwidth
        self.active = active

    def save(self, results: list[report.Result], floors: list[report.Floor],
             notes: list[str], overlaps: list[dict[str, Any]], *, complete: bool) -> None:
        if not self.active:
            return
        if self.s.json:
            files.write_json(self.s.json, files.to_json(
                settings=self.settings, machine=self.machine, bandwidth=self.bandwidth,
                peers=notes, results=results, floors=floors, overlap=overlaps,
                complete=complete))
        if self.s.csv:
            files.write_csv(self.s.csv, results, floors)

    def finish(self, results: list[report.Result], floors: list[report.Floor],
               notes: list[str], overlaps: list[dict[str, Any]], out: Output) -> None:
        if not self.active:
            return
        s = self.s
        self.save(results, floors, notes, overlaps, complete=True)
        if s.json:
            out.line(f"# JSON written to {s.json}")
        if s.csv:
            out.line(f"# CSV written to {s.csv}")
        if s.plot:
            from .plot import plot

            machine = self.machine
            where = machine.get("cpu") if s.device == "cpu" else ", ".join(
                (machine.get("gpus") or {}).get("names", [])) or "GPU"
            title = (f"gpuring bench {s.collective}: {self.settings['ranks']} ranks, "
                     f"{s.device} ({where}), {', '.join(s.dtypes)}; commit "
                     f"{machine.get('commit') or 'unknown'}, {self.settings['date'][:10]}")
            out.line(plot(s.plot, summarize(results), floors, title))
