"""The probe's parts. Each runs in its own child process of `python -m gpuring.bench.probe`
(two-process parts start a peer of their own), records what it measures as it goes, and may be
killed when its time is up. `PARTS` and `PEERS` name them for the command line."""

from __future__ import annotations

import importlib.metadata
import itertools
import os
import platform
import signal
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from ._probe_gpu import (
    Channel,
    FlagOps,
    Gpu,
    Hang,
    Peer,
    Recorder,
    Settings,
    attempt,
    check_cu,
    describe,
    launch_copy_kernel,
    launch_reduce_kernel,
    pattern,
    stats,
)

__all__ = ["PARTS", "PEERS", "Part"]

#: a part: (recorder, settings, budget in seconds) -> None
Part = Callable[[Recorder, Settings, float], None]

_IPC_SEED, _REPLY_SEED, _DEAD_SEED = 1, 2, 3


def _deadline(budget: float) -> float:
    """When a part should give up on its own: a little before the probe kills it."""
    return time.monotonic() + max(1.0, budget - 2.0)


def _left(deadline: float) -> float:
    return max(0.5, deadline - time.monotonic())


def _median_us(gpu: Gpu, stream: Any, enqueue: Callable[[], None], reps: int,
               inner: int = 3) -> float:
    """Median GPU time of one `enqueue`'s work on `stream`. Each repetition queues one untimed
    run first, so that the GPU is still busy with it while the host queues the start event and
    `inner` timed runs (no host gap inside the timed span); the time is then divided by
    `inner`."""
    enqueue()
    times = []
    for _ in range(reps):
        enqueue()
        start = gpu.event(stream)
        for _ in range(inner):
            enqueue()
        end = gpu.event(stream)
        end.synchronize()
        times.append(gpu.elapsed_us(start, end) / inner)
    return float(np.median(times))


# ---------------------------------------------------------------------------- versions

def part_versions(rec: Recorder, s: Settings, budget: float) -> None:
    """GPU, driver, CUDA runtime, CuPy, cuda-bindings, NCCL (and whether CuPy is the simulator)."""
    rec(python=platform.python_version(), numpy=np.__version__)
    import cupy

    rt = cupy.cuda.runtime
    rec(cupy=cupy.__version__, simulated=str(cupy.__version__).endswith("+cudasim"))
    rec(device_count=attempt(lambda: rt.getDeviceCount()),
        cuda_runtime=attempt(lambda: rt.runtimeGetVersion()),
        driver=attempt(lambda: rt.driverGetVersion()))
    props = attempt(lambda: rt.getDeviceProperties(0))
    if isinstance(props, dict):
        name = props.get("name", b"?")
        rec(gpu=name.decode(errors="replace") if isinstance(name, bytes) else str(name),
            total_memory=props.get("totalGlobalMem"),
            multiprocessors=props.get("multiProcessorCount"))
    else:
        rec(gpu=props)
    rec(compute_capability=attempt(lambda: cupy.cuda.Device(0).compute_capability))
    rec(cuda_bindings=attempt(lambda: importlib.metadata.version("cuda-bindings")))

    def nccl_version() -> Any:
        from cupy.cuda import nccl

        return nccl.get_version()

    rec(nccl=attempt(nccl_version))
    rec(torch=attempt(lambda: importlib.metadata.version("torch")))


# ---------------------------------------------------------------------------- IPC

def part_ipc(rec: Recorder, s: Settings, budget: float) -> None:
    """Process A (here) allocates with cudaMalloc, fills a pattern and exports it; process B
    opens it, checks the pattern, times a copy out of the mapping and writes a reply."""
    gpu = Gpu()
    n = s.ipc_bytes
    mem = gpu.alloc(n)
    gpu.upload(mem.ptr, pattern(n, _IPC_SEED))
    handle = bytes(gpu.rt.ipcGetMemHandle(mem.ptr))
    rec(bytes=n, phase="exported")
    peer = Peer("ipc", handle=handle.hex(), nbytes=n)
    rec(peer_pid=peer.pid)
    try:
        got = peer.chan.recv("checked")
        rec(phase="peer checked", peer_read_ok=got["read_ok"], open_ms=got["open_ms"],
            peer_copy_GBps=got["copy_GBps"])
        reply_ok = bool(np.array_equal(gpu.download(mem.ptr, n), pattern(n, _REPLY_SEED)))
        peer.chan.send("verified", ok=reply_ok)
        peer.chan.recv("closed")
        rec(phase="done", reply_ok=reply_ok, ok=bool(got["read_ok"]) and reply_ok)
    finally:
        peer.close()


