"""The table (nccl-tests' layout), the peer and floor sections, JSON, CSV and the plot."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from .metrics import IN_PLACE, OUT_OF_PLACE

__all__ = ["Result", "Floor", "SCHEMA", "header_lines", "table_header", "table_row",
           "footer_lines", "peer_lines", "floor_lines", "floor_basis", "ratios", "avg_busbw",
           "to_json", "write_json", "write_csv", "replace_file", "plot"]

SCHEMA = "gpuring.bench/1"
_PLACE = (OUT_OF_PLACE, IN_PLACE)
_CELL = f"{'':>11}{'n/a':>9}{'':>9}{'':>7}"


@dataclass
class Result:
    """One system, size, op and placement; times in us. Back to back (the default):
    `time_us` combines the ranks' times per call as -a says, `min_us`/`max_us` are the
    fastest and slowest rank's, `rank_us` every rank's. Per iteration (-I): `time_us` is the
    slowest rank's p50, `p99_us` the largest rank p99, `min_us`/`max_us` the shortest and
    longest single call of any rank, `rank_us` every rank's p50."""

    system: str
    collective: str
    size: int
    count: int
    type: str
    redop: str
    root: int
    placement: str
    ranks: int
    time_us: float
    min_us: float
    max_us: float
    algbw_GBps: float
    busbw_GBps: float
    wrong: int
    rank_us: list[float] = field(default_factory=list)
    p99_us: float | None = None


@dataclass
class Floor:
    """gpuring against the memory-bandwidth floor at one size."""

    size: int
    redop: str
    traffic_bytes: float
    traffic_over_size: float
    floor_us: float
    time_us: float
    efficiency_pct: float
    #: the memory that sets the floor, how many ranks share it, the bytes all of them move
    #: through it and its bandwidth
    memory: str = ""
    ranks_sharing: int = 1
    memory_bytes: float = 0.0
    memory_GBps: float = 0.0
    #: gpuring's result the floor is of, and whether it was faster than the floor (efficiency
    #: above 100 %: faster than copies of the same size; noise, or a wrong byte count)
    placement: str = ""
    beats_floor: bool = False
    #: the bytes gpuring's own plan moves on its busiest rank (beside the required ones)
    plan_bytes: float = 0.0


def _ranks(ranks: list[int]) -> str:
    """[0, 2] -> "0, 2"; [0, 1, 2, 3] -> "0-3"."""
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(str(r) for r in ranks)


def floor_basis(bandwidth: dict[str, Any]) -> str:
    """Which bandwidth the floor assumes and which ranks share it, e.g. "GPU 0 shared by 2
    ranks (0, 2) at 10.00 GB/s"."""
    memories = bandwidth.get("memories")
    if not memories:
        return f"memory bandwidth {bandwidth['GBps_per_rank']:.2f} GB/s per rank"
    parts = []
    for m in memories:
        k = len(m["ranks"])
        shared = f"shared by {k} ranks" if k > 1 else "used by 1 rank"
        parts.append(f"{m['memory']} {shared} ({_ranks(m['ranks'])}) at {m['GBps']:.2f} GB/s")
    return "; ".join(parts)


def header_lines(machine: dict[str, Any], settings: dict[str, Any],
                 bandwidth: dict[str, Any] | None = None) -> list[str]:
    """The '#' lines above the table: what ran, where, with what, and the bandwidth the floor
    assumes."""
    v = machine.get("versions", {})
    lines = [
        f"# gpuring bench {settings['collective']}: {settings['ranks']} ranks, device "
        f"{settings['device']}, dtype {settings['dtype']}, sizes {settings['min_bytes']} .. "
        f"{settings['max_bytes']} B x{settings['factor']}, {settings['iters']} iterations, "
        f"{settings['warmup']} warm-up, {settings['check_iters']} check",
        f"# machine: {machine.get('host')}, {machine.get('cpu')}, {machine.get('cpus')} CPUs, "
        f"{machine.get('os')}",
    ]
    g = machine.get("gpus")
    if g:
        lines.append(f"# GPUs: {', '.join(g['names']) or 'none'}; driver {g['driver']}")
    libs = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    lines.append(f"# versions: {libs}")
    lines.append(f"# commit: {machine.get('commit') or 'not a git checkout'}; chunk_bytes "
                 f"{settings.get('chunk_bytes') or 'default'}, channels "
                 f"{settings.get('channels') or 'default'}")
    if settings.get("per_iteration"):
        lines.append("# time: each call timed on its own after a barrier; the slowest rank's "
                     "median (p50); checks run apart from the timed calls")
    else:
        combine = {0: "rank 0's", 1: "the ranks' average", 2: "the fastest rank's",
                   3: "the slowest rank's"}[settings.get("average", 1)]
        lines.append(f"# time: one barrier, then {settings['iters']} calls back to back, time "
                     f"per call; {combine} (-a {settings.get('average', 1)}); warm-up: "
                     f"{settings['warmup']} calls of each system at every size, first; checks "
                     "run apart from the timed calls")
    if bandwidth is not None:
        lines.append(f"# floor: the bytes the collective must move, over the copy bandwidth "
                     f"at each size; at 128 MiB: {floor_basis(bandwidth)} (each with all its "
                     "ranks copying at once); the ranks sharing a memory move all their bytes "
                     "through it")
    return lines


