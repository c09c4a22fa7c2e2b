"""CudaDevice on a real GPU: kernels against NumPy references, copies, flags, IPC, close."""

from __future__ import annotations

import gc
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy", reason="CuPy is not installed")


def _gpu_count() -> int:
    try:
        return int(cp.cuda.runtime.getDeviceCount())
    except Exception:  # no driver, no device
        return 0


if _gpu_count() == 0:
    pytest.skip("no CUDA device", allow_module_level=True)

from gpuring._errors import GpuringError  # noqa: E402
from gpuring._ops import COMPLEX_DTYPES, SUPPORTED_DTYPES, ReduceOp  # noqa: E402
from gpuring.devices import _cuda_driver  # noqa: E402
from gpuring.devices import cuda as cuda_module  # noqa: E402
from gpuring.devices.base import Flag, FlagWaitAborted, FlagWaitTimeout, Span  # noqa: E402
from gpuring.devices.cuda import RELEASED, CudaDevice, CudaMemory  # noqa: E402

FLAG_MODES = ["kernel"] + (["memops"] if _cuda_driver.memops_support(0) is None else [])


@pytest.fixture(params=FLAG_MODES)
def device(request: pytest.FixtureRequest) -> Iterator[CudaDevice]:
    dev = CudaDevice(0, timeout=20.0, flags=request.param)
    yield dev
    dev.close()


# ------------------------------------------------------------------------------ references

def _random(dtype: str, n: int, rng: np.random.Generator) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=n, dtype=dt, endpoint=True)
    if dt.kind == "c":
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dt)
    return (rng.standard_normal(n) * 4).astype(dt)


def _wrap(value: int, dt: np.dtype) -> int:
    bits = dt.itemsize * 8
    value &= (1 << bits) - 1
    if dt.kind == "i" and value >= 1 << (bits - 1):
        value -= 1 << bits
    return value


def _reference(a: np.ndarray, b: np.ndarray, op: ReduceOp, divisor: int) -> np.ndarray:
    """Exact integers (Python ints, wrapped, C division); floats in the kernel's precision
    (float16 through float32, rounded once)."""
    dt = a.dtype
    if dt.kind in "iu":
        out = []
        for x, y in zip(a.tolist(), b.tolist(), strict=True):
            if op in (ReduceOp.SUM, ReduceOp.AVG):
                v = _wrap(x + y, dt)
            elif op is ReduceOp.PROD:
                v = _wrap(x * y, dt)
            else:
                v = min(x, y) if op is ReduceOp.MIN else max(x, y)
            if divisor != 1:
                v = abs(v) // divisor * (1 if v >= 0 else -1)
            out.append(v)
        return np.array(out, dtype=dt)
    work = np.float32 if dt.name in ("float16", "bfloat16") else dt.type
    x, y = a.astype(work), b.astype(work)
    ufunc = {ReduceOp.SUM: np.add, ReduceOp.AVG: np.add, ReduceOp.PROD: np.multiply,
             ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}[op]
    r = ufunc(x, y)
    if divisor != 1 and dt.kind == "c":  # the kernel divides each part by the real divisor
        q = np.empty_like(r)
        q.real = r.real / r.real.dtype.type(divisor)
        q.imag = r.imag / r.imag.dtype.type(divisor)
        r = q
    elif divisor != 1:
        r = r / work(divisor)
    return r.astype(dt)


def _ops_for(dtype: str) -> list[ReduceOp]:
    if dtype in COMPLEX_DTYPES:
        return [ReduceOp.SUM, ReduceOp.PROD, ReduceOp.AVG]
    return list(ReduceOp)


def _ready_stream(dev: CudaDevice) -> Any:
    """A device stream, after the caller's stream finished making the inputs (device streams
    are non-blocking: they do not wait for the legacy stream by themselves)."""
    cp.cuda.get_current_stream().synchronize()
    return dev.create_stream()


def _span(mem, offset: int, nbytes: int) -> Span:
    return Span(mem, offset, nbytes)


