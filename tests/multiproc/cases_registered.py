"""Named items of registered memory: arrays from comm.empty/zeros, which the peers read in
place. (Families of items: harness.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from harness import Item, ItemChecker, Plan, dev, rank_order_fold

import gpuring


def _device(c: ItemChecker) -> str:
    return "cpu" if c.xp is np else "cuda"


def _one_kind(n: int, size: int, dtype: str, op: str, seed: int) -> Item:
    """Every verb on registered arrays of one size, dtype and op, refilled and called again
    at once (3 times); the rank-order fold's bits, whatever the form."""
    count = n * size
    root = n - 1
    at = f"{dtype}-{op}-{count}elems"
    ids = {"two_shot": f"all_reduce-{at}-registered-out_of_place",
           "one_shot": f"all_reduce-{at}-registered-new_result",
           "plain": f"all_reduce-{at}-plain-two_shot-out_of_place",
           "in_place": f"all_reduce-{at}-registered-in_place",
           "reduce_scatter": f"reduce_scatter-{at}-registered-new_result",
           "reduce": f"reduce-{at}-root{root}-registered-new_result",
           "all_gather_in_place": f"all_gather-{dtype}-{size}elems-registered-in_place",
           "all_gather": f"all_gather-{dtype}-{size}elems-registered-new_result",
           "broadcast": f"broadcast-{dtype}-root{root}-{size}elems-registered-in_place"}

    def body(c: ItemChecker) -> None:
        comm, rank, device = c.comm, c.comm.rank, _device(c)
        x = comm.empty(count, dtype, device=device)
        out = comm.empty(count, dtype, device=device)
        for call in range(3):
            ins = c.inputs(dtype, (count,), seed + call, op)
            want = rank_order_fold(ins, op)
            label = f"{at} call {call}"
            x[...] = dev(c, ins[rank])
            with c.into(ids["two_shot"]):
                c.expect(comm.all_reduce(x, op=op, out=out), want, label, copy=True)
            with c.into(ids["one_shot"]):
                c.expect(comm.all_reduce(x, op=op), want, label, copy=True)
            with c.into(ids["plain"]):
                c.expect(comm.all_reduce(dev(c, ins[rank]), op=op, algorithm="two_shot"), want,
                         label, copy=True)
            with c.into(ids["in_place"]):
                comm.all_reduce(x, op=op, out=x)
                c.expect(x, want, label, copy=True)
            x[...] = dev(c, ins[rank])
            with c.into(ids["reduce_scatter"]):
                c.expect(comm.reduce_scatter(x, op=op), want.reshape(n, -1)[rank], label,
                         copy=True, shared=False)
            with c.into(ids["reduce"]):
                got = comm.reduce(x, op=op, root=root)
                if rank == root:
                    c.expect(got, want, label, copy=True, shared=False)
                else:
                    c.check(got is None, "reduce returned an array off the root")
        blocks = comm.empty((n, size), dtype, device=device)
        ins = c.inputs(dtype, (size,), seed + 100)
        blocks[rank] = dev(c, ins[rank])
        with c.into(ids["all_gather_in_place"]):
            comm.all_gather(blocks[rank], out=blocks)  # in place: each rank's own offset
            c.expect(blocks, np.stack(ins), f"all_gather in place {size}", copy=True)
        x[:size] = dev(c, ins[rank])
        with c.into(ids["all_gather"]):
            c.expect(comm.all_gather(x[:size]), np.stack(ins), f"all_gather {size}", copy=True)
        with c.into(ids["broadcast"]):
            comm.broadcast(x[:size], root=root)
            c.expect(x[:size], ins[root], f"broadcast {size}", copy=True)

    return Item(tuple(ids.values()), body)


