"""Named items of the reducing collectives (all_reduce, reduce_scatter, reduce) and of the
family's verbs that move data beside them (all_gather, broadcast): every dtype and op, odd
sizes, hundreds of calls back to back, deterministic mode, algorithm= per call, and the same
arrays called again. (Families of items: harness.py.)"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import numpy as np
from harness import (
    COMPLEX,
    DTYPES,
    FLOATS,
    OPS,
    Item,
    ItemChecker,
    Plan,
    deterministic_fold,
    dev,
    rank_order_fold,
)

import gpuring
from gpuring import GpuringError


def _one_dtype_op(n: int, dtype: str, op: str, seed: int) -> Iterator[Item]:
    """all_reduce out of place and in place, reduce_scatter and reduce of one dtype and op."""
    count = 3 * n * 5 + 1
    root = seed % n
    name = f"{dtype}-{op}"

    def all_reduce(c: ItemChecker) -> None:
        ins = c.inputs(dtype, (count,), seed, op)
        c.expect(c.comm.all_reduce(dev(c, ins[c.comm.rank]), op=op),
                 c.reduce_reference(ins, op), f"all_reduce {name}")

    def all_reduce_in_place(c: ItemChecker) -> None:
        ins = c.inputs(dtype, (count,), seed, op)
        x = dev(c, ins[c.comm.rank].copy())
        c.check(c.comm.all_reduce(x, op=op, out=x) is x, "all_reduce(x, out=x) is not x")
        c.expect(x, c.reduce_reference(ins, op), f"all_reduce in place {name}")

    def reduce_scatter(c: ItemChecker) -> None:
        big = c.inputs(dtype, (n * 37,), seed + 1000, op)
        full = c.reduce_reference(big, op)
        c.expect(c.comm.reduce_scatter(dev(c, big[c.comm.rank]), op=op),
                 full.reshape(n, -1)[c.comm.rank], f"reduce_scatter {name}", shared=False)

    def reduce(c: ItemChecker) -> None:
        ins = c.inputs(dtype, (count,), seed, op)
        got = c.comm.reduce(dev(c, ins[c.comm.rank]), op=op, root=root)
        if c.comm.rank == root:
            c.expect(got, c.reduce_reference(ins, op), f"reduce {name} root {root}",
                     shared=False)
        else:
            c.check(got is None, f"reduce returned {type(got).__name__} off the root")

    yield Item.one(f"all_reduce-{name}-out_of_place", all_reduce)
    yield Item.one(f"all_reduce-{name}-in_place", all_reduce_in_place)
    yield Item.one(f"reduce_scatter-{name}-out_of_place", reduce_scatter)
    yield Item.one(f"reduce-{name}-root{root}-out_of_place", reduce)


def _gather_broadcast(n: int, dtype: str, seed: int) -> Iterator[Item]:
    root = (seed + 1) % n

    def all_gather(c: ItemChecker) -> None:
        ins = c.inputs(dtype, (5, 3), seed + 2000)
        c.expect(c.comm.all_gather(dev(c, ins[c.comm.rank])), np.stack(ins),
                 f"all_gather {dtype}", copy=True)

    def broadcast(c: ItemChecker) -> None:
        ins = c.inputs(dtype, (5, 3), seed + 2000)
        x = dev(c, ins[c.comm.rank].copy())
        c.check(c.comm.broadcast(x, root=root) is x, "broadcast(x) is not x")
        c.expect(x, ins[root], f"broadcast {dtype} root {root}", copy=True)

    yield Item.one(f"all_gather-{dtype}-out_of_place", all_gather)
    yield Item.one(f"broadcast-{dtype}-root{root}-in_place", broadcast)


def dtypes_ops(plan: Plan) -> Iterator[Item]:
    """Every dtype (or those of the option `dtypes`) and op: all_reduce in and out of place,
    reduce_scatter and reduce; all_gather and broadcast of every dtype."""
    seed = 1
    for dtype in plan.option("dtypes") or DTYPES:
        for op in OPS:
            if dtype in COMPLEX and op in ("min", "max"):
                continue
            seed += 1
            yield from _one_dtype_op(plan.n, dtype, op, seed)
        yield from _gather_broadcast(plan.n, dtype, seed)


def _one_size(n: int, size: int, channels: int, chunk: int | None, seed: int
              ) -> Iterator[Item]:
    kw = {"channels": channels, "chunk_bytes": chunk}
    tuning = f"ch{channels}" + (f"-chunk{chunk}" if chunk else "")
    where = f"{size}elems-{tuning}"

    def floats(c: ItemChecker) -> list[np.ndarray]:
        return c.inputs("float32", (size,), seed)

    def all_reduce(c: ItemChecker) -> None:
        ins = floats(c)
        c.expect(c.comm.all_reduce(dev(c, ins[c.comm.rank]), **kw),
                 c.reduce_reference(ins, "sum"), f"all_reduce {where}")

    def all_gather(c: ItemChecker) -> None:
        ins = floats(c)
        c.expect(c.comm.all_gather(dev(c, ins[c.comm.rank]), **kw), np.stack(ins),
                 f"all_gather {where}", copy=True)

    def broadcast(c: ItemChecker) -> None:
        ins = floats(c)
        x = dev(c, ins[c.comm.rank].copy())
        c.expect(c.comm.broadcast(x, root=n - 1, **kw), ins[n - 1], f"broadcast {where}",
                 copy=True)

    def reduce(c: ItemChecker) -> None:
        ins = floats(c)
        got = c.comm.reduce(dev(c, ins[c.comm.rank]), root=0, **kw)
        if c.comm.rank == 0:
            c.expect(got, c.reduce_reference(ins, "sum"), f"reduce {where}", shared=False)
        else:
            c.check(got is None, f"reduce returned {type(got).__name__} off the root")

    def ints(c: ItemChecker) -> tuple[list[np.ndarray], object]:
        rs_in = c.inputs("int32", (size * n,), seed)
        return rs_in, c.reduce_reference(rs_in, "sum").reshape(n, -1)[c.comm.rank]

    def reduce_scatter(c: ItemChecker) -> None:
        rs_in, rs_want = ints(c)
        c.expect(c.comm.reduce_scatter(dev(c, rs_in[c.comm.rank]), **kw), rs_want,
                 f"reduce_scatter {where}", shared=False)

    def all_gather_in_place(c: ItemChecker) -> None:
        ins, rank = floats(c), c.comm.rank
        slots = dev(c, np.full((n, size), -1.0, np.float32))
        slots[rank] = dev(c, ins[rank])
        c.check(c.comm.all_gather(slots[rank], out=slots, **kw) is slots,
                "all_gather(out=slots) is not slots")
        c.expect(slots, np.stack(ins), f"all_gather in place {where}", copy=True)

    def reduce_scatter_in_place(c: ItemChecker) -> None:
        rs_in, rs_want = ints(c)
        rs_x = dev(c, rs_in[c.comm.rank].copy())
        mine = rs_x.reshape(n, size)[c.comm.rank]
        c.check(c.comm.reduce_scatter(rs_x, out=mine, **kw) is mine,
                "reduce_scatter(out=its block) is not that block")
        c.expect(mine, rs_want, f"reduce_scatter in place {where}", shared=False)

    def broadcast_out_of_place(c: ItemChecker) -> None:
        ins = floats(c)
        source = dev(c, ins[c.comm.rank])
        dest = dev(c, np.full(size, -1.0, np.float32))
        c.check(c.comm.broadcast(source, root=n - 1, out=dest, **kw) is dest,
                "broadcast(out=dest) is not dest")
        c.expect(dest, ins[n - 1], f"broadcast out of place {where}", copy=True)
        c.expect(source, ins[c.comm.rank], f"broadcast leaves x {where}", copy=True,
                 shared=False)

    yield Item.one(f"all_reduce-float32-sum-{where}-out_of_place", all_reduce)
    yield Item.one(f"all_gather-float32-{where}-out_of_place", all_gather)
    yield Item.one(f"broadcast-float32-root{n - 1}-{where}-in_place", broadcast)
    yield Item.one(f"reduce-float32-sum-root0-{where}-out_of_place", reduce)
    yield Item.one(f"reduce_scatter-int32-sum-{where}-out_of_place", reduce_scatter)
    yield Item.one(f"all_gather-float32-{where}-in_place", all_gather_in_place)
    yield Item.one(f"reduce_scatter-int32-sum-{where}-in_place", reduce_scatter_in_place)
    yield Item.one(f"broadcast-float32-root{n - 1}-{where}-out_of_place",
                   broadcast_out_of_place)


def sizes(plan: Plan) -> Iterator[Item]:
    """Odd sizes (0, 1, n-1, primes) on 1 channel and on 3 in small pieces, every verb in and
    out of place; shapes; one 24 MiB array."""
    n = plan.n
    seed = 100
    for size in sorted({0, 1, max(n - 1, 0), 2, 7, 31, 1031, 65537, 262147}):
        for channels, chunk in ((1, None), (3, 4096)):
            seed += 1
            yield from _one_size(n, size, channels, chunk, seed)

    def empty_3d(c: ItemChecker) -> None:
        ins = c.inputs("int64", (4, 0, 3), seed + 1)
        c.expect(c.comm.all_reduce(dev(c, ins[c.comm.rank])), c.reduce_reference(ins, "sum"),
                 "empty 3d")

    def max_3d(c: ItemChecker) -> None:
        ins = c.inputs("float64", (6, 5, 4), seed + 2)
        c.expect(c.comm.all_reduce(dev(c, ins[c.comm.rank]), op="max"),
                 c.reduce_reference(ins, "max"), "3d max")

    def strided(c: ItemChecker) -> None:  # non-contiguous input works through a copy
        ins = c.inputs("float32", (10, 8), seed + 3)
        c.expect(c.comm.all_reduce(dev(c, ins[c.comm.rank])[:, ::2]),
                 c.reduce_reference([a[:, ::2] for a in ins], "sum"), "strided input")

    def large(c: ItemChecker) -> None:  # more than a buffer region on the CPU (16 MiB)
        ins = c.inputs("float32", (6 << 20,), seed + 4)
        c.expect(c.comm.all_reduce(dev(c, ins[c.comm.rank])), c.reduce_reference(ins, "sum"),
                 "24 MiB")

    yield Item.one("all_reduce-int64-sum-4x0x3-out_of_place", empty_3d)
    yield Item.one("all_reduce-float64-max-6x5x4-out_of_place", max_3d)
    yield Item.one("all_reduce-float32-sum-10x8_strided-out_of_place", strided)
    yield Item.one("all_reduce-float32-sum-24MiB-out_of_place", large)


B2B = {0: "back_to_back-all_reduce-int32-sum-out_of_place",
       1: "back_to_back-reduce_scatter-int32-sum-out_of_place",
       2: "back_to_back-all_gather-int32-out_of_place",
       3: "back_to_back-broadcast-int32-in_place"}


def back_to_back(plan: Plan) -> Iterator[Item]:
    """200 collectives of varying size, verb, channels and pieces, back to back, never
    waiting between: one run, each verb's results under an id of its own."""

    def body(c: ItemChecker) -> None:
        comm, n = c.comm, c.comm.size
        rng = np.random.default_rng(7)  # same sequence on every rank
        for i in range(200):
            size = int(rng.choice([1, 3, 100, 1000, 5000, 20000]))
            kind = int(rng.integers(0, 4))
            channels = int(rng.integers(1, 4))
            ins = c.inputs("int32", (size * n,), 5000 + i)
            with c.into(B2B[kind]):
                if kind == 0:
                    got = comm.all_reduce(dev(c, ins[comm.rank]), channels=channels,
                                          chunk_bytes=2048)
                    c.expect(got, c.reduce_reference(ins, "sum"), f"call {i}: all_reduce")
                elif kind == 1:
                    got = comm.reduce_scatter(dev(c, ins[comm.rank]), channels=channels,
                                              chunk_bytes=2048)
                    c.expect(got, c.reduce_reference(ins, "sum").reshape(n, -1)[comm.rank],
                             f"call {i}: reduce_scatter", shared=False)
                elif kind == 2:
                    got = comm.all_gather(dev(c, ins[comm.rank][:size]), channels=channels)
                    c.expect(got, np.stack([a[:size] for a in ins]),
                             f"call {i}: all_gather", copy=True)
                else:
                    x = dev(c, ins[comm.rank].copy())
                    comm.broadcast(x, root=i % n, channels=channels, chunk_bytes=1024)
                    c.expect(x, ins[i % n], f"call {i}: broadcast root {i % n}", copy=True)
            if i % 50 == 0:
                comm.barrier()

    yield Item(tuple(B2B.values()), body)


