"""A CUDA simulator that stands in for CuPy, so that `CudaDevice` and the GPU tests run on a
machine without a GPU. Put this directory first on PYTHONPATH; `import cupy` then finds this.

What it models, and how:
- device memory is host memory: `cuda.Memory` maps a /dev/shm file, so that CUDA IPC
  (`ipcGetMemHandle` / `ipcOpenMemHandle`) maps the same pages in a peer process; a device
  pointer is a plain address; a kernel given one outside every allocation, mapping, pinned
  buffer and live array, or on another device's memory without peer access (IPC's lazy
  flag or deviceEnablePeerAccess), faults when it runs: the context's sticky
  cudaErrorIllegalAddress, after which every call and event query fails, as on a GPU;
  freeing memory a peer still maps makes that peer's next access fault (SIGBUS), as
  undefined behaviour may.
  Files are named after the process (and the `gpuring run` job, whose launcher removes them);
  those of dead processes are removed when the simulator is next imported;
- host memory a process mapped (a shared-memory file) can be registered (`hostRegister`):
  kernels and stream memory operations may then touch it at its host address;
- every stream is a thread that runs its operations in order, started when the first operation
  is queued on it (importing the simulator starts none); events mark a point in a stream;
  `Stream.wait_event` holds a stream, with no timeout, like the GPU does; a stream belongs to
  the device current when it was made, and the legacy default stream synchronises implicitly
  with the blocking streams of its device (non-blocking ones are independent);
- `RawModule` kernels are those of kernels/reduce.cu built for the CPU
  (kernels_host_build.py), launched with the grid they are given;
- `cuda.bindings.driver` is simulated: its stream memory operations (`cuStreamWaitValue64`,
  `cuStreamWriteValue64`, and 64-bit waits and writes in `cuStreamBatchMemOp`) work when
  GPURING_CUDASIM_MEMOPS=1, and otherwise the device reports
  none and the calls fail with CUDA_ERROR_NOT_SUPPORTED, as on a device without them;
- occupancy (`cuOccupancyMaxActiveBlocksPerMultiprocessor` in that driver, and CuPy's
  `cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor`) answers from the registers of the
  kernel in the CUBIN that was loaded (cubin.py), by the rules of sm_80 and sm_90;
- arrays (`ndarray`) hold their data in host memory; every operation on them first waits for
  the current stream, as reading a result on the GPU would, except views (reshape, basic
  indexing, ...), which CuPy makes without touching the data.
- graph capture: between `Stream.begin_capture()` and `end_capture()` the stream records what
  is queued on it (kernels, copies, memsets, stream memory operations) instead of running it,
  and `Graph.launch(stream)` queues all of it again on `stream`, each replay with the values
  recorded (a kernel's arguments, a flag value). What a capture forbids fails, and ends the
  capture invalidated (`end_capture` then raises): synchronizing a capturing stream, querying
  or synchronizing an event recorded in the capture, a stream waiting on an event recorded
  outside it; allocating memory, querying or synchronizing an event or a stream in a
  capture's thread, or in any thread while a capture in the global mode runs (CuPy's default
  mode, relaxed, allows them). Work from another stream joining a capture (a wait on its
  event) is not simulated and fails;
- GPURING_CUDASIM_JITTER=1 delays stream operations at random, to expose missing ordering;
- CUDA_DEVICE_MAX_CONNECTIONS=N makes the streams share N hardware queues in turn.
- contexts: a thread has a current device (`setDevice`, default 0) and, once it made a call
  that needs one, a current context. As in CUDA >= 12, `setDevice` creates the device's
  primary context, and a runtime call in a thread with no current context creates the current
  device's (device 0 unless set). `contexts_created()` lists the devices this process has a
  context on: a library that touches GPU 0 from a helper thread shows up there.
- fork: as in CUDA, the process's first runtime call (any but the error calls) or driver call
  (cuInit) initializes CUDA, and importing the simulator makes none. A child forked
  before that runs on the GPU as any process does; a child forked after it gets
  cudaErrorInitializationError ("initialization error") from every runtime call and
  CUDA_ERROR_NOT_INITIALIZED from every driver call (what CUDA does in a forked child of an
  initialized parent), promptly: nothing the parent queued runs in the child, and memory the
  parent allocated is still the parent's (the child's frees leave it alone).

It is not CuPy: only what gpuring and its tests use is here, and a call it does not know fails
with AttributeError.
"""

from __future__ import annotations

import builtins  # this module defines any, all, sum, abs ... as cupy does: use the builtins
import ctypes
import importlib
import itertools
import mmap
import os
import random as _stdrandom
import secrets
import struct
import sys
import threading
import time
import types
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from shm_names import allocation_name, live_mappers, mapping_marker, sweep_dead_allocations

__version__ = "0.0.0+cudasim"
_HERE = Path(__file__).resolve().parent
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_JITTER = os.environ.get("GPURING_CUDASIM_JITTER") == "1"
_SM_COUNT = 4
_TOTAL_MEMORY = 16 << 30


class CUDARuntimeError(RuntimeError):
    def __init__(self, name: str, message: str = ""):
        super().__init__(f"{name}: {message}" if message else name)
        self.status = name


class _Initialization:
    """Whether CUDA is initialized in this process, and whether it was in the parent this
    process was forked from (then CUDA refuses every call here)."""

    def __init__(self) -> None:
        self.initialized = False
        self.inherited = False


_init = _Initialization()


def _initialize() -> None:
    """A runtime call: it initializes CUDA in this process, or fails as CUDA fails every
    call in a child forked from a process that had initialized it."""
    if _init.inherited:
        raise CUDARuntimeError("cudaErrorInitializationError", "initialization error")
    _init.initialized = True


# ------------------------------------------------------------------------------ streams

class _Marker:
    """A point in a stream: set once the stream has run everything before it."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.when = 0.0

    def reach(self) -> None:
        self.when = time.perf_counter()
        self.reached.set()


#: the context's sticky error (an illegal address): once set, the process's CUDA is dead
_sticky: list[CUDARuntimeError] = []


def _fault(what: str) -> None:
    """What a kernel touching memory that is not the device's does to the context."""
    error = CUDARuntimeError("cudaErrorIllegalAddress",
                             f"an illegal memory access was encountered ({what})")
    if not _sticky:
        _sticky.append(error)
    raise error


class _Worker(threading.Thread):
    """The thread that runs a stream's (or a hardware queue's) operations, started when the
    first one is queued."""

    def __init__(self, name: str):
        super().__init__(name=name, daemon=True)
        self.queue: list[Callable[[], None]] = []
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.rng = _stdrandom.Random(secrets.randbits(32))
        #: an operation taken off the queue is running (under `cond`, as the queue)
        self.running = False
        self.launched = False
        _workers.add(self)

    def forked(self) -> None:
        """In a forked child: the thread is gone, and nothing the parent queued runs here."""
        self.cond = threading.Condition()
        self.queue = []
        self.running = False

    def idle(self) -> bool:
        """Nothing queued and nothing running: work queued before now has all run."""
        with self.cond:
            return not self.queue and not self.running

    def put(self, op: Callable[[], None]) -> None:
        _initialize()
        if _sticky:  # the context is dead: every call fails with its error, as CUDA's do
            raise _sticky[0]
        if self.error is not None:
            raise CUDARuntimeError("cudaErrorLaunchFailure", f"earlier failure: {self.error}")
        with self.cond:
            if not self.launched:
                self.launched = True
                self.start()
            self.queue.append(op)
            self.cond.notify()

    def run(self) -> None:
        while True:
            with self.cond:
                self.running = False
                while not self.queue:
                    self.cond.wait()
                op = self.queue.pop(0)
                self.running = True
            if _JITTER and self.rng.random() < 0.3:
                time.sleep(self.rng.random() * 200e-6)
            try:
                op()
            except BaseException as exc:  # a sticky error, as on the GPU
                self.error = exc
            del op  # hold nothing of it while idle


