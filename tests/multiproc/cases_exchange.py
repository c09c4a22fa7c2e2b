"""Named items of the verbs that move blocks unreduced (gather, scatter, all_to_all) and of
the uneven forms (all_gather_v, all_to_all_v, reduce_scatter_v) (families of items:
harness.py)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from harness import (
    Item,
    ItemChecker,
    Plan,
    dev,
    expect_mismatches,
    moved_blocks,
    rank_order_fold,
    shape_name,
)


def _blocks(n: int, i: int, dtype: str, block: tuple[int, ...], seed: int) -> Iterator[Item]:
    shape = shape_name(block)

    def inputs(c: ItemChecker) -> list[np.ndarray]:
        return c.inputs(dtype, (n, *block), seed)

    def gather(root: int):  # type: ignore[no-untyped-def]
        def body(c: ItemChecker) -> None:
            ins, rank = inputs(c), c.comm.rank
            got = c.comm.gather(dev(c, ins[rank][rank]), root=root)
            if rank == root:
                c.expect(got, np.stack([ins[q][q] for q in range(n)]),
                         f"gather {dtype} {shape} root {root}", copy=True, shared=False)
            else:
                c.check(got is None, f"gather returned {type(got).__name__} off the root")
        return body

    def scatter(root: int):  # type: ignore[no-untyped-def]
        def body(c: ItemChecker) -> None:
            ins, rank = inputs(c), c.comm.rank
            got = c.comm.scatter(dev(c, ins[rank]), root=root)
            c.expect(got, ins[root][rank], f"scatter {dtype} {shape} root {root}", copy=True,
                     shared=False)
        return body

    def all_to_all(c: ItemChecker) -> None:
        ins, rank = inputs(c), c.comm.rank
        out = c.xp.zeros((n, *block), dtype)
        c.check(c.comm.all_to_all(dev(c, ins[rank]), out=out) is out,
                "all_to_all(out=out) is not out")
        c.expect(out, np.stack([ins[q][rank] for q in range(n)]),
                 f"all_to_all {dtype} {shape}", copy=True, shared=False)

    for root in range(n) if n <= 3 or i < 3 else (0, n - 1):
        yield Item.one(f"gather-{dtype}-{shape}-root{root}-out_of_place", gather(root))
        yield Item.one(f"scatter-{dtype}-{shape}-root{root}-out_of_place", scatter(root))
    yield Item.one(f"all_to_all-{dtype}-{shape}-out_of_place", all_to_all)


def exchange(plan: Plan) -> Iterator[Item]:
    """gather, scatter and all_to_all: every block where it belongs, bit for bit, every dtype,
    shapes from empty blocks to several buffer rounds (or the first `blocks` of them, the
    option), every root, given outputs, registered arrays; a mismatched root or block shape
    raises CollectiveMismatchError on every rank, a wrong first dimension ValueError before
    the ranks meet, and the communicator goes on."""
    n = plan.n
    seed = 19000
    for i, (dtype, block) in enumerate(moved_blocks()[:plan.option("blocks")]):
        seed += 1
        yield from _blocks(n, i, dtype, block, seed)

    def registered(c: ItemChecker) -> None:  # registered arrays: staged as usual
        device = "cpu" if c.xp is np else "cuda"
        x = c.comm.empty((n, 1000), "int32", device=device)
        ins = c.inputs("int32", (n, 1000), seed + 1)
        x[...] = dev(c, ins[c.comm.rank])
        c.expect(c.comm.all_to_all(x), np.stack([ins[q][c.comm.rank] for q in range(n)]),
                 "all_to_all registered", copy=True, shared=False)

    def root_mismatch(c: ItemChecker) -> None:
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        expect_mismatches(c, [("root", lambda: comm.gather(xp.ones(4), root=min(rank, 1)))])

    def shape_mismatch(c: ItemChecker) -> None:
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        expect_mismatches(c, [("shape", lambda: comm.all_to_all(xp.ones((n, 4 + (rank == 1)))))])

    def wrong_blocks(c: ItemChecker) -> None:
        try:
            c.comm.scatter(c.xp.ones((n + 1, 2)))
        except ValueError as exc:
            c.check("one block per rank" in str(exc), f"refused as: {exc}")
        else:
            c.check(False, "scatter took n + 1 blocks")

    def after(c: ItemChecker) -> None:
        c.expect(c.comm.all_to_all(c.xp.full((n, 3), c.comm.rank)),
                 np.repeat(np.arange(n), 3).reshape(n, 3), "all_to_all after mismatch",
                 copy=True, shared=False)

    yield Item.one("all_to_all-int32-registered", registered)
    if n > 1:
        yield Item.one("gather-float64-4-root_on_rank0_differs-mismatch", root_mismatch)
        yield Item.one("all_to_all-float64-shape_on_rank1_differs-mismatch", shape_mismatch)
    yield Item.one(f"scatter-float64-{n + 1}blocks-refused", wrong_blocks)
    yield Item.one("all_to_all-int64-after_mismatch-out_of_place", after)


UNEVEN_DTYPES = [("float32", (3,)), ("int64", ()), ("complex64", (2, 5)), ("float16", (1,))]


def uneven(plan: Plan) -> Iterator[Item]:
    """all_gather_v, all_to_all_v and reduce_scatter_v: every rank's blocks where they
    belong with the shapes their senders gave (empty ones too, even blocks as a special
    case), reductions within their rounding bound (the rank-order fold's bits in
    deterministic mode); different trailing dimensions, counts or dtypes raise
    CollectiveMismatchError on every rank, and the communicator goes on."""
    n = plan.n
    seed = 20000
    for i, (dtype, trailing) in enumerate(UNEVEN_DTYPES):
        for kind, rows in (("uneven", [(q * 7 + i) % 5 for q in range(n)]), ("even", [4] * n),
                           ("empty", [0] * n)):
            seed += 1
            yield Item.one(f"all_gather_v-{dtype}-{kind}_rows-{'_'.join(map(str, rows))}",
                           _all_gather_v(n, dtype, trailing, rows, seed))
        seed += 1
        yield Item.one(f"all_to_all_v-{dtype}-uneven", _all_to_all_v(n, i, dtype, trailing,
                                                                       seed))
    for op, dtype in (("sum", "float32"), ("max", "int32"), ("avg", "float64")):
        seed += 1
        yield Item.one(f"reduce_scatter_v-{dtype}-{op}-uneven",
                       _reduce_scatter_v(n, op, dtype, seed))

    def mismatch(field: str, call):  # type: ignore[no-untyped-def]
        def body(c: ItemChecker) -> None:
            expect_mismatches(c, [(field, lambda: call(c.comm, c.comm.rank, c.xp))])
        return body

    mismatches = {
        "all_gather_v-float64-trailing_dimensions_on_rank1_differ-mismatch": mismatch(
            "trailing dimensions",
            lambda comm, rank, xp: comm.all_gather_v(xp.ones((2, 3 + (rank == 1))))),
        "reduce_scatter_v-float64-counts_on_rank0_differ-mismatch": mismatch(
            "counts", lambda comm, rank, xp: comm.reduce_scatter_v(
                xp.ones(3 * n), [3] * n if rank else [3 * n] + [0] * (n - 1))),
        "all_to_all_v-dtype_on_rank0_differs-mismatch": mismatch(
            "dtype", lambda comm, rank, xp: comm.all_to_all_v(
                [xp.ones(2, "float32" if rank else "float64") for _ in range(n)])),
    }

    def after(c: ItemChecker) -> None:
        got = c.comm.all_gather_v(c.xp.full((c.comm.rank + 1, 2), c.comm.rank))
        c.check(len(got) == n, f"{len(got)} blocks")
        c.expect(got[n - 1], np.full((n, 2), n - 1), "all_gather_v after mismatch", copy=True)

    if n > 1:
        for name, body in mismatches.items():
            yield Item.one(name, body)
    yield Item.one("all_gather_v-int64-after_mismatch", after)


def _all_gather_v(n: int, dtype: str, trailing: tuple[int, ...], rows: list[int], seed: int
                  ):  # type: ignore[no-untyped-def]
    def body(c: ItemChecker) -> None:
        xs = [c.inputs(dtype, (rows[q], *trailing), seed)[q] for q in range(n)]
        got = c.comm.all_gather_v(dev(c, xs[c.comm.rank]))
        c.check(len(got) == n, f"{len(got)} blocks")
        for q in range(min(n, len(got))):
            c.expect(got[q], xs[q], f"all_gather_v {dtype} {rows} from {q}", copy=True)
    return body


def _all_to_all_v(n: int, i: int, dtype: str, trailing: tuple[int, ...], seed: int
                  ):  # type: ignore[no-untyped-def]
    def body(c: ItemChecker) -> None:
        rank = c.comm.rank
        shapes = [[((q + 2 * j + i) % 4, *trailing) for j in range(n)] for q in range(n)]
        sent = [[c.inputs(dtype, shapes[q][j], seed + 100 * q + j)[0] for j in range(n)]
                for q in range(n)]
        got = c.comm.all_to_all_v([dev(c, b) for b in sent[rank]])
        c.check(len(got) == n, f"{len(got)} blocks")
        for q in range(min(n, len(got))):
            c.expect(got[q], sent[q][rank], f"all_to_all_v {dtype} from {q}", copy=True,
                     shared=False)
    return body


def _reduce_scatter_v(n: int, op: str, dtype: str, seed: int):  # type: ignore
    def body(c: ItemChecker) -> None:
        rank = c.comm.rank
        counts = [(3 * q + 1) % 7 for q in range(n)]
        ins = c.inputs(dtype, (sum(counts),), seed, op)
        got = c.comm.reduce_scatter_v(dev(c, ins[rank]), counts, op=op)
        start = sum(counts[:rank])
        piece = [a[start:start + counts[rank]] for a in ins]
        if c.comm.config.deterministic:
            c.expect(got, rank_order_fold(piece, op), f"reduce_scatter_v {op} {counts}",
                     copy=True, shared=False)
        else:
            c.expect(got, c.reduce_reference(piece, op), f"reduce_scatter_v {op} {counts}",
                     shared=False)
    return body


FAMILIES = {"exchange": exchange, "uneven": uneven}
