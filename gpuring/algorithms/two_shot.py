"""Two-shot schedules (`algorithm="two_shot"`, formerly "direct") for one round: every rank
reads its peers' buffers directly.

All_reduce: rank r stages into its buffer the segments its peers reduce (segment q for rank
q), reduces segment r of every rank's data in rank order 0, 1, ..., n-1 (one n-input reduce,
its own data read from its input), and copies every rank's reduced segment into its output.
Reduce_scatter stops after the reduce (segment r is rank r's block); reduce (to `root`)
sends the reduced segments to the root only. Two flag hops instead of the ring's 2(n-1), no
more bytes through memory on one node than the ring, and every element is one fold in rank
order, whatever the segment, piece or channel it falls in: the same bits whatever the size,
`chunk_bytes` and `channels` (the one-shot all_reduce and the one-operation GPU collectives
fold in the same order). That is what deterministic mode runs.

Each segment is split into `channels` slices and each slice into pieces of `chunk` elements
(`piece_ranges`); a piece is published as soon as it is written. Within a round no buffer
location is written twice: staged segments go to region RS, reduced ones to region AG.
"""

from __future__ import annotations

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
    ReduceN,
    RoundPlan,
    Signal,
    Wait,
)
from .ring import ALL_REDUCE, REDUCE, REDUCE_SCATTER, Segment, piece_ranges

__all__ = ["two_shot_round", "TWO_SHOT_KINDS"]

#: the collectives with a two-shot schedule
TWO_SHOT_KINDS = frozenset({ALL_REDUCE, REDUCE_SCATTER, REDUCE})


def _channel(kind: str, n: int, x: int, root: int, segs: tuple[Segment, ...], c: int,
             channels: int, chunk: int,
             peers_index: list[dict[tuple[int, int, int], int]] | None) -> tuple[
                 list[Op], dict[tuple[int, int, int], int]]:
    """Ops of rank `x` on channel `c`, and the READY index of every piece it publishes, keyed
    by (region, segment, piece). `peers_index[q]` is rank q's map (None: keys only)."""
    ops: list[Op] = []
    published: dict[tuple[int, int, int], int] = {}

    def pieces(g: int) -> list[tuple[int, int]]:
        return piece_ranges(segs[g].length, c, channels, chunk)

    def publish(region: int, g: int, p: int, readers: tuple[int, ...]) -> None:
        published[(region, g, p)] = len(published) + 1
        ops.append(Signal(len(published), readers))

    def wait(q: int, region: int, g: int, p: int) -> None:
        if peers_index is not None:
            ops.append(Wait(q, peers_index[q][(region, g, p)]))

    for q in range(n):  # stage what each peer reduces
        if q == x:
            continue
        seg = segs[q]
        for p, (o, k) in enumerate(pieces(q)):
            ops.append(Copy(Loc(BUF, seg.buf_off + o, x, RS), Loc(IN, seg.in_off + o), k))
            publish(RS, q, p, (q,))
    if kind == ALL_REDUCE:
        readers = tuple(q for q in range(n) if q != x)
    else:  # the root gathers a reduce; a reduce_scatter's segment stays with its rank
        readers = (root,) if kind == REDUCE and x != root else ()
    seg = segs[x]
    for p, (o, k) in enumerate(pieces(x)):  # reduce this rank's segment, in rank order
        for q in range(n):
            if q != x:
                wait(q, RS, x, p)
        srcs = tuple(Loc(IN, seg.in_off + o) if q == x else Loc(BUF, seg.buf_off + o, q, RS)
                     for q in range(n))
        final = Loc(BUF, seg.buf_off + o, x, AG)
        if n == 2:
            ops.append(Reduce(final, srcs[0], srcs[1], k, True))
        else:
            ops.append(ReduceN(final, srcs, k, True))
        if readers:
            publish(AG, x, p, readers)
        if kind == REDUCE_SCATTER:
            ops.append(Copy(Loc(OUT, seg.out_off + o), final, k))
    if kind == ALL_REDUCE or (kind == REDUCE and x == root):  # gather every reduced segment
        for q in range(n):
            seg = segs[q]
            for p, (o, k) in enumerate(pieces(q)):
                if q != x:
                    wait(q, AG, q, p)
                ops.append(Copy(Loc(OUT, seg.out_off + o), Loc(BUF, seg.buf_off + o, q, AG), k))
    return ops, published


def two_shot_round(kind: str, n: int, rank: int, segs: tuple[Segment, ...], chunk: int,
                   channels: int, *, root: int = 0) -> RoundPlan:
    """One round of a two-shot all_reduce, reduce_scatter or reduce (to `root`) for `rank`.
    `segs[g]` is segment g, which rank g reduces (reduce_scatter: rank g's block)."""
    if kind not in TWO_SHOT_KINDS:
        raise ValueError(f"no two-shot schedule for {kind}")
    if len(segs) != n or n < 2:
        raise ValueError("a two-shot round needs n >= 2 and one segment per rank")
    plans: list[ChannelPlan] = []
    for c in range(channels):
        index = [_channel(kind, n, q, root, segs, c, channels, chunk, None)[1]
                 for q in range(n)]
        ops, _ = _channel(kind, n, rank, root, segs, c, channels, chunk, index)
        plans.append(tuple(ops))
    return RoundPlan(tuple(plans), schedule="two_shot")