#: every worker made in this process (a forked child stops those it inherited)
_workers: weakref.WeakSet[_Worker] = weakref.WeakSet()
_streams: dict[int, Stream] = {}
#: driver calls that enqueued work or made events in this process, as a GPU would count them:
#: every operation queued on a stream (kernel launch, copy, memset, stream memory operation,
#: event record or wait) and every event created; tests compare CudaDevice's own count with it
driver_calls = [0]
#: CUDA_DEVICE_MAX_CONNECTIONS: how many hardware work queues the streams share (CUDA's
#: default is 8). Streams beyond that share a queue in turn, and work on a shared queue runs
#: in the order it was queued, whatever its stream: a stream blocked in a wait holds the
#: others on its queue too. Unset here: a queue per stream (as while streams are few).
_CONNECTIONS = int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "0") or 0)
_queues: list[_Worker] = []


def _worker_for(null: bool) -> _Worker:
    """The queue a new stream's work goes to."""
    if null or _CONNECTIONS <= 0:
        return _Worker(f"cudasim-stream-{len(_streams):#x}")
    if len(_queues) < _CONNECTIONS:
        _queues.append(_Worker(f"cudasim-queue-{len(_queues)}"))
        return _queues[-1]
    return _queues[(len(_streams) - 1) % _CONNECTIONS]
_legacy_lock = threading.Lock()
_stream_ids = itertools.count(0x1000, 0x10)

#: capture modes (cudaStreamCaptureMode)
streamCaptureModeGlobal, streamCaptureModeThreadLocal, streamCaptureModeRelaxed = 0, 1, 2


class _Capture:
    """A stream's capture under way: what it recorded, and why it was invalidated."""

    def __init__(self, mode: int):
        self.mode = mode
        self.thread = threading.get_ident()
        self.ops: list[Callable[[], None]] = []
        self.invalid: str | None = None


#: captures under way in this process
_captures: list[_Capture] = []


def _invalidate(capture: _Capture, error: str, what: str) -> CUDARuntimeError:
    """What a call a capture forbids does: the capture is invalidated, the call fails."""
    capture.invalid = capture.invalid or f"{error}: {what}"
    return CUDARuntimeError(error, what)


def _unsafe_call(what: str) -> None:
    """A potentially unsafe call (one that may synchronize, say cudaMalloc): forbidden in the
    thread of a capture that is not relaxed, and in any thread during a global one."""
    me = threading.get_ident()
    for capture in list(_captures):
        if capture.mode == streamCaptureModeGlobal or (
                capture.mode == streamCaptureModeThreadLocal and capture.thread == me):
            raise _invalidate(capture, "cudaErrorStreamCaptureUnsupported",
                              f"{what} during a stream capture")


class Graph:
    """A captured graph (cupy.cuda.graph.Graph): `launch` queues its work on a stream as one
    driver call."""

    def __init__(self, ops: list[Callable[[], None]]):
        self._ops = ops

    def upload(self, stream: Stream | None = None) -> None:
        pass

    def launch(self, stream: Stream | None = None) -> None:
        target = _stream(stream)
        if target._capturing() is not None:
            raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported",
                                   "cudasim does not simulate a graph launched into a capture")
        driver_calls[0] += 1
        for op in self._ops:
            target._put(op, count=False)


class Stream:
    """A CUDA stream: a thread running operations in order."""

    null: Stream

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        if not null:
            _context()
        self.ptr = 0 if null else next(_stream_ids)
        self.non_blocking = non_blocking
        # the device current at creation (-1: the legacy stream, which every device has)
        self.device_id = -1 if null else _Runtime.getDevice()
        self._worker = _worker_for(null)
        self._capture: _Capture | None = None
        _streams[self.ptr] = self

    def _capturing(self) -> _Capture | None:
        """The capture under way on this stream (an ExternalStream shares its stream's)."""
        return _streams[self.ptr]._capture

    def _put(self, op: Callable[[], None], *, count: bool = True) -> None:
        """Queue `op` (one driver call, unless `count` is False: see `driver_calls`), or record
        it while the stream captures. The legacy default stream and the
        blocking streams of its device order each other implicitly (CUDA's legacy
        semantics): work on the legacy stream waits for what every blocking stream has
        queued, and work on a blocking stream waits for what the legacy stream has queued.
        Non-blocking streams are left alone."""
        if count:
            driver_calls[0] += 1
        capture = self._capturing()
        if capture is not None:
            capture.ops.append(op)
            return
        if self.ptr != 0 and self.non_blocking:
            self._worker.put(op)
            return
        with _legacy_lock:
            device = _Runtime.getDevice() if self.ptr == 0 else self.device_id
            others = ([s for s in list(_streams.values()) if s.ptr != 0 and not s.non_blocking
                       and s.device_id == device and s is not self and s._worker is not
                       self._worker] if self.ptr == 0 else [Stream.null])
            for other in others:
                marker = _Marker()
                try:
                    other._worker.put(marker.reach)
                except CUDARuntimeError:
                    continue  # a failed stream never gets there; the error shows elsewhere
                self._worker.put(marker.reached.wait)
            self._worker.put(op)

    def record(self, event: Event | None = None) -> Event:
        event = event or Event()
        event.record(self)
        return event

    def wait_event(self, event: Event) -> None:
        capture = self._capturing()
        if event._captured is not None:
            if event._captured is not capture:
                raise CUDARuntimeError("cudaErrorStreamCaptureUnsupported", "cudasim does not "
                                       "simulate a stream joining a capture")
            driver_calls[0] += 1  # within one stream's capture: stream order already holds
            return
        if capture is not None and event._marker is not None:
            raise _invalidate(capture, "cudaErrorStreamCaptureIsolation",
                              "a capturing stream waits on an event recorded outside it")
        marker = event._marker
        if marker is not None:
            self._put(marker.reached.wait)
        else:  # an event never recorded: the call returns at once, but it was made
            driver_calls[0] += 1

    def begin_capture(self, mode: int | None = None) -> None:
        """Record what is queued on this stream from now on instead of running it (CuPy's
        default mode: relaxed)."""
        if self.ptr == 0:
            raise RuntimeError("cannot capture on the default (legacy) stream")
        if self._capturing() is not None:
            raise CUDARuntimeError("cudaErrorIllegalState", "the stream is capturing already")
        capture = _Capture(streamCaptureModeRelaxed if mode is None else int(mode))
        _streams[self.ptr]._capture = capture
        _captures.append(capture)

    def end_capture(self) -> Graph:
        capture = self._capturing()
        if capture is None:
            raise CUDARuntimeError("cudaErrorIllegalState", "the stream is not capturing")
        if capture.mode != streamCaptureModeRelaxed and capture.thread != threading.get_ident():
            raise CUDARuntimeError("cudaErrorStreamCaptureWrongThread")
        _streams[self.ptr]._capture = None
        _captures.remove(capture)
        if capture.invalid is not None:
            raise CUDARuntimeError("cudaErrorStreamCaptureInvalidated", capture.invalid)
        return Graph(capture.ops)

    def is_capturing(self) -> bool:
        return self._capturing() is not None

    def synchronize(self) -> None:
        capture = self._capturing()
        if capture is not None:
            raise _invalidate(capture, "cudaErrorStreamCaptureUnsupported",
                              "synchronizing a capturing stream")
        _unsafe_call("cudaStreamSynchronize")
        event = Event()
        event.record(self)
        event.synchronize()
        if self._worker.error is not None:
            raise CUDARuntimeError("cudaErrorLaunchFailure", str(self._worker.error))

    @property
    def done(self) -> bool:
        capture = self._capturing()
        if capture is not None:
            raise _invalidate(capture, "cudaErrorStreamCaptureUnsupported",
                              "querying a capturing stream")
        event = Event()
        event.record(self)
        return event.done

    def use(self) -> Stream:
        _check_stream_device(self)
        _current_streams()[_Runtime.getDevice()] = self
        return self

    def __enter__(self) -> Stream:
        _check_stream_device(self)
        streams = _current_streams()
        device = _Runtime.getDevice()
        _stream_stack().append((device, streams.get(device)))
        streams[device] = self
        return self

    def __exit__(self, *exc: object) -> None:
        device, previous = _stream_stack().pop()
        _current_streams()[device] = previous


_current = threading.local()


