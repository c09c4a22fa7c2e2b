"""Runs as every rank of a multi-process test: `worker.py CASE OUTDIR [device]`.

Each rank rebuilds every rank's input from a shared seed, so it checks its results against a
float64 or exact-integer reference by itself. It also writes a digest of every result to
OUTDIR/CASE-RANK.txt; the test compares those files across ranks (bitwise identity).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import os
import sys
import warnings

import numpy as np

import gpuring

INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOATS = ["float16", "float32", "float64"]
# bfloat16 arrays come from ml_dtypes, imported by `Checker.inputs` only for a bfloat16 case
# (the import costs a rank about a second)
if importlib.util.find_spec("ml_dtypes") is not None:
    FLOATS.insert(1, "bfloat16")
COMPLEX = ["complex64", "complex128"]
DTYPES = INTS + FLOATS + COMPLEX
OPS = ["sum", "prod", "min", "max", "avg"]


#: unit roundoff of each float dtype (of the real parts for complex)
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24,
                 "float64": 2.0 ** -53, "complex64": 2.0 ** -24, "complex128": 2.0 ** -53}
#: spacing of the subnormals: the most one rounding can lose near zero, whatever the value
SUBNORMAL = {"float16": 2.0 ** -24, "bfloat16": 2.0 ** -133, "float32": 2.0 ** -149,
             "float64": 2.0 ** -1074, "complex64": 2.0 ** -149, "complex128": 2.0 ** -1074}


@dataclasses.dataclass(frozen=True)
class Reference:
    """The exact result of a reduction (`value`, float64/complex128 for floats), the error
    allowed on each element (`bound`) and the dtype of the result."""

    value: np.ndarray
    bound: np.ndarray
    dtype: np.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    def reshape(self, *shape: int) -> Reference:
        return Reference(self.value.reshape(*shape), self.bound.reshape(*shape), self.dtype)

    def __getitem__(self, key) -> Reference:
        return Reference(self.value[key], self.bound[key], self.dtype)


def rounding_bound(arrays: list[np.ndarray], op: str) -> np.ndarray:
    """Per element, the most by which a float reduction of `arrays` (one per rank) may differ
    from reduce_reference's value, from the rounding model: every step rounds once, with unit
    roundoff u (float16 and bfloat16: reduced in float32, then rounded to 16 bits, so u is
    that of both roundings together), in whatever order the algorithm takes (a ring's chain, the
    one-shot's rank order, MPI's tree). n ranks take n-1 steps.

    - sum: step k rounds a partial sum of k+1 of the ranks' values, at most the sum of the k+1
      largest |x_r| (M_{k+1}); rounding errors grow the partials by at most (1+u)^n. So the
      error is at most u·(1+u)^n·(M_2 + ... + M_n).
    - avg: that sum's error over n, plus two more roundings of the quotient (the division, and
      the cast to 16 bits; or the reciprocal and the product): 2·u·(1+u)^n·M_n/n.
    - prod: each step multiplies the result by at most (1+c·u) (c = 1; complex: c = sqrt(5),
      the bound of a complex product): ((1+c·u)^(n-1) - 1)·prod|x_r|.
    - min, max: no rounding at all, 0.

    Values that reach the subnormals lose up to the subnormal spacing per rounding, absolutely.
    The reference, computed in float64 in rank order, has an error of its own, bounded the
    same way with float64's u; both are added."""
    dtype = arrays[0].dtype
    n = len(arrays)
    bound = np.zeros(arrays[0].shape)
    if op in ("min", "max") or dtype.kind in "iu" or bound.size == 0:
        return bound
    u = UNIT_ROUNDOFF[dtype.name]
    if dtype.name in ("float16", "bfloat16"):
        u = (1 + u) * (1 + UNIT_ROUNDOFF["float32"]) - 1
    c = np.sqrt(5.0) if dtype.kind == "c" else 1.0
    flat = [a.reshape(-1) for a in arrays]
    out = bound.reshape(-1)
    for lo in range(0, out.size, 1 << 20):  # in pieces: a 64 MiB result needs no more memory
        mags = np.stack([np.abs(a[lo:lo + (1 << 20)].astype(
            np.complex128 if dtype.kind == "c" else np.float64)) for a in flat])
        piece = out[lo:lo + mags.shape[1]]
        for step_u in (u, UNIT_ROUNDOFF["float64"]):  # the library's, then the reference's
            grow = (1 + step_u) ** n
            if op == "prod":
                growth = np.expm1((n - 1) * np.log1p(c * step_u))  # (1+c·u)^(n-1) - 1
                piece += growth * np.prod(mags, axis=0)
                continue
            mags.sort(axis=0)  # ascending: M_j sums the last j rows
            largest = np.cumsum(mags[::-1], axis=0)
            partials = largest[1:].sum(axis=0)  # M_2 + ... + M_n
            if op == "avg":
                piece += step_u * grow * (partials + 2 * largest[-1]) / n
            else:
                piece += step_u * grow * partials
        spread = np.maximum(mags.max(axis=0), 1.0) ** n if op == "prod" else 1.0
        piece += (n + 1) * SUBNORMAL[dtype.name] * spread
    return bound


class Checker:
    def __init__(self, comm: gpuring.Communicator, case: str, outdir: str, xp=np):
        self.comm = comm
        self.xp = xp
        self.uses_other_gpus = False  # the case itself makes another GPU current
        self.digests: list[str] = []
        self.path = os.path.join(outdir, f"{case}-{comm.rank}.txt")
        self.checked = 0

    def inputs(self, dtype: str, shape: tuple[int, ...], seed: int, op: str = "sum"):
        """Every rank's input (list indexed by rank), random and never all zeros."""
        if dtype == "bfloat16":
            import ml_dtypes  # noqa: F401 - gives NumPy the bfloat16 dtype
        out = []
        for r in range(self.comm.size):
            rng = np.random.default_rng([seed, r])
            if dtype in INTS:
                info = np.iinfo(dtype)
                hi = 4 if op == "prod" else min(info.max, 1 << 20)
                lo = -hi if info.min < 0 else 0
                a = rng.integers(lo, hi, size=shape, endpoint=True).astype(dtype)
            elif dtype in COMPLEX:
                a = (rng.uniform(-1, 1, shape) + 1j * rng.uniform(-1, 1, shape)).astype(dtype)
            else:
                lo, hi = (0.5, 1.5) if op == "prod" else (-2, 2)
                a = rng.uniform(lo, hi, shape).astype(dtype)
            out.append(a)
        return out

    def reduce_reference(self, arrays: list[np.ndarray], op: str) -> Reference:
        """The reduction of every rank's array (list indexed by rank): its exact value for
        integers (avg rounded toward zero), and for floats its float64/complex128 value with
        the error the library may make on each element (see `rounding_bound`)."""
        dtype = arrays[0].dtype
        exact = dtype.kind in "iu"
        wide = [a if exact else a.astype(np.complex128 if dtype.kind == "c" else np.float64)
                for a in arrays]
        acc = wide[0].copy()
        for a in wide[1:]:
            if op in ("sum", "avg"):
                acc = acc + a
            elif op == "prod":
                acc = acc * a
            elif op == "min":
                acc = np.minimum(acc, a)
            else:
                acc = np.maximum(acc, a)
        if op == "avg":
            n = len(arrays)
            if exact:
                q = np.abs(acc.astype(np.int64) if dtype.kind == "i" else acc) // n
                acc = (np.sign(acc) * q).astype(dtype) if dtype.kind == "i" else q.astype(dtype)
            else:
                acc = acc / n
        if exact:
            return Reference(acc.astype(dtype), np.zeros(acc.shape), dtype)
        return Reference(acc, rounding_bound(arrays, op), dtype)

    def expect(self, got, want: np.ndarray | Reference, what: str, *, copy: bool = False,
               shared: bool = True) -> None:
        """Compare a result with what it must be: a Reference (a reduction) within its
        per-element rounding bound (exactly for integers, min and max), a plain array
        (a copy of inputs, `copy`, or any exact value) bit for bit; the dtype must match.
        Results every rank holds (`shared`) go into the digest file."""
        got = host(got)
        assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
        if isinstance(want, Reference):
            assert not copy, f"{what}: a copy is compared with a plain array"
            assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
            if got.dtype.kind in "iu":
                assert np.array_equal(got, want.value), f"{what}: wrong values"
            else:
                err = np.abs(got.astype(want.value.dtype) - want.value)
                bad = ~(err <= want.bound)  # NaN too
                assert not bad.any(), (
                    f"{what}: {int(bad.sum())} of {got.size} elements beyond the rounding "
                    f"bound, first at {np.argwhere(bad)[0].tolist()}: got "
                    f"{got[bad][0]!r}, exact {want.value[bad][0]!r}, error "
                    f"{err[bad][0]:.3g} > bound {want.bound[bad][0]:.3g}")
        else:
            assert got.dtype == want.dtype, f"{what}: dtype {got.dtype} != {want.dtype}"
            if not np.array_equal(got, want):
                flat_got, flat_want = got.reshape(-1), np.asarray(want).reshape(-1)
                first = int(np.argmax(flat_got != flat_want))
                raise AssertionError(f"{what}: wrong values, first at element {first}: got "
                                     f"{flat_got[first]!r}, want {flat_want[first]!r}")
        if shared:
            self.digests.append(f"{what} {hashlib.sha256(got.tobytes()).hexdigest()}")
        self.checked += 1

    def finish(self) -> None:
        with open(self.path, "w") as f:
            f.write("\n".join(self.digests) + "\n")


def host(x) -> np.ndarray:
    """A NumPy copy of a result (CuPy arrays come back from the GPU)."""
    return x.get() if hasattr(x, "get") else np.asarray(x)


def dev(c: Checker, a: np.ndarray):
    return c.xp.asarray(a)