def peer_ipc(chan: Channel, args: dict[str, Any]) -> None:
    gpu = Gpu()
    n = int(args["nbytes"])
    start = time.perf_counter()
    ptr = int(gpu.rt.ipcOpenMemHandle(bytes.fromhex(args["handle"])))
    open_ms = (time.perf_counter() - start) * 1e3
    read_ok = bool(np.array_equal(gpu.download(ptr, n), pattern(n, _IPC_SEED)))
    local, stream = gpu.alloc(n), gpu.stream()
    us = _median_us(gpu, stream, lambda: gpu.copy_async(local.ptr, ptr, n, stream), reps=5)
    gpu.upload(ptr, pattern(n, _REPLY_SEED))
    chan.send("checked", read_ok=read_ok, open_ms=open_ms, copy_GBps=2 * n / us / 1e3)
    chan.recv("verified")
    gpu.rt.ipcCloseMemHandle(ptr)
    chan.send("closed")


# ---------------------------------------------------------------------------- memops

def part_memops(rec: Recorder, s: Settings, budget: float) -> None:
    """The device attribute, then whether a write then a wait on one stream, and a wait
    released by another stream, complete."""
    gpu = Gpu()  # first: the CUDA simulator installs its driver module with CuPy
    from cuda.bindings import driver

    check_cu(driver.cuInit(0), "cuInit")
    (dev,) = check_cu(driver.cuDeviceGet(0), "cuDeviceGet")
    attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
    rec(attribute_id=int(attr))
    (value,) = check_cu(driver.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute")
    rec(attribute=int(value))
    flags = FlagOps(gpu, "memops")
    words = gpu.alloc(16)
    one, two = gpu.stream(), gpu.stream()
    flags.write(one, words.ptr, 7)
    flags.wait(one, words.ptr, 7)
    outcome = gpu.finish(gpu.event(one), 5.0)
    rec(same_stream=outcome, value=gpu.read_u64(words.ptr) if outcome == "done" else None)
    flags.wait(one, words.ptr + 8, 3)  # released by the other stream
    waiting = gpu.event(one)
    flags.write(two, words.ptr + 8, 3)
    cross = gpu.finish(waiting, 5.0)
    rec(cross_stream=cross, works=outcome == "done" and cross == "done"
        and rec.data["value"] == 7)


# ---------------------------------------------------------------------------- kernels

def part_kernels(rec: Recorder, s: Settings, budget: float) -> None:
    """Compile (or load from the cache) and load kernels/reduce.cu once, so later parts and
    the GPU tests find it ready; how long that took and how."""
    from ..devices import _kernels

    gpu = Gpu()
    rec(compute_capability=attempt(lambda: gpu.cupy.cuda.Device(0).compute_capability))
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = _kernels.get_module(0)
    rec(load_s=time.perf_counter() - start, module=type(module).__name__,
        warnings=[str(w.message)[:300] for w in caught])
    for name in (_kernels.COPY_KERNEL, _kernels.WAIT_FLAG_KERNEL, _kernels.WRITE_FLAG_KERNEL,
                 _kernels.reduce_kernel_name("float32", "sum")):
        _kernels.get_function(name, 0)
    rec(ok=True)


# ---------------------------------------------------------------------------- copy bandwidth

def part_copy_bandwidth(rec: Recorder, s: Settings, budget: float) -> None:
    """Device-to-device copy of `copy_bytes`: cudaMemcpyAsync, then gpuring_copy_bytes, timed
    with events (see _median_us), read + written bytes counted."""
    gpu = Gpu()
    n = s.copy_bytes
    src, dst, stream = gpu.alloc(n, 1), gpu.alloc(n), gpu.stream()
    rec(bytes=n, reps=10, counted="read + write (2 x bytes)",
        timed="median of 10 groups of 3 back-to-back copies, events around each group")
    us = _median_us(gpu, stream, lambda: gpu.copy_async(dst.ptr, src.ptr, n, stream), reps=10)
    rec(memcpy_us=us, memcpy_GBps=2 * n / us / 1e3)
    us = _median_us(gpu, stream, lambda: launch_copy_kernel(gpu, stream, dst.ptr, src.ptr, n),
                    reps=10)
    rec(kernel_us=us, kernel_GBps=2 * n / us / 1e3)


# ---------------------------------------------------------------------------- host cost

def _enqueue_us(enqueue: Callable[[], None], iters: int, drain: Callable[[], None]) -> float:
    """Mean host microseconds of one `enqueue`, timed around the enqueue loops only (in rounds
    of 250, drained in between, so that a full queue never blocks the host)."""
    for _ in range(min(50, iters)):
        enqueue()
    drain()
    total, done = 0.0, 0
    while done < iters:
        count = min(250, iters - done)
        start = time.perf_counter()
        for _ in range(count):
            enqueue()
        total += time.perf_counter() - start
        done += count
        drain()
    return total / iters * 1e6


def part_host_cost(rec: Recorder, s: Settings, budget: float) -> None:
    """Host microseconds per enqueue from Python: a small reduce kernel, cuStreamWriteValue64
    with its arguments built per call (as CudaDevice does) and pre-built, and the same ops
    through gpuring's own CudaDevice stream."""
    from ..devices import _kernels

    gpu = Gpu()
    stream, iters, n = gpu.stream(), s.host_iters, 1024
    deadline = _deadline(budget)

    def drain() -> None:
        gpu.finish_or_raise(gpu.event(stream), _left(deadline), "the host-cost stream")

    bufs = [gpu.alloc(4 * n) for _ in range(3)]
    kernel = _kernels.get_kernel("float32", "sum", 0)
    rec(iters=iters, kernel_launch_us=_enqueue_us(
        lambda: launch_reduce_kernel(kernel, gpu, stream, bufs[0].ptr, bufs[1].ptr,
                                     bufs[2].ptr, n), iters, drain))
    try:
        rec(**_memops_cost(gpu, stream, iters, drain))
    except Exception as exc:
        rec(memops_error=describe(exc))
    try:
        rec(**_gpuring_cost(iters))
    except Exception as exc:
        rec(gpuring_error=describe(exc))


def _memops_cost(gpu: Gpu, stream: Any, iters: int,
                 drain: Callable[[], None]) -> dict[str, float]:
    from cuda.bindings import driver as d

    check_cu(d.cuInit(0), "cuInit")
    word = gpu.alloc(8)
    cu = d.CUstream(stream.ptr)
    fence = d.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
    geq = d.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
    ok = d.CUresult.CUDA_SUCCESS

    def write_built() -> None:
        if d.cuStreamWriteValue64(cu, d.CUdeviceptr(word.ptr), d.cuuint64_t(5), fence)[0] != ok:
            raise RuntimeError("cuStreamWriteValue64 failed")

    addr, five = d.CUdeviceptr(word.ptr), d.cuuint64_t(5)

    def write_prebuilt() -> None:
        if d.cuStreamWriteValue64(cu, addr, five, fence)[0] != ok:
            raise RuntimeError("cuStreamWriteValue64 failed")

    def wait_prebuilt() -> None:  # the word already holds 5: the wait passes at once
        if d.cuStreamWaitValue64(cu, addr, five, geq)[0] != ok:
            raise RuntimeError("cuStreamWaitValue64 failed")

    return {"write_value_built_us": _enqueue_us(write_built, iters, drain),
            "write_value_prebuilt_us": _enqueue_us(write_prebuilt, iters, drain),
            "wait_value_prebuilt_us": _enqueue_us(wait_prebuilt, iters, drain)}


def _gpuring_cost(iters: int) -> dict[str, Any]:
    """reduce and write_flag as gpuring's scheduler calls them on a CudaDevice stream."""
    from .._ops import ReduceOp
    from ..devices.base import Flag, Span
    from ..devices.cuda import CudaDevice

    dev = CudaDevice(0, timeout=30.0)
    try:
        mem, stream = dev.alloc(3 * 4096 + 8), dev.create_stream()
        dst, a, b = (Span(mem, i * 4096, 4096) for i in range(3))
        flag, values = Flag(mem, 3 * 4096), itertools.count(1)
        return {
            "gpuring_flags_mode": dev.flags_mode,
            "gpuring_reduce_us": _enqueue_us(
                lambda: stream.reduce(dst, a, b, "float32", ReduceOp.SUM), iters,
                stream.synchronize),
            "gpuring_write_flag_us": _enqueue_us(
                lambda: stream.write_flag(flag, next(values)), iters, stream.synchronize),
        }
    finally:
        dev.close()


# ---------------------------------------------------------------------------- ping-pong

def _batches(round_trips: int, batch: int) -> list[range]:
    """Round-trip values 1..round_trips in batches."""
    return [range(v, min(v + batch, round_trips + 1)) for v in range(1, round_trips + 1, batch)]


def part_pingpong(rec: Recorder, s: Settings, budget: float, mode: str) -> None:
    """Two processes on one GPU, each owning a flag word in its own cudaMalloc memory that the
    other writes through its IPC mapping. Round trip v: A's stream writes v into B's word and
    waits until its own word >= v; B's stream waits until its own word >= v and writes v into
    A's word. Each batch is enqueued by both processes behind a gate on A's stream, then
    released; the round-trip times are events on A's stream (GPU side)."""
    deadline = _deadline(budget)
    gpu = Gpu()
    flags = FlagOps(gpu, mode, timeout_s=budget)
    mem = gpu.alloc(16)  # [0]: my word (B writes it), [8]: my gate (my host writes it)
    own, gate = mem.ptr, mem.ptr + 8
    rec(mode=mode, round_trips=s.round_trips, batch=s.batch, simulated=gpu.simulated,
        mps=bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), phase="starting the peer")
    peer = Peer("pingpong", mode=mode, handle=bytes(gpu.rt.ipcGetMemHandle(own)).hex(),
                round_trips=s.round_trips, batch=s.batch, budget=budget)
    rec(peer_pid=peer.pid)
    try:
        theirs = int(gpu.rt.ipcOpenMemHandle(bytes.fromhex(peer.chan.recv("ready")["handle"])))
        stream, samples, wall = gpu.stream(), [], 0.0
        for k, values in enumerate(_batches(s.round_trips, s.batch)):
            flags.wait(stream, gate, k + 1)
            events = [gpu.event(stream)]
            for v in values:
                flags.write(stream, theirs, v)
                flags.wait(stream, own, v)
                events.append(gpu.event(stream))
            peer.chan.recv("enqueued")
            start = time.perf_counter()
            gpu.write_u64(gate, k + 1)
            gpu.finish_or_raise(events[-1], _left(deadline), f"{mode} ping-pong batch {k}")
            if flags.timed_out():
                raise Hang(f"a spin wait gave up in batch {k}")
            wall += time.perf_counter() - start
            samples += [gpu.elapsed_us(a, b) for a, b in itertools.pairwise(events)]
            rec(phase=f"batch {k} done", batches_done=k + 1, host_wall_s=wall, **stats(samples))
        mine = gpu.read_u64(own)
        peer.chan.send("done")
        peers = int(peer.chan.recv("closed")["own"])
        gpu.rt.ipcCloseMemHandle(theirs)
        rec(phase="done", values_ok=mine == peers == s.round_trips)
    finally:
        peer.close()