def table_header() -> list[str]:
    left = f"{'size':>12}{'count':>13}{'type':>9}{'redop':>7}{'root':>6}"
    left_units = f"{'(B)':>12}{'(elements)':>13}{'':>9}{'':>7}{'':>6}"
    cells = f"{'time':>11}{'algbw':>9}{'busbw':>9}{'#wrong':>7}"
    units = f"{'(us)':>11}{'(GB/s)':>9}{'(GB/s)':>9}{'':>7}"
    width = len(cells)
    return [
        f"#{'':>{len(left) - 1}}{'out-of-place':^{width}}  {'in-place':^{width}}",
        f"#{left[1:]}{cells}  {cells}",
        f"#{left_units[1:]}{units}  {units}",
    ]


def _cell(r: Result | None) -> str:
    if r is None:
        return _CELL
    return f"{r.time_us:>11.2f}{r.algbw_GBps:>9.2f}{r.busbw_GBps:>9.2f}{r.wrong:>7d}"


def table_row(by_place: dict[str, Result]) -> str:
    """One line: a size and op, out-of-place then in-place ('n/a' where gpuring has none)."""
    first = next(iter(by_place.values()))
    left = (f"{first.size:>12d}{first.count:>13d}{first.type:>9}{first.redop:>7}"
            f"{first.root:>6d}")
    return f"{left}{_cell(by_place.get(OUT_OF_PLACE))}  {_cell(by_place.get(IN_PLACE))}"


def avg_busbw(results: list[Result]) -> float:
    values = [r.busbw_GBps for r in results if r.system == "gpuring"]
    return statistics.fmean(values) if values else 0.0


def footer_lines(results: list[Result]) -> list[str]:
    wrong = sum(r.wrong for r in results)
    return [f"# Wrong elements    : {wrong} {'OK' if wrong == 0 else 'FAILED'}",
            f"# Avg bus bandwidth : {avg_busbw(results):.4f} GB/s",
            "#"]


def _primary(results: list[Result], size: int, redop: str, placement: str) -> Result | None:
    mine = [r for r in results if r.system == "gpuring" and r.size == size
            and r.redop == redop]
    for r in mine:
        if r.placement == placement:
            return r
    return mine[0] if mine else None


def ratios(results: list[Result]) -> list[dict[str, Any]]:
    """gpuring busbw / peer busbw per peer row (same size and op; the peer's placement when
    gpuring has it)."""
    out = []
    for p in results:
        if p.system == "gpuring":
            continue
        g = _primary(results, p.size, p.redop, p.placement)
        if g is None:
            continue
        ratio = (p.time_us / g.time_us) if g.time_us > 0 else float("nan")
        out.append({"peer": p.system, "size": p.size, "redop": p.redop,
                    "gpuring_placement": g.placement, "ratio": ratio})
    return out


def peer_lines(notes: list[str], results: list[Result]) -> list[str]:
    lines = ["# Peers: the same arrays, ranks and sizes; ratio = gpuring busbw / peer busbw "
             "(> 1: gpuring is faster)"]
    lines += [f"#   {note}" for note in notes]
    peers = [r for r in results if r.system != "gpuring"]
    if not peers:
        return lines
    by_key = {(q["peer"], q["size"], q["redop"]): q["ratio"] for q in ratios(results)}
    lines.append(f"#{'size':>11}{'redop':>7}{'system':>8}{'placement':>14}{'time':>11}"
                 f"{'algbw':>9}{'busbw':>9}{'#wrong':>7}{'ratio':>8}")
    lines.append(f"#{'(B)':>11}{'':>7}{'':>8}{'':>14}{'(us)':>11}{'(GB/s)':>9}{'(GB/s)':>9}"
                 f"{'':>7}{'':>8}")
    for p in peers:
        ratio = by_key.get((p.system, p.size, p.redop), float("nan"))
        lines.append(f"{p.size:>12d}{p.redop:>7}{p.system:>8}{p.placement:>14}"
                     f"{p.time_us:>11.2f}{p.algbw_GBps:>9.2f}{p.busbw_GBps:>9.2f}"
                     f"{p.wrong:>7d}{ratio:>8.2f}")
    return lines