def case_uneven_close(c: Checker) -> None:
    """The last rank is slow to close: the others must not free their buffers while it still
    maps them (its peers wait for it at close)."""
    import time

    comm = c.comm
    ins = c.inputs("float32", (5000,), 900)
    c.expect(comm.all_reduce(dev(c, ins[comm.rank])), c.reduce_reference(ins, "sum"),
             "before an uneven close")
    comm.synchronize()
    if comm.rank == comm.size - 1:
        time.sleep(1.0)


def case_dtypes_ops(c: Checker, dtypes: tuple[str, ...] | None = None) -> None:
    """Every dtype (or those of `dtypes`) and op, all_reduce in and out of place, plus
    reduce_scatter and reduce."""
    n, comm = c.comm.size, c.comm
    seed = 1
    for dtype in dtypes or DTYPES:
        for op in OPS:
            if dtype in COMPLEX and op in ("min", "max"):
                continue
            seed += 1
            count = 3 * n * 5 + 1
            ins = c.inputs(dtype, (count,), seed, op)
            want = c.reduce_reference(ins, op)
            c.expect(comm.all_reduce(dev(c, ins[comm.rank]), op=op), want,
                     f"all_reduce {dtype} {op}")
            x = dev(c, ins[comm.rank].copy())
            res = comm.all_reduce(x, op=op, out=x)
            assert res is x
            c.expect(x, want, f"all_reduce in place {dtype} {op}")
            big = c.inputs(dtype, (n * 37,), seed + 1000, op)
            full = c.reduce_reference(big, op)
            c.expect(comm.reduce_scatter(dev(c, big[comm.rank]), op=op),
                     full.reshape(n, -1)[comm.rank], f"reduce_scatter {dtype} {op}", shared=False)
            root = seed % n
            got = comm.reduce(dev(c, ins[comm.rank]), op=op, root=root)
            if comm.rank == root:
                c.expect(got, want, f"reduce {dtype} {op} root {root}", shared=False)
            else:
                assert got is None
        ins = c.inputs(dtype, (5, 3), seed + 2000)
        c.expect(comm.all_gather(dev(c, ins[comm.rank])), np.stack(ins), f"all_gather {dtype}",
                 copy=True)
        root = (seed + 1) % n
        x = dev(c, ins[comm.rank].copy())
        assert comm.broadcast(x, root=root) is x
        c.expect(x, ins[root], f"broadcast {dtype} root {root}", copy=True)


def case_sizes(c: Checker) -> None:
    """Odd sizes (0, 1, n-1, primes), shapes, channels and small pieces, one 24 MiB array."""
    comm, n = c.comm, c.comm.size
    seed = 100
    sizes = sorted({0, 1, max(n - 1, 0), 2, 7, 31, 1031, 65537, 262147})
    for size in sizes:
        for channels, chunk in ((1, None), (3, 4096)):
            seed += 1
            kw = {"channels": channels, "chunk_bytes": chunk}
            ins = c.inputs("float32", (size,), seed)
            want = c.reduce_reference(ins, "sum")
            c.expect(comm.all_reduce(dev(c, ins[comm.rank]), **kw), want,
                     f"all_reduce {size} ch{channels}")
            gathered = comm.all_gather(dev(c, ins[comm.rank]), **kw)
            c.expect(gathered, np.stack(ins), f"all_gather {size} ch{channels}", copy=True)
            x = dev(c, ins[comm.rank].copy())
            c.expect(comm.broadcast(x, root=n - 1, **kw), ins[n - 1], f"broadcast {size}",
                     copy=True)
            got = comm.reduce(dev(c, ins[comm.rank]), root=0, **kw)
            if comm.rank == 0:
                c.expect(got, want, f"reduce {size} ch{channels}", shared=False)
            rs_in = c.inputs("int32", (size * n,), seed)
            rs_want = c.reduce_reference(rs_in, "sum").reshape(n, -1)[comm.rank]
            c.expect(comm.reduce_scatter(dev(c, rs_in[comm.rank]), **kw), rs_want,
                     f"reduce_scatter {size} ch{channels}", shared=False)
            # the in-place forms of all_gather and reduce_scatter, broadcast out of place
            slots = dev(c, np.full((n, size), -1.0, np.float32))
            slots[comm.rank] = dev(c, ins[comm.rank])
            got = comm.all_gather(slots[comm.rank], out=slots, **kw)
            assert got is slots
            c.expect(slots, np.stack(ins), f"all_gather in place {size} ch{channels}",
                     copy=True)
            rs_x = dev(c, rs_in[comm.rank].copy())
            mine = rs_x.reshape(n, size)[comm.rank]
            assert comm.reduce_scatter(rs_x, out=mine, **kw) is mine
            c.expect(mine, rs_want, f"reduce_scatter in place {size} ch{channels}",
                     shared=False)
            source = dev(c, ins[comm.rank])
            dest = dev(c, np.full(size, -1.0, np.float32))
            assert comm.broadcast(source, root=n - 1, out=dest, **kw) is dest
            c.expect(dest, ins[n - 1], f"broadcast out of place {size}", copy=True)
            c.expect(source, ins[comm.rank], f"broadcast leaves x {size}", copy=True,
                     shared=False)
    ins = c.inputs("int64", (4, 0, 3), seed + 1)
    c.expect(comm.all_reduce(dev(c, ins[comm.rank])), c.reduce_reference(ins, "sum"), "empty 3d")
    ins = c.inputs("float64", (6, 5, 4), seed + 2)
    c.expect(comm.all_reduce(dev(c, ins[comm.rank]), op="max"),
             c.reduce_reference(ins, "max"), "3d max")
    # non-contiguous input works through a copy
    ins = c.inputs("float32", (10, 8), seed + 3)
    c.expect(comm.all_reduce(dev(c, ins[comm.rank])[:, ::2]),
             c.reduce_reference([a[:, ::2] for a in ins], "sum"), "strided input")
    # one array of 24 MiB: more than a buffer region on the CPU (16 MiB)
    ins = c.inputs("float32", (6 << 20,), seed + 4)
    c.expect(comm.all_reduce(dev(c, ins[comm.rank])), c.reduce_reference(ins, "sum"), "24 MiB")


def rank_order_fold(ins: list[np.ndarray], op: str) -> np.ndarray:
    """ins[0] op ins[1] op ... in rank order, each step rounded to the dtype (16-bit floats
    computed in float32), avg dividing at the last step (16-bit floats: the float32 sum,
    rounded once after the division; other floats: the sum rounded, then divided): the bits
    of the one-kernel all_reduce and of deterministic mode (sum, avg, prod, min and max of
    real float dtypes)."""
    fold = ins[0].copy()
    for k, a in enumerate(ins[1:], 2):
        if op in ("max", "min"):
            fold = np.maximum(fold, a) if op == "max" else np.minimum(fold, a)
            continue
        half = a.dtype.name in ("float16", "bfloat16")  # (bfloat16's kind is "V")
        wide = np.float32 if half else a.dtype
        step = np.multiply(fold.astype(wide), a.astype(wide)) if op == "prod" else (
            np.add(fold.astype(wide), a.astype(wide)))
        if op == "avg" and k == len(ins):
            if not half:
                step = step.astype(a.dtype)
            step = step / (np.float32 if half or a.dtype == np.float32 else a.dtype.type)(
                len(ins))
        fold = step.astype(a.dtype)
    return fold


def deterministic_fold(c: Checker, ins: list[np.ndarray], op: str) -> np.ndarray:
    """The bits of deterministic mode: the rank-order fold on one node; across nodes (where
    collectives run in two levels) the node-major fold: each node's ranks folded in rank
    order, those folded in node order, avg dividing the sum at the end (16-bit floats in
    float32, rounded once)."""
    nodes = c.comm._control.nodes
    order = list(dict.fromkeys(nodes))
    if c.comm._path.layout is None:
        return rank_order_fold(ins, op)
    step = "sum" if op == "avg" else op
    folded = rank_order_fold([rank_order_fold([ins[r] for r in range(len(nodes))
                                               if nodes[r] == node], step)
                              for node in order], step)
    if op != "avg":
        return folded
    if folded.dtype.name in ("float16", "bfloat16"):
        return (folded.astype(np.float32) / np.float32(len(nodes))).astype(folded.dtype)
    return folded / folded.dtype.type(len(nodes))


