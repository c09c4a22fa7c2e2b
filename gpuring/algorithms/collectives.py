"""Whole-collective plans: split a collective into rounds that fit the buffers, pick an
algorithm per round. Pure: the same arguments give equal plans. Not cached: a collective is
planned once per prepared call (`_prepare`), and a cache saved 274 of the 2,972 Python
opcodes of a preparation (`bench/host_cost.py --without prepared [--without plans]`)."""

from __future__ import annotations

import os
import sys
import warnings

from .exchange import EXCHANGE_KINDS, exchange_rounds
from .oneshot import barrier_round, one_shot_all_reduce
from .plan import RoundPlan, relabel, split_even
from .registered import registered_form, registered_round
from .ring import (
    ALL_GATHER,
    ALL_REDUCE,
    BROADCAST,
    REDUCE,
    REDUCE_SCATTER,
    Segment,
    chain_round,
    ring_round,
)
from .two_shot import TWO_SHOT_KINDS, two_shot_round

__all__ = ["plan_collective", "ALGORITHMS", "FORMER_NAMES", "algorithm_name"]

#: what `algorithm` may ask for: "auto" (all_reduce: one-shot up to `one_shot_bytes` where it
#: fits one buffer region, else the ring; the others: the ring or chain),
#: "ring" (the ring; a chain for reduce), "two_shot" (a reduce-scatter then an all-gather,
#: every rank reading its peers directly; formerly "direct"), "one_shot" (every rank reduces
#: everything, in rounds of a buffer region; all_reduce only)
ALGORITHMS = ("auto", "ring", "two_shot", "one_shot")

#: the algorithms' former names, still accepted (with a DeprecationWarning) where a user names
#: one: a call's `algorithm=`, GPURING_ALGORITHM, `init(algorithm=)`; tuning tables written
#: before the rename are read without a warning
FORMER_NAMES = {"direct": "two_shot"}

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def algorithm_name(algorithm: str, where: str) -> str:
    """`algorithm` under its current name: a former one (`FORMER_NAMES`) is translated, with
    a DeprecationWarning (`where` says who asked) pointing at the first caller outside
    gpuring; any other name is returned as it is (checking it is the caller's business)."""
    current = FORMER_NAMES.get(algorithm) if isinstance(algorithm, str) else None
    if current is None:
        return algorithm
    level, frame = 1, sys._getframe(0)
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1  # type: ignore[assignment]
    warnings.warn(f"{where}: algorithm {algorithm!r} is deprecated, use {current!r} (the "
                  f"same two-shot schedule)", DeprecationWarning, stacklevel=level)
    return current