def _current_streams() -> dict[int, Any]:
    """This thread's current stream per device (CuPy keeps one per device and thread)."""
    streams = getattr(_current, "streams", None)
    if streams is None:
        streams = _current.streams = {}
    return streams


def _stream_stack() -> list[tuple[int, Any]]:
    stack = getattr(_current, "stream_stack", None)
    if stack is None:
        stack = _current.stream_stack = []
    return stack


def _check_stream_device(stream: Any) -> None:
    """As CuPy: a stream becomes current only while its own device is the current one."""
    device = _Runtime.getDevice()
    if stream.device_id >= 0 and stream.device_id != device:
        raise RuntimeError(f"The device that the stream is created on ({stream.device_id}) "
                           f"does not match with the current device ({device}).")


Stream.null = Stream(null=True)


class ExternalStream(Stream):
    """A stream made by another library (say torch), named by its handle and device: the
    same stream, so work queued through either runs in one order."""

    def __init__(self, ptr: int, device_id: int = -1):  # no new thread: it shares the stream
        self._stream = _stream(int(ptr))
        self.ptr = self._stream.ptr
        self.non_blocking = self._stream.non_blocking
        self.device_id = self._stream.device_id if device_id < 0 else device_id
        self._worker = self._stream._worker
        self._capture = None  # its stream's capture is the one that counts (`_capturing`)


_contexts: set[int] = set()  # devices whose primary context this process created


def _context() -> None:
    """A runtime call that needs a context: the current device's, created if need be."""
    _initialize()
    if getattr(_current, "context", None) is None:
        device = getattr(_current, "device", 0)
        _contexts.add(device)
        _current.context = device


def contexts_created() -> set[int]:
    """The devices this process created a CUDA context on (simulator only)."""
    return set(_contexts)


def get_current_stream(device_id: int | None = None) -> Stream:
    device = _Runtime.getDevice() if device_id is None else device_id
    return _current_streams().get(device) or Stream.null


def _stream(ptr: int | Stream | None) -> Stream:
    if ptr is None:
        return get_current_stream()
    if isinstance(ptr, Stream):
        return ptr
    try:
        return _streams[int(ptr)]
    except KeyError:
        raise CUDARuntimeError("cudaErrorInvalidResourceHandle", f"stream {ptr:#x}") from None


_events: weakref.WeakValueDictionary[int, Event] = weakref.WeakValueDictionary()
_event_ids = itertools.count(0x10_0000, 0x10)


class Event:
    def __init__(self, block: bool = False, disable_timing: bool = False,
                 interprocess: bool = False):
        _initialize()
        driver_calls[0] += 1
        self._marker: _Marker | None = None
        self._stream: Stream | None = None
        self._captured: _Capture | None = None  # recorded in this capture
        self.ptr = next(_event_ids)
        _events[self.ptr] = self

    def record(self, stream: Stream | None = None) -> None:
        _context()
        target = _stream(stream)
        capture = target._capturing()
        if capture is not None:  # a node of the graph: the host can never wait for it
            driver_calls[0] += 1
            self._marker, self._stream, self._captured = None, target, capture
            return
        marker = _Marker()
        self._marker, self._stream, self._captured = marker, target, None
        target._put(marker.reach)

    def _check_not_captured(self, what: str) -> None:
        _initialize()
        if self._captured is not None:
            raise _invalidate(self._captured, "cudaErrorStreamCaptureUnsupported",
                              f"{what} an event recorded in a capture")
        _unsafe_call(f"{what} an event")

    @property
    def done(self) -> bool:
        self._check_not_captured("querying")
        return self._marker is None or self._marker.reached.is_set()

    def synchronize(self) -> None:
        self._check_not_captured("synchronizing")
        if self._marker is not None:
            self._marker.reached.wait()


def get_elapsed_time(start: Event, end: Event) -> float:
    """Milliseconds between two recorded events."""
    if start._marker is None or end._marker is None or not end.done or not start.done:
        raise CUDARuntimeError("cudaErrorNotReady")
    return (end._marker.when - start._marker.when) * 1e3


def _sync_current() -> None:
    get_current_stream().synchronize()


# ------------------------------------------------------------------------------ memory

class _Allocation:
    """`size` bytes of a /dev/shm file mapped at `ptr` (shared, so peers can map it).

    Freeing it while a peer still maps it is undefined behaviour in CUDA; here the owner's
    free truncates the file, so a peer that still reads or writes it dies of SIGBUS at once
    (a loud failure, as an illegal address on a GPU is)."""

    MAGIC = b"cudasim1"

    def __init__(self, size: int, name: str | None = None):
        self.size = size
        self.owner = name is None
        self.pid = os.getpid()  # a forked child's copy of the mapping is not its memory
        self.device = _Runtime.getDevice()  # the owner's (a peer's handle says which)
        self.name = name or allocation_name()
        self.opens = 1
        path = f"/dev/shm/{self.name}"
        try:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if self.owner else 0), 0o600)
        except FileNotFoundError:  # the exporter freed it: an invalid handle by now
            raise CUDARuntimeError("cudaErrorInvalidValue", f"{self.name} was freed") from None
        try:
            if self.owner:
                os.ftruncate(fd, size)
            ptr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED,
                             fd, 0)
            if ptr in (None, ctypes.c_void_p(-1).value):
                raise CUDARuntimeError("cudaErrorMemoryAllocation",
                                       os.strerror(ctypes.get_errno()))
            self.ptr: int = ptr
        finally:
            os.close(fd)

    def handle(self) -> bytes:
        """64 bytes: magic, size with the owner's device in the top byte, name."""
        name = self.name.encode()
        sized = self.size | self.device << 56
        return (self.MAGIC + struct.pack("<qI", sized, len(name)) + name).ljust(64, b"\0")

    @classmethod
    def name_in(cls, handle: bytes) -> str:
        if len(handle) != 64 or not handle.startswith(cls.MAGIC):
            raise CUDARuntimeError("cudaErrorInvalidValue", "not an IPC handle")
        _size, length = struct.unpack_from("<qI", handle, len(cls.MAGIC))
        start = len(cls.MAGIC) + 12
        return handle[start:start + length].decode()

    @classmethod
    def from_handle(cls, handle: bytes) -> _Allocation:
        sized, _length = struct.unpack_from("<qI", handle, len(cls.MAGIC))
        alloc = cls(sized & ((1 << 56) - 1), cls.name_in(handle))
        alloc.device = sized >> 56
        return alloc

    def map_in_peer(self) -> None:
        """Record that this process maps a peer's allocation (its owner checks at free)."""
        open(mapping_marker(self.name, os.getpid()), "w").close()

    def free(self) -> None:
        if not self.ptr or self.pid != os.getpid():
            return
        _libc.munmap(self.ptr, self.size)
        self.ptr = 0
        if not self.owner:
            try:
                os.unlink(mapping_marker(self.name, os.getpid()))
            except FileNotFoundError:
                pass
            return
        path = f"/dev/shm/{self.name}"
        mappers = live_mappers(self.name)
        try:
            os.truncate(path, 0)  # peers' mappings now fault on access
            os.unlink(path)
        except FileNotFoundError:
            pass
        if mappers:  # undefined behaviour on a GPU: make it loud and certain here
            sys.stderr.write(f"cudasim: cudaFree of {self.name} while processes {mappers} "
                             "still map it (undefined behaviour in CUDA); aborting\n")
            sys.stderr.flush()
            os.abort()


_allocated: dict[int, _Allocation] = {}  # base pointer -> allocation made here
_opened: dict[int, _Allocation] = {}  # base pointer -> peer allocation mapped here
_used = [0]


class Memory:
    """Device memory outside any pool (cudaMalloc); freed when the object goes."""

    def __init__(self, size: int):
        _context()
        _unsafe_call("cudaMalloc")
        self._alloc = _Allocation(max(int(size), 1))
        _allocated[self._alloc.ptr] = self._alloc
        _used[0] += self._alloc.size
        self.ptr = self._alloc.ptr
        self.size = int(size)
        self.device_id = self._alloc.device

    def __del__(self) -> None:
        alloc = getattr(self, "_alloc", None)
        if _allocated is None:  # interpreter shutdown: the mapping goes with the process (and
            return  # the next import, or `shm_names --check`, sweeps its file)
        if alloc is not None and alloc.ptr:
            _allocated.pop(alloc.ptr, None)
            _used[0] -= alloc.size
            alloc.free()