def case_deterministic(c: Checker) -> None:
    """Deterministic mode (GPURING_DETERMINISTIC=1, with small buffers): every all_reduce,
    reduce_scatter, reduce and all_reduce_many result is the rank-order fold bit for bit,
    whatever the size (one-shot or one operation, one round, several rounds), chunk_bytes,
    channels and fusion; the ring is refused, and the communicator goes on."""
    from gpuring import GpuringError

    comm, n, rank = c.comm, c.comm.size, c.comm.rank
    assert comm.config.deterministic
    root = n - 1
    cases = [("float32", "sum"), ("float16", "sum"), ("float64", "avg"), ("float32", "prod"),
             ("float32", "max"), ("int32", "min")]
    if "bfloat16" in FLOATS:
        cases.append(("bfloat16", "avg"))
    tunings = [(None, None), (4096, 1), (1 << 14, 3)]
    seed = 15000
    for size in (7, 3000, 40000):  # 40000 per rank: several rounds of a 256K buffer
        for (dtype, op), (chunk, channels) in zip(
                cases, tunings * len(cases), strict=False):
            seed += 1
            ins = c.inputs(dtype, (n * size,), seed, op)
            label = f"deterministic {dtype} {op} {n * size} chunk {chunk} channels {channels}"
            got = comm.all_reduce(dev(c, ins[rank]), op=op, chunk_bytes=chunk,
                                  channels=channels)
            c.expect(got, deterministic_fold(c, ins, op), f"{label} all_reduce", copy=True)
            got = comm.reduce_scatter(dev(c, ins[rank]), op=op, chunk_bytes=chunk,
                                      channels=channels)
            c.expect(got, deterministic_fold(c, [a.reshape(n, -1)[rank] for a in ins], op),
                     f"{label} reduce_scatter", copy=True, shared=False)
            got = comm.reduce(dev(c, ins[rank]), op=op, root=root, chunk_bytes=chunk,
                              channels=channels)
            if rank == root:
                c.expect(got, deterministic_fold(c, ins, op), f"{label} reduce", copy=True,
                         shared=False)
    arrays = [c.inputs("float32", shape, 15500 + i) for i, shape in
              enumerate([(33,), (100, 7), (5,), (4000,)])]
    for fusion in (1 << 10, 1 << 20):  # alone, then packed together
        got = comm.all_reduce_many([dev(c, a[rank]) for a in arrays], fusion_bytes=fusion)
        for i, (g, a) in enumerate(zip(got, arrays, strict=True)):
            c.expect(g, deterministic_fold(c, a, "sum"), f"deterministic fused {fusion} {i}",
                     copy=True)
    try:  # every rank asks for the ring: refused on every rank, once agreed
        comm.all_reduce(dev(c, np.ones(3000, np.float32)), algorithm="ring")
    except GpuringError as exc:
        assert "deterministic" in str(exc), str(exc)
    else:
        raise AssertionError("the ring ran in deterministic mode")
    try:  # only rank 0 asks for it: a mismatch, on every rank
        comm.all_reduce(dev(c, np.ones(3000, np.float32)),
                        algorithm="ring" if rank == 0 else None)
    except gpuring.CollectiveMismatchError as exc:
        assert "algorithm" in exc.differences, exc.differences
    else:
        raise AssertionError("ranks ran different schedules in deterministic mode")
    ins = c.inputs("float32", (5000,), 15900)
    c.expect(comm.all_reduce(dev(c, ins[rank]), algorithm="two_shot"),
             deterministic_fold(c, ins, "sum"), "deterministic after the refusal", copy=True)


def case_two_shot(c: Checker) -> None:
    """algorithm="two_shot" (and "one_shot") asked per call, without deterministic mode: the
    rank-order fold's bits too; "ring" as asked; a wrong name refused; "direct", the former
    name, runs the two-shot schedule with a DeprecationWarning, and a rank passing it agrees
    with ranks passing "two_shot"."""
    comm, n, rank = c.comm, c.comm.size, c.comm.rank
    seed = 16000
    for size in (10, 5000, 100000):
        for algorithm in ("two_shot", "one_shot", "ring"):
            seed += 1
            ins = c.inputs("float32", (n * size,), seed)
            got = comm.all_reduce(dev(c, ins[rank]), algorithm=algorithm, chunk_bytes=8192,
                                  channels=2)
            label = f"{algorithm} all_reduce {n * size}"
            if algorithm == "ring":
                c.expect(got, c.reduce_reference(ins, "sum"), label)
            else:
                c.expect(got, rank_order_fold(ins, "sum"), label, copy=True)
        ins = c.inputs("float64", (n * size,), seed + 500, "prod")
        got = comm.reduce_scatter(dev(c, ins[rank]), op="prod", algorithm="two_shot")
        c.expect(got, rank_order_fold([a.reshape(n, -1)[rank] for a in ins], "prod"),
                 f"two_shot reduce_scatter {size}", copy=True, shared=False)
    ins = c.inputs("float32", (n * 5000,), seed + 1000)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = comm.all_reduce(dev(c, ins[rank]), algorithm="direct" if rank == 0 else "two_shot")
    c.expect(got, rank_order_fold(ins, "sum"), "'direct' beside 'two_shot'", copy=True)
    former = [w for w in caught if issubclass(w.category, DeprecationWarning)
              and "'two_shot'" in str(w.message)]
    assert len(former) == (rank == 0), [str(w.message) for w in caught]
    if c.xp is np:  # (a small one on the GPU runs as one operation)
        assert comm.last_schedule == "two_shot", comm.last_schedule
    try:
        comm.reduce_scatter(dev(c, np.ones(n, np.float32)), algorithm="one_shot")
    except ValueError as exc:
        assert "algorithm must be one of" in str(exc), str(exc)
    else:
        raise AssertionError("reduce_scatter took algorithm='one_shot'")


def case_graph_capture(c: Checker) -> None:
    """Collectives captured into a CUDA graph (CuPy stream capture) and replayed: each replay
    works on what the input buffers hold then (the bits of the rank-order fold), several
    replays with fresh inputs; all_reduce from a few elements to 4 MiB, out of place and in
    place; reduce_scatter, all_gather, broadcast, reduce (those out of place and in place),
    gather and scatter (root 0, the others' root the last rank) and all_to_all, small and in
    pieces. Those that run in rounds outside a graph run as one kernel per piece in it. An
    empty collective records nothing. A first call during a capture, a barrier and an
    uneven form are refused without harm to the capture or the communicator. Needs
    GPURING_CUDA_FUSED=kernel (GPURING_FUSED_BYTES and GPURING_CUDA_GRAPH_PIECE_BYTES as
    the test sets them)."""
    from gpuring import GpuringError

    comm, xp, n, rank = c.comm, c.xp, c.comm.size, c.comm.rank
    root = n - 1
    stream = xp.cuda.Stream(non_blocking=True)
    shapes = [(5, "float32", "sum"), (3000, "int32", "max"), (20000, "float32", "avg"),
              (1 << 18, "float32", "sum"),  # 1 MiB
              ((1 << 20) + 5, "float32", "sum")]  # 4 MiB and a ragged piece: in rounds
    bufs = [(xp.zeros(size, dtype), xp.zeros(size, dtype)) for size, dtype, _ in shapes]
    big = xp.zeros(300_001, "float32")  # in place, in pieces
    # (per-rank block, dtype) of each of the others, small and in pieces
    others = [(700, "float32"), (300_001 if n == 2 else 150_001, "float32")]
    rs = [(xp.zeros(n * m, dt), xp.zeros(m, dt)) for m, dt in others]
    ag = [(xp.zeros(m, "int32"), xp.zeros((n, m), "int32")) for m, _ in others]
    bc = [(xp.zeros(m, "float64"), xp.zeros(m, "float64")) for m, _ in others]
    rd = [(xp.zeros(m, dt), xp.zeros(m, dt)) for m, dt in others]
    rs_place = [xp.zeros(n * m, "float32") for m in (64, others[1][0] + 2)]  # into its block
    ga = [(xp.zeros(m, "float32"), xp.zeros((n, m), "float32")) for m in (700, 300_001)]
    sc = [(xp.zeros((n, m), dt), xp.zeros(m, dt)) for m, dt in others]
    a2a = [(xp.zeros((n, m), "int32"), xp.zeros((n, m), "int32")) for m, _ in others]
    empty = (xp.zeros((n, 0), "float32"), xp.zeros((n, 0), "float32"))  # nothing to record

    def family() -> None:  # every call of the graph beside the all_reduces
        for (ri, ro), (gi, go), (bi, bo), (di, do) in zip(rs, ag, bc, rd, strict=True):
            comm.reduce_scatter(ri, out=ro)
            comm.all_gather(gi, out=go)
            comm.broadcast(bi, root=root, out=bo)
            comm.reduce(di, root=root, out=do if rank == root else None)
            comm.all_gather(go[rank], out=go)  # in place: its block already there
        for place in rs_place:
            comm.reduce_scatter(place, out=place.reshape(n, -1)[rank])
        for (gi, go), (si, so), (ai, ao) in zip(ga, sc, a2a, strict=True):
            assert comm.gather(gi, root=0, out=go if rank == 0 else None) is (
                go if rank == 0 else None)
            comm.scatter(si, root=0, out=so)
            comm.all_to_all(ai, out=ao)
        comm.all_reduce(big, out=big)

    with stream:
        for (_, _, op), (x, out) in zip(shapes, bufs, strict=True):  # warm-up, uncaptured
            comm.all_reduce(x, op=op, out=out)
        comm.all_reduce(bufs[0][0], out=bufs[0][0])
        comm.all_to_all(empty[0], out=empty[1])
        family()
        stream.synchronize()
        refused, schedules = [], []
        graphs = []  # CuPy's default capture mode (relaxed), then torch.cuda.graph's own
        for mode in (None, xp.cuda.runtime.streamCaptureModeThreadLocal):
            stream.begin_capture(mode)
            assert comm.all_to_all(empty[0], out=empty[1]) is empty[1]
            schedules.append(comm.last_schedule)
            for attempt in (lambda: comm.broadcast(bufs[1][0], root=0),  # never called
                            comm.barrier,
                            lambda: comm.all_gather_v(bufs[2][0])):  # shapes on the host
                try:
                    attempt()
                except GpuringError as exc:
                    refused.append(str(exc))
            for (_, _, op), (x, out) in zip(shapes, bufs, strict=True):
                comm.all_reduce(x, op=op, out=out)
                schedules.append(comm.last_schedule)
            comm.all_reduce(bufs[0][0], out=bufs[0][0])  # after the first read it
            family()
            graphs.append(stream.end_capture())
    assert len(refused) == 6, refused
    for mode in (0, 3):  # each capture's refusals
        assert "outside the capture first" in refused[mode], refused
        assert "barrier cannot be captured" in refused[mode + 1], refused
        assert "all_gather_v cannot be captured" in refused[mode + 2], refused
    assert schedules.pop(0) == "nothing", schedules
    one_shot = gpuring.settings.get("GPURING_FUSED_BYTES")
    assert schedules[:5] == [
        "fused" if size * np.dtype(dtype).itemsize <= one_shot else "kernels"
        for size, dtype, _ in shapes], schedules
    for replay in range(3):  # each graph, then the first again
        folds = []
        seed = 9500 + 40 * replay
        with stream:
            for i, ((size, dtype, op), (x, _)) in enumerate(zip(shapes, bufs, strict=True)):
                ins = c.inputs(dtype, (size,), seed + i)
                x[...] = dev(c, ins[rank])
                folds.append(rank_order_fold(ins, op))
            want = []  # per shape of `others`: reduce_scatter, all_gather, broadcast, reduce
            for k, ((m, dt), (ri, _), (gi, _), (bi, _), (di, _)) in enumerate(
                    zip(others, rs, ag, bc, rd, strict=True)):
                at = seed + 10 + 5 * k
                rss, ags = c.inputs(dt, (n * m,), at), c.inputs("int32", (m,), at + 1)
                bcs, rds = c.inputs("float64", (m,), at + 2), c.inputs(dt, (m,), at + 3)
                ri[...], gi[...] = dev(c, rss[rank]), dev(c, ags[rank])
                bi[...], di[...] = dev(c, bcs[rank]), dev(c, rds[rank])
                want.append((rank_order_fold([a.reshape(n, -1)[rank] for a in rss], "sum"),
                             np.stack(ags), bcs[root], rank_order_fold(rds, "sum")))
            places = []
            for k, place in enumerate(rs_place):
                rps = c.inputs("float32", (place.size,), seed + 30 + k)
                place[...] = dev(c, rps[rank])
                places.append(rank_order_fold([a.reshape(n, -1)[rank] for a in rps], "sum"))
            bigs = c.inputs("float32", (big.size,), seed + 35)
            big[...] = dev(c, bigs[rank])
            moved = []  # per shape of `others`: gather, scatter, all_to_all
            for k, ((m, dt), (gi, _), (si, _), (ai, _)) in enumerate(
                    zip(others, ga, sc, a2a, strict=True)):
                at = seed + 40 + 3 * k
                gas = c.inputs("float32", gi.shape, at)
                scs, a2as = c.inputs(dt, (n, m), at + 1), c.inputs("int32", (n, m), at + 2)
                gi[...], si[...], ai[...] = dev(c, gas[rank]), dev(c, scs[rank]), \
                    dev(c, a2as[rank])
                moved.append((np.stack(gas), scs[0][rank], np.stack([a[rank] for a in a2as])))
            graphs[replay % 2].launch(stream)
            stream.synchronize()
        for (size, dtype, op), (_, out), fold in zip(shapes, bufs, folds, strict=True):
            c.expect(out, fold, f"replay {replay} {dtype} {op} {size}", copy=True)
        c.expect(bufs[0][0], folds[0], f"replay {replay} in place", copy=True)
        c.expect(big, rank_order_fold(bigs, "sum"), f"replay {replay} in place, in pieces",
                 copy=True)
        for (m, _), (_, ro), (_, go), (_, bo), (_, do), (w_rs, w_ag, w_bc, w_rd) in zip(
                others, rs, ag, bc, rd, want, strict=True):
            c.expect(ro, w_rs, f"replay {replay} reduce_scatter {m}", copy=True, shared=False)
            c.expect(go, w_ag, f"replay {replay} all_gather {m}", copy=True)
            c.expect(bo, w_bc, f"replay {replay} broadcast {m}", copy=True)
            if rank == root:
                c.expect(do, w_rd, f"replay {replay} reduce {m}", copy=True, shared=False)
        for place, fold in zip(rs_place, places, strict=True):
            c.expect(place.reshape(n, -1)[rank], fold,
                     f"replay {replay} reduce_scatter in place {place.size}", copy=True,
                     shared=False)
        for (m, _), (_, go), (_, so), (_, ao), (w_ga, w_sc, w_a2a) in zip(
                others, ga, sc, a2a, moved, strict=True):
            if rank == 0:
                c.expect(go, w_ga, f"replay {replay} gather {go.shape}", copy=True,
                         shared=False)
            c.expect(so, w_sc, f"replay {replay} scatter {m}", copy=True, shared=False)
            c.expect(ao, w_a2a, f"replay {replay} all_to_all {m}", copy=True, shared=False)
    # eager calls go on, ordered after the replays (on the default stream: after `stream`)
    ins = c.inputs("float32", (5,), 9600)
    got = comm.all_reduce(dev(c, ins[rank]))
    c.expect(got, rank_order_fold(ins, "sum"), "eager after replays", copy=True)
    ins = c.inputs("float32", (300_001,), 9601)  # in rounds again
    got = comm.all_reduce(dev(c, ins[rank]))
    c.expect(got, c.reduce_reference(ins, "sum"), "eager in rounds after replays")