def peer_pingpong(chan: Channel, args: dict[str, Any]) -> None:
    gpu = Gpu()
    flags = FlagOps(gpu, args["mode"], timeout_s=float(args["budget"]))
    mem = gpu.alloc(8)
    theirs = int(gpu.rt.ipcOpenMemHandle(bytes.fromhex(args["handle"])))
    chan.send("ready", handle=bytes(gpu.rt.ipcGetMemHandle(mem.ptr)).hex())
    stream = gpu.stream()
    for values in _batches(int(args["round_trips"]), int(args["batch"])):
        for v in values:
            flags.wait(stream, mem.ptr, v)
            flags.write(stream, theirs, v)
        chan.send("enqueued")
    chan.recv("done")
    gpu.finish_or_raise(gpu.event(stream), 10.0, "the peer's ping-pong stream")
    mine = gpu.read_u64(mem.ptr)
    gpu.rt.ipcCloseMemHandle(theirs)
    chan.send("closed", own=mine, timed_out=flags.timed_out())


# ---------------------------------------------------------------------------- dead exporter

def _flags_any(gpu: Gpu) -> FlagOps:
    """Stream memory operations where they work, else the spin kernels."""
    try:
        flags = FlagOps(gpu, "memops")
        word, stream = gpu.alloc(8), gpu.stream()
        flags.write(stream, word.ptr, 1)
        flags.wait(stream, word.ptr, 1)
        if gpu.finish(gpu.event(stream), 2.0) == "done":
            return flags
    except Exception:
        pass
    return FlagOps(gpu, "kernel")


