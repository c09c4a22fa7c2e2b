"""Statistics of the measurements: how the ranks' times combine into one (nccl-tests' -a), the
per-iteration percentiles (-I), and the spread between repeats of the whole sweep (-N)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["combine_ranks", "Iterations", "per_iteration", "Summary", "summarize", "key_of"]


def combine_ranks(seconds: np.ndarray, average: int) -> float:
    """The ranks' times as one, as nccl-tests' -a: 0 rank 0's, 1 the average, 2 the
    minimum, 3 the maximum."""
    if average == 0:
        return float(seconds[0])
    if average == 1:
        return float(seconds.mean())
    return float(seconds.min() if average == 2 else seconds.max())


@dataclass
class Iterations:
    """Per-iteration times of every rank (-I), in seconds: `p50`, `p99`, `max` of the
    iterations' times across ranks (an iteration's time is its slowest rank's), `fastest`
    the shortest single call of any rank, and each rank's own p50, p99 and max."""

    p50: float
    p99: float
    max: float
    fastest: float
    rank_p50: list[float]
    rank_p99: list[float]
    rank_max: list[float]


def per_iteration(times: np.ndarray) -> Iterations:
    """`times[r, i]`: rank r's seconds in iteration i (every rank timed the same calls)."""
    slowest = times.max(axis=0)
    return Iterations(
        p50=float(np.median(slowest)), p99=float(np.percentile(slowest, 99)),
        max=float(slowest.max()), fastest=float(times.min()),
        rank_p50=np.median(times, axis=1).tolist(),
        rank_p99=np.percentile(times, 99, axis=1).tolist(),
        rank_max=times.max(axis=1).tolist())


@dataclass
class Summary:
    """One system, collective, size, type, op, root and placement over the -N repeats of the
    sweep: the median of the repeats' times (us), their fastest and slowest, and the spread
    (slowest - fastest) / median in percent; bandwidths are at the median."""

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
    fastest_us: float
    slowest_us: float
    spread_pct: float
    algbw_GBps: float
    busbw_GBps: float
    repeats_us: list[float] = field(default_factory=list)
    wrong: int | None = None


def key_of(r: Any) -> tuple[Any, ...]:
    """What identifies one measured line across repeats."""
    return (r.system, r.collective, r.size, r.type, r.redop, r.root, r.placement)


def summarize(results: Iterable[Any]) -> list[Summary]:
    """Every measured line's repeats (report.Result objects, in the order first seen) as one
    Summary; `wrong` adds the repeats' wrong elements (None: never checked)."""
    groups: dict[tuple[Any, ...], list[Any]] = {}
    for r in results:
        groups.setdefault(key_of(r), []).append(r)
    out = []
    for rows in groups.values():
        times = [r.time_us for r in rows]
        median = float(np.median(times))
        first = rows[0]
        factor = first.busbw_GBps / first.algbw_GBps if first.algbw_GBps else 0.0
        algbw = first.size / median / 1e3 if median > 0 else 0.0
        checked = [r.wrong for r in rows if r.wrong is not None]
        out.append(Summary(
            system=first.system, collective=first.collective, size=first.size,
            count=first.count, type=first.type, redop=first.redop, root=first.root,
            placement=first.placement, ranks=first.ranks, time_us=median,
            fastest_us=min(times), slowest_us=max(times),
            spread_pct=100.0 * (max(times) - min(times)) / median if median > 0 else 0.0,
            algbw_GBps=algbw, busbw_GBps=algbw * factor, repeats_us=times,
            wrong=sum(checked) if checked else None))
    return out