class _MemoryPool:
    def free_all_blocks(self) -> None:
        pass

    def used_bytes(self) -> int:
        return 0


def get_default_memory_pool() -> _MemoryPool:
    return _MemoryPool()


_host_buffers: dict[int, Any] = {}
#: host memory registered with `hostRegister`: start -> bytes
_host_registered: dict[int, int] = {}


# ------------------------------------------------------------------------------ runtime

def _run_on(stream: Any, op: Callable[[], None]) -> None:
    _stream(stream)._put(op)


class _Runtime(types.ModuleType):
    CUDARuntimeError = CUDARuntimeError
    memcpyHostToHost, memcpyHostToDevice, memcpyDeviceToHost = 0, 1, 2
    memcpyDeviceToDevice, memcpyDefault = 3, 4
    hostAllocPortable, hostAllocMapped = 1, 2
    streamCaptureModeGlobal = streamCaptureModeGlobal
    streamCaptureModeThreadLocal = streamCaptureModeThreadLocal
    streamCaptureModeRelaxed = streamCaptureModeRelaxed

    @staticmethod
    def getDeviceCount() -> int:
        _initialize()
        return int(os.environ.get("GPURING_CUDASIM_DEVICES", "1"))

    @staticmethod
    def getDevice() -> int:
        _initialize()
        return getattr(_current, "device", 0)

    @staticmethod
    def setDevice(device: int) -> None:
        """Makes `device` current in this thread and creates its primary context (CUDA 12)."""
        _initialize()
        if not 0 <= device < _Runtime.getDeviceCount():
            raise CUDARuntimeError("cudaErrorInvalidDevice")
        _current.device = device
        _current.context = device
        _contexts.add(device)

    @staticmethod
    def deviceCanAccessPeer(device: int, peer: int) -> int:
        """1, unless GPURING_CUDASIM_NO_P2P=1 (GPUs behind different CPU sockets without
        P2P, say): then 0 between different devices."""
        _initialize()
        return int(device == peer or os.environ.get("GPURING_CUDASIM_NO_P2P") != "1")

    @staticmethod
    def deviceGetByPCIBusId(bus_id: str) -> int:
        for device in range(_Runtime.getDeviceCount()):
            if Device(device).pci_bus_id == bus_id:
                return device
        raise CUDARuntimeError("cudaErrorInvalidDevice")

    @staticmethod
    def deviceEnablePeerAccess(peer: int) -> None:
        _context()
        _peer_access.add((_Runtime.getDevice(), peer))

    @staticmethod
    def memGetInfo() -> tuple[int, int]:
        _initialize()
        return _TOTAL_MEMORY - _used[0], _TOTAL_MEMORY

    @staticmethod
    def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:
        _context()
        _run_on(stream, lambda: ctypes.memmove(dst, src, size))

    @staticmethod
    def memcpy(dst: int, src: int, size: int, kind: int) -> None:
        _context()
        Stream.null.synchronize()
        ctypes.memmove(dst, src, size)

    @staticmethod
    def memsetAsync(ptr: int, value: int, size: int, stream: int) -> None:
        _context()
        _run_on(stream, lambda: ctypes.memset(ptr, value, size))

    @staticmethod
    def hostAlloc(size: int, flags: int) -> int:
        _context()
        buffer = (ctypes.c_char * max(size, 1))()
        ptr = ctypes.addressof(buffer)
        _host_buffers[ptr] = buffer
        return ptr

    @staticmethod
    def freeHost(ptr: int) -> None:
        _initialize()
        if _host_buffers.pop(ptr, None) is None:
            raise CUDARuntimeError("cudaErrorInvalidValue", f"{ptr:#x} is not pinned memory")

    @staticmethod
    def hostRegister(ptr: int, size: int, flags: int) -> None:
        """Pins host memory the process mapped (a shared-memory file, say): kernels may
        then touch it at its host address (every device reaches it)."""
        _context()
        if builtins.any(p < ptr + size and ptr < p + n for p, n in _host_registered.items()):
            raise CUDARuntimeError("cudaErrorHostMemoryAlreadyRegistered",
                                   f"{ptr:#x} is registered already")
        _host_registered[ptr] = size

    @staticmethod
    def hostUnregister(ptr: int) -> None:
        if _host_registered.pop(ptr, None) is None:
            raise CUDARuntimeError("cudaErrorHostMemoryNotRegistered",
                                   f"{ptr:#x} is not registered")

    @staticmethod
    def ipcGetMemHandle(ptr: int) -> bytes:
        _context()
        alloc = _allocated.get(ptr)
        if alloc is None:
            raise CUDARuntimeError("cudaErrorInvalidValue",
                                   f"{ptr:#x} is not the base of a cudaMalloc allocation")
        return alloc.handle()

    @staticmethod
    def ipcOpenMemHandle(handle: bytes, flags: int = 1) -> int:
        """Maps a peer's allocation; opening the same handle again returns the same mapping
        (counted: each open needs its close)."""
        _context()
        handle = bytes(handle)
        name = _Allocation.name_in(handle)
        if builtins.any(a.name == name for a in _allocated.values()):
            raise CUDARuntimeError("cudaErrorDeviceUninitialized",
                                   "a process cannot open its own IPC handle")
        for alloc in _opened.values():
            if alloc.name == name:
                alloc.opens += 1
                return alloc.ptr
        alloc = _Allocation.from_handle(handle)
        if flags & 1:  # cudaIpcMemLazyEnablePeerAccess: this device may reach the owner's
            _peer_access.add((_Runtime.getDevice(), alloc.device))
        alloc.map_in_peer()
        _opened[alloc.ptr] = alloc
        return alloc.ptr

    @staticmethod
    def ipcCloseMemHandle(ptr: int) -> None:
        _initialize()
        alloc = _opened.get(ptr)
        if alloc is None:
            raise CUDARuntimeError("cudaErrorInvalidValue", f"{ptr:#x} was not opened by IPC")
        alloc.opens -= 1
        if alloc.opens == 0:
            del _opened[ptr]
            alloc.free()

    @staticmethod
    def eventQuery(ptr: int) -> int:
        _context()
        event = _events[ptr]
        if _sticky:
            return 700  # cudaErrorIllegalAddress: the context is dead
        if event._captured is not None:
            _invalidate(event._captured, "cudaErrorStreamCaptureUnsupported", "eventQuery")
            return 900  # cudaErrorStreamCaptureUnsupported
        try:
            _unsafe_call("cudaEventQuery")
        except CUDARuntimeError:
            return 900
        if event._stream is not None and event._stream._worker.error is not None:
            return 719  # cudaErrorLaunchFailure: the stream's earlier operation failed
        return 0 if event.done else 600

    @staticmethod
    def check_status(status: int) -> None:
        if status != 0:
            raise CUDARuntimeError(f"cuda error {status}")

    @staticmethod
    def deviceSynchronize() -> None:
        """Waits for every stream of the current device (and the legacy stream)."""
        _context()
        device = _Runtime.getDevice()
        for stream in list(_streams.values()):
            if stream.device_id in (-1, device):
                stream.synchronize()


runtime = _Runtime("cupy.cuda.runtime")


class _Attributes(dict):  # type: ignore[type-arg]
    def __missing__(self, key: str) -> int:
        raise KeyError(f"cudasim does not simulate the device attribute {key!r}")


class Device:
    def __init__(self, device: int | None = None):
        self.id = runtime.getDevice() if device is None else int(device)
        if not 0 <= self.id < runtime.getDeviceCount():
            raise CUDARuntimeError("cudaErrorInvalidDevice", str(self.id))
        self.attributes = _Attributes(MultiProcessorCount=_SM_COUNT,
                                      CanUseHostPointerForRegisteredMem=1)
        self.compute_capability = _sibling("kernels_host_build").COMPUTE_CAPABILITY
        self.pci_bus_id = f"0000:{0x18 + self.id:02x}:00.0"

    def __enter__(self) -> Device:
        # as CuPy: switch only when needed, but always restore on exit (which, in a thread
        # that had no context, creates one on the previous device: CUDA >= 12)
        previous = runtime.getDevice()
        _device_stack().append(previous)
        if previous != self.id:
            runtime.setDevice(self.id)
        return self

    def __exit__(self, *exc: object) -> None:
        runtime.setDevice(_device_stack().pop())

    def use(self) -> None:
        runtime.setDevice(self.id)

    def synchronize(self) -> None:
        previous = runtime.getDevice()
        try:
            runtime.setDevice(self.id)
            runtime.deviceSynchronize()
        finally:
            runtime.setDevice(previous)