def _check(got: np.ndarray, want: np.ndarray, dtype: str, op: ReduceOp) -> None:
    if dtype in COMPLEX_DTYPES and op is ReduceOp.PROD:
        rtol = 1e-6 if dtype == "complex64" else 1e-14
        np.testing.assert_allclose(got, want, rtol=rtol)
    else:
        np.testing.assert_array_equal(got, want)


# ------------------------------------------------------------------------------ reduce

@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_reduce_matches_numpy(device: CudaDevice, dtype: str) -> None:
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(1)
    n = 5003
    a, b = _random(dtype, n, rng), _random(dtype, n, rng)
    ga, gb = cp.asarray(a), cp.asarray(b)
    for op in _ops_for(dtype):
        divisor = 3 if op is ReduceOp.AVG else 1
        out = cp.zeros_like(ga)
        stream = _ready_stream(device)
        ma, mb, mo = device.wrap(ga), device.wrap(gb), device.wrap(out)
        nbytes = ga.nbytes
        stream.reduce(_span(mo, 0, nbytes), _span(ma, 0, nbytes), _span(mb, 0, nbytes),
                      dtype, op, divisor)
        stream.synchronize()
        _check(cp.asnumpy(out), _reference(a, b, op, divisor), dtype, op)


@pytest.mark.parametrize("dtype", ["int8", "float16", "float32", "float64", "complex128"])
@pytest.mark.parametrize("offsets", [(0, 0, 0), (1, 1, 1), (3, 3, 3), (0, 1, 2), (5, 0, 5)])
@pytest.mark.parametrize("n", [0, 1, 7, 17, 1000, 4099])
def test_reduce_unaligned_offsets_and_tails(device: CudaDevice, dtype: str,
                                            offsets: tuple[int, int, int], n: int) -> None:
    rng = np.random.default_rng(n)
    item = np.dtype(dtype).itemsize
    pad = 8
    a, b = _random(dtype, n + pad, rng), _random(dtype, n + pad, rng)
    out = cp.zeros(n + pad, dtype)
    ma, mb, mo = device.wrap(cp.asarray(a)), device.wrap(cp.asarray(b)), device.wrap(out)
    od, oa, ob = offsets
    stream = _ready_stream(device)
    stream.reduce(_span(mo, od * item, n * item), _span(ma, oa * item, n * item),
                  _span(mb, ob * item, n * item), dtype, ReduceOp.SUM)
    stream.synchronize()
    got = cp.asnumpy(out)
    np.testing.assert_array_equal(got[od:od + n],
                                  _reference(a[oa:oa + n], b[ob:ob + n], ReduceOp.SUM, 1))
    assert not got[:od].any() and not got[od + n:].any()  # nothing written outside


@pytest.mark.parametrize("dtype", ["float32", "float64", "complex64"])
def test_subnormals_are_not_flushed(device: CudaDevice, dtype: str) -> None:
    """The kernels are built without -ftz (CuPy's RawModule would flush subnormals to 0)."""
    tiny = np.finfo(np.dtype(dtype).type(0).real.dtype).smallest_subnormal
    a = np.full(64, tiny * 3, dtype=dtype)
    b = np.full(64, tiny * 2, dtype=dtype)
    ga, gb, out = cp.asarray(a), cp.asarray(b), cp.zeros(64, dtype=dtype)
    stream = _ready_stream(device)
    ma, mb, mo = device.wrap(ga), device.wrap(gb), device.wrap(out)
    stream.reduce(_span(mo, 0, a.nbytes), _span(ma, 0, a.nbytes), _span(mb, 0, a.nbytes),
                  dtype, ReduceOp.SUM)
    stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(out), a + b)
    assert (cp.asnumpy(out) != 0).all()


