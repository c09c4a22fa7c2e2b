"""The kernels of kernels/reduce.cu, compiled by the host C++ compiler and run on the CPU.

`tests/cudasim/cuda_host_emulation.h` stands in for the CUDA built-ins (thread and block
indices, rounded float operations, the global timer), so the kernel source itself, unchanged,
runs here: every (dtype, op), alignments that take each vector width (16, 8, 4 bytes, with
and without a scalar head) and the scalar path,
grid-stride loops of several shapes, in-place operands. Each result must equal, bit for bit,
what the host device computes, and no byte outside the destination may change. The flag
kernels are checked for their wait, timeout, abort and publish rules. No GPU needed: this is
how CI runs the code that the GPU runs.
"""

from __future__ import annotations

import ctypes
import threading
import time

import numpy as np
import pytest

from gpuring._ops import COMPLEX_DTYPES, SUPPORTED_DTYPES, ReduceOp
from gpuring.devices import _kernels
from gpuring.devices._host_streams import UFUNCS, average_into

from .. import reference

#: the kernels' host build takes a compiler half a minute
pytestmark = pytest.mark.slow

# (blocks, threads): one thread; a ragged grid; a grid wider than most inputs
GRIDS = [(1, 1), (3, 7), (4, 64)]
_NOT_ABORTED = np.zeros(1, np.int32)
CLEAR = _NOT_ABORTED.ctypes.data  # the device's abort word, not set
RELEASED = 2**63 - 1  # what an abort writes into the words a rank waits on



def _kernel(lib: ctypes.CDLL, name: str) -> int:
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0


def _np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _random(rng: np.random.Generator, dtype: np.dtype, n: int) -> np.ndarray:
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    if dtype.kind == "c":
        return (rng.standard_normal(n) * 50 + 1j * rng.standard_normal(n) * 50).astype(dtype)
    x = (rng.standard_normal(n) * 50).astype(np.float32).astype(dtype)
    if n >= 4:  # NaN on either side, for min/max propagation
        x[rng.integers(0, n, 2)] = np.nan
    return x


