"""Named items of collectives on plain NumPy arrays whose ranks read and write each other's
arrays where they lie, by cross-memory attach (GPURING_ATTACH_BYTES; `Engine.attached_peers`),
or stage them where a rank may not (GPURING_TEST_ATTACH_REFUSED: that rank's probe is
refused). (Families of items: harness.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from harness import COMPLEX, DTYPES, OPS, Item, ItemChecker, Plan, Reduction, rank_order_fold

from gpuring.settings import parse_size


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


def _threshold(plan: Plan) -> int:
    return parse_size(plan.env.get("GPURING_ATTACH_BYTES", "4M"))


def _schedule(c: ItemChecker, plan: Plan, kind: str, nbytes: int, what: str) -> None:
    """The call just made ran attached where it must: its input of `nbytes` reaches the
    threshold (an all_reduce: above the one-shot limit too) and no rank was refused; else
    it was staged."""
    refused = bool(plan.env.get("GPURING_TEST_ATTACH_REFUSED"))
    schedule = c.comm.last_schedule
    one_shot = kind == "two_shot" and nbytes <= parse_size(
        plan.env.get("GPURING_ONE_SHOT_BYTES", "64K"))  # (an all_reduce "auto" runs one-shot)
    if refused or nbytes < _threshold(plan) or one_shot:
        c.check(not schedule.startswith("attached"), f"{what} ran {schedule!r}")
    else:
        c.check(schedule == f"attached {kind}", f"{what} ran {schedule!r}, not attached")


def _all_reduce(plan: Plan, dtype: str, op: str, count: int, seed: int, name: str) -> Item:
    """all_reduce out of place and in place of `count` elements: the rank-order fold's bits
    (as registered rounds fold; a complex product within its rounding bound) on every rank,
    run twice with fresh inputs."""
    nbytes = count * _itemsize(dtype)
    ids = (f"all_reduce-{name}-out_of_place", f"all_reduce-{name}-in_place")
    # NumPy's complex product need not round as the reference's fold does (it may fuse a
    # multiply and an add): held to the rounding bound, and alike on every rank (digests).
    # Staged (a rank refused) the ring folds in its own order, unless deterministic
    exact = not (dtype in COMPLEX and op == "prod") and (
        not plan.env.get("GPURING_TEST_ATTACH_REFUSED")
        or plan.env.get("GPURING_DETERMINISTIC") == "1")

    def reference(c: ItemChecker, ins: list[np.ndarray]) -> np.ndarray | Reduction:
        return rank_order_fold(ins, op) if exact else c.reduce_reference(ins, op)

    def body(c: ItemChecker) -> None:
        rank = c.comm.rank
        for call in range(2):
            ins = c.inputs(dtype, (count,), seed + call, op)
            want = reference(c, ins)
            with c.into(ids[0]):
                c.expect(c.comm.all_reduce(ins[rank], op=op), want, f"{name} call {call}",
                         copy=exact)
                _schedule(c, plan, "two_shot", nbytes, f"{name} call {call}")
            x = ins[rank].copy()
            with c.into(ids[1]):
                c.check(c.comm.all_reduce(x, op=op, out=x) is x, "all_reduce(x, out=x) is not x")
                c.expect(x, want, f"{name} in place call {call}", copy=exact)
                _schedule(c, plan, "two_shot", nbytes, f"{name} in place call {call}")

    return Item(ids, body)


def attached(plan: Plan) -> Iterator[Item]:
    """all_reduce of every dtype and op just above the threshold, float32 sum at sizes around
    it (below: staged), odd counts and several pieces, in place and out of place; the same
    arrays refilled and called again at once (a rank that returned while a peer still read
    its arrays would mix two calls' data); reduce_scatter and all_gather (in place too). Every
    result is the rank-order fold's bits (or the inputs' copy), the same on every rank."""
    n = plan.n
    least = _threshold(plan)
    staged = bool(plan.env.get("GPURING_TEST_ATTACH_REFUSED"))  # (the ring's own order)
    seed = 31000
    for dtype in DTYPES:
        itemsize = _itemsize(dtype)
        for op in OPS:
            if dtype in COMPLEX and op in ("min", "max"):
                continue
            seed += 2
            yield _all_reduce(plan, dtype, op, least // itemsize + 5, seed, f"{dtype}-{op}")
    for count in (least // 4 - 1, least // 4, least // 4 + 1, 3 * least // 4 + 7,
                  (1 << 20) + 3):
        seed += 2
        yield _all_reduce(plan, "float32", "sum", count, seed, f"float32-sum-{count}elems")

    def again(c: ItemChecker) -> None:
        rank, count = c.comm.rank, least // 4 + 11
        x = np.empty(count, np.float32)
        out = np.empty(count, np.float32)
        for call in range(20):
            ins = c.inputs("float32", (count,), 32000 + call)
            x[...] = ins[rank]
            got = c.comm.all_reduce(x, out=out if call % 2 else x)
            if staged:
                c.expect(got, c.reduce_reference(ins, "sum"), f"again call {call}")
            else:
                c.expect(got, rank_order_fold(ins, "sum"), f"again call {call}", copy=True)
            _schedule(c, plan, "two_shot", x.nbytes, f"again call {call}")

    def reduce_scatter(c: ItemChecker) -> None:
        rank, block = c.comm.rank, least // 8 + 3
        for op in ("sum", "max"):
            ins = c.inputs("float64", (n * block,), 32100, op)
            got = c.comm.reduce_scatter(ins[rank], op=op)
            if staged:
                c.expect(got, c.reduce_reference(ins, op).reshape(n, -1)[rank],
                         f"reduce_scatter {op}", shared=False)
            else:
                c.expect(got, rank_order_fold(ins, op).reshape(n, -1)[rank],
                         f"reduce_scatter {op}", copy=True, shared=False)
            _schedule(c, plan, "fold_block", ins[rank].nbytes, f"reduce_scatter {op}")

    def all_gather(c: ItemChecker) -> None:
        rank, block = c.comm.rank, least // 8 + 3
        ins = c.inputs("int64", (block,), 32200)
        c.expect(c.comm.all_gather(ins[rank]), np.stack(ins), "all_gather", copy=True)
        _schedule(c, plan, "gather", ins[rank].nbytes, "all_gather")
        out = np.zeros((n, block), np.int64)
        out[rank] = ins[rank]
        c.check(c.comm.all_gather(out[rank], out=out) is out, "all_gather(out=out) is not out")
        c.expect(out, np.stack(ins), "all_gather in place", copy=True)
        _schedule(c, plan, "gather", ins[rank].nbytes, "all_gather in place")

    yield Item.one(f"all_reduce-float32-sum-{least // 4 + 11}elems-again", again)
    yield Item.one(f"reduce_scatter-float64-{n * (least // 8 + 3)}elems", reduce_scatter)
    yield Item.one(f"all_gather-int64-{least // 8 + 3}elems-out_of_place_and_in_place",
                   all_gather)


FAMILIES = {"attached": attached}