def test_min_max_propagate_nan(device: CudaDevice) -> None:
    a = cp.asarray(np.array([np.nan, 1.0, 2.0, np.nan], np.float32))
    b = cp.asarray(np.array([0.0, np.nan, 3.0, np.nan], np.float32))
    for op, mid in ((ReduceOp.MIN, 2.0), (ReduceOp.MAX, 3.0)):
        out = cp.zeros(4, np.float32)
        stream = _ready_stream(device)
        ma, mb, mo = device.wrap(a), device.wrap(b), device.wrap(out)
        stream.reduce(_span(mo, 0, 16), _span(ma, 0, 16), _span(mb, 0, 16), "float32", op)
        stream.synchronize()
        got = cp.asnumpy(out)
        assert np.isnan(got[[0, 1, 3]]).all() and got[2] == mid


def test_reduce_in_place(device: CudaDevice) -> None:
    a = cp.arange(10000, dtype=cp.int32)
    b = cp.full(10000, 7, dtype=cp.int32)
    ma, mb = device.wrap(a), device.wrap(b)
    stream = _ready_stream(device)
    stream.reduce(_span(ma, 0, a.nbytes), _span(ma, 0, a.nbytes), _span(mb, 0, b.nbytes),
                  "int32", ReduceOp.SUM)
    stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(a), np.arange(10000, dtype=np.int32) + 7)