def _device_stack() -> list[int]:
    stack = getattr(_current, "device_stack", None)
    if stack is None:
        stack = _current.device_stack = []
    return stack


# ------------------------------------------------------------------------------ kernels

# kernel name prefix: (launcher family, argument count); the first matching prefix wins
_FAMILIES = {"gpuring_fused_": ("fused", 21), "gpuring_stage_publish": ("stage", 15),
             "gpuring_reduce_n_": ("reduce_n", 13), "gpuring_reduce_": ("reduce", 6),
             "gpuring_copy_bytes": ("copy", 4), "gpuring_wait_flag": ("wait", 5),
             "gpuring_write_flags": ("write_many", 11), "gpuring_write_flag": ("write", 3)}
#: which arguments of each family are addresses (a null source of reduce_n, or a flag of
#: write_many beyond its count, is unused)
_POINTERS = {"reduce_n": (*range(9), 12), "reduce": (0, 1, 2, 5), "copy": (0, 1, 3),
             "wait": (0, 3, 4), "write": (0, 2), "write_many": (*range(8), 10),
             "fused": (0, 1, *range(9, 17), 19, 20),
             "stage": (0, 1, *range(3, 11), 13, 14)}
#: live array buffers: id -> (start, end, device)
_array_ranges: dict[int, tuple[int, int, int]] = {}
#: (device, peer device): kernels on the first may reach the second's memory
_peer_access: set[tuple[int, int]] = set()


def _note_array(host: np.ndarray, device: int) -> None:
    """Remember the buffer under `host` as memory of `device` while it lives."""
    root = host
    while isinstance(root.base, np.ndarray):
        root = root.base
    key = id(root)
    if key not in _array_ranges:
        start = root.__array_interface__["data"][0]
        _array_ranges[key] = (start, start + max(root.nbytes, 1), device)
        weakref.finalize(root, _array_ranges.pop, key, None)


def _device_of(address: int) -> int | None:
    """The device whose memory holds `address` (-1: pinned host memory, which every device
    reaches), or None when it is nobody's."""
    ranges = [(a.ptr, a.ptr + a.size, a.device)
              for a in (*_allocated.values(), *_opened.values())]
    ranges += [(p, p + ctypes.sizeof(b), -1) for p, b in _host_buffers.items()]
    ranges += [(p, p + n, -1) for p, n in _host_registered.items()]
    ranges += list(_array_ranges.values())
    return next((dev for lo, hi, dev in ranges if lo <= address < hi), None)


def _bad_address(address: int, device: int) -> str | None:
    """Why a kernel on `device` may not touch `address`; None when it may."""
    owner = _device_of(address)
    if owner is None:
        return f"{address:#x} is no memory"
    if owner not in (-1, device) and (device, owner) not in _peer_access:
        return f"{address:#x} is memory of device {owner}, without peer access from {device}"
    return None
_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()
#: every kernel handed out, by its CUfunction handle (`RawKernel.ptr`)
_functions: dict[int, RawKernel] = {}
_function_handles = itertools.count(0xF000)


def _kernel_library() -> ctypes.CDLL:
    global _lib
    with _lib_lock:
        if _lib is None:
            kernels_host_build = _sibling("kernels_host_build")
            path = os.environ.get("GPURING_CUDASIM_LIB")
            if not path:
                cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                path = str(kernels_host_build.build(cache / "gpuring" / "cudasim"))
            _lib = kernels_host_build.load(path)
        return _lib


class RawKernel:
    """A kernel (cupy.cuda.function.Function): `ptr` is its CUfunction handle, `registers`
    what a thread uses in the CUBIN it came from (None: no CUBIN, a RawModule's), which is
    what the occupancy calls answer from. `last_grid` is the grid of its latest launch."""

    def __init__(self, name: str, registers: int | None = None):
        _initialize()  # cuModuleGetFunction
        family = next((f for prefix, f in _FAMILIES.items() if name.startswith(prefix)), None)
        if family is None:
            raise CUDARuntimeError("CUDA_ERROR_NOT_FOUND", f"no kernel {name!r}")
        self.name = name
        self.registers = registers
        self.last_grid: int | None = None
        self._family, self._arity = family
        lib = _kernel_library()
        self._address = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
        self._launch = getattr(lib, f"emu_launch_{self._family}")
        self.ptr = next(_function_handles)
        _functions[self.ptr] = self

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...],
                 stream: Stream | None = None, shared_mem: int = 0) -> None:
        if len(args) != self._arity:
            raise TypeError(f"{self.name} takes {self._arity} arguments, got {len(args)}")
        for arg in args:
            if not isinstance(arg, (np.integer, np.floating, int, float)):
                raise TypeError(f"{self.name}: unsupported argument {arg!r}")
        blocks, threads = int(np.prod(grid)), int(np.prod(block))
        if not (1 <= blocks < 2**31 and 1 <= threads <= 1024):
            raise CUDARuntimeError("cudaErrorInvalidConfiguration", f"{grid} x {block}")
        _context()
        self.last_grid = blocks
        values = [int(a) for a in args]
        launch, address = self._launch, self._address
        target = _stream(stream)
        device = target.device_id if target.device_id >= 0 else _Runtime.getDevice()
        bad = [why for i in _POINTERS[self._family]
               if not (self._family == "reduce_n" and 2 <= i < 9 and values[i] == 0)
               and not (self._family == "write_many" and values[8] <= i < 8)
               and not (self._family == "fused" and values[8] <= i - 9 < 8)
               and not (self._family == "stage" and values[11] <= i - 3 < 8)
               and (why := _bad_address(values[i], device))]
        if bad:  # the launch succeeds; the kernel faults when it runs, killing the context
            target._put(lambda: _fault(f"{self.name}: {bad[0]}"))
            return
        _stream(stream)._put(lambda: launch(address, blocks, threads, *values))


class Module:
    """cupy.cuda.function.Module: a loaded CUBIN (here: the host build of the same source)."""

    def load(self, cubin: bytes) -> None:
        _initialize()
        if not isinstance(cubin, bytes) or not cubin.startswith(b"\x7fELF"):
            raise CUDARuntimeError("CUDA_ERROR_INVALID_IMAGE", "not a CUBIN")
        self._registers = _sibling("cubin").registers(cubin)

    def get_function(self, name: str) -> RawKernel:
        return RawKernel(name, getattr(self, "_registers", {}).get(name))


def _sibling(name: str) -> Any:
    """A module next to this file: cubin (register counts of a CUBIN, CUDA's occupancy
    rules) or kernels_host_build (the kernels built for the CPU; the simulated GPUs' compute
    capability)."""
    if str(_HERE) not in sys.path:
        sys.path.insert(0, str(_HERE))
    return importlib.import_module(name)


def _occupancy(handle: int, block_size: int, dynamic_shared: int) -> tuple[str, int]:
    """cuOccupancyMaxActiveBlocksPerMultiprocessor: (CUresult name, blocks of `block_size`
    threads of the kernel `handle` that fit on one SM), from the registers of its CUBIN. A
    driver call: it needs a current context and creates none."""
    kernel = _functions.get(int(handle))
    if getattr(_current, "context", None) is None:
        return "CUDA_ERROR_INVALID_CONTEXT", 0
    if kernel is None:
        return "CUDA_ERROR_INVALID_HANDLE", 0
    if not 1 <= block_size <= 1024 or dynamic_shared:
        return "CUDA_ERROR_INVALID_VALUE", 0
    return "CUDA_SUCCESS", _sibling("cubin").blocks_per_sm(kernel.registers, block_size)