def floor_lines(bandwidth: dict[str, Any], floors: list[Floor]) -> list[str]:
    lines = [f"# Floor: the bytes the collective must move on every rank (every input byte read "
             "once, every output byte written once: 2 x size per rank for all_reduce; not "
             "gpuring's plan, whose bytes are the `plan` column), summed over the ranks sharing "
             "a memory (k ranks moving the same: k x bytes/rank), over that memory's copy "
             "bandwidth measured at the same size (every rank copying `size` bytes at once, "
             "about 64 MiB in all), for the most loaded memory; efficiency = floor / gpuring's "
             f"time. (At 128 MiB: {floor_basis(bandwidth)}; {bandwidth['method']}.)"]
    if not floors:
        return [*lines, "#   (one rank: nothing moves)"]
    lines.append(f"#{'size':>11}{'redop':>7}{'bytes/rank':>14}{'x size':>8}{'plan':>8}"
                 f"{'sharing':>9}{'GB/s':>9}{'floor':>11}{'gpuring':>11}{'efficiency':>12}")
    lines.append(f"#{'(B)':>11}{'':>7}{'(B)':>14}{'':>8}{'x size':>8}{'(ranks)':>9}{'':>9}"
                 f"{'(us)':>11}{'(us)':>11}{'(%)':>12}")
    for f in floors:
        plan = f.plan_bytes / f.size if f.size else 0.0
        lines.append(f"{f.size:>12d}{f.redop:>7}{f.traffic_bytes:>14.0f}"
                     f"{f.traffic_over_size:>8.2f}{plan:>8.2f}{f.ranks_sharing:>9d}"
                     f"{f.memory_GBps:>9.2f}{f.floor_us:>11.2f}{f.time_us:>11.2f}"
                     f"{f.efficiency_pct:>12.1f}{'*' if f.beats_floor else ''}")
    if any(f.beats_floor for f in floors):
        lines.append("# * above 100 %: faster than copies of the same size ran when measured "
                     "apart from it; within a few percent that is noise, beyond it the floor's "
                     "byte count or its bandwidth is wrong for this size")
    return lines


def to_json(*, settings: dict[str, Any], machine: dict[str, Any], bandwidth: dict[str, Any],
            peers: list[str], results: list[Result], floors: list[Floor],
            complete: bool = True) -> dict[str, Any]:
    """The document --json writes (schema "gpuring.bench/1"); `complete` is False while the
    run goes on (the sizes not yet measured are missing)."""
    return {
        "schema": SCHEMA,
        "complete": complete,
        "settings": settings,
        "machine": machine,
        "memory_bandwidth": bandwidth,
        "peers": peers,
        "results": [asdict(r) for r in results],
        "ratios": ratios(results),
        "floor": [asdict(f) for f in floors],
        "avg_busbw_GBps": avg_busbw(results),
        "wrong_total": sum(r.wrong for r in results),
    }


def replace_file(path: str, write: Callable[[IO[str]], None]) -> None:
    """Write a new file beside `path` with `write`, then rename it over `path`: a reader
    (or a run killed meanwhile) sees the old file or the new one, never half of one."""
    folder, name = os.path.split(os.path.abspath(path))
    temporary = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "w", newline="") as f:
            write(f)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def write_json(path: str, document: dict[str, Any]) -> None:
    def write(f: IO[str]) -> None:
        json.dump(document, f, indent=1)
        f.write("\n")

    replace_file(path, write)


#: the CSV's columns after the Result's: the floor of the gpuring row it is of (else empty)
CSV_FLOOR = ("floor_us", "efficiency_pct", "beats_floor")


def write_csv(path: str, results: list[Result], floors: Sequence[Floor] = ()) -> None:
    """One row per result (the per-rank medians are left out), with the floor's time,
    efficiency and `beats_floor` on the gpuring row each floor is of."""
    names = [k for k in Result.__dataclass_fields__ if k != "rank_us"]
    by_row = {(f.size, f.redop, f.placement): f for f in floors}

    def write(f: IO[str]) -> None:
        writer = csv.DictWriter(f, fieldnames=[*names, *CSV_FLOOR], extrasaction="ignore")
        writer.writeheader()
        for r in results:
            row = asdict(r)
            floor = by_row.get((r.size, r.redop, r.placement)) if r.system == "gpuring" else None
            if floor is not None:
                row.update(floor_us=floor.floor_us, efficiency_pct=floor.efficiency_pct,
                           beats_floor=floor.beats_floor)
            writer.writerow(row)

    replace_file(path, write)


def plot(path: str, results: list[Result], title: str, small_bytes: int = 64 << 10) -> str:
    """busbw against size (log2 x) per system, and latency at small sizes; returns a note."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (f"--plot {path}: matplotlib is not installed (pip install matplotlib or "
                "gpuring[bench]); no plot written")
    lines: dict[str, list[Result]] = {}
    for r in results:
        label = r.system if r.system != "gpuring" else f"gpuring {r.placement}"
        if len({x.redop for x in results}) > 1:
            label += f" {r.redop}"
        lines.setdefault(label, []).append(r)
    fig, (bw, lat) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    small = [r for r in results if r.size <= small_bytes] or results
    for label, rows in lines.items():
        rows = sorted(rows, key=lambda r: r.size)
        style = "--" if "in-place" in label else "-"
        bw.plot([r.size for r in rows], [r.busbw_GBps for r in rows], style, marker="o",
                markersize=3, label=label)
        srows = [r for r in rows if r in small]
        lat.plot([r.size for r in srows], [r.time_us for r in srows], style, marker="o",
                 markersize=3, label=label)
    for ax in (bw, lat):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    bw.set_ylabel("bus bandwidth (GB/s)")
    bw.set_title("bus bandwidth")
    lat.set_ylabel("time per call (us)")
    lat.set_title(f"latency, sizes up to {max(r.size for r in small)} B")
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"# plot written to {path}"
