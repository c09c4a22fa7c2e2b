"""The vocabulary of plans: locations and the operations a rank performs on one channel.

A plan is pure data. Element offsets, never arrays; flag values relative to the round, never
absolute. The engine binds locations to memory and turns operations into stream calls.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "IN", "OUT", "BUF", "RS", "AG",
    "Loc", "Copy", "Reduce", "ReduceN", "Wait", "Signal", "Op", "ChannelPlan", "RoundPlan",
    "split_even", "relabel",
]

# Where a location lives.
IN = 0  #: the caller's input array
OUT = 1  #: the caller's output array
BUF = 2  #: a rank's communication buffer (peers map it)

# The two regions of a communication buffer used by one round.
RS = 0  #: staged input and reduce-scatter partials
AG = 1  #: final segments and all-gather forwards



class Loc(NamedTuple):
    """`space` BUF of `rank` in `region`, or IN/OUT: this rank's input or output where `rank`
    is -1, else rank `rank`'s (registered memory, which peers map; region unused). `offset`
    in elements."""

    space: int
    offset: int
    rank: int = -1
    region: int = RS


class Copy(NamedTuple):
    dst: Loc
    src: Loc
    length: int


class Reduce(NamedTuple):
    """dst = a op b over `length` elements; `last` marks the final step (avg divides there)."""

    dst: Loc
    a: Loc
    b: Loc
    length: int
    last: bool


class ReduceN(NamedTuple):
    """dst = srcs[0] op srcs[1] op ... op srcs[-1] over `length` elements (two or more
    sources), folded in that order with every step rounded to the dtype: the same bits as the
    chain of `Reduce`s dst = srcs[0] op srcs[1], dst = dst op srcs[2], ..., reading each
    source once and writing dst once. `last` as for Reduce (avg divides at the final step).
    dst may be the same memory as one source (at the same positions: an in-place fold), and
    overlaps none otherwise."""

    dst: Loc
    srcs: tuple[Loc, ...]
    length: int
    last: bool


class Wait(NamedTuple):
    """Wait until `peer` has published `value` pieces on this channel (the 1-based index, in
    this round, of the piece the peer published)."""

    peer: int
    value: int


class Signal(NamedTuple):
    """Publish on this channel that `value` pieces are written, to each rank in `readers`:
    exactly the ranks whose plans `Wait` on this rank on this channel (the ranks that read
    its buffer). Flags live with their reader, so a Signal is one write per reader."""

    value: int
    readers: tuple[int, ...]


Op = Copy | Reduce | ReduceN | Wait | Signal
ChannelPlan = tuple[Op, ...]


class RoundPlan(NamedTuple):
    """What one rank does in one round: one op sequence per channel."""

    channels: tuple[ChannelPlan, ...]
    #: the round reads the peers' registered arrays (`Loc(IN|OUT, offset, rank)`) and uses no
    #: buffer (see `registered`)
    registered: bool = False
    #: what schedule it is, in words ("ring", "chain", "two_shot", "one_shot", "exchange",
    #: "barrier", "registered two_shot", ...): what benchmarks and logs report
    schedule: str = ""


def split_even(count: int, parts: int) -> list[tuple[int, int]]:
    """Split `count` items into `parts` contiguous (start, length) ranges, the first
    `count % parts` one longer. Lengths may be zero."""
    if parts <= 0:
        raise ValueError("parts must be positive")
    base, extra = divmod(count, parts)
    out = []
    start = 0
    for i in range(parts):
        length = base + (1 if i < extra else 0)
        out.append((start, length))
        start += length
    return out


def relabel(plan: RoundPlan, order: tuple[int, ...]) -> RoundPlan:
    """`plan`, made with positions for ranks, in ranks: position p is rank `order[p]` (every
    peer a Loc, Wait or Signal names; this rank's own IN and OUT, rank -1, stay)."""
    def loc(where: Loc) -> Loc:
        return where if where.rank < 0 else where._replace(rank=order[where.rank])

    def op(o: Op) -> Op:
        if isinstance(o, Copy):
            return Copy(loc(o.dst), loc(o.src), o.length)
        if isinstance(o, Reduce):
            return o._replace(dst=loc(o.dst), a=loc(o.a), b=loc(o.b))
        if isinstance(o, ReduceN):
            return o._replace(dst=loc(o.dst), srcs=tuple(loc(s) for s in o.srcs))
        if isinstance(o, Wait):
            return Wait(order[o.peer], o.value)
        return Signal(o.value, tuple(order[r] for r in o.readers))

    return plan._replace(channels=tuple(tuple(op(o) for o in ops) for ops in plan.channels))
