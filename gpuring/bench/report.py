"""What a run found, as records (Result, Floor) and as text: the table (nccl-tests' layout)
and the footer, repeat, peer, overlap, driver-call and floor sections."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .metrics import IN_PLACE, OUT_OF_PLACE, REDUCING, ROOTED, STEADY

__all__ = ["Result", "Floor", "SCHEMA", "header_lines", "table_header", "table_row",
           "footer_lines", "driver_lines", "repeat_lines", "overlap_lines", "peer_lines",
           "floor_lines", "floor_basis", "ratios", "avg_busbw", "size_label"]

SCHEMA = "gpuring.bench/2"
_PLACE = (OUT_OF_PLACE, IN_PLACE)
_CELL = f"{'':>11}{'n/a':>9}{'':>9}{'':>7}"


@dataclass
class Result:
    """One system, size, type, op, root and placement in one repeat of the sweep; times in
    us. Back to back (the default): `time_us` combines the ranks' times per call as -a says,
    `min_us`/`max_us` are the fastest and slowest rank's, `rank_us` every rank's. Per
    iteration (-I), where an iteration's time is its slowest rank's: `time_us` is the p50 of
    the iterations, `p99_us` their p99, `max_us` the longest, `min_us` the shortest single
    call of any rank; `rank_us`, `rank_p99_us`, `rank_max_us` each rank's own p50, p99, max.
    `count` is per rank for all_gather and reduce_scatter (nccl-tests' count); `wrong` is
    None when nothing was checked (-c 0); `sets` the buffer sets the calls rotated over."""

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
    wrong: int | None
    rank_us: list[float] = field(default_factory=list)
    p99_us: float | None = None
    rank_p99_us: list[float] | None = None
    rank_max_us: list[float] | None = None
    repeat: int = 0
    sets: int = 1
    #: driver calls per call, the most of any rank (GPU; None elsewhere)
    driver_calls: float | None = None
    #: host time per call (microseconds; enqueueing only), the most of any rank (GPU; None
    #: elsewhere, where a call returns when the result is complete)
    host_us: float | None = None
    #: what gpuring ran (`Communicator.last_schedule`; None for the peers)
    schedule: str | None = None


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
    #: whether the input and output (2 x size) fit in the largest cache
    in_cache: bool = False
    type: str = ""
    root: int = -1


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


def size_label(n: float | None) -> str:
    """8 -> "8 B", 4096 -> "4 KiB", 3 << 20 -> "3 MiB" ("?" when unknown)."""
    if not n:
        return "?"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.4g} {unit}"
    return f"{int(n)} B"


def _sizes(sizes: list[int]) -> str:
    if len(sizes) <= 6:
        return ", ".join(size_label(x) for x in sizes)
    return f"{len(sizes)} sizes, {size_label(sizes[0])} .. {size_label(sizes[-1])}"


def header_lines(machine: dict[str, Any], settings: dict[str, Any],
                 bandwidth: dict[str, Any] | None = None) -> list[str]:
    """The '#' lines above the table: what ran, when, where, with what settings in force,
    how it was timed, and the bandwidth the floor assumes."""
    v = machine.get("versions", {})
    kind = settings["collective"]
    step = (f"+{settings['step_bytes']} B" if settings.get("step_bytes")
            else f"x{settings['factor']}")
    lines = [
        f"# gpuring bench {settings['collective']}: {settings['ranks']} ranks under "
        f"{settings.get('launcher', '?')}, device {settings['device']}, "
        f"{settings.get('date', '')}",
        f"# sizes: {_sizes(settings.get('sizes', []))} ({step}); dtype "
        f"{', '.join(settings['dtypes'])}; op "
        f"{', '.join(settings['ops']) if kind in REDUCING else 'none'}; root "
        f"{', '.join(map(str, settings['roots'])) if kind in ROOTED else 'none'}; "
        f"{settings['iters']} iterations, "
        f"{settings['warmup']} warm-up, {settings['check_iters']} checked, "
        f"{settings.get('repeats', 1)} repeat(s)",
        f"# machine: {machine.get('host')}, {machine.get('cpu')}, {machine.get('cpus')} CPUs, "
        f"{size_label(machine.get('memory_bytes'))} memory, {machine.get('os')}",
    ]
    g = machine.get("gpus")
    if g:
        memory = ", ".join(size_label(b) for b in g.get("memory_bytes", []))
        lines.append(f"# GPUs: {', '.join(g['names']) or 'none'} ({memory}); driver "
                     f"{g['driver']}")
        if g.get("topology"):
            lines.append(f"# topology: {g['topology']}")
    libs = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    lines.append(f"# versions: {libs}; commit {machine.get('commit') or 'not a git checkout'}")
    in_force = settings.get("in_force", {})
    config = ", ".join(f"{k} {val}" for k, val in in_force.get("config", {}).items()
                       if val is not None)
    env = ", ".join(f"{k}={val}" for k, val in in_force.get("environment", {}).items())
    per_call = ", ".join(f"{k} {settings[k]}" for k in ("chunk_bytes", "channels")
                         if settings.get(k))
    lines.append(f"# in force: {config or 'the device defaults'}"
                 f"{'; per call: ' + per_call if per_call else ''}"
                 f"{'; environment: ' + env if env else ''}")
    how = "each call waits for completion and a barrier (-z 1)" if settings.get(
        "blocking") else (
        "calls enqueued back to back (-z 0)")
    if settings.get("off_cache"):
        cache = size_label((bandwidth or {}).get("cache_bytes"))
        how += f"; buffers rotate over sets of twice the {cache} cache (--off-cache)"
    if settings.get("graph_launches"):
        lines.append(f"# time: {settings['iters']} calls captured into one CUDA graph (after a "
                     f"call outside it), one barrier, then {settings['graph_launches']} "
                     "launches of the graph back to back, time per call; the ranks' average "
                     f"(-G {settings['graph_launches']})")
    elif settings.get("per_iteration"):
        lines.append("# time: each call timed on its own after a barrier; an iteration's time "
                     f"is its slowest rank's; the table shows their p50; {how}")
    else:
        combine = {0: "rank 0's", 1: "the ranks' average", 2: "the fastest rank's",
                   3: "the slowest rank's"}[settings.get("average", 1)]
        lines.append(f"# time: one barrier, then {settings['iters']} calls back to back, time "
                     f"per call; {combine} (-a {settings.get('average', 1)}); {how}")
    steady = [op for op in settings.get("ops", []) if op in STEADY
              and settings.get("collective") in REDUCING]
    lines.append(f"# warm-up: {settings['warmup']} calls of each system in each placement at "
                 "every size of a dtype, op and root, before them, in every repeat; systems "
                 "alternate going first; checks run apart from the timed calls, on the real "
                 "inputs" + (f"; in place, timed {' and '.join(steady)} calls run on "
                             f"{' and '.join(_WORDS[STEADY[op]] for op in steady)}, which "
                             f"{'that op keeps' if len(steady) == 1 else 'those ops keep'} "
                             "call after call" if steady else ""))
    if bandwidth is not None:
        lines.append(f"# floor: the bytes the collective must move, over the copy bandwidth "
                     f"at each size (the fastest sample around it); at 128 MiB: "
                     f"{floor_basis(bandwidth)} (each with all its ranks copying at once); the "
                     "ranks sharing a memory move all their bytes through it")
    return lines


_WORDS = {0: "zeros", 1: "ones"}


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


def _wrong(wrong: int | None) -> str:
    return "N/A" if wrong is None else str(wrong)


def _cell(r: Result | None) -> str:
    if r is None:
        return _CELL
    return f"{r.time_us:>11.2f}{r.algbw_GBps:>9.2f}{r.busbw_GBps:>9.2f}{_wrong(r.wrong):>7}"


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
    """nccl-tests' footer; the wrong elements of every system (gpuring and the peers)."""
    checked = [r for r in results if r.wrong is not None]
    if not checked:
        wrong_line = "# Wrong elements    : N/A (nothing checked: -c 0, or a barrier)"
    else:
        wrong = sum(r.wrong or 0 for r in checked)
        by_system: dict[str, int] = {}
        for r in checked:
            by_system[r.system] = by_system.get(r.system, 0) + (r.wrong or 0)
        each = ", ".join(f"{k} {v}" for k, v in by_system.items())
        wrong_line = (f"# Wrong elements    : {wrong} {'OK' if wrong == 0 else 'FAILED'}"
                      f"{f' ({each})' if len(by_system) > 1 else ''}")
    return [wrong_line, f"# Avg bus bandwidth : {avg_busbw(results):.4f} GB/s", "#"]


def driver_lines(results: list[Result]) -> list[str]:
    """gpuring's host cost per collective (GPU), per size and placement: driver calls
    (kernel launches, copies, stream memory operations, event operations) and the host's
    time to enqueue them."""
    mine = [r for r in results if r.system == "gpuring" and r.driver_calls is not None
            and r.repeat == 0]
    if not mine:
        return []
    lines = ["# Host cost per collective (gpuring; the most of any rank): driver calls (kernel "
             "launches, copies, stream memory operations, event creations, records and "
             "waits) and the host's time to enqueue them",
             f"#{'size':>11}{'type':>9}{'redop':>7}{'placement':>14}{'calls':>8}"
             f"{'host_us':>10}"]
    lines += [f"{r.size:>12d}{r.type:>9}{r.redop:>7}{r.placement:>14}{r.driver_calls:>8.1f}"
              f"{r.host_us if r.host_us is not None else float('nan'):>10.1f}" for r in mine]
    return lines


def schedule_lines(results: list[Result]) -> list[str]:
    """What gpuring ran, per placement, sizes with the same schedule in one range."""
    mine = [r for r in results if r.system == "gpuring" and r.schedule and r.repeat == 0]
    lines = []
    for placement in dict.fromkeys(r.placement for r in mine):
        runs: list[list[Any]] = []
        for r in sorted((r for r in mine if r.placement == placement), key=lambda r: r.size):
            if runs and runs[-1][2] == r.schedule:
                runs[-1][1] = r.size
            else:
                runs.append([r.size, r.size, r.schedule])
        ranges = "; ".join(f"{size_label(lo)}{'' if lo == hi else '..' + size_label(hi)} "
                           f"{schedule}" for lo, hi, schedule in runs)
        lines.append(f"# Schedule ({placement}): {ranges}")
    return lines


def repeat_lines(summary: Sequence[Any]) -> list[str]:
    """The spread between the -N repeats of the sweep: per line, the median time, the
    fastest and slowest repeat, and (slowest - fastest) / median."""
    repeats = len(summary[0].repeats_us) if summary else 0
    lines = [f"# Repeats: the median of {repeats} sweeps, and their spread = (slowest - "
             "fastest) / median",
             f"#{'size':>11}{'type':>9}{'redop':>7}{'root':>5}{'system':>8}{'placement':>14}"
             f"{'median':>11}{'fastest':>11}{'slowest':>11}{'spread':>8}{'busbw':>9}",
             f"#{'(B)':>11}{'':>9}{'':>7}{'':>5}{'':>8}{'':>14}{'(us)':>11}{'(us)':>11}"
             f"{'(us)':>11}{'(%)':>8}{'(GB/s)':>9}"]
    for r in summary:
        lines.append(f"{r.size:>12d}{r.type:>9}{r.redop:>7}{r.root:>5d}{r.system:>8}"
                     f"{r.placement:>14}{r.time_us:>11.2f}{r.fastest_us:>11.2f}"
                     f"{r.slowest_us:>11.2f}{r.spread_pct:>8.1f}{r.busbw_GBps:>9.2f}")
    return lines


def overlap_lines(overlaps: list[dict[str, Any]]) -> list[str]:
    """--overlap: how much of each collective hid behind compute (OSU's definition)."""
    lines = ["# Overlap (OSU's definition): pure = the non-blocking collective started and "
             "waited for at once; compute sized to take about as long; both = start, compute, "
             "wait; overlap = 100 x (1 - (both - compute) / pure), at least 0 (100 %: hidden "
             "entirely, 0 %: none of it)",
             f"#{'size':>11}{'redop':>7}{'system':>8}{'placement':>14}{'pure':>11}"
             f"{'compute':>11}{'both':>11}{'overlap':>9}",
             f"#{'(B)':>11}{'':>7}{'':>8}{'':>14}{'(us)':>11}{'(us)':>11}{'(us)':>11}"
             f"{'(%)':>9}"]
    for o in overlaps:
        lines.append(f"{o['size']:>12d}{o['redop']:>7}{o['system']:>8}{o['placement']:>14}"
                     f"{o['pure_us']:>11.2f}{o['compute_us']:>11.2f}{o['both_us']:>11.2f}"
                     f"{o['overlap_pct']:>9.1f}")
    return lines


def _primary(results: Sequence[Any], p: Any) -> Any:
    """gpuring's line beside peer line `p`: the same repeat, size, type, op and root, in p's
    placement when gpuring has it."""
    placement = p.placement
    repeat = getattr(p, "repeat", None)
    mine = [r for r in results if r.system == "gpuring" and r.size == p.size
            and r.redop == p.redop and r.type == p.type and r.root == p.root
            and getattr(r, "repeat", None) == repeat]
    for r in mine:
        if r.placement == placement:
            return r
    return mine[0] if mine else None


def ratios(results: Sequence[Any]) -> list[dict[str, Any]]:
    """peer time / gpuring time (= gpuring busbw / peer busbw) per peer line (results or
    summaries over repeats), against gpuring's line of the same size, type, op, root and
    placement (gpuring's other placement when it lacks the peer's)."""
    out = []
    for p in results:
        if p.system == "gpuring":
            continue
        g = _primary(results, p)
        if g is None:
            continue
        ratio = (p.time_us / g.time_us) if g.time_us > 0 else float("nan")
        out.append({"peer": p.system, "size": p.size, "type": p.type, "redop": p.redop,
                    "root": p.root, "placement": p.placement,
                    "gpuring_placement": g.placement, "ratio": ratio,
                    "repeat": getattr(p, "repeat", None)})
    return out


def peer_lines(notes: list[str], results: Sequence[Any]) -> list[str]:
    """The peers' lines (the median over repeats) and their ratio to gpuring."""
    lines = ["# Peers: the same arrays, ranks and sizes; ratio = gpuring busbw / peer busbw "
             "(> 1: gpuring is faster)"]
    lines += [f"#   {note}" for note in notes]
    peers = [r for r in results if r.system != "gpuring"]
    if not peers:
        return lines
    by_key = {(q["peer"], q["size"], q["type"], q["redop"], q["root"], q["placement"]):
              q["ratio"] for q in ratios(results)}
    lines.append(f"#{'size':>11}{'type':>9}{'redop':>7}{'root':>5}{'system':>8}"
                 f"{'placement':>14}{'time':>11}{'algbw':>9}{'busbw':>9}{'#wrong':>7}"
                 f"{'ratio':>8}")
    lines.append(f"#{'(B)':>11}{'':>9}{'':>7}{'':>5}{'':>8}{'':>14}{'(us)':>11}{'(GB/s)':>9}"
                 f"{'(GB/s)':>9}{'':>7}{'':>8}")
    for p in peers:
        ratio = by_key.get((p.system, p.size, p.type, p.redop, p.root, p.placement),
                           float("nan"))
        lines.append(f"{p.size:>12d}{p.type:>9}{p.redop:>7}{p.root:>5d}{p.system:>8}"
                     f"{p.placement:>14}"
                     f"{p.time_us:>11.2f}{p.algbw_GBps:>9.2f}{p.busbw_GBps:>9.2f}"
                     f"{_wrong(p.wrong):>7}{ratio:>8.2f}")
    return lines


def floor_lines(bandwidth: dict[str, Any], floors: list[Floor]) -> list[str]:
    lines = [f"# Floor: the bytes the collective must move on every rank (every input byte read "
             "once, every output byte written once: 2 x size per rank for all_reduce; not "
             "gpuring's plan, whose bytes are the `plan` column), summed over the ranks sharing "
             "a memory (k ranks moving the same: k x bytes/rank), over that memory's copy "
             "bandwidth at the same size (every rank copying `size` bytes at once, about 64 MiB "
             "in all; the fastest of the samples taken before and after the size's "
             "measurements in every repeat), for the most loaded memory; efficiency = floor / "
             "gpuring's "
             "time (the median over repeats); cache: input and output fit in the largest "
             f"cache. (At 128 MiB: {floor_basis(bandwidth)}; {bandwidth['method']}.)"]
    if not floors:
        return [*lines, "#   (one rank: nothing moves)"]
    lines.append(f"#{'size':>11}{'redop':>7}{'bytes/rank':>14}{'x size':>8}{'plan':>8}"
                 f"{'sharing':>9}{'GB/s':>9}{'cache':>7}{'floor':>11}{'gpuring':>11}"
                 f"{'efficiency':>12}")
    lines.append(f"#{'(B)':>11}{'':>7}{'(B)':>14}{'':>8}{'x size':>8}{'(ranks)':>9}{'':>9}"
                 f"{'':>7}{'(us)':>11}{'(us)':>11}{'(%)':>12}")
    for f in floors:
        plan = f.plan_bytes / f.size if f.size else 0.0
        lines.append(f"{f.size:>12d}{f.redop:>7}{f.traffic_bytes:>14.0f}"
                     f"{f.traffic_over_size:>8.2f}{plan:>8.2f}{f.ranks_sharing:>9d}"
                     f"{f.memory_GBps:>9.2f}{'yes' if f.in_cache else 'no':>7}"
                     f"{f.floor_us:>11.2f}{f.time_us:>11.2f}"
                     f"{f.efficiency_pct:>12.1f}{'*' if f.beats_floor else ''}")
    if any(f.beats_floor for f in floors):
        lines.append("# * above 100 %: faster than copies of the same size ran when measured "
                     "apart from it; within a few percent that is noise, beyond it the floor's "
                     "byte count or its bandwidth is wrong for this size")
    return lines
