"""One-shot schedules for small messages: every rank stages its data, then reads every peer's.

Fewer operations and one flag hop instead of 2(n-1): the latency choice. The reduction runs in
rank order 0, 1, ..., n-1 on every rank, so results are bitwise identical across ranks; with
more than two ranks it is one n-input reduce (each staged input read once, the output written
once) rather than a chain of n-1 binary reduces through the output.
"""

from __future__ import annotations

from .plan import BUF, IN, OUT, RS, Copy, Loc, Op, Reduce, ReduceN, RoundPlan, Signal, Wait

__all__ = ["one_shot_all_reduce", "barrier_round"]


def one_shot_all_reduce(n: int, rank: int, count: int, offset: int = 0) -> RoundPlan:
    """All-reduce of `count` elements from element `offset` of the arrays in a single piece
    on one channel (n >= 2)."""
    others = tuple(peer for peer in range(n) if peer != rank)
    ops: list[Op] = [Copy(Loc(BUF, 0, rank, RS), Loc(IN, offset), count), Signal(1, others)]
    ops += [Wait(peer, 1) for peer in range(n) if peer != rank]
    staged = tuple(Loc(BUF, 0, peer, RS) for peer in range(n))
    if n == 2:
        ops.append(Reduce(Loc(OUT, offset), staged[0], staged[1], count, True))
    else:  # one pass over every rank's data, not n - 1 passes over the output
        ops.append(ReduceN(Loc(OUT, offset), staged, count, True))
    return RoundPlan((tuple(ops),), schedule="one_shot")


def barrier_round(n: int, rank: int) -> RoundPlan:
    """Publish arrival, then wait for every peer's."""
    ops: list[Op] = [Signal(1, tuple(peer for peer in range(n) if peer != rank))]
    ops += [Wait(peer, 1) for peer in range(n) if peer != rank]
    return RoundPlan((tuple(ops),), schedule="barrier")
