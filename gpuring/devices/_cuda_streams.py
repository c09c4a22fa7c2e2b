"""CudaDevice's memory records, events and streams: every stream operation is one or a few
driver calls (a copy, a kernel launch, a stream memory operation, an event record or wait),
counted in the device's `operations`. See `gpuring.devices.cuda` for the design."""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._ops import ReduceOp
from . import _kernels
from ._cuda_driver import _cupy, check_cu
from .base import Event, Flag, FlagWaitAborted, Memory, Span, Stream

if TYPE_CHECKING:
    from .cuda import CudaDevice

__all__ = ["CudaMemory", "THREADS"]

# CUDA runtime constants (stable ABI values)
_MEMCPY_DEFAULT = 4
_SUCCESS = 0
_NOT_READY = 600  # cudaErrorNotReady
#: threads per block of the data kernels
THREADS = 256
_RECENT_WAITS = 256  # waits remembered per stream, for error messages and abort


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


_new = object.__new__

#: events kept for reuse per device (creating one is a driver call)
_SPARE_EVENTS = 64


class _CudaEvent(Event):
    __slots__ = ("_device", "_spare", "raw")
    _SPARE_EVENTS_KEPT = _SPARE_EVENTS

    def __init__(self, raw: Any, device: CudaDevice, *, reuse: bool = False):
        """`reuse`: `raw` came from `CudaDevice._event` and goes back to it once this object
        is gone. Nothing else holds it then, so recording it again is safe: the waits queued
        on it already took the record they saw."""
        self.raw = raw
        self._device = device
        self._spare: list[Any] | None = device._spare_events if reuse else None

    def __del__(self) -> None:
        spare = getattr(self, "_spare", None)  # None too if __init__ did not finish
        if spare is not None and len(spare) < self._SPARE_EVENTS_KEPT:
            spare.append(self.raw)  # builtins only: this may run late in interpreter exit

    def query(self) -> bool:
        """True once the stream passed the event; raises the CUDA error of a failed kernel
        (`Event.done` would read False forever instead). Any thread may ask (the watchdog
        does): the query runs with this device current."""
        runtime = _cupy().cuda.runtime
        with self._device.scope():
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


def _elements(span: Span, itemsize: int, dtype: str) -> int:
    """How many `dtype` elements `span` holds (it must hold a whole number)."""
    if span.nbytes % itemsize:
        raise ValueError(f"{span.nbytes} bytes is not a whole number of {dtype}")
    return span.nbytes // itemsize


def _inbox(region: Span, producer: int) -> Flag:
    """The word of `region`'s inbox where `producer` tells its rank (the first block's row of
    the one-kernel all_reduce's inbox: the two forms never run in one job)."""
    return Flag(region.mem, region.offset + _kernels.FUSED_INBOX + 8 * producer)


def _flag_addr(flag: Flag) -> int:
    if flag.offset % 8 or flag.offset + 8 > flag.mem.nbytes:
        raise ValueError(f"flag at offset {flag.offset} is not an aligned 8-byte word in "
                         f"{flag.mem.nbytes} bytes")
    return _addr(flag)