def case_graph_capture_shared(c: Checker) -> None:
    """Ranks that share a GPU with stream memory operations. GPURING_CUDA_FUSED=auto: their
    small all_reduces run with stream memory operations outside graphs, and a capture records
    the kernel form instead (small ones, larger ones in pieces, the other collectives),
    warning once per process that it spins; replays and eager calls of both forms then take
    turns, each with fresh inputs, and every result holds (the forms' counters, inboxes and
    slots are apart). GPURING_CUDA_FUSED=memops: a capture is refused, briefly, and the
    communicator goes on."""
    from gpuring import GpuringError

    comm, xp, n, rank = c.comm, c.xp, c.comm.size, c.comm.rank
    mode = os.environ["GPURING_CUDA_FUSED"]
    stream = xp.cuda.Stream(non_blocking=True)
    small, big = (xp.zeros(1000, "float32"), xp.zeros(1000, "float32")), \
        (xp.zeros(300_001, "float32"), xp.zeros(300_001, "float32"))
    gathered = (xp.zeros(700, "int32"), xp.zeros((n, 700), "int32"))
    eager = xp.zeros(3000, "float32")

    def calls() -> list[str]:  # what the graph holds, and each call's schedule
        schedules = []
        for x, out in (small, big):
            comm.all_reduce(x, out=out)
            schedules.append(comm.last_schedule)
        comm.all_gather(gathered[0], out=gathered[1])
        schedules.append(comm.last_schedule)
        return schedules

    def eager_call(seed: int) -> None:  # an all_reduce outside the graph, in the form it takes
        ins = c.inputs("float32", (eager.size,), seed)
        eager[...] = dev(c, ins[rank])
        comm.all_reduce(eager, out=eager)
        assert comm.last_schedule == "fused", comm.last_schedule
        c.expect(eager, rank_order_fold(ins, "sum"), f"eager {seed}", copy=True)

    with stream:
        assert calls()[0] == "fused", comm.last_schedule
        eager_call(9700)
        stream.synchronize()
        if mode == "memops":
            stream.begin_capture()
            try:
                comm.all_reduce(small[0], out=small[1])
            except GpuringError as exc:
                text = str(exc)
            else:
                raise AssertionError("a capture in the memops form was not refused")
            finally:
                stream.end_capture()
            assert "GPURING_CUDA_FUSED auto or kernel" in text and len(text) < 250, text
            eager_call(9701)
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            graphs = []
            for _ in range(2):  # two graphs: one warning
                stream.begin_capture()
                assert calls() == ["kernels"] * 3, comm.last_schedule
                graphs.append(stream.end_capture())
        spins = [str(w.message) for w in caught if "captured into a CUDA graph" in
                 str(w.message)]
        assert len(spins) == 1 and "MPS" in spins[0] and "spin" in spins[0] and \
            "GPURING_CUDA_FUSED=kernel" in spins[0], [str(w.message) for w in caught]
        for replay in range(4):  # each graph, eager calls between them
            seed = 9710 + 10 * replay
            smalls, bigs = c.inputs("float32", (1000,), seed), \
                c.inputs("float32", (300_001,), seed + 1)
            gathers = c.inputs("int32", (700,), seed + 2)
            small[0][...], big[0][...] = dev(c, smalls[rank]), dev(c, bigs[rank])
            gathered[0][...] = dev(c, gathers[rank])
            graphs[replay % 2].launch(stream)
            stream.synchronize()
            c.expect(small[1], rank_order_fold(smalls, "sum"), f"replay {replay} small",
                     copy=True)
            c.expect(big[1], rank_order_fold(bigs, "sum"), f"replay {replay} in pieces",
                     copy=True)
            c.expect(gathered[1], np.stack(gathers), f"replay {replay} all_gather", copy=True)
            eager_call(seed + 3)
            eager_call(seed + 4)
    ins = c.inputs("float32", (300_001,), 9800)  # in rounds after the replays
    c.expect(comm.all_reduce(dev(c, ins[rank])), c.reduce_reference(ins, "sum"),
             "eager in rounds after replays")


def case_one_kernel(c: Checker) -> None:
    """Small all_reduces on CuPy arrays, which run as one operation on the caller's stream
    unless GPURING_CUDA_FUSED is off (one kernel, or stream memory operations where ranks
    share a GPU): the bits of the rank-order fold, from one element to 64 KiB, several calls
    with fresh inputs, out of place and in place, on the default stream and on another,
    between collectives that run in rounds on the engine's streams; at most 4 driver calls
    each where fused (one more where the stream changed), more where not."""
    comm, n, xp = c.comm, c.comm.size, c.xp
    fused = os.environ.get("GPURING_CUDA_FUSED", "auto") != "off"
    other = xp.cuda.Stream(non_blocking=True)
    seed = 9000
    for size in (1, 3, 17, 1000, 4099, 16384):  # 16384 float32: 64 KiB
        for dtype, op in (("float32", "sum"), ("int32", "max"), ("float32", "avg"),
                          ("float16", "sum")):
            seed += 1
            ins = c.inputs(dtype, (size,), seed)
            fold = rank_order_fold(ins, op)
            if seed % 2:
                with other:  # the input arrives on `other` too
                    x = dev(c, ins[c.comm.rank])
                    calls = comm.device_operations
                    got = comm.all_reduce(x, op=op, out=x)
                    assert got is x
                    other.synchronize()
            else:
                x = dev(c, ins[c.comm.rank])
                calls = comm.device_operations
                got = comm.all_reduce(x, op=op)
            calls = comm.device_operations - calls
            label = f"one kernel {dtype} {op} {size}"
            # one more where the stream changed: it waits for the collective before
            assert (calls <= 5) == fused, f"{label}: {calls} driver calls (fused: {fused})"
            c.expect(got, fold, label, copy=True)
        for call in range(3):  # on one stream: at most 4 driver calls each
            ins = c.inputs("float32", (size,), seed + 100 + call)
            x = dev(c, ins[c.comm.rank])
            calls = comm.device_operations
            got = comm.all_reduce(x)
            calls = comm.device_operations - calls
            assert (calls <= 4) == fused, f"{size} on one stream: {calls} driver calls"
            c.expect(got, rank_order_fold(ins, "sum"), f"one stream {size} {call}", copy=True)
        # a collective in rounds between them (its streams ordered after the kernel's)
        ins = c.inputs("int32", (70000,), seed)
        c.expect(comm.all_reduce(dev(c, ins[comm.rank])), c.reduce_reference(ins, "sum"),
                 f"all_reduce in rounds after {size}")
        x = dev(c, ins[comm.rank].copy())
        c.expect(comm.broadcast(x, root=n - 1), ins[n - 1], f"broadcast after {size}",
                 copy=True)