def plan_collective(kind: str, n: int, rank: int, count: int, *, itemsize: int,
                    capacity_bytes: int, chunk_bytes: int, channels: int, root: int = 0,
                    one_shot_bytes: int = 0, in_place: bool = False,
                    algorithm: str = "auto", peer_in: bool = False,
                    peer_out: bool = False, order: tuple[int, ...] = ()
                    ) -> tuple[RoundPlan, ...]:
    """The rounds `rank` runs for one collective.

    `count` is the element count of the input (all_reduce, reduce_scatter, scatter,
    all_to_all: whole input; all_gather: one rank's block; broadcast, reduce, gather: the
    array). `capacity_bytes` is the size of
    one buffer region; `one_shot_bytes` the largest all_reduce that runs one-shot;
    `in_place`: the output is the input (all_reduce, reduce_scatter, reduce: the same
    memory; broadcast: the root copies nothing; all_gather: the input is this rank's block of
    the output, which it does not copy). `algorithm`: one of `ALGORITHMS` for all_reduce,
    reduce_scatter and reduce ("auto" for the others). `peer_in`/`peer_out`: every rank's
    input/output is registered memory its peers map: where a registered form applies
    (`registered_form`), the collective is its one round, whatever its size (a small
    all_reduce that "auto" runs one-shot stays one-shot: one flag hop).
    `order`: the ranks in the order the ring and the chains visit them (a permutation of
    range(n), the same on every rank); empty: rank order. The other schedules reach every
    peer directly, in rank order.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}, not {algorithm!r}")
    if (algorithm == "one_shot" and kind != ALL_REDUCE) or (
            algorithm == "two_shot" and kind not in TWO_SHOT_KINDS):
        raise ValueError(f"{kind} has no {algorithm} schedule")
    if n < 2:
        raise ValueError("collectives across one rank need no plan")
    if not 0 <= root < n:
        raise ValueError(f"root {root} is not a rank of {n}")
    if order and sorted(order) != list(range(n)):
        raise ValueError(f"order must be a permutation of the {n} ranks, got {order}")
    if order == tuple(range(n)):
        order = ()
    cap = capacity_bytes // itemsize
    chunk = max(1, chunk_bytes // itemsize)
    if cap < n:
        raise ValueError(f"buffer of {capacity_bytes} bytes is too small for {n} ranks")
    if cap // chunk >= 1 << 31:  # piece numbers share a 64-bit flag with the round number
        raise ValueError(f"chunk of {chunk_bytes} bytes is too small for a buffer of "
                         f"{capacity_bytes} bytes; use a larger chunk_bytes")
    if kind == "barrier":
        return (barrier_round(n, rank),)
    if kind in EXCHANGE_KINDS:
        return exchange_rounds(kind, n, rank, count, root, cap, chunk, channels)
    if kind == ALL_REDUCE and algorithm == "auto" and 0 < count * itemsize <= one_shot_bytes \
            and count <= cap:  # (registered or not: one flag hop, where registered takes 3)
        return (one_shot_all_reduce(n, rank, count),)
    form = registered_form(kind, algorithm, peer_in, peer_out, in_place, n) if (
        peer_in or peer_out) else None
    if form is not None:
        return (registered_round(form, n, rank, count, chunk, channels, peer_in=peer_in,
                                 in_place=in_place, root=root),) if count else ()
    rounds: list[RoundPlan] = []
    if kind == ALL_REDUCE and algorithm == "one_shot":
        for a in range(0, count, cap):
            rounds.append(one_shot_all_reduce(n, rank, min(cap, count - a), a))
    elif kind == ALL_REDUCE:
        for a in range(0, count, cap):
            length = min(cap, count - a)
            segs = tuple(Segment(a + s, s, a + s, k) for s, k in split_even(length, n))
            rounds.append(two_shot_round(kind, n, rank, segs, chunk, channels)
                          if algorithm == "two_shot" else
                          _ring(kind, n, rank, segs, chunk, channels, order))
    elif kind == REDUCE_SCATTER:
        if count % n:
            raise ValueError(f"reduce_scatter needs a count divisible by {n}, got {count}")
        block = count // n
        step = cap // n
        for j in range(0, block, step):
            length = min(step, block - j)
            segs = tuple(Segment(b * block + j, b * length, j, length) for b in range(n))
            rounds.append(two_shot_round(kind, n, rank, segs, chunk, channels)
                          if algorithm == "two_shot" else
                          _ring(kind, n, rank, segs, chunk, channels, order))
    elif kind == REDUCE and algorithm == "two_shot":
        for a in range(0, count, cap):
            length = min(cap, count - a)
            segs = tuple(Segment(a + s, s, a + s, k) for s, k in split_even(length, n))
            rounds.append(two_shot_round(kind, n, rank, segs, chunk, channels, root=root))
    elif kind == ALL_GATHER:
        step = cap // n
        for j in range(0, count, step):
            length = min(step, count - j)
            segs = tuple(Segment(j, b * length, b * count + j, length) for b in range(n))
            rounds.append(_ring(kind, n, rank, segs, chunk, channels, order,
                                own_copy=not in_place))
    elif kind in (BROADCAST, REDUCE):
        for a in range(0, count, cap):
            length = min(cap, count - a)
            rounds.append(_chain(kind, n, rank, root, a, length, chunk, channels, order,
                                 root_copies=not in_place))
    else:
        raise ValueError(f"unknown collective {kind!r}")
    return tuple(rounds)


def _ring(kind: str, n: int, rank: int, segs: tuple[Segment, ...], chunk: int, channels: int,
          order: tuple[int, ...], *, own_copy: bool = True) -> RoundPlan:
    """`ring_round` around the ranks in `order`: planned for this rank's position in it, with
    position g taking rank order[g]'s segment (its own block, where segments belong to
    ranks), then said in ranks."""
    if not order:
        return ring_round(kind, n, rank, segs, chunk, channels, own_copy=own_copy)
    moved = tuple(segs[order[g]] for g in range(n))
    return relabel(ring_round(kind, n, order.index(rank), moved, chunk, channels,
                              own_copy=own_copy), order)


def _chain(kind: str, n: int, rank: int, root: int, in_off: int, count: int, chunk: int,
           channels: int, order: tuple[int, ...], *, root_copies: bool) -> RoundPlan:
    """`chain_round` along the ranks in `order` (from, or to, `root`)."""
    if not order:
        return chain_round(kind, n, rank, root, in_off, count, chunk, channels,
                           root_copies=root_copies)
    return relabel(chain_round(kind, n, order.index(rank), order.index(root), in_off, count,
                               chunk, channels, root_copies=root_copies), order)