class _Arena:
    """One byte buffer holding operands at chosen alignments (address modulo 16), with
    random guard bytes everywhere else."""

    def __init__(self, rng: np.random.Generator, nbytes: int):
        self.raw = rng.integers(0, 256, nbytes + 64, dtype=np.uint8)
        self.base = (-self.raw.ctypes.data) % 16  # index of a 16-byte aligned address
        self.next = self.base

    def place(self, values: np.ndarray, misalign: int) -> tuple[int, np.ndarray]:
        start = -(-self.next // 16) * 16 + misalign
        view = self.raw[start:start + values.nbytes].view(values.dtype)
        view[...] = values
        self.next = start + values.nbytes + 16
        return start, view


def _host_reduce(x: np.ndarray, y: np.ndarray, op: ReduceOp, divisor: int) -> np.ndarray:
    """What the host device computes; complex products spelled out as the kernel defines
    them (each operation rounded: NumPy may fuse them where the CPU has FMA)."""
    out = np.empty_like(x)
    if op is ReduceOp.PROD and x.dtype.kind == "c":
        out.real = x.real * y.real - x.imag * y.imag
        out.imag = x.real * y.imag + x.imag * y.real
        return out
    with np.errstate(invalid="ignore", over="ignore"):
        if divisor == 1:
            UFUNCS[op](x, y, out=out)
        else:
            average_into(out, x, y, divisor)
    return out


def _same(got: np.ndarray, expected: np.ndarray) -> bool:
    """Bitwise equal, except that any NaN equals any NaN: NaN payloads differ between
    NumPy's conversions and CUDA's (which writes its canonical NaN)."""
    if got.tobytes() == expected.tobytes():
        return True
    if expected.dtype.kind in "iub":
        return False
    if expected.dtype.itemsize == 2:  # float16, bfloat16: float32 keeps every non-NaN bit
        got, expected = got.astype(np.float32), expected.astype(np.float32)
    if expected.dtype.kind == "c":  # compare the parts
        got, expected = got.view(got.real.dtype), expected.view(expected.real.dtype)
    keep = ~(np.isnan(got) & np.isnan(expected))
    return got[keep].tobytes() == expected[keep].tobytes()


def _ops_of(dtype: str) -> list[ReduceOp]:
    if dtype in COMPLEX_DTYPES:
        return [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.AVG]
    return list(ReduceOp)


def _placements(size: int) -> list[tuple[tuple[int, int, int], int]]:
    """Offsets (dst, a, b) modulo 16 of operands of `size`-byte elements, each with the
    vector width (bytes; 0: scalar) the kernels must take there: the widest of 16, 8 and 4
    bytes (at least one element) at which all three share their offset. Every width the
    element size allows, each with and without a scalar head, and the scalar path."""
    out = [((0, 0, 0), 16), ((size % 16,) * 3, 16)]
    if size <= 8:  # 16-byte offsets differ, 8-byte ones agree
        out += [((0, 8, 0), 8), (((size % 8) + 8, size % 8, size % 8), 8)]
    if size <= 4:  # 8-byte offsets differ, 4-byte ones agree
        out += [((0, 4, 8), 4), ((size % 4, (size % 4) + 4, (size % 4) + 8), 4)]
    if size <= 2:  # no 4-byte offset in common
        out += [((0, size, 0), 0), ((3 * size % 16, 0, 5 * size % 16), 0)]
    return out


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_reduce_matches_host_device_bitwise(lib: ctypes.CDLL, dtype: str) -> None:
    """Every op, at every placement of `_placements` (each checked to take its vector
    width), sizes that leave a head, packs and a tail or only some of them, several grids."""
    dt = _np_dtype(dtype)
    rng = np.random.default_rng(sum(map(ord, dtype)))
    size = dt.itemsize
    for op in _ops_of(dtype):
        kernel = _kernel(lib, _kernels.reduce_kernel_name(dtype, op))
        for n in (0, 1, 3, 17, 64, 257):
            for aligned, width in _placements(size):
                for blocks, threads in GRIDS:
                    for divisor in ((3, 5) if op is ReduceOp.AVG else (1,)):
                        x, y = _random(rng, dt, n), _random(rng, dt, n)
                        arena = _Arena(rng, 3 * n * size + 64)
                        ia, _ = arena.place(x, aligned[1])
                        ib, _ = arena.place(y, aligned[2])
                        idst, _ = arena.place(np.zeros(n, dt), aligned[0])
                        before = arena.raw.copy()
                        data = arena.raw.ctypes.data
                        lib.emu_launch_reduce(kernel, blocks, threads, data + idst, data + ia,
                                              data + ib, n, divisor, CLEAR)
                        expected = _host_reduce(x, y, op, divisor)
                        got = arena.raw[idst:idst + n * size].view(dt)
                        where = f"{dtype} {op.value} n={n} align={aligned} " \
                            f"grid={blocks}x{threads} divisor={divisor}"
                        assert lib.emu_last_vector_width() == width, where
                        assert _same(got, expected), where
                        outside = np.ones(arena.raw.size, bool)
                        outside[idst:idst + n * size] = False
                        assert np.array_equal(arena.raw[outside], before[outside]), where


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_reduce_matches_an_independent_reference(lib: ctypes.CDLL, dtype: str) -> None:
    """Against tests/reference.py, written from the documented rules and sharing no code with
    gpuring, so a rule broken in both the kernels and the host device fails here."""
    dt = _np_dtype(dtype)
    rng = np.random.default_rng(97 + sum(map(ord, dtype)))
    n = 515
    for op in _ops_of(dtype):
        kernel = _kernel(lib, _kernels.reduce_kernel_name(dtype, op))
        for divisor in ((3, 7) if op is ReduceOp.AVG else (1,)):
            x, y = _random(rng, dt, n), _random(rng, dt, n)
            out = np.zeros(n, dt)
            lib.emu_launch_reduce(kernel, 4, 64, out.ctypes.data, x.ctypes.data,
                                  y.ctypes.data, n, divisor, CLEAR)
            name = "sum" if op is ReduceOp.AVG else op.value
            want = reference.pairwise(x, y, name, divisor)
            assert _same(out, want), f"{dtype} {op.value} divisor={divisor}"


def _chain(xs: list[np.ndarray], op: ReduceOp, divisor: int) -> np.ndarray:
    """What the chain of binary reduces computes: xs[0] op xs[1], then op xs[2], ... in that
    order, each step rounded to the dtype, the divisor at the last step only."""
    acc = xs[0]
    for k in range(1, len(xs)):
        acc = _host_reduce(acc, xs[k], op, divisor if k == len(xs) - 1 else 1)
    return acc


def _operand(rng: np.random.Generator, dt: np.dtype, n: int, op: ReduceOp) -> np.ndarray:
    """`_random`, with floating-point factors of a product near 1, so that a long chain
    stays finite and every step's rounding counts."""
    x = _random(rng, dt, n)
    if op is ReduceOp.PROD and dt.kind in "fcV":
        x = (1 + x.astype(np.complex128 if dt.kind == "c" else np.float64) / 500).astype(dt)
    return x


def _fold(lib: ctypes.CDLL, kernel: int, grid: tuple[int, int], dst: int, srcs: list[int],
          n: int, divisor: int, abort: int = CLEAR) -> None:
    """Launch the n-input kernel as CudaDevice does: one launch per `fold_launches` entry."""
    for sources, last in _kernels.fold_launches(dst, srcs):
        pointers = [*sources, *[0] * (_kernels.MAX_SOURCES - len(sources))]
        lib.emu_launch_reduce_n(kernel, *grid, dst, *pointers, len(sources), n,
                                divisor if last else 1, abort)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_reduce_n_matches_the_chain_of_binary_reduces_bitwise(lib: ctypes.CDLL,
                                                              dtype: str) -> None:
    """The n-input kernel gives the bits of the binary chain for every op, 2 to 17 sources
    (one launch up to 8, then several), at every placement of `_placements` (dst at its
    first offset, the last source at its second, the other sources at its third; the last
    launch checked to take the width), sizes with and without packs, several grids."""
    dt = _np_dtype(dtype)
    rng = np.random.default_rng(sum(map(ord, dtype)) + 1)
    size = dt.itemsize
    cases = 0
    for op in _ops_of(dtype):
        kernel = _kernel(lib, _kernels.reduce_n_kernel_name(dtype, op))
        divisor = 3 if op is ReduceOp.AVG else 1
        for nsrc in (2, 3, 8, 9, 17):
            for (o_dst, o_last, o_rest), width in _placements(size):
                for n in (1, 67):
                    grid = GRIDS[cases % len(GRIDS)]
                    cases += 1
                    xs = [_operand(rng, dt, n, op) for _ in range(nsrc)]
                    arena = _Arena(rng, (nsrc + 1) * (n * size + 32))
                    addrs = [arena.place(x, o_rest)[0] for x in xs[:-1]]
                    addrs.append(arena.place(xs[-1], o_last)[0])
                    idst, _ = arena.place(np.zeros(n, dt), o_dst)
                    before = arena.raw.copy()
                    data = arena.raw.ctypes.data
                    _fold(lib, kernel, grid, data + idst, [data + a for a in addrs], n, divisor)
                    where = f"{dtype} {op.value} nsrc={nsrc} n={n} " \
                        f"align={(o_dst, o_last, o_rest)} grid={grid}"
                    assert lib.emu_last_vector_width() == width, where
                    got = arena.raw[idst:idst + n * size].view(dt)
                    assert _same(got, _chain(xs, op, divisor)), where
                    outside = np.ones(arena.raw.size, bool)
                    outside[idst:idst + n * size] = False
                    assert np.array_equal(arena.raw[outside], before[outside]), where


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "complex64"])
def test_reduce_n_in_place(lib: ctypes.CDLL, dtype: str) -> None:
    """One launch may write over any of its sources; a longer fold may write over the
    first (each later launch starts from dst)."""
    dt = _np_dtype(dtype)
    rng = np.random.default_rng(11)
    n = 301
    kernel = _kernel(lib, _kernels.reduce_n_kernel_name(dtype, "sum"))
    for nsrc, into in ((5, 0), (5, 2), (5, 4), (12, 0)):
        xs = [_random(rng, dt, n) for _ in range(nsrc)]
        want = _chain(xs, ReduceOp.SUM, 1)
        arena = _Arena(rng, nsrc * (n * dt.itemsize + 32))
        placed = [arena.place(x, 0) for x in xs]
        data = arena.raw.ctypes.data
        _fold(lib, kernel, (2, 32), data + placed[into][0], [data + a for a, _ in placed], n, 1)
        assert _same(placed[into][1], want), (nsrc, into)


