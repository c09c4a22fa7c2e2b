"""Runs as every rank of a multi-process test: `worker.py CASE OUTDIR [device]`.

Each rank rebuilds every rank's input from a shared seed, so it checks its results against a
float64 or exact-integer reference by itself. It also writes a digest of every result to
OUTDIR/CASE-RANK.txt; the test compares those files across ranks (bitwise identity).
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np

import gpuring

INTS = ["int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64"]
FLOATS = ["float16", "float32", "float64"]
try:  # bfloat16 arrays come from ml_dtypes
    import ml_dtypes  # noqa: F401

    FLOATS.insert(1, "bfloat16")
except ImportError:
    pass
COMPLEX = ["complex64", "complex128"]
DTYPES = INTS + FLOATS + COMPLEX
OPS = ["sum", "prod", "min", "max", "avg"]


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

    def reduce_reference(self, arrays: list[np.ndarray], op: str) -> np.ndarray:
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
        return acc.astype(dtype) if exact else acc

    def expect(self, got, want: np.ndarray, what: str, *, copy: bool = False,
               shared: bool = True) -> None:
        """Compare with the reference: exact for integers and for copies of the inputs
        (`copy`), within rounding for reduced floats (the reference is float64). Results
        every rank holds (`shared`) go into the digest file."""
        got = host(got)
        assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
        if got.dtype.kind in "iu" or copy:
            assert np.array_equal(got, want), f"{what}: wrong values"
        else:
            tol = {"float16": 2e-2, "bfloat16": 5e-2, "float32": 1e-5, "float64": 1e-12,
                   "complex64": 1e-5, "complex128": 1e-12}[got.dtype.name]
            scale = np.abs(want).max() if want.size else 1.0
            err = np.abs(got.astype(want.dtype) - want).max() if want.size else 0.0
            assert err <= tol * max(scale, 1.0) * self.comm.size, f"{what}: error {err}"
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


def case_dtypes_ops(c: Checker) -> None:
    """Every dtype and op, all_reduce in and out of place, plus reduce_scatter and reduce."""
    n, comm = c.comm.size, c.comm
    seed = 1
    for dtype in DTYPES:
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
    """Odd sizes (0, 1, n-1, primes), shapes, channels and small pieces, one 64 MiB array."""
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
    ins = c.inputs("int64", (4, 0, 3), seed + 1)
    c.expect(comm.all_reduce(dev(c, ins[comm.rank])), c.reduce_reference(ins, "sum"), "empty 3d")
    ins = c.inputs("float64", (6, 5, 4), seed + 2)
    c.expect(comm.all_reduce(dev(c, ins[comm.rank]), op="max"),
             c.reduce_reference(ins, "max"), "3d max")
    # non-contiguous input works through a copy
    ins = c.inputs("float32", (10, 8), seed + 3)
    c.expect(comm.all_reduce(dev(c, ins[comm.rank])[:, ::2]),
             c.reduce_reference([a[:, ::2] for a in ins], "sum"), "strided input")
    # one array of 64 MiB
    ins = c.inputs("float32", (16 << 20,), seed + 4)
    c.expect(comm.all_reduce(dev(c, ins[comm.rank])), c.reduce_reference(ins, "sum"), "64 MiB")


def case_back_to_back(c: Checker) -> None:
    """Hundreds of collectives of varying size and kind, back to back, never waiting between."""
    comm, n = c.comm, c.comm.size
    rng = np.random.default_rng(7)  # same sequence on every rank
    for i in range(300):
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
    want = sum(np.arange(6, dtype=np.float64) + r for r in range(comm.size))
    c.expect(gpuring.all_reduce(x, op=gpuring.ReduceOp.SUM), want, "module all_reduce")
    c.expect(gpuring.all_gather(x), np.stack([np.arange(6.0) + r for r in range(comm.size)]),
             "module all_gather", copy=True)
    gpuring.barrier()
    y = x.copy()
    c.expect(gpuring.broadcast(y, root=0), np.arange(6.0), "module broadcast", copy=True)
    assert comm.local_rank == comm.rank and comm.local_size == comm.size


CASES = {name[5:]: fn for name, fn in globals().items() if name.startswith("case_")}


def use_nonblocking_host_device() -> None:
    """Run NumPy collectives through the scheduler's non-blocking path (the one GPUs take):
    threaded streams only, completion by events, each collective ordered after the previous
    one by the engine; the caller waits for the final event, as a CUDA stream would."""
    from gpuring import communicator
    from gpuring.devices.host import HostDevice

    class NonBlockingHostDevice(HostDevice):
        blocking = False
        default_channels = 2

        def create_stream(self, *, inline: bool = False):
            return super().create_stream(inline=False)

        def order_caller_after(self, event) -> None:
            event.wait(self)

    make = communicator._make_device

    def make_device(kind, control, config):
        device = make(kind, control, config)
        if kind == "cpu":
            device.close()
            return NonBlockingHostDevice(name_prefix=device.name_prefix, timeout=config.timeout)
        return device

    communicator._make_device = make_device


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
