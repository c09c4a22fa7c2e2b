"""CudaDevice's events and streams: every stream operation is one or a few driver calls (a
copy, a kernel launch, a stream memory operation, an event record or wait), counted in the
device's `operations`. What a stream asks of its device is `StreamDevice`. See
`gpuring.devices.cuda` for the design."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from .._ops import ReduceOp
from . import _kernels
from ._cuda_driver import MEMCPY_DEFAULT, check_cu, cupy_module
from ._cuda_memory import CudaMemory
from ._streams import Event, Flag, FlagWaitAborted, Span, Stream

__all__ = ["THREADS", "CudaEvent", "CudaStream", "StreamDevice", "addr", "flag_addr",
           "new_event", "take_event", "record_on"]

# CUDA runtime constants (stable ABI values)
_SUCCESS = 0
_NOT_READY = 600  # cudaErrorNotReady
#: threads per block of the data kernels
THREADS = 256
_RECENT_WAITS = 256  # waits remembered per stream, for error messages and abort
#: events kept for reuse per device (creating one is a driver call)
_SPARE_EVENTS = 64


class StreamDevice(Protocol):
    """What a stream and its events ask of their device (`CudaDevice`)."""

    device_id: int
    #: `with device.scope():` the device is current in the calling thread
    scope: Callable[[], AbstractContextManager[Any]]
    #: "memcpy" or "kernel" (GPURING_CUDA_COPY); "memops" or "kernel" (GPURING_CUDA_FLAGS)
    copy_mode: str
    flags_mode: str
    #: the abort word every kernel checks first, and the status word (see `_cuda_waits`)
    abort_ptr: int
    status_ptr: int
    timeout: float
    timeout_ns: int
    #: driver calls made to enqueue work or make events (`Device.operations`)
    operations: int
    #: events recorded before that nothing holds any more, free to record again
    spare_events: list[Any]
    #: the last event recorded on a caller's stream
    last_on_caller: CudaEvent | None

    @property
    def aborted(self) -> str | None: ...

    def check(self, tag: Any = None, stream: CudaStream | None = None) -> None: ...

    def timeout_error(self, stream: CudaStream | None) -> Exception: ...

    def note_wait_word(self, word: int) -> None: ...

    def grid_for(self, kernel: Any, n: int, per_thread: int) -> int: ...

    def reduce_kernel(self, dtype: str, op: ReduceOp) -> tuple[Any, int]: ...

    def reduce_n_kernel(self, dtype: str, op: ReduceOp) -> tuple[Any, int]: ...


_new = object.__new__


class CudaEvent(Event):
    """A CUDA event. `scope` makes its device current; `spare` (where not None) is where
    the raw event goes back once this object is gone (`record_on`)."""

    __slots__ = ("raw", "scope", "spare")
    _SPARE_EVENTS_KEPT = _SPARE_EVENTS

    def __init__(self, raw: Any, scope: Callable[[], AbstractContextManager[Any]],
                 spare: list[Any] | None = None):
        self.raw = raw
        self.scope = scope
        self.spare = spare

    def __del__(self) -> None:
        spare = getattr(self, "spare", None)  # None too if __init__ did not finish
        if spare is not None and len(spare) < self._SPARE_EVENTS_KEPT:
            spare.append(self.raw)  # builtins only: this may run late in interpreter exit

    def query(self) -> bool:
        """True once the stream passed the event; raises the CUDA error of a failed kernel
        (`Event.done` would read False forever instead). Any thread may ask (the watchdog
        does): the query runs with this device current."""
        runtime = cupy_module().cuda.runtime
        with self.scope():
            status = runtime.eventQuery(self.raw.ptr)
        if status == _SUCCESS:
            return True
        if status == _NOT_READY:
            return False
        runtime.check_status(status)  # raises CUDARuntimeError naming the error
        raise RuntimeError(f"cudaEventQuery returned {status}")


def new_event() -> Any:
    """A new CuPy event to record (a driver call); inside the device's `scope()`."""
    return cupy_module().cuda.Event(block=False, disable_timing=True)


def take_event(device: StreamDevice) -> Any:
    """An event to record: one the device recorded before and nothing holds any more (given
    back by a collected `CudaEvent`), else a new one (counted). Inside `device.scope()`."""
    try:
        return device.spare_events.pop()
    except IndexError:
        device.operations += 1
        return new_event()


def record_on(device: StreamDevice, raw_stream: Any) -> CudaEvent:
    """An event recorded on the CuPy stream `raw_stream` (inside `device.scope()`), which
    goes back to the device's spare events once the returned object is gone: nothing else
    holds it then, so recording it again is safe (the waits queued on it already took the
    record they saw)."""
    raw = take_event(device)
    raw.record(raw_stream)
    device.operations += 1
    # CudaEvent(raw, device.scope, spare) without the call of __init__ (on every call's path)
    event = _new(CudaEvent)
    event.raw, event.scope, event.spare = raw, device.scope, device.spare_events
    return event


