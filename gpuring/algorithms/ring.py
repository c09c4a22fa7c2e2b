"""Ring and chain schedules for one round, for one rank.

Ring (n ranks, left = r-1, right = r+1): reduce-scatter step s = 0..n-2 has rank r reduce
segment (r-s-2) % n from its input and the partial its left neighbour produced at step s-1
(the left neighbour's staged input at s = 0), so rank r ends holding segment r. All-gather
step t = 0..n-2 has rank r pull segment (r-1-t) % n from its left neighbour. Every segment is
reduced along one chain and then copied, so every rank gets the same bits.

Each segment is split into `channels` slices (one independent ring each) and each slice into
pieces of `chunk` elements; a piece is published with a READY flag as soon as it is written,
so the next rank works on it while this one moves to the next piece.

Within a round no buffer location is written twice: staged input and partials go to region RS,
final and forwarded segments to region AG. Rounds alternate buffer halves; the engine makes
a round wait until peers have finished reading the half it is about to overwrite.
"""

from __future__ import annotations

from typing import NamedTuple

from .plan import (
    AG,
    BUF,
    IN,
    OUT,
    RS,
    ChannelPlan,
    Copy,
    Loc,
    Op,
    Reduce,
    RoundPlan,
    Signal,
    Wait,
    split_even,
)

__all__ = ["Segment", "ring_round", "chain_round", "piece_ranges"]

ALL_REDUCE = "all_reduce"
REDUCE_SCATTER = "reduce_scatter"
ALL_GATHER = "all_gather"
BROADCAST = "broadcast"
REDUCE = "reduce"


class Segment(NamedTuple):
    """Where segment data lives: element offsets in the input, the buffer regions and the
    output, and its length."""

    in_off: int
    buf_off: int
    out_off: int
    length: int


def piece_ranges(count: int, channel: int, channels: int, chunk: int) -> list[tuple[int, int]]:
    """(start, length) of the pieces of `channel`'s slice of a range of `count` elements,
    relative to the range's start. Empty pieces are never produced."""
    start, length = split_even(count, channels)[channel]
    return [(start + p, min(chunk, length - p)) for p in range(0, length, chunk)]


def _ring_channel(kind: str, n: int, x: int, segs: tuple[Segment, ...], c: int, channels: int,
                  chunk: int, left_index: dict[tuple[int, int, int], int] | None,
                  own_copy: bool = True) -> tuple[list[Op], dict[tuple[int, int, int], int]]:
    """Ops of rank `x` on channel `c`, and the READY index of every piece it publishes, keyed
    by (region, segment, piece). `left_index` is the left neighbour's map (None: keys only);
    `own_copy` as in `ring_round`."""
    left = (x - 1) % n
    readers = ((x + 1) % n,)  # the right neighbour pulls from this rank's buffer
    ops: list[Op] = []
    published: dict[tuple[int, int, int], int] = {}

    def pieces(g: int) -> list[tuple[int, int]]:
        return piece_ranges(segs[g].length, c, channels, chunk)

    def publish(region: int, g: int, p: int) -> None:
        published[(region, g, p)] = len(published) + 1
        ops.append(Signal(len(published), readers))

    def wait_left(region: int, g: int, p: int) -> None:
        if left_index is not None:
            ops.append(Wait(left, left_index[(region, g, p)]))

    if kind in (ALL_REDUCE, REDUCE_SCATTER):
        g = (x - 1) % n
        seg = segs[g]
        for p, (o, k) in enumerate(pieces(g)):
            ops.append(Copy(Loc(BUF, seg.buf_off + o, x, RS), Loc(IN, seg.in_off + o), k))
            publish(RS, g, p)
        for s in range(n - 1):
            g = (x - s - 2) % n
            seg = segs[g]
            last = s == n - 2
            for p, (o, k) in enumerate(pieces(g)):
                wait_left(RS, g, p)
                mine = Loc(IN, seg.in_off + o)
                theirs = Loc(BUF, seg.buf_off + o, left, RS)
                if not last:
                    ops.append(Reduce(Loc(BUF, seg.buf_off + o, x, RS), mine, theirs, k, False))
                    publish(RS, g, p)
                elif kind == REDUCE_SCATTER:
                    ops.append(Reduce(Loc(OUT, seg.out_off + o), mine, theirs, k, True))
                else:
                    final = Loc(BUF, seg.buf_off + o, x, AG)
                    ops.append(Reduce(final, mine, theirs, k, True))
                    publish(AG, g, p)
                    ops.append(Copy(Loc(OUT, seg.out_off + o), final, k))
    if kind == ALL_GATHER:
        seg = segs[x]
        for p, (o, k) in enumerate(pieces(x)):
            ops.append(Copy(Loc(BUF, seg.buf_off + o, x, AG), Loc(IN, seg.in_off + o), k))
            publish(AG, x, p)
            if own_copy:
                ops.append(Copy(Loc(OUT, seg.out_off + o), Loc(IN, seg.in_off + o), k))
    if kind in (ALL_REDUCE, ALL_GATHER):
        for t in range(n - 1):
            g = (x - 1 - t) % n
            seg = segs[g]
            for p, (o, k) in enumerate(pieces(g)):
                wait_left(AG, g, p)
                theirs = Loc(BUF, seg.buf_off + o, left, AG)
                if t < n - 2:
                    mine = Loc(BUF, seg.buf_off + o, x, AG)
                    ops.append(Copy(mine, theirs, k))
                    publish(AG, g, p)
                    ops.append(Copy(Loc(OUT, seg.out_off + o), mine, k))
                else:
                    ops.append(Copy(Loc(OUT, seg.out_off + o), theirs, k))
    return ops, published