def _compare(gpu: Gpu, bufs: list[Any], expected: np.ndarray) -> list[str]:
    """For each buffer: intact, zeros, differs (how much), or the error reading it back."""
    out = []
    for buf in bufs:
        try:
            got = gpu.download(buf.ptr, expected.size)
        except Exception as exc:
            out.append(f"error: {describe(exc)}")
            continue
        if np.array_equal(got, expected):
            out.append("intact")
        elif not got.any():
            out.append("zeros")
        else:
            out.append(f"differs ({float(np.mean(got == expected)) * 100:.1f} % equal)")
    return out


def _context_check(gpu: Gpu, seconds: float) -> str:
    """Does this process's context still work: new memory, a reduce kernel, synchronize."""
    from ..devices import _kernels

    try:
        n = 1024
        a, b, c = (gpu.alloc(4 * n) for _ in range(3))
        gpu.upload(a.ptr, np.arange(n, dtype=np.float32))
        gpu.upload(b.ptr, np.full(n, 2, np.float32))
        stream = gpu.stream()
        kernel = _kernels.get_kernel("float32", "sum", 0)
        launch_reduce_kernel(kernel, gpu, stream, c.ptr, a.ptr, b.ptr, n)
        outcome = gpu.finish(gpu.event(stream), seconds)
        if outcome != "done":
            return outcome
        got = gpu.download(c.ptr, 4 * n).view(np.float32)
        return "works" if np.array_equal(got, np.arange(n, dtype=np.float32) + 2) else "wrong"
    except Exception as exc:
        return f"error: {describe(exc)}"