def addr(span_or_flag: Span | Flag) -> int:
    """The device address of a span or flag of live CUDA memory."""
    mem = span_or_flag.mem
    if not isinstance(mem, CudaMemory) or not mem.ptr:
        raise ValueError(f"not live CUDA memory: {mem!r}")
    return mem.ptr + span_or_flag.offset


def _elements(span: Span, itemsize: int, dtype: str) -> int:
    """How many `dtype` elements `span` holds (it must hold a whole number)."""
    if span.nbytes % itemsize:
        raise ValueError(f"{span.nbytes} bytes is not a whole number of {dtype}")
    return span.nbytes // itemsize


def flag_addr(flag: Flag) -> int:
    """The device address of a flag: an aligned 8-byte word of its memory."""
    if flag.offset % 8 or flag.offset + 8 > flag.mem.nbytes:
        raise ValueError(f"flag at offset {flag.offset} is not an aligned 8-byte word in "
                         f"{flag.mem.nbytes} bytes")
    return addr(flag)


class CudaStream(Stream):
    """A CuPy non-blocking stream. Every method only enqueues (except synchronize)."""

    def __init__(self, device: StreamDevice, raw: Any, *, caller: bool = False):
        """`caller`: a stream of the caller's, which only one-kernel all_reduces use."""
        self._device = device
        self.raw = raw
        self._caller = caller
        #: the recent flag waits: (flag, value, tag)
        self.waits: collections.deque[tuple[Flag, int, Any]] = collections.deque(
            maxlen=_RECENT_WAITS)
        #: (driver module, the driver's CUstream) for stream memory operations, once made
        #: (`driver_stream`)
        self.cu: tuple[Any, Any] | None = None

    def driver_stream(self) -> tuple[Any, Any]:
        """(driver module, CUstream), made once per stream. Called inside `scope()`, which
        makes the device's context current for the driver call."""
        found = self.cu
        if found is None:
            from cuda.bindings import driver

            found = self.cu = (driver, driver.CUstream(self.raw.ptr))
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
                    (np.uint64(addr(dst)), np.uint64(addr(src)), np.uint64(n),
                     np.uint64(dev.abort_ptr)),
                    stream=self.raw)
            else:
                runtime = cupy_module().cuda.runtime
                runtime.memcpyAsync(addr(dst), addr(src), dst.nbytes, MEMCPY_DEFAULT,
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
                   (np.uint64(addr(dst)), np.uint64(addr(a)), np.uint64(addr(b)),
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
        out = addr(dst)
        launches = _kernels.fold_launches(out, [addr(s) for s in srcs])
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
        word = flag_addr(flag)
        dev.note_wait_word(word)
        self.waits.append((flag, value, tag))
        with dev.scope():
            if dev.flags_mode == "memops":
                driver, cu = self.driver_stream()
                geq = driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
                check_cu(driver.cuStreamWaitValue64(
                    cu, driver.CUdeviceptr(word), driver.cuuint64_t(value), geq),
                    "cuStreamWaitValue64")
            else:
                _kernels.get_function(_kernels.WAIT_FLAG_KERNEL, dev.device_id)(
                    (1,), (1,),
                    (np.uint64(word), np.uint64(value), np.uint64(dev.timeout_ns),
                     np.uint64(dev.status_ptr), np.uint64(dev.abort_ptr)),
                    stream=self.raw)
        dev.operations += 1

    def write_flag(self, flag: Flag, value: int) -> None:
        """A one-thread kernel in either flag mode: it publishes nothing once the device is
        aborted, so data computed after a failure never reaches a peer (a stream memory write
        queued before the abort would still run once the stream is released)."""
        dev = self._device
        dev.check()
        word = flag_addr(flag)
        with dev.scope():
            _kernels.get_function(_kernels.WRITE_FLAG_KERNEL, dev.device_id)(
                (1,), (1,), (np.uint64(word), np.uint64(value), np.uint64(dev.abort_ptr)),
                stream=self.raw)
        dev.operations += 1

    def write_flags(self, flags: Sequence[Flag], value: int) -> None:
        """`write_flag` of several flags: one launch per `MAX_FLAGS` of them."""
        if len(flags) == 1:
            self.write_flag(flags[0], value)
            return
        dev = self._device
        dev.check()
        addrs = [flag_addr(flag) for flag in flags]
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

    def record_in_scope(self) -> CudaEvent:
        """`record()` where the device is current already (inside `device.scope()`)."""
        event = record_on(self._device, self.raw)
        if self._caller:
            self._device.last_on_caller = event
        return event

    def wait_event(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
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