def deterministic(plan: Plan) -> Iterator[Item]:
    """Deterministic mode (GPURING_DETERMINISTIC=1, with small buffers): every all_reduce,
    reduce_scatter, reduce and all_reduce_many result is the rank-order fold bit for bit
    (across nodes the node-major fold), whatever the size (one-shot or one operation, one
    round, several rounds), chunk_bytes, channels and fusion; the ring is refused, and the
    communicator goes on."""
    n = plan.n
    root = n - 1
    cases = [("float32", "sum"), ("float16", "sum"), ("float64", "avg"), ("float32", "prod"),
             ("float32", "max"), ("int32", "min")]
    if "bfloat16" in FLOATS:
        cases.append(("bfloat16", "avg"))
    tunings = [(None, None), (4096, 1), (1 << 14, 3)]
    seed = 15000
    for size in (7, 3000, 40000):  # 40000 per rank: several rounds of a 256K buffer
        for (dtype, op), (chunk, channels) in zip(cases, tunings * len(cases), strict=False):
            seed += 1
            yield from _deterministic_one(n, root, dtype, op, size, chunk, channels, seed)
    for fusion in (1 << 10, 1 << 20):  # alone, then packed together
        yield Item.one(f"all_reduce_many-float32-sum-4arrays-fusion{fusion >> 10}K-"
                       "out_of_place", _deterministic_fused(fusion))

    def ring_refused(c: ItemChecker) -> None:  # every rank asks for the ring: refused
        c.check(c.comm.config.deterministic, "GPURING_DETERMINISTIC=1 is not in effect")
        try:
            c.comm.all_reduce(dev(c, np.ones(3000, np.float32)), algorithm="ring")
        except GpuringError as exc:
            c.check("deterministic" in str(exc), f"refused for another reason: {exc}")
        else:
            c.check(False, "the ring ran in deterministic mode")

    def ring_on_rank_0(c: ItemChecker) -> None:  # only rank 0 asks for it: a mismatch
        try:
            c.comm.all_reduce(dev(c, np.ones(3000, np.float32)),
                              algorithm="ring" if c.comm.rank == 0 else None)
        except gpuring.CollectiveMismatchError as exc:
            c.check("algorithm" in exc.differences, f"the mismatch names {exc.differences}")
        else:
            c.check(False, "ranks ran different schedules in deterministic mode")

    def after(c: ItemChecker) -> None:
        ins = c.inputs("float32", (5000,), 15900)
        c.expect(c.comm.all_reduce(dev(c, ins[c.comm.rank]), algorithm="two_shot"),
                 deterministic_fold(c, ins, "sum"), "after the refusal", copy=True)

    yield Item.one("all_reduce-float32-sum-ring-refused", ring_refused)
    yield Item.one("all_reduce-float32-sum-ring_on_rank0-mismatch", ring_on_rank_0)
    yield Item.one("all_reduce-float32-sum-two_shot-after_refusal-out_of_place", after)