def _read_mapping(gpu: Gpu, stream: Any, bufs: list[Any], ptr: int, n: int,
                  seconds: float) -> str:
    """memcpy and a copy kernel out of the peer's mapping; "done", "hang" or the error."""
    try:
        gpu.copy_async(bufs[0].ptr, ptr, n, stream)
        launch_copy_kernel(gpu, stream, bufs[1].ptr, ptr, n)
        return gpu.finish(gpu.event(stream), seconds)
    except Exception as exc:  # enqueueing on a context that already failed
        return f"error: {describe(exc)}"


def _try_to(action: Callable[[], None]) -> str:
    """"done", or the error `action` raised."""
    try:
        action()
    except Exception as exc:
        return f"error: {describe(exc)}"
    return "done"


def _stop_if_hung(rec: Recorder, outcome: str) -> None:
    """A stuck stream may also hang the process's exit: record and leave at once."""
    if outcome == "hang":
        rec(phase="stopped: a read of the dead peer's memory hangs")
        os._exit(0)


def part_dead_exporter(rec: Recorder, s: Settings, budget: float) -> None:
    """B (here) maps memory that A exports and queues reads of it behind a gate on its own
    stream; A is killed (SIGKILL); the gate opens; then new reads are queued; then B checks
    its context still works. Each read: done, hang, or the CUDA error (sticky or not)."""
    deadline = _deadline(budget)
    gpu = Gpu()
    n = s.ipc_bytes
    expected = pattern(n, _DEAD_SEED)
    peer = Peer("exporter", nbytes=n)
    rec(peer_pid=peer.pid)
    ptr = int(gpu.rt.ipcOpenMemHandle(bytes.fromhex(peer.chan.recv("exported")["handle"])))
    rec(bytes=n, simulated=gpu.simulated, before_kill=_compare(gpu, [_Ptr(ptr)], expected)[0])
    flags, gate = _flags_any(gpu), gpu.alloc(8)
    bufs, stream = [gpu.alloc(n), gpu.alloc(n)], gpu.stream()
    wait_s = min(5.0, _left(deadline) / 3)
    flags.wait(stream, gate.ptr, 1)
    gpu.copy_async(bufs[0].ptr, ptr, n, stream)
    launch_copy_kernel(gpu, stream, bufs[1].ptr, ptr, n)
    queued = gpu.event(stream)
    os.kill(peer.pid, signal.SIGKILL)
    rec(gate=flags.mode, exporter_exit=peer.close(), wait_s=wait_s,
        phase="exporter killed")
    time.sleep(0.5)  # let the driver tear the dead process's context down
    opened = _try_to(lambda: gpu.write_u64(gate.ptr, 1))
    outcome = gpu.finish(queued, wait_s) if opened == "done" else f"gate: {opened}"
    rec(queued_read=outcome)
    _stop_if_hung(rec, outcome)
    rec(queued_data=_compare(gpu, bufs, expected))
    outcome = _read_mapping(gpu, stream, bufs, ptr, n, wait_s)
    rec(later_read=outcome)
    _stop_if_hung(rec, outcome)
    rec(later_data=_compare(gpu, bufs, expected))
    rec(context_after=_context_check(gpu, wait_s))
    rec(close_mapping=_try_to(lambda: gpu.rt.ipcCloseMemHandle(ptr)), phase="done")
    if gpu.simulated:
        rec(answer="unsupported here: the simulator keeps a dead process's /dev/shm memory "
                   "mapped, so these outcomes say nothing of a GPU")


