"""What the probe's parts share: settings, the result recorder, the channel to a peer process,
a thin handle on one GPU, flag operations and the kernel launches.

Everything here runs in a part's child process (or its peer), never in the probe itself: the
probe process does not touch CUDA, so it can start MPS, kill a stuck part and still write its
JSON.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO, Any

import numpy as np

from gpuring.settings import parse_size

__all__ = ["Settings", "Recorder", "Hang", "PeerFailed", "Channel", "Peer", "Gpu", "FlagOps",
           "launch_flag_kernel", "launch_copy_kernel", "launch_reduce_kernel", "describe",
           "attempt", "stats", "pattern", "check_cu"]

_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault (unified addressing)
_HOST_ALLOC_PORTABLE_MAPPED = 1 | 2  # cudaHostAllocPortable | cudaHostAllocMapped
_SUCCESS = 0
_NOT_READY = 600  # cudaErrorNotReady
_THREADS = 256  # threads per block, as CudaDevice launches its kernels
_BLOCKS_PER_SM = 8


@dataclasses.dataclass(frozen=True)
class Settings:
    """How much the probe measures; each field has an environment variable (for dry runs)."""

    #: seconds for the whole probe; a part that would start later is skipped
    budget_s: float = 75.0
    #: flag round trips per ping-pong
    round_trips: int = 1000
    #: round trips enqueued at once (both processes enqueue a batch, then it is released)
    batch: int = 100
    #: bytes of the device-to-device copy
    copy_bytes: int = 1 << 30
    #: bytes of the IPC pattern (and of the dead exporter's buffer)
    ipc_bytes: int = 64 << 20
    #: enqueues timed per host-cost figure
    host_iters: int = 2000
    #: seconds the abort parts wait for the release of blocked streams before they call it
    #: a hang (a release that works takes milliseconds)
    release_s: float = 10.0
    #: parts to run (empty: all)
    parts: tuple[str, ...] = ()
    #: every time box multiplied by this (slow machines, the CUDA simulator)
    time_scale: float = 1.0

    @classmethod
    def from_env(cls) -> Settings:
        """Defaults, overridden by GPURING_PROBE_* variables."""
        readers: dict[str, tuple[str, Callable[[str], Any]]] = {
            "budget_s": ("GPURING_PROBE_BUDGET", float),
            "round_trips": ("GPURING_PROBE_ROUND_TRIPS", int),
            "batch": ("GPURING_PROBE_BATCH", int),
            "copy_bytes": ("GPURING_PROBE_COPY_BYTES", parse_size),
            "ipc_bytes": ("GPURING_PROBE_IPC_BYTES", parse_size),
            "host_iters": ("GPURING_PROBE_HOST_ITERS", int),
            "release_s": ("GPURING_PROBE_RELEASE_S", float),
            "parts": ("GPURING_PROBE_PARTS",
                      lambda v: tuple(p.strip() for p in v.split(",") if p.strip())),
            "time_scale": ("GPURING_DEVICE_CHECK_TIME_SCALE", float),
        }
        values = {field: read(os.environ[env]) for field, (env, read) in readers.items()
                  if os.environ.get(env)}
        settings = cls(**values)
        if settings.round_trips < 1 or settings.batch < 1 or settings.host_iters < 1:
            raise ValueError("GPURING_PROBE_ROUND_TRIPS, _BATCH and _HOST_ITERS must be >= 1")
        if settings.time_scale < 1:
            raise ValueError("GPURING_DEVICE_CHECK_TIME_SCALE must be at least 1")
        return settings


class Recorder:
    """A part's result: a dict rewritten to `path` (atomically) at every call, so that what was
    measured before the part was killed is kept."""

    def __init__(self, path: str):
        self.path = path
        self.data: dict[str, Any] = {}

    def __call__(self, **fields: Any) -> None:
        self.data.update(fields)
        partial = f"{self.path}.tmp"
        with open(partial, "w", encoding="utf-8") as f:
            json.dump(self.data, f, default=str)
        os.replace(partial, self.path)


class Hang(RuntimeError):
    """GPU work the part waited for did not finish in the time it allowed."""


class PeerFailed(RuntimeError):
    """The peer process reported an error or went away."""


def describe(exc: BaseException) -> str:
    """`Type: message` of an exception, on one line."""
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")[:1000]


def attempt(fn: Callable[[], Any]) -> Any:
    """fn(), or the text "unavailable: <error>" when it raises."""
    try:
        return fn()
    except Exception as exc:
        return f"unavailable: {describe(exc)}"


def stats(values_us: list[float]) -> dict[str, Any]:
    """Median, p99 and friends of per-round-trip times in microseconds."""
    if not values_us:
        return {"samples": 0}
    a = np.asarray(values_us, dtype=np.float64)
    p10, p50, p90, p99 = (float(x) for x in np.percentile(a, [10, 50, 90, 99]))
    return {"samples": int(a.size), "median_us": p50, "p99_us": p99, "p10_us": p10,
            "p90_us": p90, "min_us": float(a.min()), "max_us": float(a.max()),
            "mean_us": float(a.mean()), "total_ms": float(a.sum() / 1e3)}


def pattern(nbytes: int, seed: int) -> np.ndarray:
    """`nbytes` random bytes from `seed` (both sides of IPC rebuild the same bytes)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