def _deterministic_one(n: int, root: int, dtype: str, op: str, size: int, chunk: int | None,
                       channels: int | None, seed: int) -> Iterator[Item]:
    tuning = f"chunk{chunk or 'default'}-ch{channels or 'default'}"
    label = f"{dtype}-{op}-{n * size}elems-{tuning}"

    def inputs(c: ItemChecker) -> list[np.ndarray]:
        return c.inputs(dtype, (n * size,), seed, op)

    def all_reduce(c: ItemChecker) -> None:
        ins = inputs(c)
        got = c.comm.all_reduce(dev(c, ins[c.comm.rank]), op=op, chunk_bytes=chunk,
                                channels=channels)
        c.expect(got, deterministic_fold(c, ins, op), f"all_reduce {label}", copy=True)

    def reduce_scatter(c: ItemChecker) -> None:
        ins, rank = inputs(c), c.comm.rank
        got = c.comm.reduce_scatter(dev(c, ins[rank]), op=op, chunk_bytes=chunk,
                                    channels=channels)
        c.expect(got, deterministic_fold(c, [a.reshape(n, -1)[rank] for a in ins], op),
                 f"reduce_scatter {label}", copy=True, shared=False)

    def reduce(c: ItemChecker) -> None:
        ins = inputs(c)
        got = c.comm.reduce(dev(c, ins[c.comm.rank]), op=op, root=root, chunk_bytes=chunk,
                            channels=channels)
        if c.comm.rank == root:
            c.expect(got, deterministic_fold(c, ins, op), f"reduce {label}", copy=True,
                     shared=False)
        else:
            c.check(got is None, f"reduce returned {type(got).__name__} off the root")

    yield Item.one(f"all_reduce-{label}-out_of_place", all_reduce)
    yield Item.one(f"reduce_scatter-{label}-out_of_place", reduce_scatter)
    yield Item.one(f"reduce-{label}-root{root}-out_of_place", reduce)


