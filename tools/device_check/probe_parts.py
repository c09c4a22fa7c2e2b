"""The probe's parts that measure what works and how fast: versions, CUDA IPC, stream memory
operations, the kernels, copy bandwidth, host cost and the flag ping-pongs (those about
failures are in `probe_faults`). Each runs in its own child process of `python -m
tools.device_check.probe` (two-process parts start a peer of their own), records what it
measures as it goes, and may be killed when its time is up; `probe_registry` names them."""

from __future__ import annotations

import importlib.metadata
import itertools
import os
import platform
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from .probe_gpu import (
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

__all__ = ["Part", "part_deadline", "time_left", "part_versions", "part_ipc", "peer_ipc",
           "part_memops", "part_kernels", "part_copy_bandwidth", "part_host_cost",
           "part_pingpong", "peer_pingpong"]

#: a part: (recorder, settings, budget in seconds) -> None
Part = Callable[[Recorder, Settings, float], None]

_IPC_SEED, _REPLY_SEED = 1, 2


def part_deadline(budget: float) -> float:
    """When a part should give up on its own: a little before the probe kills it."""
    return time.monotonic() + max(1.0, budget - 2.0)


def time_left(deadline: float) -> float:
    """Seconds left before `deadline` (at least half a second, for a last bounded wait)."""
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
    from gpuring.devices import _kernels

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
    from gpuring.devices import _kernels

    gpu = Gpu()
    stream, iters, n = gpu.stream(), s.host_iters, 1024
    deadline = part_deadline(budget)

    def drain() -> None:
        gpu.finish_or_raise(gpu.event(stream), time_left(deadline), "the host-cost stream")

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
    from gpuring._ops import ReduceOp
    from gpuring.devices.base import Flag, Span
    from gpuring.devices.cuda import CudaDevice

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
    deadline = part_deadline(budget)
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
            gpu.finish_or_raise(events[-1], time_left(deadline), f"{mode} ping-pong batch {k}")
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