class _CudaStream(Stream):
    """A CuPy non-blocking stream. Every method only enqueues (except synchronize)."""

    def __init__(self, device: CudaDevice, raw: Any, *, caller: bool = False):
        """`caller`: a stream of the caller's, which only one-kernel all_reduces use."""
        self._device = device
        self.raw = raw
        self._caller = caller
        self.waits: collections.deque[tuple[Flag, int, Any]] = collections.deque(
            maxlen=_RECENT_WAITS)
        #: (driver module, the driver's CUstream) for stream memory operations
        self._cu: tuple[Any, Any] | None = None

    def _driver_stream(self) -> tuple[Any, Any]:
        """(driver module, CUstream), made once per stream. Called inside `scope()`, which
        makes the device's context current for the driver call."""
        found = self._cu
        if found is None:
            from cuda.bindings import driver

            found = self._cu = (driver, driver.CUstream(self.raw.ptr))
        return found

    def copy(self, dst: Span, src: Span) -> None:
        """A copy engine transfer (`GPURING_CUDA_COPY=memcpy`), except from or into a peer's
        memory (registered arrays): that always runs as a kernel, which touches nothing once
        the device is aborted (a dead peer's memory may be gone)."""
        if dst.nbytes != src.nbytes:
            raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
        if dst.nbytes == 0:
            return
        dev = self._device
        with dev.scope():
            if dev.copy_mode == "kernel" or getattr(src.mem, "kind", "") == "peer" or \
                    getattr(dst.mem, "kind", "") == "peer":
                n = dst.nbytes
                kernel = _kernels.get_function(_kernels.COPY_KERNEL, dev.device_id)
                kernel(
                    (dev.grid_for(kernel, n, 16),), (THREADS,),
                    (np.uint64(_addr(dst)), np.uint64(_addr(src)), np.uint64(n),
                     np.uint64(dev.abort_ptr)),
                    stream=self.raw)
            else:
                runtime = _cupy().cuda.runtime
                runtime.memcpyAsync(_addr(dst), _addr(src), dst.nbytes, _MEMCPY_DEFAULT,
                                    self.raw.ptr)
        dev.operations += 1

    def reduce(self, dst: Span, a: Span, b: Span, dtype: str, op: ReduceOp,
               divisor: int = 1) -> None:
        if not (dst.nbytes == a.nbytes == b.nbytes):
            raise ValueError(f"reduce of {a.nbytes} and {b.nbytes} bytes into {dst.nbytes}")
        dev = self._device
        kernel, itemsize = dev.reduce_kernel(dtype, op)
        n = _elements(dst, itemsize, dtype)
        if n == 0:
            return
        with dev.scope():
            kernel((dev.grid_for(kernel, n, max(1, 16 // itemsize)),), (THREADS,),
                   (np.uint64(_addr(dst)), np.uint64(_addr(a)), np.uint64(_addr(b)),
                    np.uint64(n), np.int64(divisor), np.uint64(dev.abort_ptr)),
                   stream=self.raw)
        dev.operations += 1

    def reduce_n(self, dst: Span, srcs: Sequence[Span], dtype: str, op: ReduceOp,
                 divisor: int = 1) -> None:
        """One launch of the n-input kernel per `MAX_SOURCES` sources (`fold_launches`)."""
        if len(srcs) < 2 or any(s.nbytes != dst.nbytes for s in srcs):
            raise ValueError(f"reduce_n of {[s.nbytes for s in srcs]} bytes into {dst.nbytes}")
        dev = self._device
        kernel, itemsize = dev.reduce_n_kernel(dtype, op)
        n = _elements(dst, itemsize, dtype)
        if n == 0:
            return
        out = _addr(dst)
        launches = _kernels.fold_launches(out, [_addr(s) for s in srcs])
        with dev.scope():
            grid = (dev.grid_for(kernel, n, max(1, 16 // itemsize)),)
            for sources, last in launches:
                pointers = [np.uint64(a) for a in sources]
                pointers += [np.uint64(0)] * (_kernels.MAX_SOURCES - len(sources))
                kernel(grid, (THREADS,),
                       (np.uint64(out), *pointers, np.int32(len(sources)), np.uint64(n),
                        np.int64(divisor if last else 1), np.uint64(dev.abort_ptr)),
                       stream=self.raw)
        dev.operations += len(launches)

    def wait_flag(self, flag: Flag, value: int, tag: Any = None) -> None:
        dev = self._device
        dev.check(tag)
        if not (isinstance(flag.mem, CudaMemory) and flag.mem.kind == "local"):
            raise ValueError("a stream may only wait on a flag in memory this device "
                             f"allocated (abort must be able to release it), not {flag.mem!r}")
        addr = _flag_addr(flag)
        dev.note_wait_word(addr)
        self.waits.append((flag, value, tag))
        with dev.scope():
            if dev.flags_mode == "memops":
                driver, cu = self._driver_stream()
                geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
                check_cu(driver.cuStreamWaitValue64(
                    cu, driver.CUdeviceptr(addr), driver.cuuint64_t(value), geq),
                    "cuStreamWaitValue64")
            else:
                _kernels.get_function(_kernels.WAIT_FLAG_KERNEL, dev.device_id)(
                    (1,), (1,),
                    (np.uint64(addr), np.uint64(value), np.uint64(dev.timeout_ns),
                     np.uint64(dev.status_ptr), np.uint64(dev.abort_ptr)),
                    stream=self.raw)
        dev.operations += 1

    def write_flag(self, flag: Flag, value: int) -> None:
        """A one-thread kernel in either flag mode: it publishes nothing once the device is
        aborted, so data computed after a failure never reaches a peer (a stream memory write
        queued before the abort would still run once the stream is released)."""
        dev = self._device
        dev.check()
        addr = _flag_addr(flag)
        with dev.scope():
            _kernels.get_function(_kernels.WRITE_FLAG_KERNEL, dev.device_id)(
                (1,), (1,), (np.uint64(addr), np.uint64(value), np.uint64(dev.abort_ptr)),
                stream=self.raw)
        dev.operations += 1

    def write_flags(self, flags: Sequence[Flag], value: int) -> None:
        """`write_flag` of several flags: one launch per `MAX_FLAGS` of them."""
        if len(flags) == 1:
            self.write_flag(flags[0], value)
            return
        dev = self._device
        dev.check()
        addrs = [_flag_addr(flag) for flag in flags]
        kernel = _kernels.get_function(_kernels.WRITE_FLAGS_KERNEL, dev.device_id)
        with dev.scope():
            for first in range(0, len(addrs), _kernels.MAX_FLAGS):
                batch = addrs[first:first + _kernels.MAX_FLAGS]
                pointers = [np.uint64(a) for a in batch]
                pointers += [np.uint64(0)] * (_kernels.MAX_FLAGS - len(batch))
                kernel((1,), (1,), (*pointers, np.int32(len(batch)), np.uint64(value),
                                    np.uint64(dev.abort_ptr)), stream=self.raw)
                dev.operations += 1

    def capturing(self) -> bool:
        with self._device.scope():
            return bool(self.raw.is_capturing())

    def record(self) -> Event:
        with self._device.scope():
            return self.record_in_scope()

    def record_in_scope(self) -> _CudaEvent:
        """`record()` where the device is current already (inside `device.scope()`)."""
        dev = self._device
        raw = dev._event()
        raw.record(self.raw)
        dev.operations += 1
        # _CudaEvent(raw, dev, reuse=True) without the call of __init__ (on every call's path)
        event = _new(_CudaEvent)
        event.raw, event._device, event._spare = raw, dev, dev._spare_events
        if self._caller:
            dev.last_on_caller = event
        return event

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, _CudaEvent):
            raise TypeError(f"not a CUDA event: {event!r}")
        with self._device.scope():
            self.raw.wait_event(event.raw)
        self._device.operations += 1

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