def _deterministic_fused(fusion: int):  # type: ignore[no-untyped-def]
    def body(c: ItemChecker) -> None:
        rank = c.comm.rank
        arrays = [c.inputs("float32", shape, 15500 + i) for i, shape in
                  enumerate([(33,), (100, 7), (5,), (4000,)])]
        got = c.comm.all_reduce_many([dev(c, a[rank]) for a in arrays], fusion_bytes=fusion)
        for i, (g, a) in enumerate(zip(got, arrays, strict=True)):
            c.expect(g, deterministic_fold(c, a, "sum"), f"fused {fusion} array {i}",
                     copy=True)

    return body


def two_shot(plan: Plan) -> Iterator[Item]:
    """algorithm="two_shot" (and "one_shot") asked per call, without deterministic mode: the
    rank-order fold's bits too; "ring" as asked; a wrong name refused; "direct", the former
    name, runs the two-shot schedule with a DeprecationWarning, and a rank passing it agrees
    with ranks passing "two_shot"."""
    n = plan.n
    seed = 16000
    for size in (10, 5000, 100000):
        for algorithm in ("two_shot", "one_shot", "ring"):
            seed += 1
            yield Item.one(f"all_reduce-float32-sum-{n * size}elems-{algorithm}-out_of_place",
                           _algorithm_all_reduce(n, size, algorithm, seed))
        yield Item.one(f"reduce_scatter-float64-prod-{n * size}elems-two_shot-out_of_place",
                       _two_shot_reduce_scatter(n, size, seed + 500))

    def direct(c: ItemChecker) -> None:
        comm, rank = c.comm, c.comm.rank
        ins = c.inputs("float32", (n * 5000,), seed + 1000)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = comm.all_reduce(dev(c, ins[rank]),
                                  algorithm="direct" if rank == 0 else "two_shot")
        c.expect(got, rank_order_fold(ins, "sum"), "'direct' beside 'two_shot'", copy=True)
        former = [w for w in caught if issubclass(w.category, DeprecationWarning)
                  and "'two_shot'" in str(w.message)]
        c.check(len(former) == (rank == 0),
                f"warnings: {[str(w.message) for w in caught]}")
        if c.xp is np:  # (a small one on the GPU runs as one operation)
            c.check(comm.last_schedule == "two_shot", f"schedule {comm.last_schedule}")

    def one_shot_refused(c: ItemChecker) -> None:
        try:
            c.comm.reduce_scatter(dev(c, np.ones(n, np.float32)), algorithm="one_shot")
        except ValueError as exc:
            c.check("algorithm must be one of" in str(exc), f"refused as: {exc}")
        else:
            c.check(False, "reduce_scatter took algorithm='one_shot'")

    yield Item.one(f"all_reduce-float32-sum-{n * 5000}elems-direct_beside_two_shot-"
                   "out_of_place", direct)
    yield Item.one("reduce_scatter-float32-sum-one_shot-refused", one_shot_refused)


