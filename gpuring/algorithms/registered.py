"""Schedules over registered memory: every rank reads its peers' arrays where they lie.

An array from `Communicator.empty`/`zeros` lives in memory every peer has mapped, so a
collective on such arrays needs no buffer: rank x reads rank q's input (`Loc(IN, offset, q)`)
or output (`Loc(OUT, offset, q)`) in place, or writes rank q's output, and one round does the
whole collective, whatever its size. That memory is the caller's, so two signals bracket
every access to it:

- *entered* (first): this rank is in the collective, so its input is final (on a GPU: the
  work queued before the call is done) and its caller no longer reads its output; the ranks
  that read or write its memory may start;
- *finished* (last): this rank is done with the memory of the ranks it read or wrote. A rank
  ends the collective only once every rank that touches its memory said so: its caller may
  use the arrays again at once.

The forms (each rank's own input and output are its arguments; "data" below is a rank's
input where inputs are registered, else its output once it copied its input there):

- all_reduce, two-shot (outputs registered, in place or not): rank x folds segment x of every
  rank's data in rank order 0..n-1 into its output, piece by piece, and copies each piece at
  once (still in cache) into every other rank's output: each rank reads its share of every
  input and writes its share of every output, 2 x size through memory in all, with two
  signals (a rank writes a segment of a peer's output that only it reads or writes);
- all_reduce, one-shot (inputs registered, out of place): every rank folds every rank's
  input, in rank order, into its output;
- reduce_scatter: rank x folds block x of every rank's input into its output;
- reduce: the root folds every rank's input into its output;
- all_gather: every rank copies every rank's input into its block of its output;
- broadcast: every rank copies the root's input into its output.

Every element of a reduction is one fold in rank order, as in the two-shot and one-shot
schedules: the same bits. A fold may write its own rank's source (in place): each element is
read from every source before it is written (`Stream.reduce_n`).
"""

from __future__ import annotations

from collections.abc import Callable

from .plan import (
    IN,
    OUT,
    ChannelPlan,
    Copy,
    Loc,
    Op,
    Reduce,
    ReduceN,
    RoundPlan,
    Signal,
    Wait,
    split_even,
)
from .ring import ALL_GATHER, ALL_REDUCE, BROADCAST, REDUCE, REDUCE_SCATTER, piece_ranges

__all__ = ["registered_form", "registered_round", "REGISTERED_FORMS"]

#: the registered forms, by name
REGISTERED_FORMS = ("two_shot", "one_shot", "fold_block", "fold_root", "gather", "broadcast")

_ENTERED = ("entered",)
_FINISHED = ("finished",)


#: "auto" runs an all_reduce whose inputs only are registered one-shot up to this many ranks
#: (each rank reads n x size: 3 x size on 2 ranks, against 4.5 x size staged through a ring;
#: beyond 4 ranks the ring moves less)
ONE_SHOT_RANKS = 4


def registered_form(kind: str, algorithm: str, peer_in: bool, peer_out: bool,
                    in_place: bool, n: int = 2) -> str | None:
    """The registered form of `kind` for `algorithm` ("auto", "two_shot" or "one_shot"; the
    ring has none), or None where none applies and the collective stages through the buffers.
    `peer_in`/`peer_out`: every rank's input/output is registered; `in_place`: the output is
    the input; `n`: the ranks."""
    if algorithm == "ring":
        return None
    if kind == ALL_REDUCE:
        if peer_out and algorithm in ("auto", "two_shot"):
            return "two_shot"
        if peer_in and not in_place and (algorithm == "one_shot" or (
                algorithm == "auto" and n <= ONE_SHOT_RANKS)):
            return "one_shot"
        return None
    if not peer_in:
        return None
    if kind == REDUCE_SCATTER:
        return "fold_block"
    if kind == REDUCE:
        return "fold_root"
    if kind == ALL_GATHER:
        return "gather"
    if kind == BROADCAST:
        return "broadcast"
    return None


def registered_round(form: str, n: int, rank: int, count: int, chunk: int, channels: int, *,
                     peer_in: bool, in_place: bool, root: int = 0) -> RoundPlan:
    """The one round of `form` (`registered_form`) for `rank` of `n`. `count` is the element
    count of the input (all_gather: one rank's block); `in_place`: the output is the input
    (all_gather: the input is this rank's block of the output; broadcast: the root's output
    holds its input)."""
    if form not in REGISTERED_FORMS:
        raise ValueError(f"no registered form {form!r}")
    if n < 2:
        raise ValueError("a registered round needs n >= 2")
    if form == "fold_block" and count % n:
        raise ValueError(f"reduce_scatter needs a count divisible by {n}, got {count}")
    if count // max(1, chunk) >= 1 << 30:  # piece numbers share a flag with the round number
        raise ValueError(f"{count} elements in pieces of {chunk} are too many pieces")
    plans: list[ChannelPlan] = []
    for c in range(channels):
        index = [_channel(form, n, q, count, root, c, channels, chunk, peer_in, in_place,
                          None)[1] for q in range(n)]
        ops, _ = _channel(form, n, rank, count, root, c, channels, chunk, peer_in, in_place,
                          index)
        plans.append(tuple(ops))
    return RoundPlan(tuple(plans), registered=True, schedule=f"registered {form}")


