"""CudaDevice: the device interface on an NVIDIA GPU, for CuPy arrays.

Memory is plain `cudaMalloc` (`cupy.cuda.Memory`, outside CuPy's pool, so one IPC handle names
exactly one buffer) shared with peer processes through CUDA IPC. Streams are CuPy non-blocking
streams; reductions are the RawModule kernels of `kernels/reduce.cu`; flags are 64-bit words
in device memory.

Flag waits and writes use stream memory operations (`cuStreamWaitValue64` /
`cuStreamWriteValue64`): a blocked wait costs nothing on the GPU. Where they are unavailable,
one-thread kernels spin on the flag instead. `GPURING_CUDA_FLAGS=memops|kernel|auto` (default
auto) chooses.

Timeouts and abort. A spinning wait kernel gives up after the device's timeout and marks a
status word in mapped pinned host memory; the host reads that word without a copy and raises.
A stream memory wait has no timeout and cannot be cancelled, so the host bounds it instead:
`Stream.synchronize` polls with backoff and raises FlagWaitTimeout at the deadline. `abort`
sets the status word: spinning waits return at once and flag-write kernels stop publishing,
so nothing computed after a failure reaches a peer. Streams blocked in stream memory waits
stay blocked (releasing them would mean writing into peers' flags); a failed communicator
leaks their memory at close rather than free memory a peer might still read.

The device never synchronizes the host in a collective: `blocking` is False, and the caller's
stream is ordered with events (`caller_event`, `order_caller_after`).
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np

from .._errors import CollectiveTimeoutError
from .._ops import ReduceOp
from . import _kernels
from .base import (
    Device,
    Event,
    Flag,
    FlagWaitAborted,
    FlagWaitTimeout,
    Memory,
    Span,
    Stream,
)

__all__ = ["CudaDevice", "CudaMemory", "CudaHandle", "FLAGS_ENV"]

#: environment variable that selects how flags are waited for and written
FLAGS_ENV = "GPURING_CUDA_FLAGS"
#: environment variable that selects how copies run: "memcpy" (default) or "kernel"
COPY_ENV = "GPURING_CUDA_COPY"

# CUDA runtime constants (stable ABI values)
_HOST_ALLOC_PORTABLE = 1
_HOST_ALLOC_MAPPED = 2
_MEMCPY_DEFAULT = 4
_SUCCESS = 0
_NOT_READY = 600  # cudaErrorNotReady

_THREADS = 256
_BLOCKS_PER_SM = 8
_RECENT_WAITS = 256  # waits remembered per stream, for error messages and abort

# status word values (kernels/reduce.cu: gpuring_wait_flag)
_STATUS_OK = 0
_STATUS_TIMED_OUT = 1
_STATUS_ABORTED = 2


def _cupy() -> Any:
    import cupy

    return cupy


class CudaMemory(Memory):
    """Device memory: `kind` is "local" (allocated here), "peer" (opened from a peer) or
    "borrowed" (a user's array)."""

    def __init__(self, ptr: int, nbytes: int, kind: str, owner: Any = None):
        self.ptr = ptr
        self.nbytes = nbytes
        self.kind = kind
        self._owner = owner  # keeps the cupy Memory / array alive

    def release(self) -> None:
        """Drop the reference that keeps the allocation alive (frees a local allocation)."""
        self._owner = None
        self.ptr = 0

    def __repr__(self) -> str:
        return f"CudaMemory({self.kind}, ptr={self.ptr:#x}, nbytes={self.nbytes})"


class CudaHandle(NamedTuple):
    """What `export` hands to peers (picklable)."""

    pid: int
    device_id: int
    ptr: int
    nbytes: int
    ipc: bytes


class _CudaEvent(Event):
    def __init__(self, raw: Any):
        self.raw = raw

    def query(self) -> bool:
        """True once the stream passed the event; raises the CUDA error of a failed kernel
        (`Event.done` would read False forever instead)."""
        runtime = _cupy().cuda.runtime
        status = runtime.eventQuery(self.raw.ptr)
        if status == _SUCCESS:
            return True
        if status == _NOT_READY:
            return False
        runtime.check_status(status)  # raises CUDARuntimeError naming the error
        raise RuntimeError(f"cudaEventQuery returned {status}")


def _addr(span_or_flag: Span | Flag) -> int:
    mem = span_or_flag.mem
    if not isinstance(mem, CudaMemory) or not mem.ptr:
        raise ValueError(f"not live CUDA memory: {mem!r}")
    return mem.ptr + span_or_flag.offset


def _flag_addr(flag: Flag) -> int:
    if flag.offset % 8 or flag.offset + 8 > flag.mem.nbytes:
        raise ValueError(f"flag at offset {flag.offset} is not an aligned 8-byte word in "
                         f"{flag.mem.nbytes} bytes")
    return _addr(flag)


class _CudaStream(Stream):
    """A CuPy non-blocking stream. Every method only enqueues (except synchronize)."""

    def __init__(self, device: CudaDevice, raw: Any):
        self._device = device
        self.raw = raw
        self.waits: collections.deque[tuple[Flag, int, Any]] = collections.deque(
            maxlen=_RECENT_WAITS)
        self._cu: Any = None  # the driver's CUstream for stream memory operations

    def _driver_stream(self) -> Any:
        """(driver module, CUstream), made once per stream; binds the device's context to
        this thread the first time a thread asks."""
        from cuda.bindings import driver

        self._device.bind_driver()
        if self._cu is None:
            self._cu = driver.CUstream(self.raw.ptr)
        return driver, self._cu

    def copy(self, dst: Span, src: Span) -> None:
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
        if dst.nbytes == 0:
            return
        dev = self._device
        with dev.gpu:
            if dev.copy_mode == "kernel":
                n = dst.nbytes
                _kernels.get_function(_kernels.COPY_KERNEL, dev.device_id)(
                    (dev.grid_for(n, 16),), (_THREADS,),
                    (np.uint64(_addr(dst)), np.uint64(_addr(src)), np.uint64(n)),
                    stream=self.raw)
            else:
                runtime = _cupy().cuda.runtime
                runtime.memcpyAsync(_addr(dst), _addr(src), dst.nbytes, _MEMCPY_DEFAULT,
                                    self.raw.ptr)

    def reduce(self, dst: Span, a: Span, b: Span, dtype: str, op: ReduceOp,
               divisor: int = 1) -> None:
        if not (dst.nbytes == a.nbytes == b.nbytes):
            raise ValueError(f"reduce of {a.nbytes} and {b.nbytes} bytes into {dst.nbytes}")
        dev = self._device
        kernel, itemsize = dev.reduce_kernel(dtype, op)
        if dst.nbytes % itemsize:
            raise ValueError(f"{dst.nbytes} bytes is not a whole number of {dtype}")
        n = dst.nbytes // itemsize
        if n == 0:
            return
        with dev.gpu:
            kernel((dev.grid_for(n, max(1, 16 // itemsize)),), (_THREADS,),
                   (np.uint64(_addr(dst)), np.uint64(_addr(a)), np.uint64(_addr(b)),
                    np.uint64(n), np.int64(divisor)),
                   stream=self.raw)

    def wait_flag(self, flag: Flag, value: int, tag: Any = None) -> None:
        dev = self._device
        dev.check(tag)
        addr = _flag_addr(flag)
        self.waits.append((flag, value, tag))
        with dev.gpu:
            if dev.flags_mode == "memops":
                driver, cu = self._driver_stream()
                geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
                _check_cu(driver.cuStreamWaitValue64(
                    cu, driver.CUdeviceptr(addr), driver.cuuint64_t(value), geq),
                    "cuStreamWaitValue64")
            else:
                _kernels.get_function(_kernels.WAIT_FLAG_KERNEL, dev.device_id)(
                    (1,), (1,),
                    (np.uint64(addr), np.uint64(value), np.uint64(dev.timeout_ns),
                     np.uint64(dev.status_ptr)),
                    stream=self.raw)

    def write_flag(self, flag: Flag, value: int) -> None:
        dev = self._device
        dev.check()  # no new flag writes after an abort (memops writes queued before it
        # still run if their stream gets that far; kernel-mode writes check the status word)
        addr = _flag_addr(flag)
        with dev.gpu:
            if dev.flags_mode == "memops":
                driver, cu = self._driver_stream()
                # the default flags put a system-scope memory barrier before the write
                fence = driver.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
                _check_cu(driver.cuStreamWriteValue64(
                    cu, driver.CUdeviceptr(addr), driver.cuuint64_t(value), fence),
                    "cuStreamWriteValue64")
            else:
                _kernels.get_function(_kernels.WRITE_FLAG_KERNEL, dev.device_id)(
                    (1,), (1,), (np.uint64(addr), np.uint64(value),
                                 np.uint64(dev.status_ptr)), stream=self.raw)

    def record(self) -> Event:
        with self._device.gpu:
            raw = _cupy().cuda.Event(block=False, disable_timing=True)
            raw.record(self.raw)
        return _CudaEvent(raw)

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, _CudaEvent):
            raise TypeError(f"not a CUDA event: {event!r}")
        with self._device.gpu:
            self.raw.wait_event(event.raw)

    def synchronize(self) -> None:
        """Poll the stream with backoff until it is idle, bounded by the device's timeout."""
        dev = self._device
        done = self.record()
        deadline = time.monotonic() + dev.timeout
        delay = 1e-6
        while not done.query():
            if dev.aborted is not None:
                raise FlagWaitAborted(dev.aborted, self._last_tag())
            if time.monotonic() > deadline:
                raise dev.timeout_error(self)
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        dev.check(self._last_tag(), stream=self)
        self.waits.clear()

    def _last_tag(self) -> Any:
        return self.waits[-1][2] if self.waits else None


def _check_cu(result: tuple[Any, ...], what: str) -> None:
    from cuda.bindings import driver

    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise RuntimeError(f"{what} failed: {name.decode() if name else err}")


def _memops_supported(device_id: int) -> bool:
    try:
        from cuda.bindings import driver

        _check_cu(driver.cuInit(0), "cuInit")
        err, dev = driver.cuDeviceGet(device_id)
        _check_cu((err,), "cuDeviceGet")
        attr = driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS
        err, value = driver.cuDeviceGetAttribute(attr, dev)
        return err == driver.CUresult.CUDA_SUCCESS and bool(value)
    except Exception:  # no cuda-bindings, no driver entry point: use the spin kernels
        return False


class CudaDevice(Device):
    """CuPy arrays on one GPU, shared with peers through CUDA IPC.

    `device_id` defaults to `local_rank` (or $GPURING_LOCAL_RANK) modulo the GPU count.
    `timeout` bounds every flag wait in seconds. `flags` is "memops", "kernel" or "auto"
    (default: $GPURING_CUDA_FLAGS, else auto); `copy` is "memcpy" or "kernel".
    """

    kind = "cuda"
    # Every piece costs a few stream operations queued from Python (several microseconds each)
    # while an H200 moves a MiB in well under a microsecond: pieces must be large for the
    # host to keep ahead of the GPU. One channel: one kernel already fills the GPU.
    default_chunk_bytes = 8 << 20
    default_channels = 1
    default_buffer_bytes = 64 << 20
    blocking = False

    def __init__(self, device_id: int | None = None, *, local_rank: int | None = None,
                 timeout: float = 300.0, flags: str | None = None, copy: str | None = None):
        cupy = _cupy()
        runtime = cupy.cuda.runtime
        count = runtime.getDeviceCount()
        if count == 0:
            raise RuntimeError("CudaDevice: no CUDA device is visible")
        if device_id is None:
            if local_rank is None:
                local_rank = int(os.environ.get("GPURING_LOCAL_RANK", "0"))
            device_id = local_rank % count
        self.device_id = device_id
        self.gpu = cupy.cuda.Device(device_id)
        self.timeout = timeout
        self.timeout_ns = int(timeout * 1e9)

        mode = (flags or os.environ.get(FLAGS_ENV) or "auto").lower()
        if mode not in ("auto", "memops", "kernel"):
            raise ValueError(f"{FLAGS_ENV}={mode!r}: use memops, kernel or auto")
        supported = _memops_supported(device_id)
        if mode == "memops" and not supported:
            raise RuntimeError("64-bit stream memory operations are not available on device "
                               f"{device_id}; use {FLAGS_ENV}=kernel")
        self.flags_mode = "memops" if mode == "memops" or (mode == "auto" and supported) \
            else "kernel"
        self.copy_mode = (copy or os.environ.get(COPY_ENV) or "memcpy").lower()
        if self.copy_mode not in ("memcpy", "kernel"):
            raise ValueError(f"{COPY_ENV}={self.copy_mode!r}: use memcpy or kernel")

        with self.gpu:
            self._sm_count = int(self.gpu.attributes["MultiProcessorCount"])
            self._side = cupy.cuda.Stream(non_blocking=True)  # small host<->device chores
            # status word in mapped pinned memory: read and written by host and kernels
            self.status_ptr = int(runtime.hostAlloc(
                8, _HOST_ALLOC_PORTABLE | _HOST_ALLOC_MAPPED))
        self._status = ctypes.c_int32.from_address(self.status_ptr)
        self._status.value = _STATUS_OK
        self._owned: list[CudaMemory] = []
        self._opened: dict[bytes, CudaMemory] = {}
        self._streams: list[_CudaStream] = []
        self._abort_reason: str | None = None
        self._closed = False
        self._bound = threading.local()  # threads whose driver context is bound
        self._reduce_kernels: dict[tuple[str, ReduceOp], tuple[Any, int]] = {}

    # -- helpers ------------------------------------------------------------------------------
    def reduce_kernel(self, dtype: str, op: ReduceOp) -> tuple[Any, int]:
        """(kernel, itemsize) of the reduce for (dtype, op) on this GPU; looked up once."""
        found = self._reduce_kernels.get((dtype, op))
        if found is None:
            found = (_kernels.get_kernel(dtype, op, self.device_id), np.dtype(dtype).itemsize)
            self._reduce_kernels[(dtype, op)] = found
        return found

    def grid_for(self, n: int, per_thread: int) -> int:
        """Blocks for a grid-stride loop over n elements, per_thread elements a thread."""
        blocks = -(-n // (_THREADS * per_thread))
        return max(1, min(blocks, self._sm_count * _BLOCKS_PER_SM))

    def bind_driver(self) -> None:
        """Make this device's primary context current for driver API calls in this thread
        (cudaSetDevice binds it; a thread that made no runtime call yet has none). Stream
        operations run inside `with self.gpu`, which keeps it current afterwards."""
        if getattr(self._bound, "done", False):
            return
        _cupy().cuda.runtime.setDevice(self.device_id)
        self._bound.done = True

    def read_u64(self, addr: int) -> int:
        """The 8-byte word at a device address, read on a side stream (not the legacy one,
        which may be blocked behind the caller's work)."""
        runtime = _cupy().cuda.runtime
        out = np.zeros(1, np.uint64)
        with self.gpu:
            runtime.memcpyAsync(out.ctypes.data, addr, 8, _MEMCPY_DEFAULT,
                                self._side.ptr)
            self._side.synchronize()
        return int(out[0])

    def check(self, tag: Any = None, stream: _CudaStream | None = None) -> None:
        """Raise if the device was aborted or a spinning wait timed out."""
        if self._abort_reason is not None:
            raise FlagWaitAborted(self._abort_reason, tag)
        if self._closed:
            raise RuntimeError("CudaDevice is closed")
        if self._status.value == _STATUS_TIMED_OUT:
            raise self.timeout_error(stream)

    def _recent_waits(self, first: _CudaStream | None) -> Iterator[tuple[Flag, int, Any]]:
        streams = ([first] if first is not None else []) + \
            [s for s in self._streams if s is not first]
        for stream in streams:
            yield from stream.waits

    def timeout_error(self, stream: _CudaStream | None) -> Exception:
        """FlagWaitTimeout for the first recent wait whose flag is still short (this stream's
        first), else a CollectiveTimeoutError."""
        last = None
        for flag, value, tag in self._recent_waits(stream):
            try:
                observed = self.read_u64(_addr(flag))
            except Exception:  # e.g. a dead peer's mapping
                return FlagWaitTimeout(flag, value, -1, tag)
            if observed < value:
                return FlagWaitTimeout(flag, value, observed, tag)
            last = (flag, value, observed, tag)
        if last is not None and self._status.value == _STATUS_TIMED_OUT:
            return FlagWaitTimeout(*last)  # the flag arrived after the kernel gave up
        return CollectiveTimeoutError(
            f"CUDA stream did not finish within {self.timeout} s on device {self.device_id}")

    # -- caller ordering ------------------------------------------------------------------------
    def caller_event(self) -> Event | None:
        cupy = _cupy()
        with self.gpu:
            raw = cupy.cuda.Event(block=False, disable_timing=True)
            raw.record(cupy.cuda.get_current_stream())
        return _CudaEvent(raw)

    def order_caller_after(self, event: Event) -> None:
        if not isinstance(event, _CudaEvent):
            raise TypeError(f"not a CUDA event: {event!r}")
        with self.gpu:
            _cupy().cuda.get_current_stream().wait_event(event.raw)

    # -- memory -----------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> CudaMemory:
        cupy = _cupy()
        with self.gpu:
            raw = cupy.cuda.Memory(max(nbytes, 1))
            cupy.cuda.runtime.memsetAsync(raw.ptr, 0, max(nbytes, 1), self._side.ptr)
            self._side.synchronize()
        mem = CudaMemory(int(raw.ptr), nbytes, "local", raw)
        self._owned.append(mem)
        return mem

    def export(self, mem: Memory) -> CudaHandle:
        if not isinstance(mem, CudaMemory) or mem.kind != "local":
            raise TypeError(f"only memory from CudaDevice.alloc can be exported, not {mem!r}")
        with self.gpu:
            ipc = bytes(_cupy().cuda.runtime.ipcGetMemHandle(mem.ptr))
        return CudaHandle(os.getpid(), self.device_id, mem.ptr, mem.nbytes, ipc)

    def open(self, handle: Any) -> CudaMemory:
        handle = CudaHandle(*handle)
        if handle.pid == os.getpid():  # a process cannot open its own handle: same pointer
            return CudaMemory(handle.ptr, handle.nbytes, "peer")
        mem = self._opened.get(handle.ipc)
        if mem is None:
            with self.gpu:
                ptr = _cupy().cuda.runtime.ipcOpenMemHandle(handle.ipc)
            mem = CudaMemory(int(ptr), handle.nbytes, "peer")
            self._opened[handle.ipc] = mem
        return mem

    def wrap(self, array: Any) -> CudaMemory:
        cupy = _cupy()
        if not isinstance(array, cupy.ndarray) or not array.flags.c_contiguous:
            raise TypeError("CudaDevice wraps C-contiguous CuPy arrays only")
        if array.device.id != self.device_id:
            raise ValueError(f"array is on device {array.device.id}, "
                             f"the communicator uses device {self.device_id}")
        return CudaMemory(int(array.data.ptr), int(array.nbytes), "borrowed", array)

    def seal(self, mem: Memory) -> None:
        """Nothing to do on CUDA (HostDevice unlinks its shared-memory file here)."""

    # -- streams ------------------------------------------------------------------------------
    def create_stream(self, *, inline: bool = False) -> Stream:
        """A non-blocking CuPy stream. `inline` is ignored: GPU work is always asynchronous."""
        with self.gpu:
            stream = _CudaStream(self, _cupy().cuda.Stream(non_blocking=True))
        self._streams.append(stream)
        return stream

    # -- abort and close -------------------------------------------------------------------------
    @property
    def aborted(self) -> str | None:
        return self._abort_reason

    def abort(self, reason: str) -> None:
        if self._abort_reason is not None:
            return
        self._abort_reason = reason
        if self._closed:
            return
        # Spinning wait kernels return, and write kernels stop publishing, so nothing computed
        # after this point reaches a peer. Streams blocked in stream memory waits stay blocked:
        # releasing them would mean writing into peers' flags, which other ranks read too.
        # Closing a failed communicator leaks such streams' memory instead.
        self._status.value = _STATUS_ABORTED

    def _drain(self, seconds: float) -> bool:
        """Wait up to `seconds` for every stream to be idle; True if they are. False also when
        the GPU reports an error (a failed kernel): then nothing is known to be idle."""
        try:
            with self.gpu:
                events = [s.record() for s in self._streams]
            deadline = time.monotonic() + seconds
            delay = 1e-5
            while not all(e.query() for e in events):
                if time.monotonic() > deadline:
                    return False
                time.sleep(delay)
                delay = min(delay * 2, 1e-2)
        except Exception as exc:
            warnings.warn(f"gpuring: CUDA error while closing: {exc}", RuntimeWarning,
                          stacklevel=3)
            return False
        return True

    def detach_peers(self) -> None:
        runtime = _cupy().cuda.runtime
        with self.gpu:
            for mem in self._opened.values():
                runtime.ipcCloseMemHandle(mem.ptr)
                mem.release()
            self._opened.clear()

    def close(self) -> None:
        """Wait for the streams (bounded), close peer mappings, free memory. Idempotent.
        If streams stay stuck even after an abort, memory is leaked rather than the process
        hung (cudaFree would wait for them)."""
        if self._closed:
            return
        drained = self._drain(min(self.timeout, 10.0))
        if not drained:
            self.abort("CudaDevice closed while streams were still waiting")
            drained = self._drain(10.0)
        self._closed = True
        if not drained:
            warnings.warn("gpuring: CUDA streams still busy at close; leaking their memory",
                          RuntimeWarning, stacklevel=2)
            return
        self.detach_peers()
        runtime = _cupy().cuda.runtime
        with self.gpu:
            for mem in self._owned:
                mem.release()  # drops the cupy.cuda.Memory: cudaFree
            self._opened.clear()
            self._owned.clear()
            self._streams.clear()
            self._side = None
            self._status = None  # type: ignore[assignment]
            runtime.freeHost(self.status_ptr)
            self.status_ptr = 0