def ring_round(kind: str, n: int, rank: int, segs: tuple[Segment, ...], chunk: int,
               channels: int, *, own_copy: bool = True) -> RoundPlan:
    """One round of a ring all_reduce, reduce_scatter or all_gather for `rank`.

    `segs[g]` describes segment g (all_reduce, reduce_scatter) or rank g's block (all_gather).
    Without `own_copy` an all_gather leaves out the copy of this rank's input into its own
    block of the output (in place: the input is that block).
    """
    if kind not in (ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER):
        raise ValueError(f"not a ring collective: {kind}")
    if len(segs) != n or n < 2:
        raise ValueError("a ring round needs n >= 2 and one segment per rank")
    plans: list[ChannelPlan] = []
    left = (rank - 1) % n
    for c in range(channels):
        _, left_index = _ring_channel(kind, n, left, segs, c, channels, chunk, None)
        ops, _ = _ring_channel(kind, n, rank, segs, c, channels, chunk, left_index, own_copy)
        plans.append(tuple(ops))
    return RoundPlan(tuple(plans), schedule="ring")


def chain_round(kind: str, n: int, rank: int, root: int, in_off: int, count: int, chunk: int,
                channels: int, *, root_copies: bool = False) -> RoundPlan:
    """One round of a pipelined chain broadcast (from `root`) or reduce (to `root`) over
    elements [in_off, in_off + count) for `rank`. The chain runs root, root+1, ... for
    broadcast and root+1, root+2, ..., root for reduce; each rank pulls from its left. With
    `root_copies` the root of a broadcast also copies its input to its output, after
    publishing each piece."""
    if kind not in (BROADCAST, REDUCE):
        raise ValueError(f"not a chain collective: {kind}")
    left = (rank - 1) % n
    readers = ((rank + 1) % n,)
    if kind == BROADCAST:
        pos = (rank - root) % n
        region = AG
    else:
        pos = (rank - root - 1) % n
        region = RS
    plans: list[ChannelPlan] = []
    for c in range(channels):
        ops: list[Op] = []
        for p, (o, k) in enumerate(piece_ranges(count, c, channels, chunk)):
            mine = Loc(BUF, o, rank, region)
            theirs = Loc(BUF, o, left, region)
            src = Loc(IN, in_off + o)
            dst = Loc(OUT, in_off + o)
            if pos == 0:
                ops.append(Copy(mine, src, k))
                ops.append(Signal(p + 1, readers))
                if root_copies and kind == BROADCAST:
                    ops.append(Copy(dst, src, k))
                continue
            ops.append(Wait(left, p + 1))
            if kind == BROADCAST:
                if pos < n - 1:
                    ops.append(Copy(mine, theirs, k))
                    ops.append(Signal(p + 1, readers))
                    ops.append(Copy(dst, mine, k))
                else:
                    ops.append(Copy(dst, theirs, k))
            elif pos < n - 1:
                ops.append(Reduce(mine, src, theirs, k, False))
                ops.append(Signal(p + 1, readers))
            else:
                ops.append(Reduce(dst, src, theirs, k, True))
        plans.append(tuple(ops))
    return RoundPlan(tuple(plans), schedule="chain")