def _algorithm_all_reduce(n: int, size: int, algorithm: str, seed: int):  # type: ignore
    def body(c: ItemChecker) -> None:
        ins = c.inputs("float32", (n * size,), seed)
        got = c.comm.all_reduce(dev(c, ins[c.comm.rank]), algorithm=algorithm,
                                chunk_bytes=8192, channels=2)
        label = f"{algorithm} all_reduce {n * size}"
        if algorithm == "ring":
            c.expect(got, c.reduce_reference(ins, "sum"), label)
        else:
            c.expect(got, rank_order_fold(ins, "sum"), label, copy=True)

    return body


def _two_shot_reduce_scatter(n: int, size: int, seed: int):  # type: ignore[no-untyped-def]
    def body(c: ItemChecker) -> None:
        ins, rank = c.inputs("float64", (n * size,), seed, "prod"), c.comm.rank
        got = c.comm.reduce_scatter(dev(c, ins[rank]), op="prod", algorithm="two_shot")
        c.expect(got, rank_order_fold([a.reshape(n, -1)[rank] for a in ins], "prod"),
                 f"two_shot reduce_scatter {size}", copy=True, shared=False)

    return body


def again(plan: Plan) -> Iterator[Item]:
    """The same arrays called again and again (a call that comes again skips its checks and
    binding: `LastCalls`), their contents refilled in place between calls: every verb, small
    (one operation on a GPU) and large, out of place and in place; a new op on the same
    arrays, and an array reshaped in place, are new calls; once the prepared calls are
    forgotten (on every rank at once), a call that comes again is prepared anew, and kept
    so. Last, a rank that changes the op on the same arrays while the others run the call
    agreed before fails them all with a mismatch, within a watchdog tick (the communicator
    is then unusable: data had moved)."""
    for size in (100, 50000):
        yield _again_one_size(plan.n, size)

    def reshaped(c: ItemChecker) -> None:
        comm, n, rank, xp = c.comm, c.comm.size, c.comm.rank, c.xp
        x = xp.zeros(12, "int64")  # reshaped in place: the same object, a new call
        for shape in ((12,), (3, 4), (12,)):
            x.shape = shape
            x[...] = dev(c, np.arange(12).reshape(shape) + rank)
            c.expect(comm.all_reduce(x, out=x),
                     np.arange(12).reshape(shape) * n + sum(range(n)), f"reshaped {shape}")

    yield Item.one("again-all_reduce-int64-sum-reshaped-in_place", reshaped)
    yield Item.one("again-all_reduce-float32-op_changed_on_rank1-mismatch", _again_op_changed,
                   last=True, stderr=KEEPS_GPU_BUFFERS)