# ---------------------------------------------------------------------------- peer process

class Channel:
    """JSON lines between a part and its peer process (the peer's stdin and stdout)."""

    def __init__(self, rfile: IO[str], wfile: IO[str]):
        self._r = rfile
        self._w = wfile

    def send(self, kind: str, **fields: Any) -> None:
        self._w.write(json.dumps({"kind": kind, **fields}) + "\n")
        self._w.flush()

    def recv(self, kind: str) -> dict[str, Any]:
        """The next message, which must be `kind`; PeerFailed on an error or end of file."""
        line = self._r.readline()
        if not line:
            raise PeerFailed(f"the peer exited before sending {kind!r}")
        msg: dict[str, Any] = json.loads(line)
        if msg.get("kind") == "error":
            raise PeerFailed(f"peer: {msg.get('error')}")
        if msg.get("kind") != kind:
            raise PeerFailed(f"expected {kind!r} from the peer, got {msg.get('kind')!r}")
        return msg


class Peer:
    """A second process of a part, `python -m tools.device_check.probe --peer ROLE`, sent
    `args`. It runs in the part's process group, so the probe kills it with the part."""

    def __init__(self, role: str, **args: Any):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tools.device_check.probe", "--peer", role],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.chan = Channel(self.proc.stdout, self.proc.stdin)
        self.chan.send("args", **args)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self, timeout: float = 10.0) -> int | None:
        """Wait for the peer to exit (killing it after `timeout`); its exit status."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


# ---------------------------------------------------------------------------- one GPU

class Gpu:
    """Device 0 of this process through CuPy, with a side stream for small host copies."""

    def __init__(self) -> None:
        import cupy

        self.cupy = cupy
        self.rt = cupy.cuda.runtime
        cupy.cuda.Device(0).use()
        self.side = cupy.cuda.Stream(non_blocking=True)
        self._sm_count = 0
        # the abort word every gpuring kernel reads first (kernels/reduce.cu); never set here
        self.abort_word = self.alloc(256)

    @property
    def simulated(self) -> bool:
        return str(self.cupy.__version__).endswith("+cudasim")

    def sm_count(self) -> int:
        """Asked once: CuPy's Device.attributes reads every attribute, far too slow to do
        between two timing events."""
        if not self._sm_count:
            self._sm_count = int(self.cupy.cuda.Device(0).attributes["MultiProcessorCount"])
        return self._sm_count

    def stream(self) -> Any:
        return self.cupy.cuda.Stream(non_blocking=True)

    def alloc(self, nbytes: int, fill: int = 0) -> Any:
        """Plain cudaMalloc memory (`cupy.cuda.Memory`, outside the pool), set to `fill`."""
        mem = self.cupy.cuda.Memory(nbytes)
        self.rt.memsetAsync(mem.ptr, fill, nbytes, self.side.ptr)
        self.side.synchronize()
        return mem

    def upload(self, ptr: int, host: np.ndarray) -> None:
        host = np.ascontiguousarray(host)
        self.rt.memcpyAsync(ptr, host.ctypes.data, host.nbytes, _MEMCPY_DEFAULT, self.side.ptr)
        self.side.synchronize()

    def download(self, ptr: int, nbytes: int) -> np.ndarray:
        out = np.empty(nbytes, np.uint8)
        self.rt.memcpyAsync(out.ctypes.data, ptr, nbytes, _MEMCPY_DEFAULT, self.side.ptr)
        self.side.synchronize()
        return out

    def read_u64(self, ptr: int) -> int:
        return int(self.download(ptr, 8).view(np.uint64)[0])

    def write_u64(self, ptr: int, value: int) -> None:
        self.upload(ptr, np.array([value], np.uint64))

    def copy_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self.rt.memcpyAsync(dst, src, nbytes, _MEMCPY_DEFAULT, stream.ptr)

    def event(self, stream: Any) -> Any:
        """A timing event recorded on `stream` now."""
        event = self.cupy.cuda.Event()
        event.record(stream)
        return event

    def elapsed_us(self, start: Any, end: Any) -> float:
        return float(self.cupy.cuda.get_elapsed_time(start, end)) * 1e3

    def finish(self, event: Any, seconds: float) -> str:
        """Poll `event` for up to `seconds`: "done", "hang", or "error: <CUDA error>"."""
        deadline = time.monotonic() + seconds
        delay = 1e-5
        while True:
            try:
                status = int(self.rt.eventQuery(event.ptr))
            except Exception as exc:
                return f"error: {describe(exc)}"
            if status == _SUCCESS:
                return "done"
            if status != _NOT_READY:
                try:
                    self.rt.check_status(status)
                except Exception as exc:
                    return f"error: {describe(exc)}"
                return f"error: CUDA status {status}"
            if time.monotonic() > deadline:
                return "hang"
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)

    def finish_or_raise(self, event: Any, seconds: float, what: str) -> None:
        outcome = self.finish(event, seconds)
        if outcome == "hang":
            raise Hang(f"{what} did not finish within {seconds:.1f} s")
        if outcome != "done":
            raise RuntimeError(f"{what}: {outcome}")

    def grid_for(self, n: int, per_thread: int) -> int:
        """Blocks of a grid-stride loop, as CudaDevice.grid_for computes them."""
        return max(1, min(-(-n // (_THREADS * per_thread)), self.sm_count() * _BLOCKS_PER_SM))


def check_cu(result: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    """The values of a cuda-bindings driver call; RuntimeError naming the error otherwise."""
    from cuda.bindings import driver

    if result[0] != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(result[0])
        raise RuntimeError(f"{what} failed: {name.decode() if name else result[0]}")
    return result[1:]


# ---------------------------------------------------------------------------- kernels

# The one place that launches gpuring_wait_flag / gpuring_write_flag of kernels/reduce.cu:
# wait_flag(flag, value, timeout_ns, status, abort) and write_flag(flag, value, abort); one
# block of one thread each. `abort` is the device word every kernel reads first.
def launch_flag_kernel(kernel: Any, stream: Any, flag: int, value: int, *, status: int,
                       abort: int, timeout_ns: int | None = None) -> None:
    """Launch the wait kernel (when `timeout_ns` is given) or the write kernel."""
    if timeout_ns is None:
        args: tuple[Any, ...] = (np.uint64(flag), np.uint64(value), np.uint64(abort))
    else:
        args = (np.uint64(flag), np.uint64(value), np.uint64(timeout_ns), np.uint64(status),
                np.uint64(abort))
    kernel((1,), (1,), args, stream=stream)


def launch_copy_kernel(gpu: Gpu, stream: Any, dst: int, src: int, nbytes: int) -> None:
    """gpuring_copy_bytes(dst, src, nbytes) with CudaDevice's grid."""
    from gpuring.devices import _kernels

    kernel = _kernels.get_function(_kernels.COPY_KERNEL, 0)
    kernel((gpu.grid_for(nbytes, 16),), (_THREADS,),
           (np.uint64(dst), np.uint64(src), np.uint64(nbytes), np.uint64(gpu.abort_word.ptr)),
           stream=stream)