def _readers(form: str, n: int, x: int, root: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the ranks that read or write rank x's memory, the ranks whose memory x reads or
    writes)."""
    others = tuple(q for q in range(n) if q != x)
    if form == "fold_root":  # the root reads everyone; nobody reads the root
        return ((root,), ()) if x != root else ((), others)
    if form == "broadcast":  # everyone reads the root
        return (others, ()) if x == root else ((), (root,))
    return others, others


def _channel(form: str, n: int, x: int, count: int, root: int, c: int, channels: int,
             chunk: int, peer_in: bool, in_place: bool,
             peers_index: list[dict[tuple[object, ...], int]] | None
             ) -> tuple[list[Op], dict[tuple[object, ...], int]]:
    """Ops of rank `x` on channel `c`, and the READY index of every signal it sends, keyed
    by what it says. `peers_index[q]` is rank q's map (None: keys only)."""
    ops: list[Op] = []
    published: dict[tuple[object, ...], int] = {}
    read_by, reads = _readers(form, n, x, root)

    def publish(what: tuple[object, ...], readers: tuple[int, ...]) -> None:
        published[what] = len(published) + 1
        if readers:
            ops.append(Signal(len(published), readers))

    def wait(q: int, what: tuple[object, ...]) -> None:
        if peers_index is not None:
            ops.append(Wait(q, peers_index[q][what]))

    def pieces(length: int) -> list[tuple[int, int]]:
        return piece_ranges(length, c, channels, chunk)

    def fold(dst: Callable[[int], Loc], src: Callable[[int, int], Loc], length: int) -> None:
        """dst(o) = src(0, o) op src(1, o) op ... over this channel's pieces of `length`."""
        for o, k in pieces(length):
            ops.append(_fold_op(dst(o), tuple(src(q, o) for q in range(n)), k))

    def mine_or(space: int, q: int, offset: int) -> Loc:
        return Loc(space, offset, -1 if q == x else q)

    if form == "two_shot":
        segs = split_even(count, n)
        data = IN if peer_in or in_place else OUT
        if data == OUT and not in_place:  # the peers read this rank's input from its output
            for g, (start, length) in enumerate(segs):
                if g != x:
                    for o, k in pieces(length):
                        ops.append(Copy(Loc(OUT, start + o), Loc(IN, start + o), k))
        publish(_ENTERED, read_by)
        for q in reads:
            wait(q, _ENTERED)
        start, length = segs[x]
        for o, k in pieces(length):
            ops.append(_fold_op(Loc(OUT, start + o), tuple(
                Loc(IN, start + o) if q == x else Loc(data, start + o, q) for q in range(n)),
                k))
            ops += [Copy(Loc(OUT, start + o, q), Loc(OUT, start + o), k)
                    for q in range(n) if q != x]
    else:
        if form == "broadcast" and x == root and not in_place:
            for o, k in pieces(count):
                ops.append(Copy(Loc(OUT, o), Loc(IN, o), k))
        publish(_ENTERED, read_by)
        for q in reads:
            wait(q, _ENTERED)
        if form == "one_shot" or (form == "fold_root" and x == root):
            fold(lambda o: Loc(OUT, o), lambda q, o: mine_or(IN, q, o), count)
        elif form == "fold_block":
            block = count // n
            fold(lambda o: Loc(OUT, o), lambda q, o: mine_or(IN, q, x * block + o), block)
        elif form == "gather":
            for q in range(n):
                if q != x or not in_place:
                    for o, k in pieces(count):
                        ops.append(Copy(Loc(OUT, q * count + o), mine_or(IN, q, o), k))
        elif form == "broadcast" and x != root:
            for o, k in pieces(count):
                ops.append(Copy(Loc(OUT, o), Loc(IN, o, root), k))
    publish(_FINISHED, reads)
    for q in read_by:
        wait(q, _FINISHED)
    return ops, published


def _fold_op(dst: Loc, srcs: tuple[Loc, ...], length: int) -> Op:
    """dst = srcs[0] op srcs[1] op ..., the final step (avg divides there)."""
    if len(srcs) == 2:
        return Reduce(dst, srcs[0], srcs[1], length, True)
    return ReduceN(dst, srcs, length, True)