#: what closing a communicator whose peers may still read its GPU buffers says (a warning
#: and the line it names)
KEEPS_GPU_BUFFERS = (r".*RuntimeWarning: gpuring: keeping \d+ bytes of GPU communication "
                     r"buffers allocated: a peer of the failed job may still read them\n.*",)


def _again_one_size(n: int, size: int) -> Item:
    at = f"{n * size}elems"
    ids = {"all_reduce": f"again-all_reduce-float32-sum-{at}-out_of_place",
           "prepared": f"again-all_reduce-float32-sum-{at}-prepared_anew",
           "in_place": f"again-all_reduce-float32-sum-{at}-in_place",
           "new_op": f"again-all_reduce-float32-max-{at}-out_of_place",
           "reduce_scatter": f"again-reduce_scatter-float32-sum-{at}-out_of_place",
           "all_gather": f"again-all_gather-int32-{size}elems-out_of_place",
           "broadcast": f"again-broadcast-int32-{size}elems-in_place",
           "reduce": f"again-reduce-int32-sum-{size}elems-out_of_place"}

    def body(c: ItemChecker) -> None:
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        root = n - 1
        x, out = xp.zeros(n * size, "float32"), xp.zeros(n * size, "float32")
        mine, block = xp.zeros(size, "float32"), xp.zeros(size, "int32")
        gathered, reduced = xp.zeros((n, size), "int32"), xp.zeros(size, "int32")
        for call in range(4):
            seed = 12000 + 10 * call + size
            ins = c.inputs("float32", (n * size,), seed)
            x[...] = dev(c, ins[rank])
            op = "max" if call == 3 else "sum"  # the same arrays, another op: a new call
            generation = comm._path.generation
            if call == 1:  # a call that comes again (call 0's), after every rank forgot its
                # prepared calls at once (as its bounds make it)
                with c.into(ids["prepared"]):
                    c.check(comm._last_calls.find("all_reduce", x, out, (op, None, None, None))
                            is not None, "call 0 was not kept")
                comm._path._forget_prepared()
            with c.into(ids["new_op" if call == 3 else "all_reduce"]):
                got = comm.all_reduce(x, op=op, out=out)
                c.check(got is out, "all_reduce(out=out) is not out")
                kept = comm._last_calls.find("all_reduce", x, out, (op, None, None, None))
                c.check(kept is not None, f"call {call} was not kept")
                c.expect(out, c.reduce_reference(ins, op), f"all_reduce call {call}")
            if call == 1 and kept is not None:  # prepared anew, and kept so for the next call
                with c.into(ids["prepared"]):
                    c.check(kept.generation == generation + 1,
                            f"generation {kept.generation}, was {generation}")
                    c.check(kept.prepared is comm._path.prepared.get(kept.known_key),
                            "the call kept is not the one prepared anew")
            if call == 1:  # in place: a call of its own
                with c.into(ids["in_place"]):
                    comm.all_reduce(x, out=x)
                    c.expect(x, c.reduce_reference(ins, "sum"), "in place")
                x[...] = dev(c, ins[rank])
            with c.into(ids["reduce_scatter"]):
                comm.reduce_scatter(x, out=mine)
                c.expect(mine, c.reduce_reference(ins, "sum").reshape(n, -1)[rank],
                         f"reduce_scatter call {call}", shared=False)
            blocks = c.inputs("int32", (size,), seed + 1)
            block[...] = dev(c, blocks[rank])
            with c.into(ids["all_gather"]):
                comm.all_gather(block, out=gathered)
                c.expect(gathered, np.stack(blocks), f"all_gather call {call}", copy=True)
            block[...] = dev(c, blocks[rank])
            with c.into(ids["broadcast"]):
                comm.broadcast(block, root=root)
                c.expect(block, blocks[root], f"broadcast call {call}", copy=True)
            block[...] = dev(c, blocks[rank])
            with c.into(ids["reduce"]):
                result = comm.reduce(block, root=root, out=reduced)
                if rank == root:
                    c.expect(result, c.reduce_reference(blocks, "sum"), f"reduce call {call}",
                             shared=False)
                else:
                    c.check(result is None, "reduce returned an array off the root")

    return Item(tuple(ids.values()), body)


def _again_op_changed(c: ItemChecker) -> None:
    comm, rank, xp = c.comm, c.comm.rank, c.xp
    x = xp.ones(8, "float32")
    comm.all_reduce(x, out=x)
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()
    try:  # rank 1 changes the op on the same arrays: the others run the call agreed before
        comm.all_reduce(x, op="max" if rank == 1 else "sum", out=x)
        if xp is not np:
            comm.synchronize()
    except gpuring.CollectiveMismatchError as exc:
        if "op" in exc.differences:  # across nodes the ranks agree at every call
            c.check(exc.differences["op"][1] == "max", f"differences {exc.differences}")
            return
        c.check("called all_reduce(shape=(8,), dtype=float32, op=max" in str(exc), str(exc))
        c.check("rank 0 went ahead with all_reduce(shape=(8,), dtype=float32, op=sum"
                in str(exc), str(exc))
    else:
        c.check(False, "no CollectiveMismatchError for another op on the same arrays")


FAMILIES = {"dtypes_ops": dtypes_ops, "sizes": sizes, "back_to_back": back_to_back,
            "deterministic": deterministic, "two_shot": two_shot, "again": again}