def registered(plan: Plan) -> Iterator[Item]:
    """Arrays from comm.empty/zeros (registered memory, which the peers read in place): every
    verb, in place and out of place, from a few elements to several MiB, results the
    rank-order fold's bits (as deterministic mode, whatever the form); arrays refilled and
    called again at once many times (a rank that returned early, or read a peer's array
    before the peer entered, would mix two calls' data); views at other offsets of a
    registration (an all_gather in place: each rank's block at its own offset), a reduce in
    place on the root only; a rank whose array is registered where its peers' are not, or
    lies at another offset, is a mismatch on every rank, and the communicator goes on, as it
    does after a registration refused for its dtype. Plain arrays interleaved (two-shot) give
    the same bits."""
    n = plan.n
    root = n - 1

    def zeros(c: ItemChecker) -> None:
        z = c.comm.zeros((3,), "int16", device=_device(c))
        c.check(type(z) is type(c.xp.zeros(1)) and z.dtype == np.int16,
                f"comm.zeros made a {type(z).__name__} of {z.dtype}")
        c.expect(z, np.zeros(3, np.int16), "registered zeros")

    yield Item.one("zeros-int16-3-registered", zeros)
    seed = 17000
    for size, dtype, op in ((7, "float32", "sum"), (5000, "float64", "avg"),
                            (300000, "float32", "sum"), (1000, "float16", "sum"),
                            (2000, "int32", "max")):
        yield _one_kind(n, size, dtype, op, seed + 1)
        seed += 3

    def back_to_back(c: ItemChecker) -> None:  # refilled at once after each call
        comm, rank = c.comm, c.comm.rank
        size = 20000
        x = comm.empty(n * size, "float32", device=_device(c))
        tunings = [(None, None), (4096, 3), (1 << 16, 2)]  # the same bits, whatever the pieces
        for call in range(12):
            ins = c.inputs("float32", (n * size,), 17500 + call)
            x[...] = dev(c, ins[rank])
            chunk, channels = tunings[call % 3]
            comm.all_reduce(x, out=x, chunk_bytes=chunk, channels=channels)
            c.expect(x, rank_order_fold(ins, "sum"), f"back to back call {call}", copy=True)

    def reduce_on_root(c: ItemChecker) -> None:
        comm, rank, size = c.comm, c.comm.rank, 20000
        x = comm.empty(size, "float32", device=_device(c))
        x[...] = dev(c, np.arange(size, dtype=np.float32) + rank)
        got = comm.reduce(x, root=root, out=x if rank == root else None)
        if rank == root:
            c.check(got is x, "reduce(out=x) is not x on the root")
            c.expect(got, np.arange(size, dtype=np.float32) * n + sum(range(n)),
                     "reduce in place on the root", shared=False)
        else:
            c.check(got is None, "reduce returned an array off the root")

    def mismatch(what: str, on_rank_0_only: bool):  # type: ignore[no-untyped-def]
        def body(c: ItemChecker) -> None:
            comm, rank = c.comm, c.comm.rank
            x = comm.empty(16, "float32", device=_device(c))
            x[...] = 1
            if on_rank_0_only:
                mine = x[:8] if rank == 0 else c.xp.ones(8, "float32")
            else:
                mine = x[8 * (rank == 1):8 * (rank == 1) + 8]
            try:
                comm.all_reduce(mine)
            except gpuring.CollectiveMismatchError as exc:
                c.check("registered" in exc.differences, f"differences {exc.differences}")
            else:
                c.check(False, f"no CollectiveMismatchError for {what}")
        return body

    def refused(c: ItemChecker) -> None:  # refused before the ranks meet
        try:
            c.comm.empty(4, object, device=_device(c))
        except TypeError as exc:
            c.check("not supported" in str(exc), f"refused as: {exc}")
        else:
            c.check(False, "a registered array of objects")

    def after(c: ItemChecker) -> None:
        x = c.comm.empty(8, "float32", device=_device(c))
        x[...] = 1
        c.expect(c.comm.all_reduce(x), np.full(8, n, np.float32), "after a mismatch")

    yield Item.one(f"all_reduce-float32-sum-{n * 20000}elems-registered-in_place-"
                   "back_to_back", back_to_back)
    yield Item.one(f"reduce-float32-sum-20000elems-root{root}-registered-in_place_on_root",
                   reduce_on_root)
    if n > 1:
        yield Item.one("all_reduce-float32-8-registered_on_rank0_only-mismatch",
                       mismatch("a plain array on the others", True))
        yield Item.one("all_reduce-float32-8-offset_on_rank1_differs-mismatch",
                       mismatch("another offset on rank 1", False))
    yield Item.one("empty-object-refused", refused)
    yield Item.one("all_reduce-float32-sum-8-registered-after_mismatch", after)


FAMILIES = {"registered": registered}