class RawModule:
    def __init__(self, code: str | None = None, *, path: str | None = None,
                 options: tuple[str, ...] = (), backend: str = "nvrtc", **_: Any):
        self.code = code

    def get_function(self, name: str) -> RawKernel:
        return RawKernel(name)


# ------------------------------------------------------------------------------ arrays

class _Data:
    """cupy.cuda.MemoryPointer: the address, and the device the memory is on."""

    __slots__ = ("device_id", "ptr")

    def __init__(self, ptr: int, device_id: int):
        self.ptr = ptr
        self.device_id = device_id


#: an array's layout, kept as plain attributes (C fields in CuPy: reading them costs nothing)
_LAYOUT = ("shape", "dtype", "strides", "size", "ndim", "nbytes", "itemsize")

#: one Device object per GPU for `ndarray.device` (CuPy's are as cheap to get)
_array_devices: dict[int, Device] = {}


class MemoryPointer(_Data):
    """cupy.cuda.MemoryPointer(mem, offset): the address `offset` bytes into `mem`, which it
    keeps alive."""

    __slots__ = ("mem",)

    def __init__(self, mem: Any, offset: int):
        super().__init__(mem.ptr + offset, mem.device_id)
        self.mem = mem


class ndarray:
    """A device array; its bytes live in host memory (a NumPy array). As CuPy's,
    `ndarray(shape, dtype, memptr=p)` is an array over the memory `p` points to (which the
    array keeps alive), and without `memptr` a new one on the current device."""

    def __init__(self, shape: Any, dtype: Any = float, memptr: MemoryPointer | None = None,
                 strides: Any = None, order: str = "C"):
        if strides is not None or order != "C":
            raise NotImplementedError("cudasim's ndarray() makes C-contiguous arrays only")
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        dtype = np.dtype(dtype)
        if memptr is None:
            _context()
            self._init(np.empty(shape, dtype), runtime.getDevice())
            return
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        block = (ctypes.c_uint8 * max(nbytes, 1)).from_address(memptr.ptr)
        block.keep = memptr  # type: ignore[attr-defined]  # views of the array hold it too
        self._init(np.frombuffer(block, np.uint8, count=nbytes).view(dtype).reshape(shape),
                   memptr.device_id)

    @classmethod
    def _of(cls, host: np.ndarray) -> ndarray:
        """A device array over `host` (the simulator's device memory), on the current
        device."""
        array = cls.__new__(cls)
        array._init(host, runtime.getDevice())
        return array

    def _init(self, host: np.ndarray, device_id: int) -> None:
        self._a = host
        self._device_id = device_id
        _note_array(host, self._device_id)
        # the address never changes, the layout only through `shape`: read once, as attribute
        # reads cost CuPy next to nothing (they are C fields of a Cython class there)
        self._data = _Data(host.ctypes.data, self._device_id)
        self._layout()

    def _layout(self) -> None:
        host, put = self._a, object.__setattr__
        for name in _LAYOUT:
            put(self, name, getattr(host, name))

    def __setattr__(self, name: str, value: Any) -> None:
        """As CuPy: `shape` reshapes the array in place (a view of the same bytes), the other
        layout attributes cannot be set."""
        if name == "shape":  # a new view of the same bytes (work queued on the old one
            view = self._a.view()  # still lands there), or an error as CuPy's where a
            view.shape = value  # reshape needs a copy
            object.__setattr__(self, "_a", view)
            self._layout()
        elif name in _LAYOUT:
            raise AttributeError(f"attribute '{name}' of 'cupy.ndarray' objects is not writable")
        else:
            object.__setattr__(self, name, value)

    def __del__(self) -> None:
        # On a GPU, freed device memory is never handed to the host's allocator, and CuPy's
        # pool reuses it only in stream order. Here array bytes are host memory, so they are
        # kept until every stream has passed this point (see _graveyard).
        host = getattr(self, "_a", None)
        if host is not None:
            _bury(host)

    # -- what gpuring reads
    flags = property(lambda self: self._a.flags)
    data = property(lambda self: self._data)

    @property
    def device(self) -> Device:
        found = _array_devices.get(self._device_id)
        if found is None:
            found = _array_devices[self._device_id] = Device(self._device_id)
        return found
    T = property(lambda self: ndarray._of(self._a.T))

    def set(self, host: np.ndarray, stream: Stream | None = None) -> None:
        source = np.array(host, dtype=self.dtype, copy=True).reshape(self.shape)
        target = self._a
        _stream(stream)._put(lambda: np.copyto(target, source))

    def get(self) -> np.ndarray:
        _sync_current()
        return self._a.copy()

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __len__(self) -> int:
        return len(self._a)

    def __repr__(self) -> str:
        return f"cudasim.ndarray({self._a!r})"

    def __getitem__(self, key: Any) -> Any:
        if _basic_index(key):  # a view of the same memory: no work on any stream
            result = self._a[_unwrap(key)]
            if isinstance(result, np.ndarray) and np.shares_memory(result, self._a):
                return _wrap(result)
        _sync_current()  # a value or a gather: read once the stream has written it
        return _wrap(self._a[_unwrap(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        # queued on the current stream, as a CuPy assignment is
        target, index = self._a, _unwrap_queued(key)
        source = _unwrap_queued(value)
        get_current_stream()._put(lambda: target.__setitem__(index, source))

    def __bool__(self) -> bool:
        _sync_current()
        return bool(self._a)

    def __int__(self) -> int:
        _sync_current()
        return int(self._a)

    def __float__(self) -> float:
        _sync_current()
        return float(self._a)

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._a, name)  # reshape, view, astype, copy, sum, max, ...
        if callable(value):
            def call(*args: Any, **kwargs: Any) -> Any:
                if name in _VIEWS:  # a view of the same memory: no work on any stream
                    result = value(*_unwrap(args), **_unwrap(kwargs))
                    if isinstance(result, np.ndarray) and np.shares_memory(result, self._a):
                        return _wrap(result)
                _sync_current()
                result = value(*_unwrap(args), **_unwrap(kwargs))
                if isinstance(result, np.ndarray) and not np.shares_memory(result, self._a):
                    return _arriving(result)  # a new array: written on the stream
                return _wrap(result)
            return call
        return _wrap(value)


#: methods whose result is a view where the layout allows (CuPy then only makes an object)
_VIEWS = frozenset({"reshape", "view", "transpose", "squeeze", "swapaxes", "ravel"})


def _basic_index(key: Any) -> bool:
    """Whether indexing with `key` gives a view (integers, slices, ellipsis, None)."""
    keys = key if isinstance(key, tuple) else (key,)
    return builtins.all(k is None or k is Ellipsis or isinstance(k, slice) or (
        isinstance(k, (int, np.integer)) and not isinstance(k, (bool, np.bool_))) for k in keys)


def _unwrap(x: Any) -> Any:
    if isinstance(x, ndarray):
        _sync_current()
        return x._a
    if isinstance(x, tuple):
        return tuple(_unwrap(v) for v in x)
    if isinstance(x, list):
        return [_unwrap(v) for v in x]
    if isinstance(x, dict):
        return {k: _unwrap(v) for k, v in x.items()}
    return x


_graveyard: list[tuple[list[_Marker], np.ndarray]] = []
_graveyard_lock = threading.Lock()


def _bury(host: np.ndarray) -> None:
    """Keep `host` alive until every stream has run what was queued before now (a queue with
    nothing queued or running has: it needs no marker, and neither does a second stream of
    one queue; a capturing stream records its work, so runs none of it now)."""
    markers = []
    queues = set()
    for stream in list(_streams.values()):
        worker = stream._worker
        if worker in queues or stream._capturing() is not None or worker.idle():
            continue
        queues.add(worker)
        marker = _Marker()
        try:
            worker.put(marker.reach)  # the simulator's own: no driver call
        except Exception:  # a failed stream never gets there
            continue
        markers.append(marker)
    with _graveyard_lock:
        _graveyard.append((markers, host))


def _collect() -> None:
    with _graveyard_lock:
        _graveyard[:] = [(m, h) for m, h in _graveyard
                         if not builtins.all(x.reached.is_set() for x in m)]


def _unwrap_queued(x: Any) -> Any:
    """Like _unwrap, for an operation queued on the current stream: device arrays as they are
    (the stream reaches their pending writes first), host data copied now."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, np.ndarray):
        return x.copy()
    if isinstance(x, tuple):
        return tuple(_unwrap_queued(v) for v in x)
    if isinstance(x, list):
        return [_unwrap_queued(v) for v in x]
    return x


def _wrap(x: Any) -> Any:
    return ndarray._of(x) if isinstance(x, np.ndarray) else x


def _arriving(host: np.ndarray) -> ndarray:
    """A new device array that receives `host` on the current stream, as a host-to-device
    copy does: work on other streams must be ordered after it to see the data."""
    _collect()
    out = np.empty_like(host)
    source = host.copy()
    get_current_stream()._put(lambda: np.copyto(out, source))
    return ndarray._of(out)


def _binary(name: str) -> Callable[..., Any]:
    if name.startswith("__i"):  # x += y: queued on the current stream, as on the GPU
        def inplace(self: ndarray, *args: Any) -> Any:
            target, values = self._a, _unwrap_queued(args)
            get_current_stream()._put(lambda: getattr(target, name)(*values))
            return self
        inplace.__name__ = name
        return inplace

    def op(self: ndarray, *args: Any) -> Any:
        _sync_current()
        result = getattr(self._a, name)(*_unwrap(args))
        return _arriving(result) if isinstance(result, np.ndarray) else result
    op.__name__ = name
    return op


for _name in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor",
              "matmul"):
    for _form in (f"__{_name}__", f"__r{_name}__", f"__i{_name}__"):
        setattr(ndarray, _form, _binary(_form))
for _form in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__neg__",
              "__abs__", "__invert__", "__pos__"):
    setattr(ndarray, _form, _binary(_form))
ndarray.__hash__ = None  # type: ignore[assignment]


class _HostCapsule:
    """Presents a DLPack capsule of host memory (the simulator's device memory) to NumPy."""

    def __init__(self, capsule: Any):
        self._capsule = capsule

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)


def from_dlpack(x: Any) -> ndarray:
    """A device array sharing `x`'s memory. As CuPy does, the current stream is handed to the
    producer, which orders its own pending work before that stream (DLPack's stream rule);
    the simulated producer's capsule describes host memory, which is device memory here."""
    stream = get_current_stream()
    capsule = x.__dlpack__(stream=stream.ptr or 1)  # 1: the legacy default stream
    return ndarray._of(np.from_dlpack(_HostCapsule(capsule)))


def asnumpy(x: Any, stream: Stream | None = None) -> np.ndarray:
    return x.get() if isinstance(x, ndarray) else np.asarray(x)


def asarray(x: Any, dtype: Any = None, order: Any = None) -> ndarray:
    if isinstance(x, ndarray) and (dtype is None or np.dtype(dtype) == x.dtype):
        return x
    _sync_current()
    return _arriving(np.array(_unwrap(x), dtype=dtype, order=order or "K", copy=True))


array = asarray


def ascontiguousarray(x: Any, dtype: Any = None) -> ndarray:
    _sync_current()
    return ndarray._of(np.ascontiguousarray(_unwrap(x), dtype=dtype))


def get_array_module(*args: Any) -> Any:
    return sys.modules[__name__] if builtins.any(isinstance(a, ndarray) for a in args) else np


def may_share_memory(a: Any, b: Any, max_work: Any = None) -> bool:
    """From the arrays' extents alone, as CuPy decides it: nothing waits for a stream."""
    def extent(x: Any) -> Any:
        return x._a if isinstance(x, ndarray) else x

    return bool(np.may_share_memory(extent(a), extent(b)))


def _numpy_function(name: str) -> Callable[..., Any]:
    fn = getattr(np, name)

    def call(*args: Any, **kwargs: Any) -> Any:
        _sync_current()
        result = fn(*_unwrap(args), **_unwrap(kwargs))
        return _arriving(result) if isinstance(result, np.ndarray) else result
    call.__name__ = name
    return call


for _name in ("empty", "zeros", "ones", "full", "arange", "linspace", "empty_like",
              "zeros_like", "ones_like", "full_like", "abs", "all", "any", "array_equal",
              "concatenate", "stack", "sqrt", "maximum", "minimum", "isnan", "sum", "allclose",
              "where", "isfinite"):
    globals()[_name] = _numpy_function(_name)
for _name in ("dtype", "float16", "float32", "float64", "int8", "int16", "int32", "int64",
              "uint8", "uint16", "uint32", "uint64", "complex64", "complex128", "bool_",
              "nan", "inf"):
    globals()[_name] = getattr(np, _name)


class _Random:
    def __init__(self) -> None:
        self._rng = np.random.default_rng()

    def seed(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def standard_normal(self, size: Any = None, dtype: Any = np.float64) -> ndarray:
        return ndarray._of(self._rng.standard_normal(size).astype(dtype))

    def random(self, size: Any = None, dtype: Any = np.float64) -> ndarray:
        return ndarray._of(self._rng.random(size).astype(dtype))

    def randint(self, low: int, high: int | None = None, size: Any = None,
                dtype: Any = np.int64) -> ndarray:
        return ndarray._of(self._rng.integers(low, high, size).astype(dtype))


random = _Random()  # cupy.random


# ------------------------------------------------------------------------------ cupy.cuda

cuda = types.ModuleType("cupy.cuda")
function = types.ModuleType("cupy.cuda.function")
driver = types.ModuleType("cupy.cuda.driver")


def _ctx_get_current() -> int:
    """cuCtxGetCurrent: a handle of the thread's current context, 0 when it has none."""
    context = getattr(_current, "context", None)
    return 0 if context is None else 0x7000 + context


class CUDADriverError(RuntimeError):
    """cupy.cuda.driver.CUDADriverError."""


def _cupy_occupancy(func: int, block_size: int, dynamic_shared: int) -> int:
    """cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor."""
    status, blocks = _occupancy(func, block_size, dynamic_shared)
    if status != "CUDA_SUCCESS":
        raise CUDADriverError(status)
    return blocks


driver.ctxGetCurrent = _ctx_get_current  # type: ignore[attr-defined]
driver.CUDADriverError = CUDADriverError  # type: ignore[attr-defined]
driver.occupancyMaxActiveBlocksPerMultiprocessor = _cupy_occupancy  # type: ignore[attr-defined]
function.Module = Module  # type: ignore[attr-defined]
graph = types.ModuleType("cupy.cuda.graph")
graph.Graph = Graph  # type: ignore[attr-defined]
for _name, _value in {"runtime": runtime, "function": function, "driver": driver,
                      "graph": graph,
                      "Stream": Stream, "ExternalStream": ExternalStream,
                      "Event": Event, "Memory": Memory, "MemoryPointer": MemoryPointer,
                      "Device": Device,
                      "get_current_stream": get_current_stream,
                      "get_elapsed_time": get_elapsed_time}.items():
    setattr(cuda, _name, _value)
sys.modules["cupy.cuda"] = cuda


def _load_nccl() -> types.ModuleType:
    """cupy.cuda.nccl: the stand-in next to this file (tests/cudasim/nccl.py)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "cupy.cuda.nccl", os.path.join(os.path.dirname(__file__), "nccl.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["cupy.cuda.nccl"] = module
    spec.loader.exec_module(module)
    return module


cuda.nccl = _load_nccl()  # type: ignore[attr-defined]
sys.modules["cupy.cuda.runtime"] = runtime
sys.modules["cupy.cuda.function"] = function
sys.modules["cupy.cuda.driver"] = driver
sys.modules["cupy.cuda.graph"] = graph


def __getattr__(name: str) -> Any:
    """Any other NumPy function, on arrays (cupy.tanh, cupy.exp, ...)."""
    if name.startswith("__") or not callable(getattr(np, name, None)):
        raise AttributeError(f"cudasim's cupy has no {name!r}")
    return _numpy_function(name)


# ------------------------------------------------------------------------------ driver memops

def _install_driver(memops: bool) -> None:
    """A `cuda.bindings.driver` with the calls CudaDevice makes. Signatures and enum names
    follow cuda-bindings: each call returns (CUresult, ...). With `memops` False the device
    reports no 64-bit stream memory operations, and those calls fail as the driver fails
    them then (CUDA_ERROR_NOT_SUPPORTED)."""
    import enum

    driver = types.ModuleType("cuda.bindings.driver")

    class CUresult(enum.IntEnum):
        CUDA_SUCCESS = 0
        CUDA_ERROR_INVALID_VALUE = 1
        CUDA_ERROR_NOT_INITIALIZED = 3
        CUDA_ERROR_INVALID_CONTEXT = 201
        CUDA_ERROR_INVALID_HANDLE = 400
        CUDA_ERROR_NOT_SUPPORTED = 801

    class CUdevice_attribute(enum.IntEnum):
        CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS = 122

    class CUstreamWaitValue_flags(enum.IntEnum):
        CU_STREAM_WAIT_VALUE_GEQ = 0

    class CUstreamBatchMemOpType(enum.IntEnum):
        CU_STREAM_MEM_OP_WAIT_VALUE_64 = 4
        CU_STREAM_MEM_OP_WRITE_VALUE_64 = 5

    class CUstreamWriteValue_flags(enum.IntEnum):
        CU_STREAM_WRITE_VALUE_DEFAULT = 0

    class _Handle:
        def __init__(self, value: int = 0):
            self.value = int(value)

        def __int__(self) -> int:
            return self.value

    class CUstream(_Handle):
        pass

    class CUdeviceptr(_Handle):
        pass

    class cuuint64_t(_Handle):
        pass

    class CUfunction(_Handle):
        pass

    class _MemOpValue:  # CUstreamMemOpWaitValueParams_st / ...WriteValueParams_st
        def __init__(self) -> None:
            self.address = CUdeviceptr(0)
            self.value64 = cuuint64_t(0)
            self.flags = 0

    class CUstreamBatchMemOpParams:
        """One operation of cuStreamBatchMemOp (a union in C: `operation` says which part
        counts)."""

        def __init__(self) -> None:
            self.operation = 0
            self.waitValue = _MemOpValue()
            self.writeValue = _MemOpValue()

    def _refused() -> bool:
        """Whether a driver call fails with CUDA_ERROR_NOT_INITIALIZED: in a child forked
        from a process that had initialized CUDA, every one does (cuInit too). Elsewhere the
        driver counts as initialized (by cuInit, or the runtime's first call)."""
        if _init.inherited:
            return True
        _init.initialized = True
        return False

    def cuInit(flags: int) -> tuple[CUresult]:
        if _refused():
            return (CUresult.CUDA_ERROR_NOT_INITIALIZED,)
        return (CUresult.CUDA_SUCCESS,)

    def cuDeviceGet(ordinal: int) -> tuple[CUresult, int | None]:
        if _refused():
            return (CUresult.CUDA_ERROR_NOT_INITIALIZED, None)
        return (CUresult.CUDA_SUCCESS, ordinal)

    def cuDeviceGetAttribute(attrib: CUdevice_attribute,
                             dev: int) -> tuple[CUresult, int | None]:
        if _refused():
            return (CUresult.CUDA_ERROR_NOT_INITIALIZED, None)
        return (CUresult.CUDA_SUCCESS, int(memops))

    def cuGetErrorName(error: CUresult) -> tuple[CUresult, bytes]:
        return (CUresult.CUDA_SUCCESS, CUresult(error).name.encode())

    def _memop(stream: Any, addr: Any, value: Any,
               op: Callable[[ctypes.c_uint64, int], None]) -> tuple[CUresult]:
        if _refused():
            return (CUresult.CUDA_ERROR_NOT_INITIALIZED,)
        if not memops:
            return (CUresult.CUDA_ERROR_NOT_SUPPORTED,)
        if not isinstance(stream, CUstream) or not isinstance(addr, CUdeviceptr) or \
                not isinstance(value, cuuint64_t):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        word, target = ctypes.c_uint64.from_address(int(addr)), int(value)
        _stream(int(stream))._put(lambda: op(word, target))
        return (CUresult.CUDA_SUCCESS,)

    def _wait_geq(word: ctypes.c_uint64, target: int) -> None:
        delay = 1e-6
        while word.value < target:
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def _write(word: ctypes.c_uint64, target: int) -> None:
        word.value = target

    def cuOccupancyMaxActiveBlocksPerMultiprocessor(
            func: CUfunction, blockSize: int, dynamicSMemSize: int) -> tuple[CUresult, int]:
        if _refused():
            return (CUresult.CUDA_ERROR_NOT_INITIALIZED, 0)
        if not isinstance(func, CUfunction):
            return (CUresult.CUDA_ERROR_INVALID_VALUE, 0)
        status, blocks = _occupancy(int(func), blockSize, dynamicSMemSize)
        return (CUresult[status], blocks)

    def cuStreamBatchMemOp(stream: CUstream, count: int, paramArray: list[Any],
                           flags: int) -> tuple[CUresult]:
        """64-bit waits (>=) and writes, in order, as one operation of the stream."""
        if _refused():
            return (CUresult.CUDA_ERROR_NOT_INITIALIZED,)
        if not memops:
            return (CUresult.CUDA_ERROR_NOT_SUPPORTED,)
        if not isinstance(stream, CUstream) or flags or not 0 < count < 256 or \
                count != len(paramArray):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        steps: list[tuple[ctypes.c_uint64, int, Callable[[ctypes.c_uint64, int], None]]] = []
        for param in paramArray:
            if param.operation == CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WAIT_VALUE_64:
                part, op = param.waitValue, _wait_geq
                if part.flags != CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ:
                    return (CUresult.CUDA_ERROR_NOT_SUPPORTED,)  # only >= is simulated
            elif param.operation == CUstreamBatchMemOpType.CU_STREAM_MEM_OP_WRITE_VALUE_64:
                part, op = param.writeValue, _write
            else:
                return (CUresult.CUDA_ERROR_NOT_SUPPORTED,)
            if not isinstance(part.address, CUdeviceptr) or \
                    not isinstance(part.value64, cuuint64_t):
                return (CUresult.CUDA_ERROR_INVALID_VALUE,)
            steps.append((ctypes.c_uint64.from_address(int(part.address)), int(part.value64),
                          op))
        _stream(int(stream))._put(lambda: [op(word, value) for word, value, op in steps])
        return (CUresult.CUDA_SUCCESS,)

    def cuStreamWaitValue64(stream: CUstream, addr: CUdeviceptr, value: cuuint64_t,
                            flags: int) -> tuple[CUresult]:
        return _memop(stream, addr, value, _wait_geq)

    def cuStreamWriteValue64(stream: CUstream, addr: CUdeviceptr, value: cuuint64_t,
                             flags: int) -> tuple[CUresult]:
        return _memop(stream, addr, value, _write)

    for name, value in list(locals().items()):
        if not name.startswith("_") and name not in ("driver", "enum"):
            setattr(driver, name, value)
    try:  # the real package, its nvrtc loaded first (it needs the real driver module)
        import cuda.bindings.nvrtc  # noqa: F401
    except ImportError:
        for package in ("cuda", "cuda.bindings"):
            sys.modules[package] = types.ModuleType(package)
            sys.modules[package].__path__ = []  # type: ignore[attr-defined]
    sys.modules["cuda.bindings.driver"] = driver
    sys.modules["cuda.bindings"].driver = driver  # type: ignore[attr-defined]


_install_driver(memops=os.environ.get("GPURING_CUDASIM_MEMOPS") == "1")
sweep_dead_allocations()  # what killed processes left behind


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's threads: nothing the parent queued runs here,
    and a lock another thread held at the fork is held forever, so every lock is new. Where
    the parent had initialized CUDA, every call fails here, as CUDA's do."""
    global _legacy_lock, _lib_lock, _graveyard_lock
    _legacy_lock, _lib_lock, _graveyard_lock = (threading.Lock(), threading.Lock(),
                                                threading.Lock())
    for worker in list(_workers):
        worker.forked()
    _graveyard.clear()  # no stream of the parent's runs here: what they kept alive may go
    _init.inherited = _init.inherited or _init.initialized


os.register_at_fork(after_in_child=_after_fork_in_child)