@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_reduce_n_gives_the_bits_of_the_binary_chain(device: CudaDevice, dtype: str) -> None:
    """reduce_n (one launch up to 8 sources, several beyond) gives bit for bit what the chain
    reduce(dst, s0, s1), reduce(dst, dst, s2), ... gives on the same GPU, the divisor at the
    last step; sources at offsets that share no 16-byte alignment with dst."""
    if dtype == "bfloat16":
        pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(5)
    item = np.dtype(dtype).itemsize
    n = 1003
    for op in _ops_for(dtype):
        divisor = 7 if op is ReduceOp.AVG else 1
        for nsrc in (3, 11):
            offsets = [(k % 3) * max(1, 4 // item) for k in range(nsrc)]
            srcs = [device.wrap(cp.asarray(_random(dtype, n + 4, rng))) for _ in range(nsrc)]
            spans = [_span(m, o * item, n * item) for m, o in zip(srcs, offsets, strict=True)]
            chain, fold = cp.zeros(n, dtype), cp.zeros(n + 1, dtype)
            mc, mf = device.wrap(chain), device.wrap(fold)
            stream = _ready_stream(device)
            acc = _span(mc, 0, n * item)
            for k in range(1, nsrc):
                stream.reduce(acc, spans[0] if k == 1 else acc, spans[k], dtype, op,
                              divisor if k == nsrc - 1 else 1)
            stream.reduce_n(_span(mf, item, n * item), spans, dtype, op, divisor)
            stream.synchronize()
            got = cp.asnumpy(fold)
            assert got[1:].tobytes() == cp.asnumpy(chain).tobytes(), (op, nsrc)
            assert not got[0], (op, nsrc)  # nothing written before dst


def test_grids_are_at_most_one_wave_of_each_kernel(device: CudaDevice) -> None:
    """A grid-stride kernel's grid is capped at the blocks of that kernel that fit on all
    SMs at once, as the driver reports for it (kernels differ: their registers decide), so a
    large reduce runs one whole wave. On the simulator the driver's answer comes from the
    registers of the NVRTC build that was loaded, and the launch itself is checked."""
    from gpuring.devices import _kernels

    sms = int(device.gpu.attributes["MultiProcessorCount"])
    kernels = [device.reduce_kernel("float16", ReduceOp.SUM)[0],
               device.reduce_n_kernel("int8", ReduceOp.MAX)[0],
               _kernels.get_function(_kernels.COPY_KERNEL, device.device_id)]
    for kernel in kernels:
        per_sm = device.blocks_per_sm(kernel)
        assert 1 <= per_sm <= 2048 // 256
        assert device.grid_for(kernel, 1 << 40, 1) == sms * per_sm
        assert device.grid_for(kernel, 300, 1) == 2
        if hasattr(kernel, "registers"):  # the simulator
            from cubin import blocks_per_sm

            assert kernel.registers, "no register count from the loaded CUBIN"
            assert per_sm == blocks_per_sm(kernel.registers, 256)
    n = sms * 8 * 256 * 8 + 1  # float16: 8 elements a thread; more than one wave at most
    a = cp.ones(n, cp.float16)
    ma = device.wrap(a)
    stream = _ready_stream(device)
    stream.reduce(_span(ma, 0, 2 * n), _span(ma, 0, 2 * n), _span(ma, 0, 2 * n), "float16",
                  ReduceOp.SUM)
    stream.synchronize()
    assert bool((a == 2).all())
    if hasattr(kernels[0], "last_grid"):  # the simulator
        assert kernels[0].last_grid == sms * device.blocks_per_sm(kernels[0])


# ------------------------------------------------------------------------------ copy

@pytest.mark.parametrize("copy_mode", ["memcpy", "kernel"])
@pytest.mark.parametrize("offsets", [(0, 0), (3, 3), (1, 6), (16, 0)])
@pytest.mark.parametrize("n", [0, 1, 15, 16, 33, 100003])
def test_copy(copy_mode: str, offsets: tuple[int, int], n: int) -> None:
    dev = CudaDevice(0, timeout=20.0, copy=copy_mode)
    try:
        src_host = np.random.default_rng(n).integers(0, 256, n + 32, dtype=np.uint8)
        src = dev.wrap(cp.asarray(src_host))
        dst_arr = cp.zeros(n + 32, cp.uint8)
        dst = dev.wrap(dst_arr)
        od, os_ = offsets
        stream = _ready_stream(dev)
        stream.copy(_span(dst, od, n), _span(src, os_, n))
        stream.synchronize()
        got = cp.asnumpy(dst_arr)
        np.testing.assert_array_equal(got[od:od + n], src_host[os_:os_ + n])
        assert not got[:od].any() and not got[od + n:].any()
    finally:
        dev.close()


# ------------------------------------------------------------------------------ flags

def test_flag_orders_two_streams(device: CudaDevice) -> None:
    """The reader's copy runs after the writer's flag, not merely later: the test raises the
    flag only once the reader has reached its wait (a marker written just before it is
    visible) and the copy has not run; the copy's source holds -1 until the writer's reduce,
    so a copy that ran before the flag leaves -1 behind."""
    flags = device.alloc(64)
    flag, marker = Flag(flags, 8), Flag(flags, 16)
    n = 1 << 20
    x, y = cp.arange(n, dtype=cp.float32), cp.ones(n, dtype=cp.float32)
    src, dst = cp.full(n, -1, cp.float32), cp.zeros(n, cp.float32)
    mx, my, ms, md = (device.wrap(v) for v in (x, y, src, dst))
    nbytes = n * 4
    reader, writer = _ready_stream(device), _ready_stream(device)

    reader.write_flag(marker, 1)
    reader.wait_flag(flag, 5, tag="test-wait")
    reader.copy(_span(md, 0, nbytes), _span(ms, 0, nbytes))
    copied = reader.record()
    deadline = time.monotonic() + 60  # only so that a broken device fails instead of hanging
    while device.read_u64(flags.ptr + 16) != 1:
        assert time.monotonic() < deadline, "the reader never reached its wait"
        time.sleep(1e-3)
    assert not copied.query(), "the copy ran before the flag it waits for"
    assert not cp.asnumpy(dst).any(), "the copy ran before the flag it waits for"

    writer.reduce(_span(ms, 0, nbytes), _span(mx, 0, nbytes), _span(my, 0, nbytes),
                  "float32", ReduceOp.SUM)
    writer.write_flag(flag, 5)
    writer.synchronize()
    reader.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(dst), np.arange(n, dtype=np.float32) + 1)
    assert device.read_u64(flags.ptr + 8) == 5


def test_events_order_streams_and_caller(device: CudaDevice) -> None:
    n = 1 << 20
    x = cp.zeros(n, cp.float32)
    x += 2  # on the caller's current stream
    before = device.caller_event()
    assert before is not None
    stream = device.create_stream()
    stream.wait_event(before)
    mx = device.wrap(x)
    stream.reduce(_span(mx, 0, n * 4), _span(mx, 0, n * 4), _span(mx, 0, n * 4), "float32",
                  ReduceOp.SUM)
    device.order_caller_after(stream.record())
    assert float(x.sum()) == 4.0 * n  # read on the caller's stream, after the reduce


def test_the_device_counts_each_driver_call(device: CudaDevice) -> None:
    """`operations` grows by the driver calls each stream operation makes: one per copy,
    reduce, flag wait, flag write, event record and event wait, and one per event created
    (events are reused once nothing holds them). On the CUDA simulator, which counts the
    calls it receives, the two counts agree."""
    simulated = getattr(cp, "driver_calls", None)
    n = 4096
    x, y = cp.arange(n, dtype=cp.float32), cp.ones(n, dtype=cp.float32)
    mx, my = device.wrap(x), device.wrap(y)
    flags = device.alloc(64)
    stream = _ready_stream(device)
    stream.synchronize()
    start, start_sim = device.operations, simulated[0] if simulated else 0
    stream.copy(_span(mx, 0, 4 * n), _span(my, 0, 4 * n))
    stream.reduce(_span(mx, 0, 4 * n), _span(mx, 0, 4 * n), _span(my, 0, 4 * n), "float32",
                  ReduceOp.SUM)
    stream.write_flag(Flag(flags, 8), 3)
    stream.wait_flag(Flag(flags, 8), 3)
    event = stream.record()
    stream.wait_event(event)
    device.order_caller_after(device.caller_event())
    calls = device.operations - start
    assert 8 <= calls <= 8 + 2  # 8 operations, and at most two events created
    if simulated:
        assert simulated[0] - start_sim == calls
    stream.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(x), np.ones(n, np.float32) * 2)
    # an event nobody holds any more is recorded again instead of a new one being made
    start = device.operations
    for _ in range(10):
        stream.wait_event(stream.record())
    assert device.operations - start <= 20 + 1
    stream.synchronize()