@pytest.mark.parametrize("dtype", ["float16", "int32", "complex128"])
@pytest.mark.parametrize("into", ["a", "b"])
def test_reduce_in_place(lib: ctypes.CDLL, dtype: str, into: str) -> None:
    """dst may alias either operand (the reduce-scatter accumulates in place)."""
    dt = np.dtype(dtype)
    rng = np.random.default_rng(7)
    n = 301
    kernel = _kernel(lib, _kernels.reduce_kernel_name(dtype, "sum"))
    for misalign in (0, dt.itemsize):
        x, y = _random(rng, dt, n), _random(rng, dt, n)
        arena = _Arena(rng, 2 * x.nbytes + 64)
        ia, va = arena.place(x, misalign)
        ib, vb = arena.place(y, misalign)
        idst = ia if into == "a" else ib
        data = arena.raw.ctypes.data
        lib.emu_launch_reduce(kernel, 2, 32, data + idst, data + ia, data + ib, n, 1, CLEAR)
        result = va if into == "a" else vb
        assert _same(result, _host_reduce(x, y, ReduceOp.SUM, 1))


def test_integer_sum_wraps_and_average_truncates_toward_zero(lib: ctypes.CDLL) -> None:
    x = np.array([2**31 - 1, -7, 7, -(2**31), -1], np.int32)
    y = np.array([1, 0, 0, -1, 0], np.int32)
    out = np.zeros_like(x)
    kernel = _kernel(lib, _kernels.reduce_kernel_name("int32", "sum"))
    lib.emu_launch_reduce(kernel, 1, 4, out.ctypes.data, x.ctypes.data, y.ctypes.data, 5, 1,
                          CLEAR)
    assert out.tolist() == [-(2**31), -7, 7, 2**31 - 1, -1]
    lib.emu_launch_reduce(kernel, 1, 4, out.ctypes.data, x.ctypes.data, y.ctypes.data, 5, 2,
                          CLEAR)
    # (2^31-1)+1 wraps to -2^31, /2; -7/2 -> -3; 7/2 -> 3; ...; -1/2 -> 0
    assert out.tolist() == [-(2**30), -3, 3, (2**31 - 1) // 2, 0]


def test_copy_bytes(lib: ctypes.CDLL) -> None:
    rng = np.random.default_rng(3)
    kernel = _kernel(lib, _kernels.COPY_KERNEL)
    # (dst, src) offsets modulo 16 and the vector width each takes
    placements = (((0, 0), 16), ((5, 5), 16), ((8, 0), 8), ((3, 11), 8), ((4, 0), 4),
                  ((1, 5), 4), ((3, 9), 0), ((2, 0), 0))
    for nbytes in (0, 1, 15, 16, 17, 100, 1000):
        for (dst_mis, src_mis), width in placements:
            for blocks, threads in GRIDS:
                src = rng.integers(0, 256, nbytes, dtype=np.uint8)
                arena = _Arena(rng, 2 * nbytes + 64)
                isrc, _ = arena.place(src, src_mis)
                idst, _ = arena.place(np.zeros(nbytes, np.uint8), dst_mis)
                before = arena.raw.copy()
                data = arena.raw.ctypes.data
                lib.emu_launch_copy(kernel, blocks, threads, data + idst, data + isrc, nbytes,
                                    CLEAR)
                assert lib.emu_last_vector_width() == width
                assert np.array_equal(arena.raw[idst:idst + nbytes], src)
                before[idst:idst + nbytes] = src
                assert np.array_equal(arena.raw, before)


def test_data_kernels_do_nothing_once_aborted(lib: ctypes.CDLL) -> None:
    """After an abort, queued reduces (binary and n-input) and copies run without reading or
    writing anything: a dead peer's memory may be gone, and a result computed then is
    garbage. An n-input launch with a source count outside 1..8 does nothing either."""
    aborted = np.ones(1, np.int32)
    x = np.arange(1, 65, dtype=np.float32)
    out = np.full(64, -1.0, np.float32)
    bad = 16  # an address nothing may read: the kernels must not touch their operands
    reduce = _kernel(lib, _kernels.reduce_kernel_name("float32", "sum"))
    lib.emu_launch_reduce(reduce, 2, 32, out.ctypes.data, x.ctypes.data, bad, 64, 1,
                          aborted.ctypes.data)
    lib.emu_launch_copy(_kernel(lib, _kernels.COPY_KERNEL), 2, 32, out.ctypes.data, bad,
                        out.nbytes, aborted.ctypes.data)
    fold = _kernel(lib, _kernels.reduce_n_kernel_name("float32", "sum"))
    for count, abort in ((3, aborted.ctypes.data), (0, CLEAR), (9, CLEAR)):  # or a bad count
        lib.emu_launch_reduce_n(fold, 2, 32, out.ctypes.data, x.ctypes.data, bad, bad,
                                *[bad] * 5, count, 64, 1, abort)
    assert np.all(out == -1.0)
    lib.emu_launch_reduce(reduce, 2, 32, out.ctypes.data, x.ctypes.data, x.ctypes.data, 64, 1,
                          CLEAR)
    assert np.array_equal(out, 2 * x)


class _Flags:
    def __init__(self) -> None:
        self.flag = np.zeros(1, np.uint64)
        self.status = np.zeros(1, np.int32)
        self.abort = np.zeros(1, np.int32)


def _wait(lib: ctypes.CDLL, f: _Flags, value: int, timeout_ns: int) -> float:
    start = time.monotonic()
    lib.emu_launch_wait(_kernel(lib, _kernels.WAIT_FLAG_KERNEL), 1, 1, f.flag.ctypes.data,
                        value, timeout_ns, f.status.ctypes.data, f.abort.ctypes.data)
    return time.monotonic() - start


def test_wait_flag_returns_once_the_flag_is_reached(lib: ctypes.CDLL) -> None:
    f = _Flags()
    f.flag[0] = (5 << 32) | 3
    _wait(lib, f, (5 << 32) | 3, 0)  # already there (64-bit comparison)
    assert f.status[0] == 0

    def publish() -> None:
        time.sleep(0.05)
        f.flag[0] = (6 << 32)

    writer = threading.Thread(target=publish)
    writer.start()
    _wait(lib, f, (5 << 32) | 4, 0)  # no timeout: returns only when the flag moves
    writer.join()
    assert f.flag[0] == 6 << 32 and f.status[0] == 0


def test_wait_flag_times_out_into_the_status_word(lib: ctypes.CDLL) -> None:
    """A timed-out wait tells the host (status) and stops the kernels queued after it
    (abort), so nothing after the wait runs on data that never came."""
    f = _Flags()
    waited = _wait(lib, f, 1, timeout_ns=20_000_000)
    assert f.status[0] == 1 and f.abort[0] == 1
    assert waited >= 0.02


def test_wait_flag_returns_at_once_after_an_abort(lib: ctypes.CDLL) -> None:
    f = _Flags()
    f.status[0] = 2
    assert _wait(lib, f, 1, timeout_ns=0) < 5.0  # would spin forever without the abort
    assert f.status[0] == 2 and f.flag[0] == 0
    assert f.abort[0] == 1  # the kernels queued after it are off, whatever the host did


def test_write_flag_publishes_only_while_not_aborted(lib: ctypes.CDLL) -> None:
    f = _Flags()
    kernel = _kernel(lib, _kernels.WRITE_FLAG_KERNEL)
    lib.emu_launch_write(kernel, 1, 1, f.flag.ctypes.data, 9, f.abort.ctypes.data)
    assert f.flag[0] == 9
    f.abort[0] = 1
    lib.emu_launch_write(kernel, 1, 1, f.flag.ctypes.data, 10, f.abort.ctypes.data)
    assert f.flag[0] == 9
    # extra threads of a wider launch must not write
    f.abort[0] = 0
    lib.emu_launch_write(kernel, 2, 3, f.flag.ctypes.data, 11, f.abort.ctypes.data)
    assert f.flag[0] == 11


def test_write_flags_sets_the_first_count_flags_while_not_aborted(lib: ctypes.CDLL) -> None:
    """Several flags in one launch: the first `count`, to one value, never lowered, nothing
    once aborted, nothing from extra threads; the unused pointers are never touched."""
    kernel = _kernel(lib, _kernels.WRITE_FLAGS_KERNEL)
    words = np.zeros(_kernels.MAX_FLAGS, dtype=np.uint64)
    words[2] = RELEASED
    abort = np.zeros(1, dtype=np.int32)
    pointers = [words[i:].ctypes.data for i in range(5)] + [0] * (_kernels.MAX_FLAGS - 5)
    lib.emu_launch_write_many(kernel, 2, 3, *pointers, 5, 7, abort.ctypes.data)
    assert words.tolist() == [7, 7, RELEASED, 7, 7, 0, 0, 0]
    abort[0] = 1
    lib.emu_launch_write_many(kernel, 1, 1, *pointers, 5, 9, abort.ctypes.data)
    assert words.tolist() == [7, 7, RELEASED, 7, 7, 0, 0, 0]


def test_write_flag_never_lowers_a_word(lib: ctypes.CDLL) -> None:
    """A released wait word (raised to the largest value by an abort) stays released even
    when a late producer writes its ordinary value."""
    f = _Flags()
    f.flag[0] = RELEASED
    lib.emu_launch_write(_kernel(lib, _kernels.WRITE_FLAG_KERNEL), 1, 1, f.flag.ctypes.data,
                         (7 << 32) | 3, f.abort.ctypes.data)
    assert f.flag[0] == RELEASED


# ------------------------------------------------------------------ one-kernel all_reduce

class _FusedRank:
    """One rank of the one-kernel all_reduce: its region, status and abort words."""

    def __init__(self, slot_bytes: int):
        self.region = np.zeros(_kernels.fused_region_bytes(slot_bytes), np.uint8)
        self.status = np.zeros(2, np.int32)
        self.abort = np.zeros(1, np.int32)


#: the collectives of gpuring_fused_* (GPURING_ALL_REDUCE ... in reduce.cu)
KINDS = {"all_reduce": 0, "reduce_scatter": 1, "all_gather": 2, "broadcast": 3, "reduce": 4}


def _fused_calls(lib: ctypes.CDLL, dtype: str, op: ReduceOp, inputs: list[list[np.ndarray]],
                 grid: int | list[int], *, in_place: bool = False, timeout_ns: int = 10**10,
                 ranks: list[_FusedRank] | None = None, kind: str = "all_reduce",
                 root: int = 0) -> list[list[np.ndarray]]:
    """Every rank (a thread each) launches the kernel once per call, inputs[call][rank], with
    `grid` blocks (or grid[call]), never waiting for the others between calls; returns
    outputs[call][rank] (in place: all_gather's input is the rank's block of the output,
    reduce_scatter's output the rank's block of the input)."""
    grids = grid if isinstance(grid, list) else [grid] * len(inputs)
    nranks = len(inputs[0])
    slot = -(-max(x.nbytes for call in inputs for x in call) // 16) * 16
    ranks = ranks or [_FusedRank(slot) for _ in range(nranks)]
    regions = [r.region.ctypes.data for r in ranks]
    regions += [0] * (_kernels.FUSED_MAX_RANKS - nranks)
    kernel = _kernel(lib, _kernels.fused_kernel_name(dtype, op))
    divisor = nranks if op is ReduceOp.AVG else 1
    outputs = [[np.empty(0)] * nranks for _ in inputs]

    def rank_main(r: int) -> None:
        for c, call in enumerate(inputs):
            x = call[r].copy()
            n = x.size
            if kind == "all_gather":
                out = np.zeros(nranks * x.size, x.dtype)
                if in_place:
                    out[r * n:(r + 1) * n] = x
                    x = out[r * n:(r + 1) * n]
            elif kind == "reduce_scatter":
                n = x.size // nranks
                out = x[r * n:(r + 1) * n] if in_place else np.zeros(n, x.dtype)
            else:
                out = x if in_place else np.zeros_like(x)
            lib.emu_launch_fused(kernel, grids[c], 32, out.ctypes.data, x.ctypes.data, n, n,
                                  divisor, KINDS[kind], root, r, nranks, *regions, slot,
                                  timeout_ns, ranks[r].status.ctypes.data,
                                  ranks[r].abort.ctypes.data)
            outputs[c][r] = out.copy()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(nranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outputs


@pytest.mark.parametrize("kind", ["reduce_scatter", "all_gather", "broadcast", "reduce"])
@pytest.mark.parametrize("nranks", [2, 3])
def test_one_kernel_collectives_of_every_kind(lib: ctypes.CDLL, kind: str, nranks: int) -> None:
    """reduce_scatter (the rank-order fold of this rank's block), all_gather, broadcast and
    reduce (the root's result; the others' outputs untouched) from the same kernel, several
    calls with fresh inputs and changing grids, out of place and in place."""
    rng = np.random.default_rng(nranks * 7 + len(kind))
    dt = np.dtype(np.float32)
    root = nranks - 1
    for in_place in (False, True):
        sizes = [(int(rng.integers(1, 300)), int(rng.integers(1, 5))) for _ in range(6)]
        per_rank = nranks if kind == "reduce_scatter" else 1
        calls = [[_operand(rng, dt, n * per_rank, ReduceOp.SUM) for _ in range(nranks)]
                 for n, _ in sizes]
        got = _fused_calls(lib, "float32", ReduceOp.SUM, calls, [g for _, g in sizes],
                           in_place=in_place, kind=kind, root=root)
        for c, call in enumerate(calls):
            n = sizes[c][0]
            for r in range(nranks):
                where = f"{kind} in_place={in_place} call {c} n={n} rank {r}"
                if kind == "reduce_scatter":
                    want = _chain([x[r * n:(r + 1) * n] for x in call], ReduceOp.SUM, 1)
                elif kind == "all_gather":
                    want = np.concatenate(call)
                elif kind == "broadcast":
                    want = call[root]
                elif r == root:
                    want = _chain(call, ReduceOp.SUM, 1)
                else:  # a reduce leaves the others' outputs alone
                    want = call[r] if in_place else np.zeros(n, dt)
                assert _same(got[c][r], want), where



@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather"])
def test_one_kernel_pieces_of_a_larger_collective(lib: ctypes.CDLL, kind: str) -> None:
    """A collective larger than a slot as one launch per piece (how a CUDA graph records it):
    each launch covers `n` elements of every rank's block, `stride` apart in the array that
    holds every rank's (reduce_scatter's input, all_gather's output); the last piece is
    shorter. The result is the whole collective's."""
    nranks, total, piece = 3, 1000, 144  # 6 whole pieces and one of 136
    dt = np.dtype(np.float32)
    rng = np.random.default_rng(len(kind))
    per_rank = nranks if kind == "reduce_scatter" else 1
    inputs = [_operand(rng, dt, total * per_rank, ReduceOp.SUM) for _ in range(nranks)]
    ranks = [_FusedRank(piece * per_rank * dt.itemsize) for _ in range(nranks)]
    regions = [r.region.ctypes.data for r in ranks]
    regions += [0] * (_kernels.FUSED_MAX_RANKS - nranks)
    kernel = _kernel(lib, _kernels.fused_kernel_name("float32", "sum"))
    outputs = [np.full(total * (nranks if kind == "all_gather" else 1), -1, dt)
               for _ in range(nranks)]

    def rank_main(r: int) -> None:
        x, out = inputs[r], outputs[r]
        for lo in range(0, total, piece):
            n = min(piece, total - lo)
            at = lo * dt.itemsize
            lib.emu_launch_fused(kernel, 2, 32, out.ctypes.data + at, x.ctypes.data + at, n,
                                  total, 1, KINDS[kind], 0, r, nranks, *regions,
                                  piece * per_rank * dt.itemsize, 10**10,
                                  ranks[r].status.ctypes.data, ranks[r].abort.ctypes.data)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(nranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(nranks):
        if kind == "reduce_scatter":
            want = _chain([x[r * total:(r + 1) * total] for x in inputs], ReduceOp.SUM, 1)
        elif kind == "all_gather":
            want = np.concatenate(inputs)
        else:
            want = _chain(inputs, ReduceOp.SUM, 1)
        assert _same(outputs[r], want), f"{kind} rank {r}"

@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8", "complex128", "float64"])
@pytest.mark.parametrize("nranks", [2, 3, 8])
def test_one_kernel_all_reduce_folds_every_rank_in_rank_order(lib: ctypes.CDLL, dtype: str,
                                                              nranks: int) -> None:
    """Every rank gets the bits of the rank-order chain of binary reduces, over several calls
    with fresh inputs (the slots alternate, the block counters move on), for sizes that leave
    blocks empty, ragged and full, each op; in place too."""
    dt = _np_dtype(dtype)
    rng = np.random.default_rng(nranks * 100 + sum(map(ord, dtype)))
    for op in _ops_of(dtype)[:3]:
        divisor = nranks if op is ReduceOp.AVG else 1
        for n, grid in ((1, 1), (37, 3), (300, 4)):
            calls = [[_operand(rng, dt, n, op) for _ in range(nranks)] for _ in range(3)]
            got = _fused_calls(lib, dtype, op, calls, grid, in_place=n == 37)
            for c, call in enumerate(calls):
                expected = _chain(call, op, divisor)
                for r in range(nranks):
                    where = f"{dtype} {op.value} n={n} grid={grid} call {c} rank {r}"
                    assert _same(got[c][r], expected), where


@pytest.mark.parametrize("nranks", [2, 3])
def test_one_kernel_all_reduce_calls_of_changing_grids(lib: ctypes.CDLL, nranks: int) -> None:
    """Back-to-back calls of different sizes and grids (a block's range moves from call to
    call): no rank overwrites a slot a peer still reads."""
    rng = np.random.default_rng(5 + nranks)
    shapes = [(int(rng.integers(1, 700)), int(rng.integers(1, 9))) for _ in range(40)]
    calls = [[_operand(rng, np.dtype(np.float32), n, ReduceOp.SUM) for _ in range(nranks)]
             for n, _ in shapes]
    got = _fused_calls(lib, "float32", ReduceOp.SUM, calls, [g for _, g in shapes])
    for c, call in enumerate(calls):
        expected = _chain(call, ReduceOp.SUM, 1)
        for r in range(nranks):
            assert _same(got[c][r], expected), f"call {c} {shapes[c]} rank {r}"


def test_one_kernel_all_reduce_times_out_naming_the_peer(lib: ctypes.CDLL) -> None:
    """A rank whose peer never launches gives up after the timeout: the status words say
    "timed out" and which peer, the abort word is set, the output is left alone."""
    ranks = [_FusedRank(64) for _ in range(3)]
    kernel = _kernel(lib, _kernels.fused_kernel_name("float32", "sum"))
    regions = [r.region.ctypes.data for r in ranks] + [0] * 5
    x = np.arange(16, dtype=np.float32)
    out = np.full(16, -1, np.float32)
    start = time.monotonic()
    lib.emu_launch_fused(kernel, 1, 32, out.ctypes.data, x.ctypes.data, 16, 16, 1, 0, 0, 0, 3,
                              *regions, 64, 20_000_000, ranks[0].status.ctypes.data,
                              ranks[0].abort.ctypes.data)
    assert time.monotonic() - start >= 0.02
    assert ranks[0].status[0] == 1 and ranks[0].status[1] in (2, 3)
    assert ranks[0].abort[0] == 1
    assert (out == -1).all()
    # once aborted, a launch does nothing at all (its epoch does not move)
    counters = ranks[0].region[:16].copy()
    lib.emu_launch_fused(kernel, 1, 32, out.ctypes.data, x.ctypes.data, 16, 16, 1, 0, 0, 0, 3,
                              *regions, 64, 0, ranks[0].status.ctypes.data,
                              ranks[0].abort.ctypes.data)
    assert (ranks[0].region[:16] == counters).all() and (out == -1).all()


def test_one_kernel_all_reduce_returns_when_the_host_aborts(lib: ctypes.CDLL) -> None:
    rank = _FusedRank(64)
    other = _FusedRank(64)
    kernel = _kernel(lib, _kernels.fused_kernel_name("int32", "max"))
    regions = [rank.region.ctypes.data, other.region.ctypes.data] + [0] * 6
    x = np.arange(16, dtype=np.int32)
    out = np.full(16, -1, np.int32)

    def abort_soon() -> None:
        time.sleep(0.05)
        rank.status[0] = 2

    helper = threading.Thread(target=abort_soon)
    helper.start()
    lib.emu_launch_fused(kernel, 2, 32, out.ctypes.data, x.ctypes.data, 16, 16, 1, 0, 0, 0, 2,
                              *regions, 64, 0, rank.status.ctypes.data, rank.abort.ctypes.data)
    helper.join()
    assert rank.abort[0] == 1 and (out == -1).all()


def test_stage_publish_copies_then_sets_the_flags_once(lib: ctypes.CDLL) -> None:
    """The staging kernel of the stream-memory-operation all_reduce: the bytes copied (any
    grid), then the first `count` flags set (never lowered), its blocks-done word back to 0;
    nothing published, nothing copied, once aborted."""
    kernel = _kernel(lib, _kernels.STAGE_KERNEL)
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, 1000, dtype=np.uint8)
    dst = np.zeros(1003, np.uint8)
    flags = np.zeros(_kernels.MAX_FLAGS, np.uint64)
    flags[1] = RELEASED
    done = np.zeros(1, np.uint32)
    abort = np.zeros(1, np.int32)
    pointers = [flags[i:].ctypes.data for i in range(3)] + [0] * (_kernels.MAX_FLAGS - 3)
    for grid, value in ((1, 5), (3, 6)):
        lib.emu_launch_stage(kernel, grid, 32, dst[1:].ctypes.data, src.ctypes.data, 1000,
                             *pointers, 3, value, done.ctypes.data, abort.ctypes.data)
        assert np.array_equal(dst[1:1001], src) and dst[0] == 0 and (dst[1001:] == 0).all()
        assert flags.tolist() == [value, RELEASED, value, 0, 0, 0, 0, 0]
        assert done[0] == 0
    abort[0] = 1
    dst[:] = 0
    lib.emu_launch_stage(kernel, 2, 32, dst.ctypes.data, src.ctypes.data, 1000, *pointers, 3,
                         9, done.ctypes.data, abort.ctypes.data)
    assert flags.tolist() == [6, RELEASED, 6, 0, 0, 0, 0, 0] and (dst == 0).all()
