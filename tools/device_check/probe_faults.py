"""The probe's parts about failures: a peer killed while a survivor reads its memory
(`part_dead_exporter`, with its peer `peer_exporter`), and CudaDevice's abort releasing
streams blocked in flag waits (`part_abort_release`). Run as the parts of `probe_parts` are."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from .probe_gpu import (
    Channel,
    FlagOps,
    Gpu,
    Peer,
    Recorder,
    Settings,
    describe,
    launch_copy_kernel,
    launch_reduce_kernel,
    pattern,
)
from .probe_parts import part_deadline, time_left

__all__ = ["part_dead_exporter", "peer_exporter", "part_abort_release"]

_DEAD_SEED = 3  # (after probe_parts' IPC and reply patterns)


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
    from gpuring.devices import _kernels

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
    deadline = part_deadline(budget)
    gpu = Gpu()
    n = s.ipc_bytes
    expected = pattern(n, _DEAD_SEED)
    peer = Peer("exporter", nbytes=n)
    rec(peer_pid=peer.pid)
    ptr = int(gpu.rt.ipcOpenMemHandle(bytes.fromhex(peer.chan.recv("exported")["handle"])))
    rec(bytes=n, simulated=gpu.simulated, before_kill=_compare(gpu, [_Ptr(ptr)], expected)[0])
    flags, gate = _flags_any(gpu), gpu.alloc(8)
    bufs, stream = [gpu.alloc(n), gpu.alloc(n)], gpu.stream()
    wait_s = min(5.0, time_left(deadline) / 3)
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
    from gpuring.devices.base import Flag
    from gpuring.devices.cuda import CudaDevice

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
