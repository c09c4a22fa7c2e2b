"""Schedules that move blocks without reducing them: gather, scatter and all_to_all.

Each is a set of moves, a block of a rank's input to a place in a rank's output. A move
between two ranks goes through the sender's buffer: the sender stages the block (piece by
piece) into its buffer region RS and signals the receiver, which copies it from there into
its output; a rank's move to itself is one copy. One round moves a slice of every block that
fits the buffer region; larger blocks take several rounds.

- gather (to `root`): block q (all of rank q's input) goes to the root's output block q;
- scatter (from `root`): block q of the root's input goes to rank q's output;
- all_to_all: block j of rank q's input goes to block q of rank j's output.
"""

from __future__ import annotations

from typing import NamedTuple

from .plan import BUF, IN, OUT, RS, ChannelPlan, Copy, Loc, Op, RoundPlan, Signal, Wait
from .ring import piece_ranges

__all__ = ["GATHER", "SCATTER", "ALL_TO_ALL", "EXCHANGE_KINDS", "Move", "exchange_rounds",
           "moves_round"]

GATHER = "gather"
SCATTER = "scatter"
ALL_TO_ALL = "all_to_all"
#: the collectives planned here
EXCHANGE_KINDS = frozenset({GATHER, SCATTER, ALL_TO_ALL})


class Move(NamedTuple):
    """`length` elements from `src`'s input at `src_off` to `dst`'s output at `dst_off`,
    staged at `buf_off` of `src`'s buffer region (where `src` != `dst`)."""

    src: int
    src_off: int
    dst: int
    dst_off: int
    length: int
    buf_off: int


def exchange_rounds(kind: str, n: int, rank: int, count: int, root: int, capacity: int,
                    chunk: int, channels: int) -> tuple[RoundPlan, ...]:
    """The rounds of `kind` for `rank`. `count` is the element count of the input (gather:
    one block; scatter, all_to_all: `n` blocks); `capacity` the elements of a buffer
    region."""
    if kind not in EXCHANGE_KINDS:
        raise ValueError(f"no exchange schedule for {kind}")
    if kind != GATHER and count % n:
        raise ValueError(f"{kind} needs an input of {n} equal blocks, got {count} elements")
    block = count if kind == GATHER else count // n
    step = capacity if kind == GATHER else capacity // n  # what one round stages per block
    rounds = []
    for a in range(0, block, step):
        length = min(step, block - a)
        if kind == GATHER:
            moves = [Move(q, a, root, q * block + a, length, 0) for q in range(n)]
        elif kind == SCATTER:
            moves = [Move(root, q * block + a, q, a, length, q * length) for q in range(n)]
        else:
            moves = [Move(q, j * block + a, j, q * block + a, length, j * length)
                     for q in range(n) for j in range(n)]
        rounds.append(moves_round(n, rank, moves, chunk, channels))
    return tuple(rounds)


def moves_round(n: int, rank: int, moves: list[Move], chunk: int,
                channels: int) -> RoundPlan:
    """One round that makes `moves` (see the module docstring), for `rank`."""
    plans: list[ChannelPlan] = []
    for c in range(channels):
        index = [_channel(q, moves, c, channels, chunk, None)[1] for q in range(n)]
        ops, _ = _channel(rank, moves, c, channels, chunk, index)
        plans.append(tuple(ops))
    return RoundPlan(tuple(plans), schedule="exchange")


def _channel(x: int, moves: list[Move], c: int, channels: int, chunk: int,
             peers_index: list[dict[tuple[int, int], int]] | None
             ) -> tuple[list[Op], dict[tuple[int, int], int]]:
    """Ops of rank `x` on channel `c`, and the READY index of every piece it stages, keyed
    by (move, piece). `peers_index[q]` is rank q's map (None: keys only)."""
    ops: list[Op] = []
    published: dict[tuple[int, int], int] = {}
    for m, move in enumerate(moves):  # stage what goes to the others
        if move.src != x or move.dst == x:
            continue
        for p, (o, k) in enumerate(piece_ranges(move.length, c, channels, chunk)):
            ops.append(Copy(Loc(BUF, move.buf_off + o, x, RS), Loc(IN, move.src_off + o), k))
            published[(m, p)] = len(published) + 1
            ops.append(Signal(len(published), (move.dst,)))
    for move in moves:  # this rank's own block
        if move.src == move.dst == x:
            for o, k in piece_ranges(move.length, c, channels, chunk):
                ops.append(Copy(Loc(OUT, move.dst_off + o), Loc(IN, move.src_off + o), k))
    for m, move in enumerate(moves):  # take what the others staged for this rank
        if move.dst != x or move.src == x:
            continue
        for p, (o, k) in enumerate(piece_ranges(move.length, c, channels, chunk)):
            if peers_index is not None:
                ops.append(Wait(move.src, peers_index[move.src][(m, p)]))
            ops.append(Copy(Loc(OUT, move.dst_off + o),
                            Loc(BUF, move.buf_off + o, move.src, RS), k))
    return ops, published