def case_back_to_back(c: Checker) -> None:
    """Hundreds of collectives of varying size and kind, back to back, never waiting between."""
    comm, n = c.comm, c.comm.size
    rng = np.random.default_rng(7)  # same sequence on every rank
    for i in range(200):
        size = int(rng.choice([1, 3, 100, 1000, 5000, 20000]))
        kind = int(rng.integers(0, 4))
        channels = int(rng.integers(1, 4))
        ins = c.inputs("int32", (size * n,), 5000 + i)
        if kind == 0:
            got = comm.all_reduce(dev(c, ins[comm.rank]), channels=channels, chunk_bytes=2048)
            c.expect(got, c.reduce_reference(ins, "sum"), f"b2b {i} all_reduce")
        elif kind == 1:
            got = comm.reduce_scatter(dev(c, ins[comm.rank]), channels=channels,
                                      chunk_bytes=2048)
            c.expect(got, c.reduce_reference(ins, "sum").reshape(n, -1)[comm.rank],
                     f"b2b {i} reduce_scatter", shared=False)
        elif kind == 2:
            got = comm.all_gather(dev(c, ins[comm.rank][:size]), channels=channels)
            c.expect(got, np.stack([a[:size] for a in ins]), f"b2b {i} all_gather", copy=True)
        else:
            x = dev(c, ins[comm.rank].copy())
            comm.broadcast(x, root=i % n, channels=channels, chunk_bytes=1024)
            c.expect(x, ins[i % n], f"b2b {i} broadcast", copy=True)
        if i % 50 == 0:
            comm.barrier()


def case_again(c: Checker) -> None:
    """The same arrays called again and again (a call that comes again skips its checks and
    binding: `LastCalls`), their contents refilled in place between calls: every verb, small
    (one operation on a GPU) and large, out of place and in place; a new op on the same
    arrays, and an array reshaped in place, are new calls; a rank that changes the op on
    the same arrays while the others run the call agreed before fails them all with a
    mismatch, within a watchdog tick (the communicator is then unusable: data had moved).
    Once the prepared calls are forgotten (on every rank at once), a call that comes again is
    prepared anew, and kept so."""
    comm, n, rank, xp = c.comm, c.comm.size, c.comm.rank, c.xp
    root = n - 1
    for size in (100, 50000):
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
                assert comm._last_calls.find("all_reduce", x, out, (op, None, None, None))
                comm._path._forget_prepared()
            got = comm.all_reduce(x, op=op, out=out)
            assert got is out
            kept = comm._last_calls.find("all_reduce", x, out, (op, None, None, None))
            assert kept is not None, "the call was not kept"
            if call == 1:  # prepared anew, and kept so for the next call
                assert kept.generation == generation + 1, (kept.generation, generation)
                assert kept.prepared is comm._path.prepared[kept.known_key]
            c.expect(out, c.reduce_reference(ins, op), f"again all_reduce {size} {call}")
            if call == 1:  # in place: a call of its own
                comm.all_reduce(x, out=x)
                c.expect(x, c.reduce_reference(ins, "sum"), f"again in place {size}")
                x[...] = dev(c, ins[rank])
            comm.reduce_scatter(x, out=mine)
            c.expect(mine, c.reduce_reference(ins, "sum").reshape(n, -1)[rank],
                     f"again reduce_scatter {size} {call}", shared=False)
            blocks = c.inputs("int32", (size,), seed + 1)
            block[...] = dev(c, blocks[rank])
            comm.all_gather(block, out=gathered)
            c.expect(gathered, np.stack(blocks), f"again all_gather {size} {call}", copy=True)
            block[...] = dev(c, blocks[rank])
            comm.broadcast(block, root=root)
            c.expect(block, blocks[root], f"again broadcast {size} {call}", copy=True)
            block[...] = dev(c, blocks[rank])
            result = comm.reduce(block, root=root, out=reduced)
            if rank == root:
                c.expect(result, c.reduce_reference(blocks, "sum"), f"again reduce {size}",
                         shared=False)
    x = xp.zeros(12, "int64")  # reshaped in place (NumPy and CuPy): the same object, a new call
    for shape in ((12,), (3, 4), (12,)):
        x.shape = shape
        x[...] = dev(c, np.arange(12).reshape(shape) + rank)
        c.expect(comm.all_reduce(x, out=x), np.arange(12).reshape(shape) * n + sum(range(n)),
                 f"again reshaped {shape}")
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
            assert exc.differences["op"][1] == "max", exc.differences
            return
        assert "called all_reduce(shape=(8,), dtype=float32, op=max" in str(exc), str(exc)
        assert "rank 0 went ahead with all_reduce(shape=(8,), dtype=float32, op=sum" in str(
            exc), str(exc)
    else:
        raise AssertionError("no CollectiveMismatchError for another op on the same arrays")


def case_registered(c: Checker) -> None:
    """Arrays from comm.empty/zeros (registered memory, which the peers read in place): every
    verb, in place and out of place, from a few elements to several MiB, results the
    rank-order fold's bits (as deterministic mode, whatever the form); arrays refilled and
    called again at once many times (a rank that returned early, or read a peer's array
    before the peer entered, would mix two calls' data); views at other offsets of a
    registration (an all_gather in place: each rank's block at its own offset), a reduce in
    place on the root only; a rank whose array is registered where its peers' are not, or
    lies at another offset, is a mismatch on every rank, and the communicator goes on, as it
    does after a registration refused for its dtype. Plain arrays interleaved (direct) give
    the same bits."""
    comm, n, rank, xp = c.comm, c.comm.size, c.comm.rank, c.xp
    device = "cpu" if xp is np else "cuda"
    root = n - 1
    seed = 17000
    zeros = comm.zeros((3,), "int16", device=device)
    assert type(zeros) is type(xp.zeros(1)) and zeros.dtype == np.int16
    c.expect(zeros, np.zeros(3, np.int16), "registered zeros")
    for size, dtype, op in ((7, "float32", "sum"), (5000, "float64", "avg"),
                            (300000, "float32", "sum"), (1000, "float16", "sum"),
                            (2000, "int32", "max")):
        count = n * size
        x = comm.empty(count, dtype, device=device)
        out = comm.empty(count, dtype, device=device)
        for call in range(3):
            seed += 1
            ins = c.inputs(dtype, (count,), seed, op)
            want = rank_order_fold(ins, op)
            label = f"registered {dtype} {op} {count} #{call}"
            x[...] = dev(c, ins[rank])
            c.expect(comm.all_reduce(x, op=op, out=out), want, f"{label} two-shot", copy=True)
            c.expect(comm.all_reduce(x, op=op), want, f"{label} one-shot", copy=True)
            c.expect(comm.all_reduce(dev(c, ins[rank]), op=op, algorithm="two_shot"), want,
                     f"{label} plain, two_shot", copy=True)
            comm.all_reduce(x, op=op, out=x)
            c.expect(x, want, f"{label} in place", copy=True)
            x[...] = dev(c, ins[rank])
            mine = comm.reduce_scatter(x, op=op)
            c.expect(mine, want.reshape(n, -1)[rank], f"{label} reduce_scatter", copy=True,
                     shared=False)
            got = comm.reduce(x, op=op, root=root)
            if rank == root:
                c.expect(got, want, f"{label} reduce", copy=True, shared=False)
        blocks = comm.empty((n, size), dtype, device=device)
        ins = c.inputs(dtype, (size,), seed + 100)
        blocks[rank] = dev(c, ins[rank])
        comm.all_gather(blocks[rank], out=blocks)  # in place: each rank's own offset
        c.expect(blocks, np.stack(ins), f"registered all_gather in place {size}", copy=True)
        x[:size] = dev(c, ins[rank])
        gathered = comm.all_gather(x[:size])
        c.expect(gathered, np.stack(ins), f"registered all_gather {size}", copy=True)
        comm.broadcast(x[:size], root=root)
        c.expect(x[:size], ins[root], f"registered broadcast {size}", copy=True)
    size = 20000  # back to back: refilled at once after each call
    x = comm.empty(n * size, "float32", device=device)
    tunings = [(None, None), (4096, 3), (1 << 16, 2)]  # the same bits, whatever the pieces
    for call in range(12):
        ins = c.inputs("float32", (n * size,), 17500 + call)
        x[...] = dev(c, ins[rank])
        chunk, channels = tunings[call % 3]
        comm.all_reduce(x, out=x, chunk_bytes=chunk, channels=channels)
        c.expect(x, rank_order_fold(ins, "sum"), f"registered back to back {call}", copy=True)
    x[:size] = dev(c, np.arange(size, dtype=np.float32) + rank)  # in place on the root only
    got = comm.reduce(x[:size], root=root, out=x[:size] if rank == root else None)
    if rank == root:
        c.expect(got, np.arange(size, dtype=np.float32) * n + sum(range(n)),
                 "registered reduce in place on the root", shared=False)
    plain = xp.ones(8, "float32")
    for what, mine in (("a plain array on the others", x[:8] if rank == 0 else plain),
                       ("another offset on rank 1", x[8 * (rank == 1):8 * (rank == 1) + 8])):
        try:
            comm.all_reduce(mine)
        except gpuring.CollectiveMismatchError as exc:
            assert "registered" in exc.differences, (what, exc.differences)
        else:
            raise AssertionError(f"no CollectiveMismatchError for {what}")
    try:  # refused before the ranks meet: the communicator goes on
        comm.empty(4, object, device=device)
    except TypeError as exc:
        assert "not supported" in str(exc), str(exc)
    else:
        raise AssertionError("a registered array of objects")
    x[:8] = 1
    c.expect(comm.all_reduce(x[:8]), np.full(8, n, np.float32), "registered after mismatch")