class _Ptr:
    """A bare device pointer where a cupy.cuda.Memory is expected."""

    def __init__(self, ptr: int):
        self.ptr = ptr


def peer_exporter(chan: Channel, args: dict[str, Any]) -> None:
    gpu = Gpu()
    n = int(args["nbytes"])
    mem = gpu.alloc(n)
    gpu.upload(mem.ptr, pattern(n, _DEAD_SEED))
    chan.send("exported", handle=bytes(gpu.rt.ipcGetMemHandle(mem.ptr)).hex())
    chan.recv("nothing")  # blocks until killed (or until the part goes away)


# ---------------------------------------------------------------------------- abort

def part_abort_release(rec: Recorder, s: Settings, budget: float) -> None:
    """CudaDevice's abort, as a survivor of a dead peer runs it: 12 streams (more than the
    default 8 hardware queues) each blocked in a flag wait nobody will satisfy, then abort.
    Does the release (a side-stream write to each waited word) reach them, and how fast?
    Run twice by the probe: as the process finds CUDA, and with CUDA_DEVICE_MAX_CONNECTIONS=1
    (one hardware queue for every stream, as some training jobs set it)."""
    from ..devices.base import Flag
    from ..devices.cuda import CudaDevice

    gpu = Gpu()
    rec(max_connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "default"))
    dev = CudaDevice(0, timeout=max(budget, 30.0))
    rec(flags_mode=dev.flags_mode)
    words = dev.alloc(8 * 12)
    streams = [dev.create_stream() for _ in range(12)]
    for i, stream in enumerate(streams):
        stream.wait_flag(Flag(words, 8 * i), 1, tag=f"stream {i}")
    blocked = [stream.record() for stream in streams]
    time.sleep(0.2)
    rec(blocked_before_abort=sum(not e.query() for e in blocked))
    start = time.perf_counter()
    dev.abort("probe: release every wait")
    drained = dev._drain(min(s.release_s, budget / 2))
    rec(released=drained, release_ms=(time.perf_counter() - start) * 1e3)
    rec(device_synchronize=gpu.finish(gpu.event(gpu.side), min(5.0, s.release_s)))
    if drained:
        dev.close(peers_may_read=True)


# ---------------------------------------------------------------------------- registries

PARTS: dict[str, Part] = {
    "versions": part_versions,
    "ipc": part_ipc,
    "memops": part_memops,
    "kernels": part_kernels,
    "copy_bandwidth": part_copy_bandwidth,
    "host_cost": part_host_cost,
    "pingpong_memops": lambda rec, s, budget: part_pingpong(rec, s, budget, "memops"),
    "pingpong_kernel": lambda rec, s, budget: part_pingpong(rec, s, budget, "kernel"),
    "pingpong_gpuring": lambda rec, s, budget: part_pingpong(rec, s, budget, "gpuring"),
    "dead_exporter": part_dead_exporter,
    "abort_release": part_abort_release,
    "abort_release_1conn": part_abort_release,
}

PEERS: dict[str, Callable[[Channel, dict[str, Any]], None]] = {
    "ipc": peer_ipc,
    "pingpong": peer_pingpong,
    "exporter": peer_exporter,
}