def test_wait_times_out() -> None:
    for mode in FLAG_MODES:
        dev = CudaDevice(0, timeout=0.5, flags=mode)
        flags = dev.alloc(8)
        stream = _ready_stream(dev)
        stream.wait_flag(Flag(flags, 0), 1, tag=("step", 3))
        with pytest.raises(FlagWaitTimeout) as info:
            stream.synchronize()
        assert info.value.tag == ("step", 3) and info.value.value == 1
        assert info.value.observed == 0
        assert _returns_within(60, dev.close), mode  # releases the wait nobody satisfies


def _returns_within(seconds: float, fn: Any) -> bool:
    """Whether fn() returned within `seconds` (run in a thread: a wedged GPU never returns)."""
    import threading

    done = threading.Event()

    def call() -> None:
        fn()
        done.set()

    threading.Thread(target=call, daemon=True).start()
    return done.wait(seconds)


def test_abort_releases_every_wait_and_the_gpu_stays_usable() -> None:
    """A wait nobody will ever satisfy (a dead peer's) ends at abort, in both flag modes:
    the device synchronizes, closes, and CuPy works afterwards."""
    for mode in FLAG_MODES:
        dev = CudaDevice(0, timeout=300.0, flags=mode)
        flags = dev.alloc(16)
        stream = _ready_stream(dev)
        stream.wait_flag(Flag(flags, 0), 1, tag="never")
        dev.abort("peer 3 died")
        with pytest.raises(FlagWaitAborted, match="peer 3 died"):
            stream.synchronize()
        with pytest.raises(FlagWaitAborted):
            stream.wait_flag(Flag(flags, 0), 2)
        assert _returns_within(60, cp.cuda.Device(0).synchronize), mode
        assert dev.read_u64(flags.ptr) == RELEASED
        assert _returns_within(60, dev.close), mode
        assert float((cp.arange(10, dtype=cp.float32) * 2).sum()) == 90.0