def launch_reduce_kernel(kernel: Any, gpu: Gpu, stream: Any, dst: int, a: int, b: int,
                         n: int) -> None:
    """A float32 reduce kernel (dst, a, b, n, divisor, abort) with CudaDevice's grid; the
    arguments are built per call, as CudaDevice builds them."""
    kernel((gpu.grid_for(n, 4),), (_THREADS,),
           (np.uint64(dst), np.uint64(a), np.uint64(b), np.uint64(n), np.int64(1),
            np.uint64(gpu.abort_word.ptr)),
           stream=stream)


class FlagOps:
    """Waits (until a 64-bit word >= value) and writes on streams, done as CudaDevice does
    them: stream memory operations ("memops") or one-thread spin kernels ("kernel")."""

    def __init__(self, gpu: Gpu, mode: str, timeout_s: float = 30.0):
        if mode not in ("memops", "kernel", "gpuring"):
            raise ValueError(f"flag mode {mode!r}")
        self.mode = mode
        self._gpu = gpu
        self._cu: dict[int, Any] = {}
        # memops: waits and writes are stream memory operations; kernel: spin-wait and write
        # kernels; gpuring: what CudaDevice does, memops waits and write kernels
        self._memops_wait = mode in ("memops", "gpuring")
        self._memops_write = mode == "memops"
        if self._memops_wait:
            from cuda.bindings import driver

            check_cu(driver.cuInit(0), "cuInit")
            self._driver = driver
            self._geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
            self._fence = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
        if mode != "memops":
            from gpuring.devices import _kernels

            self._wait_kernel = _kernels.get_function(_kernels.WAIT_FLAG_KERNEL, 0)
            self._write_kernel = _kernels.get_function(_kernels.WRITE_FLAG_KERNEL, 0)
            # the kernels' status word, in mapped pinned memory (CudaDevice does the same)
            self.status_ptr = int(gpu.rt.hostAlloc(8, _HOST_ALLOC_PORTABLE_MAPPED))
            ctypes.c_int64.from_address(self.status_ptr).value = 0
            self.timeout_ns = int(timeout_s * 1e9)

    def _stream(self, stream: Any) -> Any:
        cu = self._cu.get(stream.ptr)
        if cu is None:
            cu = self._cu[stream.ptr] = self._driver.CUstream(stream.ptr)
        return cu

    def wait(self, stream: Any, addr: int, value: int) -> None:
        if self._memops_wait:
            d = self._driver
            check_cu(d.cuStreamWaitValue64(self._stream(stream), d.CUdeviceptr(addr),
                                           d.cuuint64_t(value), self._geq),
                     "cuStreamWaitValue64")
        else:
            launch_flag_kernel(self._wait_kernel, stream, addr, value, status=self.status_ptr,
                               abort=self._gpu.abort_word.ptr,
                               timeout_ns=self.timeout_ns)

    def write(self, stream: Any, addr: int, value: int) -> None:
        if self._memops_write:
            d = self._driver
            check_cu(d.cuStreamWriteValue64(self._stream(stream), d.CUdeviceptr(addr),
                                            d.cuuint64_t(value), self._fence),
                     "cuStreamWriteValue64")
        else:
            launch_flag_kernel(self._write_kernel, stream, addr, value, status=self.status_ptr,
                               abort=self._gpu.abort_word.ptr)

    def timed_out(self) -> bool:
        """A spin wait gave up (kernel mode only)."""
        return self.mode == "kernel" and ctypes.c_int32.from_address(self.status_ptr).value != 0
