"""The planner, checked by running every rank's plan in a simulated world.

The simulator interleaves ranks and channels at random (honouring flag waits), computes on
exact Python integers, and fails on a deadlock, on a read of a buffer location nobody wrote in
the round, and on a location written twice in one round. Flags live with their reader, as on
the devices: a Signal reaches only the ranks it names, so a reader left out deadlocks.
"""

from __future__ import annotations

import functools
import itertools
import operator
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuring.algorithms.collectives import plan_collective
from gpuring.algorithms.plan import (
    BUF,
    IN,
    OUT,
    RS,
    Copy,
    Loc,
    Reduce,
    ReduceN,
    Signal,
    Wait,
    split_even,
)
from gpuring.algorithms.registered import ONE_SHOT_RANKS
from gpuring.algorithms.ring import piece_ranges


class Violation(AssertionError):
    pass


def simulate(kind: str, n: int, count: int, *, root: int = 0, chunk: int = 1, channels: int = 1,
             capacity: int = 1 << 20, one_shot: int = 0, seed: int = 0, algorithm: str = "auto",
             ordered: bool = False, in_place: bool = False, peer_in: bool = False,
             peer_out: bool = False, order: tuple[int, ...] = ()):
    """Run the plans of all ranks; return (inputs, outputs). `ordered`: each input element
    is ((rank, index),) and a reduction concatenates its operands in the order the plan
    names them, so an output element says which ranks' values were folded in which order.

    `in_place`: the output is the input's memory (all_reduce, reduce_scatter: this rank's
    block of the input, reduce: the same; all_gather: the input is this rank's block of the
    output). `peer_in`/`peer_out`: the ranks' inputs/outputs are registered, so plans may read
    a peer's (`Loc(IN|OUT, offset, rank)`), and write a peer's output: such an access fails
    before that rank entered the collective (its caller may still be using the array) and
    after it left (its caller may use it again at once); any other access to a peer's memory
    fails."""
    rng = random.Random(seed)
    inputs: list[list[Any]] = [
        [((r, i),) if ordered else rng.randrange(1, 1000) for i in range(count)]
        for r in range(n)]
    out_len = {"all_gather": n * count, "reduce_scatter": count // n, "gather": n * count,
               "scatter": count // n}.get(kind, count)
    # each rank's memory: its input and output arrays, and where IN and OUT lie in them
    memory: list[dict[str, list[Any]]] = []
    where: list[dict[int, tuple[str, int]]] = []
    for r in range(n):
        mem = {"in": list(inputs[r]), "out": [None] * out_len}
        spaces = {IN: ("in", 0), OUT: ("out", 0)}
        if kind == "broadcast":
            mem["out"] = list(inputs[r]) if in_place else mem["out"]
            if in_place:
                mem["in"] = mem["out"]
        elif in_place and kind in ("all_reduce", "reduce"):
            mem["out"] = mem["in"]
        elif in_place and kind == "reduce_scatter":
            spaces[OUT] = ("in", r * (count // n))
        elif in_place and kind == "all_gather":
            mem["out"][r * count:(r + 1) * count] = inputs[r]
            spaces[IN] = ("out", r * count)
        memory.append(mem)
        where.append(spaces)
    plans = [plan_collective(kind, n, r, count, itemsize=1, capacity_bytes=capacity,
                             chunk_bytes=chunk, channels=channels, root=root,
                             one_shot_bytes=one_shot, algorithm=algorithm, in_place=in_place,
                             peer_in=peer_in, peer_out=peer_out, order=order)
             for r in range(n)]
    nrounds = {len(p) for p in plans}
    assert len(nrounds) == 1, "ranks disagree on the number of rounds"
    entered, left = [False] * n, [False] * n
    for rnd in range(nrounds.pop()):
        buffers: list[dict] = [{} for _ in range(n)]
        # flags[reader][channel][producer]: what the producer told the reader
        flags = [[[0] * n for _ in range(channels)] for _ in range(n)]
        cursors = {(r, c): 0 for r in range(n)
                   for c, ops in enumerate(plans[r][rnd].channels) if ops}

        def array(r, loc, write=False, _rnd=rnd):
            """(the list, the index of loc's first element) of rank r's IN/OUT at loc."""
            owner = r if loc.rank == -1 else loc.rank
            if owner != r:
                if write and loc.space != OUT:
                    raise Violation(f"rank {r} writes rank {owner}'s input")
                if not (peer_in if loc.space == IN else peer_out):
                    raise Violation(f"rank {r} touches rank {owner}'s unregistered {loc}")
                if not plans[r][_rnd].registered:
                    raise Violation(f"rank {r} touches a peer's array in a staged round")
                if not entered[owner] or left[owner]:
                    raise Violation(f"rank {r} touches rank {owner}'s {loc} while its caller "
                                    f"may use it ({'left' if left[owner] else 'not entered'})")
            name, base = where[owner][loc.space]
            return memory[owner][name], base + loc.offset

        def read(r, loc, k, _buffers=buffers):
            if loc.space in (IN, OUT):
                values, at = array(r, loc)
                vals = values[at:at + k]
            else:
                vals = [_buffers[loc.rank].get((loc.region, loc.offset + i)) for i in range(k)]
            if any(v is None for v in vals):
                raise Violation(f"rank {r} read unwritten {loc}")
            return vals

        def write(r, loc, vals, _buffers=buffers):
            if loc.space == OUT:
                values, at = array(r, loc, write=True)
                values[at:at + len(vals)] = vals
            elif loc.space == BUF:
                if loc.rank != r:
                    raise Violation(f"rank {r} writes rank {loc.rank}'s buffer")
                for i, v in enumerate(vals):
                    key = (loc.region, loc.offset + i)
                    if key in _buffers[r]:
                        raise Violation(f"rank {r} writes {key} twice in a round")
                    _buffers[r][key] = v
            else:
                raise Violation("plans never write the input")

        while cursors:
            runnable = []
            for (r, c), i in cursors.items():
                op = plans[r][rnd].channels[c][i]
                if type(op) is Wait and flags[r][c][op.peer] < op.value:
                    continue
                runnable.append((r, c))
            if not runnable:
                raise Violation(f"deadlock in round {rnd}: {cursors}")
            r, c = rng.choice(runnable)
            entered[r] = True
            op = plans[r][rnd].channels[c][cursors[(r, c)]]
            if type(op) is Copy:
                write(r, op.dst, read(r, op.src, op.length))
            elif type(op) is Reduce:
                a, b = read(r, op.a, op.length), read(r, op.b, op.length)
                write(r, op.dst, [x + y for x, y in zip(a, b, strict=True)])
            elif type(op) is ReduceN:
                if len(op.srcs) < 2:
                    raise Violation(f"rank {r} folds {len(op.srcs)} sources")
                columns = zip(*(read(r, s, op.length) for s in op.srcs), strict=True)
                write(r, op.dst, [functools.reduce(operator.add, col) for col in columns])
            elif type(op) is Signal:
                if r in op.readers or len(set(op.readers)) != len(op.readers):
                    raise Violation(f"rank {r} signals {op.readers}")
                for reader in op.readers:
                    assert op.value > flags[reader][c][r]
                    flags[reader][c][r] = op.value
            cursors[(r, c)] += 1
            if cursors[(r, c)] == len(plans[r][rnd].channels[c]):
                del cursors[(r, c)]
                if not any(q == r for q, _ in cursors):  # its caller may write its arrays now
                    left[r] = True
    outputs = []
    for r in range(n):
        name, base = where[r][OUT]
        outputs.append(memory[r][name][base:base + out_len])
    return inputs, outputs


def expected(kind, n, inputs, root):
    count = len(inputs[0])
    total = [sum(col) for col in zip(*inputs, strict=True)] if count else []
    if kind == "all_reduce":
        return [total] * n
    if kind == "reduce_scatter":
        b = count // n
        return [total[r * b:(r + 1) * b] for r in range(n)]
    if kind == "all_gather":
        flat = [v for inp in inputs for v in inp]
        return [flat] * n
    if kind == "broadcast":
        return [inputs[root]] * n
    if kind == "reduce":
        return [total if r == root else None for r in range(n)]
    if kind == "gather":
        return [[v for inp in inputs for v in inp] if r == root else None for r in range(n)]
    if kind == "scatter":
        b = count // n
        return [inputs[root][r * b:(r + 1) * b] for r in range(n)]
    if kind == "all_to_all":
        b = count // n
        return [[v for q in range(n) for v in inputs[q][r * b:(r + 1) * b]] for r in range(n)]
    raise AssertionError(kind)


def check(kind, n, count, **kw):
    inputs, outputs = simulate(kind, n, count, **kw)
    want = expected(kind, n, inputs, kw.get("root", 0))
    for r in range(n):
        if want[r] is not None:
            assert outputs[r] == want[r], (kind, n, count, kw, r)


KINDS = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce"]


def slow_n(n: int) -> object:
    """A rank count whose exhaustive checks take seconds: marked slow."""
    return pytest.param(n, marks=pytest.mark.slow)


TWO_SHOT = ["all_reduce", "reduce_scatter", "reduce"]
#: (peer_in, peer_out, in_place) of calls on registered arrays, by collective
REGISTERED_CASES = {
    "all_reduce": [(True, True, False), (True, True, True), (False, True, False),
                   (True, False, False)],
    "reduce_scatter": [(True, False, False), (True, False, True)],
    "reduce": [(True, False, False), (True, False, True)],
    "all_gather": [(True, False, False), (True, False, True)],
    "broadcast": [(True, False, False), (True, False, True)],
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [2, 3, 4, slow_n(5)])
def test_exhaustive_small(kind, n):
    for count in range(0, 3 * n + 2):
        if kind == "reduce_scatter" and count % n:
            continue
        for chunk, channels in itertools.product([1, 2, 3], [1, 2, 3]):
            roots = range(n) if kind in ("broadcast", "reduce") else [0]
            for root in roots:
                check(kind, n, count, chunk=chunk, channels=channels, root=root,
                      seed=count * 7 + chunk)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [3, 4, 5])
def test_a_ring_in_another_order(kind, n):
    """The ring and the chains around the ranks in any order (as the topology asks): every
    result where it belongs, in and out of place, every root; the two-shot schedules ignore
    the order."""
    rng = random.Random(n)
    for _ in range(3):
        order = tuple(rng.sample(range(n), n))
        for count in (0, 1, n, 2 * n + 1):
            if kind == "reduce_scatter" and count % n:
                continue
            for chunk, channels, in_place in ((1, 1, False), (2, 3, True)):
                for root in range(n) if kind in ("broadcast", "reduce") else [0]:
                    check(kind, n, count, chunk=chunk, channels=channels, root=root,
                          in_place=in_place, order=order, seed=count)
        plans = [plan_collective(kind, n, r, 4 * n, itemsize=1, capacity_bytes=1 << 20,
                                 chunk_bytes=2, channels=2, root=1, order=order)
                 for r in range(n)]
        for r in range(n):  # the neighbours the plan waits on are the order's
            position = order.index(r)
            waits = {op.peer for ops in plans[r][0].channels for op in ops if type(op) is Wait}
            assert waits <= {order[(position - 1) % n]}, (order, r, waits)
    with pytest.raises(ValueError, match="permutation"):
        plan_collective(kind, n, 0, 4, itemsize=1, capacity_bytes=1 << 20, chunk_bytes=2,
                        channels=1, order=(0,) * n)


@pytest.mark.parametrize("kind", TWO_SHOT)
@pytest.mark.parametrize("n", [2, 3, 4, slow_n(5)])
def test_two_shot_exhaustive_small(kind, n):
    for count in range(0, 3 * n + 2):
        if kind == "reduce_scatter" and count % n:
            continue
        for chunk, channels in itertools.product([1, 2, 3], [1, 2, 3]):
            for root in range(n) if kind == "reduce" else [0]:
                check(kind, n, count, chunk=chunk, channels=channels, root=root,
                      seed=count * 7 + chunk, algorithm="two_shot")


@pytest.mark.parametrize("kind", TWO_SHOT)
@pytest.mark.parametrize("n", [2, 3, 4, slow_n(9)])
def test_two_shot_folds_every_element_in_rank_order(kind, n):
    """Whatever the size, rounds, pieces and channels, every element of a two-shot result is
    one fold of ranks 0, 1, ..., n-1 in that order (deterministic mode's bits); so is the
    one-shot all_reduce's."""
    cases = [(count, chunk, channels, capacity) for count in (n, 5 * n, 12 * n)
             for chunk in (1, 4) for channels in (1, 3) for capacity in (n, 4 * n, 1 << 20)]
    algorithms = ["two_shot", "one_shot"] if kind == "all_reduce" else ["two_shot"]
    for algorithm, (count, chunk, channels, capacity) in itertools.product(algorithms, cases):
        root = n - 1
        _, outputs = simulate(kind, n, count, root=root, chunk=chunk, channels=channels,
                              capacity=capacity, algorithm=algorithm, ordered=True)
        fold = [tuple((q, i) for q in range(n)) for i in range(count)]
        for r in range(n):
            if kind == "all_reduce" or (kind == "reduce" and r == root):
                assert outputs[r] == fold, (algorithm, count, chunk, channels, capacity, r)
            elif kind == "reduce_scatter":
                block = count // n
                assert outputs[r] == fold[r * block:(r + 1) * block]


def test_a_ring_does_not_fold_in_rank_order():
    """What the two-shot schedule is for: the ring's order depends on the segment."""
    _, outputs = simulate("all_reduce", 3, 6, ordered=True)
    assert outputs[0] != [tuple((q, i) for q in range(3)) for i in range(6)]


def test_an_algorithm_a_collective_lacks_is_refused():
    for kind, algorithm in (("all_gather", "two_shot"), ("broadcast", "two_shot"),
                            ("reduce", "one_shot"), ("all_reduce", "tree")):
        with pytest.raises(ValueError, match=r"schedule|algorithm must be"):
            plan_collective(kind, 3, 0, 9, itemsize=4, capacity_bytes=4096, chunk_bytes=4,
                            channels=1, algorithm=algorithm)


@pytest.mark.parametrize("kind", KINDS)
def test_several_rounds(kind):
    n = 3
    count = 6 * n * 2 + (0 if kind == "reduce_scatter" else 5)
    for capacity in (n, n + 1, 2 * n, 7 * n):
        check(kind, n, count, capacity=capacity, chunk=2, channels=2, root=1)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_one_shot_all_reduce(n):
    for count in (1, 2, 7):
        check("all_reduce", n, count, one_shot=count, seed=count)


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_one_shot_reads_every_rank_once_in_rank_order(n):
    """Two ranks: one binary reduce. More: one n-input reduce over the staged inputs of ranks
    0, 1, ..., n-1 in that order (the order every rank reduces in, for the same bits), not a
    chain of n-1 reduces through the output."""
    for rank in range(n):
        (rnd,) = plan_collective("all_reduce", n, rank, 5, itemsize=4, capacity_bytes=1 << 20,
                                 chunk_bytes=4, channels=1, one_shot_bytes=1 << 10)
        reduces = [op for op in rnd.channels[0] if type(op) in (Reduce, ReduceN)]
        staged = [Loc(BUF, 0, peer, RS) for peer in range(n)]
        if n == 2:
            assert reduces == [Reduce(Loc(OUT, 0), staged[0], staged[1], 5, True)]
        else:
            assert reduces == [ReduceN(Loc(OUT, 0), tuple(staged), 5, True)]


def test_one_shot_only_when_small():
    plan = plan_collective("all_reduce", 3, 0, 100, itemsize=4, capacity_bytes=1 << 20,
                           chunk_bytes=64, channels=1, one_shot_bytes=64)
    assert len(plan[0].channels[0]) > 8  # ring: many pieces, not one copy and two reduces


def test_barrier_plan_waits_for_everyone():
    for n in (2, 3, 5):
        for r in range(n):
            (rnd,) = plan_collective("barrier", n, r, 0, itemsize=1, capacity_bytes=4096,
                                     chunk_bytes=1, channels=1)
            waited = {op.peer for op in rnd.channels[0] if type(op) is Wait}
            assert waited == set(range(n)) - {r}


@pytest.mark.parametrize("kind", [*KINDS, "gather", "scatter", "all_to_all", "barrier"])
@pytest.mark.parametrize("n", [2, 3, 5])
def test_signals_reach_exactly_the_ranks_that_wait(kind, n):
    """A Signal names every rank that waits on it and no other (an extra reader would be a
    write nobody reads; a missing one, a wait released by nothing)."""
    count = 4 * n
    variants = [(0, "auto"), (count, "auto")] + (
        [(0, "two_shot")] if kind in TWO_SHOT else []) + (
        [(0, "one_shot")] if kind == "all_reduce" else [])
    placements = [(False, False, False), *REGISTERED_CASES.get(kind, [])]
    for (one_shot, algorithm), (peer_in, peer_out, in_place) in itertools.product(
            variants, placements):
        plans = [plan_collective(kind, n, r, count, itemsize=1, capacity_bytes=1 << 20,
                                 chunk_bytes=2, channels=2, root=1 % n,
                                 one_shot_bytes=one_shot, algorithm=algorithm,
                                 in_place=in_place, peer_in=peer_in, peer_out=peer_out)
                 for r in range(n)]
        for rnd in range(len(plans[0])):
            for c in range(max(len(p[rnd].channels) for p in plans)):
                waiters = {(r, op.peer) for r in range(n) if c < len(plans[r][rnd].channels)
                           for op in plans[r][rnd].channels[c] if type(op) is Wait}
                signals = {(reader, r) for r in range(n) if c < len(plans[r][rnd].channels)
                           for op in plans[r][rnd].channels[c] if type(op) is Signal
                           for reader in op.readers}
                assert waiters == signals, (kind, n, one_shot, rnd, c)


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(KINDS), n=st.integers(2, 7), count=st.integers(0, 200),
       chunk=st.integers(1, 40), channels=st.integers(1, 4), capacity_mult=st.integers(1, 30),
       root=st.integers(0, 6), seed=st.integers(0, 1000),
       algorithm=st.sampled_from(["auto", "ring", "two_shot", "one_shot"]),
       placement=st.integers(0, 4))
def test_random_shapes(kind, n, count, chunk, channels, capacity_mult, root, seed, algorithm,
                       placement):
    """Plain arrays (placement 0) and each case of registered ones."""
    if kind == "reduce_scatter":
        count -= count % n
    if (algorithm == "two_shot" and kind not in TWO_SHOT) or (
            algorithm == "one_shot" and kind != "all_reduce"):
        algorithm = "auto"
    cases = [(False, False, False), *REGISTERED_CASES[kind]]
    peer_in, peer_out, in_place = cases[placement % len(cases)]
    check(kind, n, count, chunk=chunk, channels=channels, capacity=n * capacity_mult,
          root=root % n, seed=seed, algorithm=algorithm, peer_in=peer_in, peer_out=peer_out,
          in_place=in_place)


def test_split_even():
    for count in range(20):
        for parts in range(1, 7):
            ranges = split_even(count, parts)
            assert sum(k for _, k in ranges) == count
            assert max(k for _, k in ranges) - min(k for _, k in ranges) <= 1
            assert all(s == ranges[i - 1][0] + ranges[i - 1][1] for i, (s, _) in
                       enumerate(ranges) if i)


def test_piece_ranges_cover_the_slice_once():
    for count, channels, chunk in itertools.product(range(12), range(1, 4), range(1, 5)):
        covered = sorted(i for c in range(channels)
                         for s, k in piece_ranges(count, c, channels, chunk)
                         for i in range(s, s + k))
        assert covered == list(range(count))


def test_bad_arguments():
    with pytest.raises(ValueError, match="divisible"):
        plan_collective("reduce_scatter", 3, 0, 10, itemsize=4, capacity_bytes=4096,
                        chunk_bytes=4, channels=1)
    with pytest.raises(ValueError, match="root"):
        plan_collective("broadcast", 3, 0, 10, itemsize=4, capacity_bytes=4096,
                        chunk_bytes=4, channels=1, root=3)
    with pytest.raises(ValueError, match="too small"):
        plan_collective("all_reduce", 8, 0, 10, itemsize=8, capacity_bytes=16,
                        chunk_bytes=4, channels=1)


def test_an_all_gather_in_place_does_not_copy_into_its_own_block() -> None:
    """In place, the input is this rank's block of the output: the plan leaves out exactly
    the copies from the input into the output, and nothing else changes."""
    from gpuring.algorithms.plan import IN, OUT, Copy

    def ops(rounds: tuple[Any, ...]) -> list[Any]:
        return [op for r in rounds for channel in r.channels for op in channel]

    for n in (2, 3):
        for rank in range(n):
            kw = dict(itemsize=4, capacity_bytes=1 << 12, chunk_bytes=64, channels=2)
            out_of_place = ops(plan_collective("all_gather", n, rank, 700, **kw))
            in_place = ops(plan_collective("all_gather", n, rank, 700, in_place=True, **kw))
            own = [op for op in out_of_place
                   if isinstance(op, Copy) and op.src.space == IN and op.dst.space == OUT]
            assert own and in_place == [op for op in out_of_place if op not in own]


# -- registered memory ------------------------------------------------------------------



def _registered_plans(kind, n, count, **kw):
    return [plan_collective(kind, n, r, count, itemsize=1, capacity_bytes=1 << 20, **kw)
            for r in range(n)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [2, 3, 4, slow_n(5)])
def test_registered_exhaustive_small(kind, n):
    """Every registered form gives the right result, reads a peer's array only while that
    peer is in the collective (after it entered, before it left), writes none, and is one
    round whatever the size."""
    for peer_in, peer_out, in_place in REGISTERED_CASES[kind]:
        for count in range(1, 3 * n + 2):
            if kind == "reduce_scatter" and count % n:
                continue
            for chunk, channels in itertools.product([1, 3], [1, 2]):
                for root in range(n) if kind in ("broadcast", "reduce") else [0]:
                    kw = dict(chunk=chunk, channels=channels, root=root, in_place=in_place,
                              peer_in=peer_in, peer_out=peer_out)
                    check(kind, n, count, seed=count * 7 + chunk, **kw)
                    (rnd,) = _registered_plans(kind, n, count, chunk_bytes=chunk,
                                               channels=channels, root=root,
                                               in_place=in_place, peer_in=peer_in,
                                               peer_out=peer_out)[0]
                    # ("auto" stages an all_reduce of registered inputs only beyond 4 ranks)
                    staged = kind == "all_reduce" and not peer_out and n > ONE_SHOT_RANKS
                    assert rnd.registered != staged, (kind, peer_in, peer_out, in_place)


@pytest.mark.parametrize("n", [2, 3, 4, slow_n(9)])
def test_registered_reductions_fold_in_rank_order(n):
    """Registered or not, in place or not, every element of a reduction is one fold of
    ranks 0..n-1 in that order: deterministic mode's bits."""
    count = 5 * n
    fold = [tuple((q, i) for q in range(n)) for i in range(count)]
    for kind in TWO_SHOT:
        for peer_in, peer_out, in_place in REGISTERED_CASES[kind]:
            for chunk, channels in ((1, 1), (4, 3)):
                root = n - 1
                # ("auto" would stage an all_reduce of registered inputs only on 9 ranks)
                algorithm = "one_shot" if kind == "all_reduce" and not peer_out else "auto"
                _, outputs = simulate(kind, n, count, root=root, chunk=chunk,
                                      channels=channels, ordered=True, in_place=in_place,
                                      peer_in=peer_in, peer_out=peer_out, algorithm=algorithm)
                for r in range(n):
                    if kind == "all_reduce" or (kind == "reduce" and r == root):
                        assert outputs[r] == fold, (kind, peer_in, peer_out, in_place, r)
                    elif kind == "reduce_scatter":
                        block = count // n
                        assert outputs[r] == fold[r * block:(r + 1) * block]


def test_which_calls_on_registered_arrays_read_their_peers():
    """The ring stages (it reads its neighbour's buffer); so does an all_reduce asked for
    two-shot whose output is not registered, or for one-shot in place (its peers would read
    what it overwrites), and a reduce_scatter whose input is not; the rest read their peers'
    arrays."""
    def registered(kind, algorithm="auto", peer_in=True, peer_out=False, in_place=False):
        rounds = plan_collective(kind, 3, 0, 30, itemsize=4, capacity_bytes=64,
                                 chunk_bytes=8, channels=1, algorithm=algorithm,
                                 in_place=in_place, peer_in=peer_in, peer_out=peer_out)
        return len(rounds) == 1 and rounds[0].registered

    assert registered("all_reduce", peer_out=True)
    assert registered("all_reduce", "two_shot", peer_in=False, peer_out=True)
    assert registered("all_reduce", "one_shot")
    assert not registered("all_reduce", "ring", peer_out=True)
    assert not registered("all_reduce", "two_shot")
    assert not registered("all_reduce", "one_shot", peer_out=True, in_place=True)
    assert not registered("reduce_scatter", peer_in=False, peer_out=True)
    for kind in ("reduce_scatter", "reduce", "all_gather", "broadcast"):
        assert registered(kind)
    assert not registered("reduce", "ring")


def test_the_registered_check_catches_a_rank_that_leaves_early(monkeypatch):
    """The simulator's check has teeth: without the waits that keep a rank in the
    collective until its readers finished, a peer reads an array its caller may write."""
    import sys

    module = sys.modules[__name__]
    real = module.plan_collective

    def without_last_waits(*args, **kwargs):
        rounds = real(*args, **kwargs)
        (rnd,) = rounds
        channels = []
        for ops in rnd.channels:
            ops = list(ops)
            while ops and type(ops[-1]) is Wait:
                ops.pop()
            channels.append(tuple(ops))
        return (rnd._replace(channels=tuple(channels)),)

    monkeypatch.setattr(module, "plan_collective", without_last_waits)
    with pytest.raises(Violation, match="left"):
        for seed in range(50):
            simulate("all_reduce", 3, 9, seed=seed, peer_in=True, peer_out=True)


EXCHANGE = ["gather", "scatter", "all_to_all"]


@pytest.mark.parametrize("kind", EXCHANGE)
@pytest.mark.parametrize("n", [2, 3, 4, slow_n(5)])
def test_exchange_exhaustive_small(kind, n):
    """gather, scatter and all_to_all move every block where it belongs, in one round or
    several (small buffers), on any channels and pieces."""
    for block in range(0, 4):
        count = block if kind == "gather" else n * block
        for chunk, channels, capacity in itertools.product([1, 3], [1, 2], [n, 3 * n, 1 << 20]):
            for root in range(n) if kind != "all_to_all" else [0]:
                check(kind, n, count, chunk=chunk, channels=channels, capacity=capacity,
                      root=root, seed=count * 7 + chunk)


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(EXCHANGE), n=st.integers(2, 7), block=st.integers(0, 60),
       chunk=st.integers(1, 20), channels=st.integers(1, 4), capacity_mult=st.integers(1, 20),
       root=st.integers(0, 6), seed=st.integers(0, 1000))
def test_exchange_random_shapes(kind, n, block, chunk, channels, capacity_mult, root, seed):
    count = block if kind == "gather" else n * block
    check(kind, n, count, chunk=chunk, channels=channels, capacity=n * capacity_mult,
          root=root % n, seed=seed)