def test_work_queued_behind_a_released_wait_touches_nothing() -> None:
    """Once aborted, the reduce, the copy from a peer, the n-input reduce of peers' data and
    the flag write queued behind a released wait run as no-ops: no garbage is computed into
    buffers or published to peers."""
    for mode in FLAG_MODES:
        dev = CudaDevice(0, timeout=300.0, flags=mode)
        flags = dev.alloc(16)
        n = 4096
        x = cp.arange(n, dtype=cp.float32)
        out = cp.full(n, -1.0, dtype=cp.float32)
        mx, mout = dev.wrap(x), dev.wrap(out)
        as_peer = CudaMemory(mx.ptr, mx.nbytes, "peer")  # read like a peer's buffer
        stream = _ready_stream(dev)
        stream.wait_flag(Flag(flags, 0), 1, tag="never")
        stream.reduce(_span(mout, 0, 4 * n), _span(mx, 0, 4 * n), _span(mx, 0, 4 * n),
                      "float32", ReduceOp.SUM)
        stream.copy(_span(mout, 0, 4 * n), _span(as_peer, 0, 4 * n))
        stream.reduce_n(_span(mout, 0, 4 * n), [_span(as_peer, 0, 4 * n)] * 9, "float32",
                        ReduceOp.SUM)
        stream.write_flag(Flag(flags, 8), 7)
        dev.abort("test")
        assert _returns_within(60, cp.cuda.Device(0).synchronize), mode
        assert bool((out == -1.0).all()), mode
        assert dev.read_u64(flags.ptr + 8) == 0, mode
        dev.close()


def test_streams_wait_only_on_their_own_memory(device: CudaDevice) -> None:
    """A peer's word could be written by nobody once that peer died, and abort cannot
    release it: such a wait is refused."""
    mem = device.alloc(64)
    peer = CudaMemory(mem.ptr, mem.nbytes, "peer")
    with pytest.raises(ValueError, match="only wait on a flag in memory this device"):
        device.create_stream().wait_flag(Flag(peer, 0), 1)


def test_spin_fallback_warns_once_with_cause_and_remedy(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    monkeypatch.setattr(_cuda_driver, "memops_support", lambda device_id: "a test reason")
    monkeypatch.setattr(_cuda_driver, "_warned_spin", False)
    monkeypatch.delenv(cuda_module.FLAGS_ENV, raising=False)
    with pytest.warns(RuntimeWarning, match="a test reason") as caught:
        dev = CudaDevice(0)
    text = str(caught[0].message)
    assert "cuda-bindings" in text and "MPS" in text and "time slice" in text
    assert dev.flags_mode == "kernel"
    dev.close()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        CudaDevice(0).close()  # once per process


def test_spin_fallback_is_logged_not_warned_off_rank0(monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture
                                                      ) -> None:
    """A rank that does not announce (not the job's rank 0) writes the reason to the
    "gpuring" logger at INFO level only: no warning, so the job says it once."""
    import logging
    import warnings

    monkeypatch.setattr(_cuda_driver, "memops_support", lambda device_id: "a test reason")
    monkeypatch.setattr(_cuda_driver, "_warned_spin", False)
    monkeypatch.delenv(cuda_module.FLAGS_ENV, raising=False)
    with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="gpuring"):
        warnings.simplefilter("error")
        dev = CudaDevice(0, announce=False)
    assert dev.flags_mode == "kernel"
    dev.close()
    assert [r.levelno for r in caplog.records if "a test reason" in r.getMessage()] == \
        [logging.INFO]


def test_missing_cuda_bindings_is_named_as_the_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    reason = _cuda_driver.memops_support(0)
    assert reason is not None and "cuda-bindings is not importable" in reason


# ------------------------------------------------------------------------------ IPC, close

def test_handles_name_the_process_not_its_pid(device: CudaDevice) -> None:
    """Equal PIDs in different PID namespaces or on other nodes must never make a rank read
    its own buffer as a peer's: only this process's own token means "my memory"."""
    mem = device.alloc(4096)
    handle = device.export(mem)
    other_process = handle._replace(process="another process with the same pid")
    with pytest.raises(Exception) as info:  # opened through IPC, as a peer's handle is
        device.open(other_process)
    assert not isinstance(info.value, GpuringError)
    elsewhere = handle._replace(process="a process elsewhere", host="another-node")
    with pytest.raises(GpuringError, match="on this host only"):
        device.open(elsewhere)