def case_tuned(c: Checker) -> None:
    """GPURING_TUNING (a table from `gpuring tune`): an all_reduce that asks for nothing takes
    the table's algorithm, piece size and channels for its size (checked in the call's
    agreed description), results right; what a call asks for wins; a rank whose table
    differs is a mismatch on every rank, and the communicator goes on."""
    import dataclasses

    comm, n, rank = c.comm, c.comm.size, c.comm.rank
    tuning = comm._path.choices.tuning
    assert tuning is not None and tuning.applies("cpu", n), "no tuning table for this job"

    def described(shape: tuple[int, ...]) -> str:
        texts = [p.text for p in comm._path.prepared.values()
                 if p.text.startswith(f"all_reduce(shape={shape},")]
        assert len(texts) == 1, texts
        return texts[0]

    # an element count at the top of each entry's range (one or many entries: the table
    # is whatever this machine measured), and one above the last bound
    bounds = [ch.max_bytes for ch in tuning.tables["all_reduce"] if ch.max_bytes]
    sizes = [b // 4 for b in bounds] + [(bounds[-1] if bounds else 4096) // 4 + 1024]
    for i, count in enumerate(sorted(set(sizes))):
        count = max(n, count - count % n)
        ins = c.inputs("float32", (count,), 18000 + i)
        c.expect(comm.all_reduce(ins[rank]), c.reduce_reference(ins, "sum"),
                 f"tuned all_reduce {count}")
        choice = tuning.choose("all_reduce", count * 4)
        text = described((count,))
        assert f"chunk_bytes={choice.chunk_bytes}, channels={choice.channels}, " \
               f"algorithm={choice.algorithm})" in text, (choice, text)
    ins = c.inputs("float32", (4 * n + 1,), 18100)
    comm.all_reduce(ins[rank], algorithm="ring", chunk_bytes=4096)
    unasked = tuning.choose("all_reduce", (4 * n + 1) * 4).channels  # (the table's, measured)
    assert f"chunk_bytes=4096, channels={unasked}, algorithm=ring)" in described((4 * n + 1,))
    if rank == 1:  # another table on rank 1
        comm._path.choices.tuning = dataclasses.replace(tuning, digest="0" * 16)
    try:
        comm.all_reduce(np.ones(77, np.float32))
    except gpuring.CollectiveMismatchError as exc:
        assert "tuning" in exc.differences, exc.differences
    else:
        raise AssertionError("no CollectiveMismatchError for different tuning tables")
    comm._path.choices.tuning = tuning
    c.expect(comm.all_reduce(np.ones(78, np.float32)), np.full(78, n, np.float32),
             "tuned after mismatch")


def expect_mismatches(attempts: list) -> None:
    """Each (field, call) raises CollectiveMismatchError naming that field."""
    for field, call in attempts:
        try:
            call()
        except gpuring.CollectiveMismatchError as exc:
            assert field in exc.differences, (field, exc.differences)
        else:
            raise AssertionError(f"no CollectiveMismatchError for a different {field}")


def moved_blocks() -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, block shape) of the cases that move data unreduced: empty to several buffer
    rounds, each in another dtype."""
    dtypes = ["float32", "int8", "uint64", "complex128", "float16"] + (
        ["bfloat16"] if "bfloat16" in FLOATS else [])
    shapes = [(0,), (1,), (7, 3), (70000,), (3, 250000)]
    return [(dtypes[i % len(dtypes)], shape) for i, shape in enumerate(shapes)]


def case_exchange(c: Checker, blocks: int | None = None) -> None:
    """gather, scatter and all_to_all: every block where it belongs, bit for bit, every dtype,
    shapes from empty blocks to several buffer rounds (or the first `blocks` of them), every
    root, given outputs, registered arrays; a mismatched root or block shape raises
    CollectiveMismatchError on every rank, a wrong first dimension ValueError before the
    ranks meet, and the communicator goes on."""
    comm, n, rank, xp = c.comm, c.comm.size, c.comm.rank, c.xp
    seed = 19000
    for i, (dtype, block) in enumerate(moved_blocks()[:blocks]):
        seed += 1
        ins = c.inputs(dtype, (n, *block), seed)
        for root in range(n) if n <= 3 or i < 3 else (0, n - 1):
            got = comm.gather(dev(c, ins[rank][rank]), root=root)
            if rank == root:
                c.expect(got, np.stack([ins[q][q] for q in range(n)]),
                         f"gather {dtype} {block} root {root}", copy=True, shared=False)
            else:
                assert got is None
            got = comm.scatter(dev(c, ins[rank]), root=root)
            c.expect(got, ins[root][rank], f"scatter {dtype} {block} root {root}", copy=True,
                     shared=False)
        out = xp.zeros((n, *block), dtype)
        got = comm.all_to_all(dev(c, ins[rank]), out=out)
        assert got is out
        c.expect(out, np.stack([ins[q][rank] for q in range(n)]), f"all_to_all {dtype} {block}",
                 copy=True, shared=False)
    device = "cpu" if xp is np else "cuda"
    x = comm.empty((n, 1000), "int32", device=device)  # registered arrays: staged as usual
    ins = c.inputs("int32", (n, 1000), seed + 1)
    x[...] = dev(c, ins[rank])
    c.expect(comm.all_to_all(x), np.stack([ins[q][rank] for q in range(n)]),
             "all_to_all registered", copy=True, shared=False)
    attempts = [
        ("root", lambda: comm.gather(xp.ones(4), root=min(rank, 1))),
        ("shape", lambda: comm.all_to_all(xp.ones((n, 4 + (rank == 1))))),
    ]
    expect_mismatches(attempts if n > 1 else [])
    try:
        comm.scatter(xp.ones((n + 1, 2)))
    except ValueError as exc:
        assert "one block per rank" in str(exc), str(exc)
    else:
        raise AssertionError("scatter took n + 1 blocks")
    c.expect(comm.all_to_all(xp.full((n, 3), rank)), np.repeat(np.arange(n), 3).reshape(n, 3),
             "all_to_all after mismatch", copy=True, shared=False)


def case_uneven(c: Checker) -> None:
    """all_gather_v, all_to_all_v and reduce_scatter_v: every rank's blocks where they
    belong with the shapes their senders gave (empty ones too, even blocks as a special
    case), reductions within their rounding bound (the rank-order fold's bits in
    deterministic mode); different trailing dimensions, counts or dtypes raise
    CollectiveMismatchError on every rank, and the communicator goes on."""
    comm, n, rank, xp = c.comm, c.comm.size, c.comm.rank, c.xp
    seed = 20000
    for i, (dtype, trailing) in enumerate([("float32", (3,)), ("int64", ()),
                                           ("complex64", (2, 5)), ("float16", (1,))]):
        for rows in ([(q * 7 + i) % 5 for q in range(n)], [4] * n, [0] * n):
            seed += 1
            xs = [c.inputs(dtype, (rows[q], *trailing), seed)[q] for q in range(n)]
            got = comm.all_gather_v(dev(c, xs[rank]))
            assert len(got) == n
            for q in range(n):
                c.expect(got[q], xs[q], f"all_gather_v {dtype} {rows} from {q}", copy=True)
        seed += 1
        shapes = [[((q + 2 * j + i) % 4, *trailing) for j in range(n)] for q in range(n)]
        sent = [[c.inputs(dtype, shapes[q][j], seed + 100 * q + j)[0] for j in range(n)]
                for q in range(n)]
        got = comm.all_to_all_v([dev(c, b) for b in sent[rank]])
        for q in range(n):
            c.expect(got[q], sent[q][rank], f"all_to_all_v {dtype} from {q}", copy=True,
                     shared=False)
    for op, dtype in (("sum", "float32"), ("max", "int32"), ("avg", "float64")):
        seed += 1
        counts = [(3 * q + 1) % 7 for q in range(n)]
        ins = c.inputs(dtype, (sum(counts),), seed, op)
        got = comm.reduce_scatter_v(dev(c, ins[rank]), counts, op=op)
        start = sum(counts[:rank])
        piece = [a[start:start + counts[rank]] for a in ins]
        if comm.config.deterministic:
            c.expect(got, rank_order_fold(piece, op), f"reduce_scatter_v {op}", copy=True,
                     shared=False)
        else:
            c.expect(got, c.reduce_reference(piece, op), f"reduce_scatter_v {op}",
                     shared=False)
    attempts = [
        ("trailing dimensions", lambda: comm.all_gather_v(xp.ones((2, 3 + (rank == 1))))),
        ("counts", lambda: comm.reduce_scatter_v(xp.ones(3 * n), [3] * n if rank else
                                                 [3 * n] + [0] * (n - 1))),
        ("dtype", lambda: comm.all_to_all_v([xp.ones(2, "float32" if rank else "float64")
                                             for _ in range(n)])),
    ]
    expect_mismatches(attempts if n > 1 else [])
    got = comm.all_gather_v(xp.full((rank + 1, 2), rank))
    c.expect(got[n - 1], np.full((n, 2), n - 1), "all_gather_v after mismatch", copy=True)


def case_p2p(c: Checker) -> None:
    """send, recv and sendrecv: ring shifts both ways (every dtype, empty to several buffer
    rounds), one peer both ways, to itself, a gather to rank 0 and back by messages in
    order, collectives of the communicator in between; a recv of another shape or two sends
    that cross raise CollectiveMismatchError on both ranks naming them, wrong ranks raise
    ValueError before anything moves, and the ranks go on."""
    comm, n, rank, xp = c.comm, c.comm.size, c.comm.rank, c.xp
    right, left = (rank + 1) % n, (rank - 1) % n
    seed = 21000
    for dtype, shape in moved_blocks():
        seed += 1
        ins = c.inputs(dtype, shape, seed)
        out = xp.zeros(shape, dtype)
        got = comm.sendrecv(dev(c, ins[rank]), right, out, left)
        assert got is out
        c.expect(out, ins[left], f"ring shift {dtype} {shape}", copy=True, shared=False)
        got = comm.sendrecv(dev(c, ins[rank]), left, xp.zeros(shape, dtype), right)
        c.expect(got, ins[right], f"ring shift back {dtype} {shape}", copy=True, shared=False)
        c.expect(comm.all_reduce(dev(c, ins[rank])), c.reduce_reference(ins, "sum"),
                 f"all_reduce between messages {dtype} {shape}")
    ins = c.inputs("int32", (1000,), seed + 1)
    partner = rank ^ 1 if rank ^ 1 < n else rank  # pairs both ways (the odd one: itself)
    got = comm.sendrecv(dev(c, ins[rank]), partner, xp.zeros(1000, "int32"), partner)
    c.expect(got, ins[partner], "sendrecv with one peer", copy=True, shared=False)
    if rank == 0:  # a gather by messages, in order, each of its own shape
        for q in range(1, n):
            for k in range(3):
                got = comm.recv(xp.zeros((q, k + 1), "float64"), q)
                c.expect(got, np.full((q, k + 1), 10.0 * q + k), f"recv {k} from {q}",
                         copy=True, shared=False)
        for q in range(1, n):
            comm.send(dev(c, ins[q]), q)
    else:
        for k in range(3):
            comm.send(xp.full((rank, k + 1), 10.0 * rank + k), 0)
        strided = xp.zeros((1000, 2), "int32")
        try:
            comm.recv(strided[:, 0], 0)
        except TypeError as exc:
            assert "C-contiguous" in str(exc), str(exc)
        else:
            raise AssertionError("recv into a strided array")
        c.expect(comm.recv(xp.zeros(1000, "int32"), 0), ins[rank], "recv from 0", copy=True,
                 shared=False)
    for bad in (lambda: comm.send(xp.ones(2), rank), lambda: comm.recv(xp.ones(2), n),
                lambda: comm.sendrecv(xp.ones(2), right, xp.ones(2), rank) if n > 1 else
                comm.sendrecv(xp.ones(2), 0, xp.ones(3), 0)):
        try:
            bad()
        except ValueError:
            pass
        else:
            raise AssertionError("a message to a wrong rank")
    if n > 1 and rank < 2:
        other = 1 - rank
        expect_mismatches([
            ("shape", lambda: comm.send(xp.ones(4), 1) if rank == 0 else
             comm.recv(xp.ones(5), 0)),
            ("root", lambda: comm.send(xp.ones(4), other)),  # both send first
        ])
        try:
            comm.send(xp.ones(4), other) if rank == 0 else comm.recv(xp.ones(4, "int8"), 0)
        except gpuring.CollectiveMismatchError as exc:
            assert exc.differences["dtype"] == {0: "float64", 1: "int8"}, exc.differences
            assert "ranks 0 and 1" in str(exc), str(exc)
        else:
            raise AssertionError("no CollectiveMismatchError for another dtype")
    trace = os.path.join(os.path.dirname(c.path), "p2p-trace.json")
    comm.start_timeline(trace)
    got = comm.sendrecv(xp.full(5, rank), right, xp.zeros(5, xp.full(5, rank).dtype), left)
    c.expect(got, np.full(5, left), "ring shift after mismatches", copy=True, shared=False)
    if comm.stop_timeline() is not None and n > 1:  # rank 0 wrote every rank's events
        import json

        with open(trace) as f:
            names = {(e["pid"], e["name"]) for e in json.load(f)["traceEvents"]}
        event = "sendrecv with rank {}" if n == 2 else "sendrecv: recv from rank {}"
        assert all((q, event.format((q - 1) % n)) in names for q in range(n)), names


def case_split(c: Checker) -> None:
    """split: members ranked by (key, rank); collectives of sub-communicators interleaved
    with their parent's and with their siblings' (each color runs a different number), a
    split of a split, messages inside one, color None, a mismatch with a collective of the
    parent, bad colors; the sub-communicators close on their own and the parent goes on."""
    comm, n, rank, xp = c.comm, c.comm.size, c.comm.rank, c.xp
    seed = 22000
    colors = [q % 2 if q < n - 1 or n < 3 else None for q in range(n)]
    sub = comm.split(colors[rank], key=-rank)  # descending parent rank
    members = sorted((q for q in range(n) if colors[q] == colors[rank]), key=lambda q: -q)
    if colors[rank] is None:
        assert sub is None
    else:
        assert sub is not None and (sub.rank, sub.size) == (members.index(rank), len(members))
    for step in range(3):
        seed += 1
        ins = c.inputs("float64", (5000,), seed)
        if sub is not None:
            for k in range(1 + (colors[rank] or 0) + step):  # siblings run different counts
                mine = c.inputs("int64", (300, 7), seed * 10 + k)
                c.expect(sub.all_reduce(dev(c, mine[rank])),
                         c.reduce_reference([mine[q] for q in members], "sum"),
                         f"sub all_reduce {step} {k}", shared=False)
                c.expect(sub.all_gather(dev(c, mine[rank])), np.stack([mine[q] for q in members]),
                         f"sub all_gather {step} {k}", copy=True, shared=False)
        c.expect(comm.all_reduce(dev(c, ins[rank])), c.reduce_reference(ins, "sum"),
                 f"parent all_reduce {step}")
    if sub is not None:
        inner = sub.split(0, key=sub.rank)  # the same ranks, the same order
        assert inner is not None and (inner.rank, inner.size) == (sub.rank, sub.size)
        x = dev(c, c.inputs("int16", (64,), seed + 1)[rank])
        got = inner.sendrecv(x, (inner.rank + 1) % inner.size, xp.zeros(64, "int16"),
                             (inner.rank - 1) % inner.size)
        sender = members[(inner.rank - 1) % inner.size]
        c.expect(got, c.inputs("int16", (64,), seed + 1)[sender], "sendrecv in a split of a split",
                 copy=True, shared=False)
        inner.close()
        sub.close()
    for bad, error in ((-1, ValueError), (True, TypeError), (1.5, TypeError)):
        try:
            comm.split(bad)
        except error:
            pass
        else:
            raise AssertionError(f"split({bad!r})")
    if n > 1:
        expect_mismatches([("step", lambda: comm.split(0) if rank == 1 else
                            comm.all_reduce(xp.ones(3)))])
    whole = comm.split(7)
    assert whole is not None and whole.rank == rank
    c.expect(whole.all_reduce(xp.full(3, rank)), np.full(3, n * (n - 1) // 2), "split whole",
             copy=True)
    whole.close()
    c.expect(comm.all_reduce(xp.full(3, rank)), np.full(3, n * (n - 1) // 2),
             "parent after its sub-communicators closed", copy=True)


def case_mismatch(c: Checker) -> None:
    """Mismatched dtype, shape, op, root and kind raise CollectiveMismatchError on every rank."""
    comm, r = c.comm, c.comm.rank
    x = np.ones(8, np.float32)
    attempts = [
        ("dtype", lambda: comm.all_reduce(x.astype("float64" if r == 1 else "float32"))),
        ("shape", lambda: comm.all_reduce(np.ones(8 + (r == 1), np.float32))),
        ("op", lambda: comm.all_reduce(x, op="max" if r == 1 else "sum")),
        ("root", lambda: comm.broadcast(x.copy(), root=1 if r == 1 else 0)),
        ("collective", lambda: comm.all_reduce(x) if r == 1 else comm.all_gather(x)),
    ]
    if os.environ.get("GPURING_TRANSPORT") != "mpi":  # settings of the ring only
        attempts += [
            ("chunk_bytes", lambda: comm.all_reduce(x, chunk_bytes=1024 if r == 1 else None)),
            ("channels", lambda: comm.all_reduce(x, channels=2 if r == 1 else None)),
        ]
    for field, call in attempts:
        try:
            call()
        except gpuring.CollectiveMismatchError as exc:
            assert field in exc.differences, (field, exc.differences)
            assert "rank 1" in str(exc), str(exc)
            c.digests.append(f"mismatch {field} raised")
        else:
            raise AssertionError(f"no CollectiveMismatchError for a different {field}")
    # the communicator still works after mismatches caught before any data moved
    c.expect(comm.all_reduce(np.full(4, r, np.int64)),
             np.full(4, sum(range(comm.size)), np.int64), "after mismatch")


def case_module_api(c: Checker) -> None:
    """Module-level verbs, init() twice, ReduceOp members, close and re-init."""
    comm = c.comm
    assert gpuring.init() is comm
    x = np.arange(6, dtype=np.float64) + comm.rank
    want = c.reduce_reference([np.arange(6.0) + r for r in range(comm.size)], "sum")
    c.expect(gpuring.all_reduce(x, op=gpuring.ReduceOp.SUM), want, "module all_reduce")
    c.expect(gpuring.all_gather(x), np.stack([np.arange(6.0) + r for r in range(comm.size)]),
             "module all_gather", copy=True)
    gpuring.barrier()
    y = x.copy()
    c.expect(gpuring.broadcast(y, root=0), np.arange(6.0), "module broadcast", copy=True)
    if not os.environ.get("GPURING_HOSTNAME"):  # one node (else `case_nodes` checks)
        assert comm.local_rank == comm.rank and comm.local_size == comm.size


def case_close_and_again(c: Checker) -> None:
    """A sub-communicator outlives the communicator it came from, which closes (rank 0 slow to
    close: the others make theirs again first); gpuring.init() then makes a new one, and
    both work."""
    import time

    comm, n = c.comm, c.comm.size
    sub = comm.split(0, key=-comm.rank)  # every rank, in reverse order
    x = np.arange(5, dtype=np.int64) + comm.rank
    want = np.arange(5, dtype=np.int64) * n + sum(range(n))
    if comm.rank == 0:
        time.sleep(0.5)
    comm.close()
    c.expect(sub.all_reduce(x), want, "the sub-communicator after its parent closed")
    again = gpuring.init()
    assert again is not comm
    c.expect(again.all_reduce(x), want, "a communicator made again")
    again.close()
    c.expect(sub.all_reduce(x), want, "the sub-communicator again")
    sub.close()


def case_nodes_without_mpi(c: Checker) -> None:
    """Simulated nodes whose ranks met without MPI (torchrun, Slurm): identity follows the
    node names; a NumPy collective across nodes raises a clear error on every rank, before
    anything moves, and the communicator goes on (a barrier, messages inside a node)."""
    comm = c.comm
    here = os.environ["GPURING_HOSTNAME"]
    nodes = comm._control.nodes
    assert nodes[comm.rank] == here and len(set(nodes)) > 1, nodes
    assert (comm.local_rank, comm.local_size) == (nodes[:comm.rank].count(here),
                                                  nodes.count(here))
    try:
        comm.all_reduce(np.ones(4, np.float32))
    except gpuring.GpuringError as exc:
        assert "need MPI between the nodes" in str(exc), str(exc)
    else:
        raise AssertionError("a NumPy collective across nodes ran without MPI")
    comm.barrier()  # the control plane's own exchange: no MPI needed
    assert comm.last_schedule == "agreement", comm.last_schedule
    peer = comm.rank ^ 1  # the neighbour on the same node
    if nodes[peer] == here:
        out = comm.sendrecv(np.full(3, comm.rank, np.int64), peer, np.empty(3, np.int64), peer)
        c.expect(out, np.full(3, peer, np.int64), "a message inside the node", shared=False)


def case_nodes(c: Checker) -> None:
    """Simulated nodes (GPURING_HOSTNAME set per rank): each rank's node, local rank and local
    size follow the names; all_reduce, reduce_scatter, all_gather, broadcast and reduce run
    in two levels (between nodes MPI for NumPy, NCCL for CuPy), a barrier is the agreement
    every call across nodes begins with, the other verbs run flat (MPI; CuPy's are refused);
    then the cases of one node, alike bit for bit on every rank; last, a rank that changes
    the op on the same arrays (every rank raises the mismatch at once: across nodes the
    ranks agree at every call)."""
    comm = c.comm
    here = os.environ["GPURING_HOSTNAME"]
    label = np.frombuffer(here.encode().ljust(32), np.uint8)
    names = [bytes(row).decode().strip() for row in host(comm.all_gather(label))]
    assert comm.rank < len(names) and names[comm.rank] == here
    assert comm.local_size == names.count(here), (names, comm.local_size)
    assert comm.local_rank == names[:comm.rank].count(here), (names, comm.local_rank)
    assert len(set(names)) > 1, names
    comm.barrier()
    assert comm.last_schedule == "agreement", comm.last_schedule
    comm.all_reduce(dev(c, np.ones(3, np.float32)))
    assert comm.last_schedule == "nodes", comm.last_schedule
    comm.gather(dev(c, np.ones(3, np.float32)), root=0)
    assert comm.last_schedule == ("mpi" if c.xp is np else "nccl"), comm.last_schedule
    # NumPy: every case of the verbs of two levels and the flat ones; CuPy: the verbs of two
    # levels on the types NCCL reduces as they are, wider (int16) and as reals (complex),
    # NCCL's point-to-point verbs, and calls that come again (the rest is the same code as
    # NumPy's)
    if c.xp is np:
        for case in (case_dtypes_ops, case_exchange, case_p2p, case_mismatch, case_again):
            case(c)
        return
    case_dtypes_ops(c, ("float32", "int16", "float16", "complex64"))
    case_exchange(c, blocks=3)
    case_again(c)


def case_nccl_on_a_shared_gpu(c: Checker) -> None:
    """CuPy collectives on NCCL (GPURING_TRANSPORT=nccl) from ranks that share one GPU,
    without NCCL_MULTI_RANK_GPU_ENABLE: every rank raises the same clear error before NCCL's
    init (NCCL would fail the ranks that share a GPU and leave the others waiting)."""
    os.environ.pop("NCCL_MULTI_RANK_GPU_ENABLE", None)
    try:
        c.comm.all_reduce(dev(c, np.ones(3, np.float32)))
    except gpuring.GpuringError as exc:
        assert "NCCL_MULTI_RANK_GPU_ENABLE=1" in str(exc), str(exc)
    else:
        raise AssertionError("NCCL ran ranks that share a GPU")


def case_without_peer_access(c: Checker) -> None:
    """CuPy arrays on GPUs that cannot access each other peer to peer: CUDA IPC cannot map a
    peer's buffers, so every collective runs on NCCL (the ranks find it out together, at
    their first CuPy collective); registered arrays are ordinary ones."""
    comm = c.comm
    comm.all_reduce(dev(c, np.ones(3, np.float32)))
    assert comm.last_schedule == "nccl", comm.last_schedule
    assert comm._path.mappable == {"cuda": False}, comm._path.mappable
    case_dtypes_ops(c, ("float32", "int16", "complex64"))
    case_exchange(c, blocks=3)
    case_p2p(c)  # on more than 2 ranks, a sendrecv's two pairs' channels on NCCL at once
    n, rank = comm.size, comm.rank
    partner = rank ^ 1 if rank ^ 1 < n else rank
    peers = {(rank + 1) % n, (rank - 1) % n, partner} | (set(range(n)) if rank == 0 else {0})
    assert set(comm._pairs.channels) == peers - {rank}, comm._pairs.channels  # (every pair)
    assert all(ch.comm.last_schedule == "nccl" for ch in comm._pairs.channels.values()), \
        [ch.comm.last_schedule for ch in comm._pairs.channels.values()]
    stream = c.xp.cuda.Stream(non_blocking=True)
    with stream:  # NCCL's route is refused under capture, harmlessly
        x = dev(c, np.ones(3, np.float32))  # (written on `stream`, before the call reads it)
        comm.all_reduce(x, out=x)
        stream.synchronize()
        stream.begin_capture()
        try:
            comm.all_reduce(x, out=x)
        except gpuring.GpuringError as exc:
            assert "cannot be captured" in str(exc) and "on NCCL" in str(exc), exc
        else:
            raise AssertionError("captured on NCCL's route")
        finally:
            stream.end_capture()
    c.expect(comm.all_reduce(x), np.full(3, c.comm.size ** 2, np.float32), "after capture")


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def use_nonblocking_host_device() -> None:
    """Run NumPy collectives through the scheduler's non-blocking path (the one GPUs take):
    threaded streams only, completion by events, each collective ordered after the previous
    one by the engine; the caller waits for the final event, as a CUDA stream would. The
    ring and the chains visit the even ranks first, then the odd ones (as a topology may
    order them: `Capabilities.ring`)."""
    from gpuring import devices
    from gpuring.devices.host import HostDevice

    class NonBlockingHostDevice(HostDevice):
        blocking = False
        default_channels = 2

        def create_stream(self, *, inline: bool = False):
            return super().create_stream(inline=False)

        def capabilities(self, handles):
            ring = tuple(sorted(range(len(handles)), key=lambda r: (r % 2, r)))
            return super().capabilities(handles)._replace(ring=ring)

        def order_caller_after(self, event) -> None:
            event.wait(self)

    devices.KINDS["cpu"] = lambda: NonBlockingHostDevice


def run_case(cases: dict) -> None:
    """A rank's program: `script CASE OUTDIR [cpu|cuda]` runs cases[CASE] on NumPy or CuPy
    arrays, checked, and writes the digests."""
    case, outdir = sys.argv[1], sys.argv[2]
    device = sys.argv[3] if len(sys.argv) > 3 else "cpu"
    xp = np
    if device == "cuda":
        import cupy

        xp = cupy
    gpu = None
    with gpuring.init(timeout=float(os.environ.get("GPURING_TIMEOUT", "60"))) as comm:
        if device == "cuda":  # the GPU gpuring picks for this rank
            gpu = comm.local_rank % xp.cuda.runtime.getDeviceCount()
            xp.cuda.Device(gpu).use()
        checker = Checker(comm, case, outdir, xp)
        cases[case](checker)
        checker.finish()
        print(f"rank {comm.rank}: {case} ok, {checker.checked} results checked")
    created = getattr(xp, "contexts_created", None)  # the CUDA simulator tells
    if created is not None and not checker.uses_other_gpus:
        # no thread of gpuring (watchdog, async, abort) touched another GPU
        assert created() == {gpu}, f"CUDA contexts on GPUs {created()}, this rank uses {gpu}"


def main() -> None:
    if os.environ.get("GPURING_TEST_NONBLOCKING") == "1":
        use_nonblocking_host_device()
    run_case(CASES)


if __name__ == "__main__":
    main()