def test_gpus_without_peer_access_are_refused(device, monkeypatch):
    """A peer's buffer on a GPU this one cannot read peer to peer (or cannot see) is a clear
    error naming both GPUs and the way out, not a failed IPC open or a kernel fault."""
    import cupy

    mem = device.alloc(4096)
    other = device.export(mem)._replace(process="another process", gpu="0000:ff:00.0")
    with pytest.raises(GpuringError, match="not visible to this process"):
        device.open(other)
    runtime = cupy.cuda.runtime
    monkeypatch.setattr(runtime, "deviceGetByPCIBusId", lambda bus: device.device_id + 1)
    monkeypatch.setattr(runtime, "deviceCanAccessPeer", lambda a, b: 0)
    with pytest.raises(GpuringError, match=r"cannot access GPU .* peer to peer.*NCCL"):
        device.open(other)


def test_export_open_in_one_process_gives_the_local_pointer(device: CudaDevice) -> None:
    mem = device.alloc(4096)
    handle = pickle.loads(pickle.dumps(device.export(mem)))
    opened = device.open(handle)
    assert opened.ptr == mem.ptr and opened.nbytes == 4096
    other = CudaDevice(0)  # a second "rank" in the same process
    try:
        assert other.open(handle).ptr == mem.ptr
    finally:
        other.close()


_CHILD = r"""
import pickle, sys
import numpy as np
import cupy as cp
from gpuring.devices.base import Span
from gpuring.devices.cuda import CudaDevice
handle = pickle.loads(bytes.fromhex(sys.stdin.read()))
dev = CudaDevice(0)
peer = dev.open(handle)
assert dev.open(handle) is peer
src = dev.wrap(cp.arange(256, dtype=cp.uint8))
cp.cuda.get_current_stream().synchronize()  # inputs made on the caller's stream
s = dev.create_stream()
s.copy(Span(peer, 0, 256), Span(src, 0, 256))
s.synchronize()
dev.close()
print("child ok")
"""


def test_ipc_between_processes(device: CudaDevice) -> None:
    mem = device.alloc(256)
    handle = device.export(mem)
    done = subprocess.run([sys.executable, "-c", _CHILD], input=pickle.dumps(handle).hex(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = np.zeros(256, np.uint8)
    cp.cuda.runtime.memcpy(out.ctypes.data, mem.ptr, 256, 4)
    np.testing.assert_array_equal(out, np.arange(256, dtype=np.uint8))


def test_alloc_is_zeroed_and_close_frees() -> None:
    dev = CudaDevice(0)
    cp.get_default_memory_pool().free_all_blocks()
    free_before = cp.cuda.runtime.memGetInfo()[0]
    mem = dev.alloc(512 << 20)
    assert dev.read_u64(mem.ptr) == 0 and dev.read_u64(mem.ptr + (512 << 20) - 8) == 0
    assert cp.cuda.runtime.memGetInfo()[0] < free_before - (256 << 20)
    dev.close()
    dev.close()  # idempotent
    assert cp.cuda.runtime.memGetInfo()[0] > free_before - (64 << 20)
    assert mem.ptr == 0


def test_an_array_over_device_memory_outlives_the_device() -> None:
    """`CudaDevice.array` (registered memory): a CuPy array over the allocation, zero-filled,
    whose writes land there; once the device is closed the array still holds the memory
    (a plain CuPy array), which is freed when the array goes."""
    dev = CudaDevice(0)
    cp.get_default_memory_pool().free_all_blocks()
    free_before = cp.cuda.runtime.memGetInfo()[0]
    mem = dev.alloc(256 << 20)
    array = dev.array(mem, (64 << 20,), "float32")
    assert isinstance(array, cp.ndarray) and array.data.ptr == mem.ptr
    assert float(array[-1:].get()[0]) == 0.0
    array[:4] = cp.arange(4, dtype=cp.float32)
    cp.cuda.get_current_stream().synchronize()
    assert dev.read_u64(mem.ptr + 8) == int(np.array([2.0, 3.0], np.float32).view(np.uint64)[0])
    dev.close()
    array += 1
    assert array[:4].get().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert cp.cuda.runtime.memGetInfo()[0] < free_before - (128 << 20)
    del array
    gc.collect()
    cp.cuda.get_current_stream().synchronize()
    cp.asarray(np.zeros(1))  # (the simulator frees what the streams have passed here)
    assert cp.cuda.runtime.memGetInfo()[0] > free_before - (64 << 20)


def test_memops_asked_for_where_the_device_has_none_is_a_clear_error() -> None:
    """GPURING_CUDA_FLAGS=memops works where the device has stream memory operations and is a
    clear error naming the way out where it has none."""
    reason = _cuda_driver.memops_support(0)
    if reason is None:
        dev = CudaDevice(0, flags="memops")
        assert dev.flags_mode == "memops"
        dev.close()
        return
    assert "CAN_USE_64_BIT_STREAM_MEM_OPS" in reason or "cuda-bindings" in reason
    with pytest.raises(RuntimeError, match="GPURING_CUDA_FLAGS=kernel"):
        CudaDevice(0, flags="memops")


_BAD_POINTER = r"""
import cupy as cp
from gpuring._ops import ReduceOp
from gpuring.devices.base import Span
from gpuring.devices.cuda import CudaDevice, CudaMemory
dev = CudaDevice(0, timeout=30.0)
x = cp.arange(1024, dtype=cp.float32)
cp.cuda.get_current_stream().synchronize()
mx = dev.wrap(x)
nowhere = CudaMemory(0x10, 4096, "borrowed")  # no allocation there
s = dev.create_stream()
s.reduce(Span(nowhere, 0, 4096), Span(mx, 0, 4096), Span(mx, 0, 4096), "float32", ReduceOp.SUM)
try:
    s.synchronize()
except Exception as exc:
    print("RAISED", type(exc).__name__, exc)
else:
    print("NO ERROR")
"""


def test_a_kernel_fault_is_reported_as_a_cuda_error() -> None:
    """A kernel that writes where no memory is faults the context: the host gets CUDA's
    illegal-address error from the stream (not a crash, not a timeout)."""
    done = subprocess.run([sys.executable, "-c", _BAD_POINTER], capture_output=True, text=True,
                          timeout=120)
    assert "RAISED" in done.stdout, done.stdout + done.stderr[-2000:]
    assert "illegal" in done.stdout.lower() or "700" in done.stdout, done.stdout


def test_the_legacy_stream_waits_for_blocking_streams_only() -> None:
    """CUDA's legacy default stream is ordered after the work of the device's blocking
    streams, never after non-blocking ones (which is why CudaDevice uses only those)."""
    from gpuring.devices import _kernels

    dev = CudaDevice(0, timeout=60.0)
    words = dev.alloc(16)
    wait = _kernels.get_function(_kernels.WAIT_FLAG_KERNEL, 0)
    release = np.array([1], np.uint64)
    side = cp.cuda.Stream(non_blocking=True)
    for blocking, offset in ((False, 0), (True, 8)):
        held = cp.cuda.Stream(non_blocking=not blocking)
        wait((1,), (1,), (np.uint64(words.ptr + offset), np.uint64(1), np.uint64(0),
                          np.uint64(dev.status_ptr), np.uint64(dev.abort_ptr)), stream=held)
        # `held` cannot pass its wait until the word is released below
        assert not held.record().done
        after = cp.cuda.Stream.null.record()
        if blocking:  # the legacy stream waits behind the blocked stream, however long
            assert not _returns_within(0.5, after.synchronize)
        else:
            after.synchronize()  # not held by a non-blocking stream
        cp.cuda.runtime.memcpyAsync(words.ptr + offset, release.ctypes.data, 8, 4, side.ptr)
        side.synchronize()
        held.synchronize()
        after.synchronize()
    dev.close()
