"""CudaDevice: the device interface on an NVIDIA GPU, for CuPy arrays.

Memory is plain `cudaMalloc` (`cupy.cuda.Memory`, outside CuPy's pool, so one IPC handle names
exactly one buffer) shared with peer processes through CUDA IPC. Streams are CuPy non-blocking
streams; reductions are the kernels of `kernels/reduce.cu`; flags are 64-bit words in device
memory.

Flag waits use stream memory operations (`cuStreamWaitValue64`): the stream's front end holds
later work, costing nothing on the GPU while it waits. Where they are unavailable, one-thread
kernels spin on the flag instead (with a loud warning: on a GPU shared by processes without
MPS a spinning kernel holds the GPU for its whole time slice). `GPURING_CUDA_FLAGS=
memops|kernel|auto` (default auto) chooses. Flag writes are always a one-thread kernel, which
publishes nothing once the device is aborted; consecutive writes of one value (a round's DONE
to every rank, a piece for several readers) are one launch.

Every driver call a stream operation makes to enqueue work or make an event is counted in
`operations` (the host cost of a collective in calls; `Communicator.device_operations`; setup,
abort and close are not counted). Events are reused: once
nothing holds an event recorded earlier, the next record takes it instead of creating one.

A stream waits only on words in memory this device allocated (the engine puts every flag
with its reader; producers write through their IPC mappings). That is what makes abort work:
a stream memory wait cannot be cancelled, only satisfied, so `abort` (1) sets a word in
device memory that every kernel checks first (data kernels then read nothing, a dead peer's
memory may be gone, and flag writes publish nothing), then (2) raises every word this
device's streams wait on to the largest flag value, with local writes on a side stream. The
streams then drain through no-op kernels, and the process can synchronize, free memory and
use the GPU again. Peers that have not aborted yet may still write into those words; closing
releases them again until the streams are idle. A timeout is the host's: `Stream.synchronize`
and the communicator's watchdog bound every wait, and a spinning wait kernel gives up by
itself after the device's timeout.

A small collective may run as one operation on the caller's stream (`Device.prepare_fused`,
`_cuda_fused`): one kernel (`gpuring_fused_*` in kernels/reduce.cu: per-block flags and a
call counter on the device), or for all_reduce three stream operations that wait with stream
memory operations; one event record per call. The kernel's waits spin, so
`GPURING_CUDA_FUSED=auto` takes the stream memory operations where ranks share a GPU and have
them (processes that share a GPU without MPS take turns on it, and a spinning kernel holds its
turn), and the kernel elsewhere (without stream memory operations the rounds' waits spin too).
Nothing in the kernel's arguments changes from call to call, so it can be captured in a CUDA
graph: while the caller's stream captures, it records no event and the watchdog does not track
it.

The device never synchronizes the host in a collective: `blocking` is False, and the caller's
stream is ordered with events (`caller_event`, `order_caller_after`). Every CUDA call runs with
this device current in the calling thread, and a thread that had no CUDA context is left with
this device's, never given another GPU's (`CudaDevice.scope`).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import socket
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .. import settings
from .._errors import CollectiveTimeoutError, GpuringError
from .._ops import ReduceOp
from . import _kernels, _topology
from ._cuda_driver import (
    FLAGS_ENV,
    Scope,
    memops_support,
    occupancy,
    warn_spin_waits,
)
from ._cuda_fused import HostEpoch, prepare_fused
from ._cuda_streams import (
    _MEMCPY_DEFAULT,
    CudaMemory,
    _addr,
    _CudaEvent,
    _CudaStream,
    _cupy,
)
from ._cuda_streams import THREADS as _THREADS
from .base import (
    Capabilities,
    Device,
    Event,
    Flag,
    FlagWaitAborted,
    FlagWaitTimeout,
    FusedOp,
    Memory,
    Span,
    Stream,
)

if TYPE_CHECKING:
    from ..rendezvous.base import ControlPlane

__all__ = ["CudaDevice", "CudaMemory", "CudaHandle", "FLAGS_ENV"]

#: environment variable that selects how copies run: "memcpy" (default) or "kernel"
COPY_ENV = "GPURING_CUDA_COPY"
#: the setting that selects when a small all_reduce runs as one kernel: "auto", "on", "off"
FUSED_ENV = "GPURING_CUDA_FUSED"
GRAPH_PIECE_ENV = "GPURING_CUDA_GRAPH_PIECE_BYTES"
#: caller's streams remembered (`caller_stream`): each holds its CuPy stream alive
_CALLER_STREAMS = 64
#: events made with the device (what a collective, the watchdog and the caller hold at once)
_SPARE_EVENTS_AT_START = 8
#: cudaStreamPerThread's handle
_PER_THREAD_STREAM = 2

# CUDA runtime constants (stable ABI values)
_HOST_ALLOC_PORTABLE = 1
_HOST_ALLOC_MAPPED = 2

#: blocks of _THREADS per SM assumed when the driver cannot say how many of a kernel fit
#: (`occupancy`): every data kernel of reduce.cu fits at least this many on sm_80 and sm_90
#: (tests/unit/test_kernels_compile.py checks their NVRTC builds' registers), so the grid is
#: still at most one wave, at the cost of occupancy
_FALLBACK_BLOCKS_PER_SM = 4

# status word values (kernels/reduce.cu: gpuring_wait_flag)
_STATUS_OK = 0
_STATUS_TIMED_OUT = 1
_STATUS_ABORTED = 2
#: what abort writes into the words a stream waits on: at or above every flag value (they stay
#: below 2^63, where the stream wait's cyclic comparison still holds)
RELEASED = 2**63 - 1
#: this process, in the handles it exports: a PID can repeat across nodes and PID namespaces
_PROCESS_TOKEN = secrets.token_hex(16)


def _new_process_token() -> None:
    """A forked child is another process: it gets its own token."""
    global _PROCESS_TOKEN
    _PROCESS_TOKEN = secrets.token_hex(16)


os.register_at_fork(after_in_child=_new_process_token)
#: memory of failed communicators that peers may still map: never freed (see CudaDevice.close)
_LEAKED: list[Any] = []


class CudaHandle(NamedTuple):
    """What `export` hands to peers (picklable). `process` is a random token of the exporting
    process and `host` its node: only an equal token means "my own memory"; `gpu` is the
    GPU's PCI bus id (the same GPU whatever each process's device numbering)."""

    process: str
    host: str
    gpu: str
    #: blocks of the one-kernel collective that fit on this GPU at once (0: not offered)
    fused_blocks: int
    #: whether this rank's streams wait with stream memory operations
    memops: bool
    device_id: int
    ptr: int
    nbytes: int
    ipc: bytes


class CudaDevice(Device):
    """CuPy arrays on one GPU, shared with peers through CUDA IPC.

    `device_id` defaults to `local_rank` (or $GPURING_LOCAL_RANK) modulo the GPU count.
    `timeout` bounds every flag wait in seconds. `flags` is "memops", "kernel" or "auto"
    (default: $GPURING_CUDA_FLAGS, else auto); `copy` is "memcpy" or "kernel".
    """

    kind = "cuda"
    arrays = "CuPy"
    reach = "the CUDA device maps peers' memory through CUDA IPC"
    # Every piece costs a few stream operations queued from Python (several microseconds each)
    # while an H200 moves a MiB in well under a microsecond: pieces must be large for the
    # host to keep ahead of the GPU. One channel: one kernel already fills the GPU.
    default_chunk_bytes = 8 << 20
    default_channels = 1
    default_buffer_bytes = 64 << 20
    blocking = False
    fused_max_bytes = 4 << 20
    fused_max_ranks = _kernels.FUSED_MAX_RANKS
    #: a fold of more sources takes several launches, each after the first starting from dst
    in_place_fold_sources = _kernels.MAX_SOURCES

    may_be_unreachable = True

    @classmethod
    def _for_rank(cls, control: ControlPlane, timeout: float) -> CudaDevice:
        return cls(local_rank=control.device_slot, timeout=timeout)

    @classmethod
    def place(cls, control: ControlPlane) -> str:
        """The PCI bus id of the GPU this rank uses (as `__init__` picks it)."""
        cupy = _cupy()
        count = cupy.cuda.runtime.getDeviceCount()
        return str(cupy.cuda.Device(control.device_slot % count).pci_bus_id) if count else ""

    @classmethod
    def unreachable(cls, control: ControlPlane, places: Sequence[str]) -> str | None:
        """CUDA IPC maps a peer's memory on another GPU only with peer-to-peer access."""
        mine = places[control.rank]
        runtime = _cupy().cuda.runtime
        count = runtime.getDeviceCount()
        if not mine or not count:
            return None  # (the device says why when it is made)
        for bus in sorted(set(places) - {mine, ""}):  # ("": that rank says why itself)
            why = _unreachable(control.device_slot % count, mine, bus)
            if why is not None:
                return why
        return None

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
        self._scope = Scope(device_id)
        self._current_stream = cupy.cuda.get_current_stream  # on every call's path
        #: `with device.scope():` this device is current in the calling thread (see `Scope`)
        self.scope: Callable[[], AbstractContextManager[Any]] = self._scope.enter
        self.timeout = timeout
        self.timeout_ns = int(timeout * 1e9)

        mode = (flags or settings.get(FLAGS_ENV)).lower()
        if mode not in ("auto", "memops", "kernel"):
            raise ValueError(f"{FLAGS_ENV}={mode!r}: use memops, kernel or auto")
        why_not = memops_support(device_id)
        if mode == "memops" and why_not is not None:
            raise RuntimeError(f"{FLAGS_ENV}=memops, but {why_not}; use {FLAGS_ENV}=kernel")
        if mode == "auto" and why_not is not None:
            warn_spin_waits(why_not)
        self.flags_mode = "memops" if mode != "kernel" and why_not is None else "kernel"
        self.copy_mode = (copy or settings.get(COPY_ENV)).lower()
        if self.copy_mode not in ("memcpy", "kernel"):
            raise ValueError(f"{COPY_ENV}={self.copy_mode!r}: use memcpy or kernel")

        with self.scope():
            self._sm_count = int(self.gpu.attributes["MultiProcessorCount"])
            self._side = cupy.cuda.Stream(non_blocking=True)  # small host<->device chores
            # status word in mapped pinned memory: read and written by host and kernels
            self.status_ptr = int(runtime.hostAlloc(
                8, _HOST_ALLOC_PORTABLE | _HOST_ALLOC_MAPPED))
            # the source of the released value that abort copies into waited-on words, and
            # where read_u64 copies a word to
            self._released_ptr = int(runtime.hostAlloc(8, _HOST_ALLOC_PORTABLE))
            self._readback_ptr = int(runtime.hostAlloc(8, _HOST_ALLOC_PORTABLE))
            # the abort word every kernel checks first, in device memory (cheap to read)
            self._abort_mem = cupy.cuda.Memory(256)
            self.abort_ptr = int(self._abort_mem.ptr)
            runtime.memsetAsync(self.abort_ptr, 0, 256, self._side.ptr)
            self._side.synchronize()
        self._status = ctypes.c_int32.from_address(self.status_ptr)
        self._status.value = _STATUS_OK
        # the peer a one-kernel collective gave up on, plus one (reduce.cu)
        self._fused_peer = ctypes.c_int32.from_address(self.status_ptr + 4)
        self._fused_peer.value = 0
        ctypes.c_uint64.from_address(self._released_ptr).value = RELEASED
        self._owned: list[CudaMemory] = []
        self._opened: dict[bytes, CudaMemory] = {}
        self._streams: list[_CudaStream] = []
        self._wait_words: set[int] = set()  # every word a stream of this device waits on
        self._lock = threading.Lock()
        self._closing = threading.RLock()  # abort (any thread) and close exclude each other
        self._abort_reason: str | None = None
        self._closed = False
        self._reduce_kernels: dict[tuple[str, ReduceOp], tuple[Any, int]] = {}
        self._reduce_n_kernels: dict[tuple[str, ReduceOp], tuple[Any, int]] = {}
        self._blocks_per_sm: dict[Any, int] = {}  # kernel -> blocks that fit on one SM
        self._spare_events: list[Any] = []  # recorded before, free to record again
        with self.scope():  # a few made with the device, so that calls seldom make one
            self._spare_events += [cupy.cuda.Event(block=False, disable_timing=True)
                                   for _ in range(_SPARE_EVENTS_AT_START)]
        self._callers: dict[int | tuple[int, int], _CudaStream] = {}  # caller's streams
        #: the last event recorded on a caller's stream after a one-kernel collective (each
        #: such call orders after the one before: this one covers them all)
        self.last_on_caller: _CudaEvent | None = None
        #: a one-kernel collective was captured into a graph, which holds this device's
        #: memory: it is never freed (a replay after close would touch it)
        self.captured = False
        self._fused_kernels: dict[tuple[str, ReduceOp], Any] = {}
        self._pci_bus_id = str(self.gpu.pci_bus_id)
        #: the one-kernel collective's most blocks, and the form of the one-operation
        #: all_reduce ("kernel", "memops" or "off"), for the job (`capabilities`)
        self.fused_blocks = 0
        self.fused_form = "off"
        #: the stream-memory-operation form's calls so far
        self.fused_epoch = HostEpoch()

    # -- helpers ------------------------------------------------------------------------------
    def reduce_kernel(self, dtype: str, op: ReduceOp) -> tuple[Any, int]:
        """(kernel, itemsize) of the reduce for (dtype, op) on this GPU; looked up once."""
        found = self._reduce_kernels.get((dtype, op))
        if found is None:
            found = (_kernels.get_kernel(dtype, op, self.device_id), np.dtype(dtype).itemsize)
            self._reduce_kernels[(dtype, op)] = found
        return found

    def reduce_n_kernel(self, dtype: str, op: ReduceOp) -> tuple[Any, int]:
        """(kernel, itemsize) of the n-input reduce for (dtype, op) on this GPU; looked up
        once."""
        found = self._reduce_n_kernels.get((dtype, op))
        if found is None:
            found = (_kernels.get_reduce_n_kernel(dtype, op, self.device_id),
                     np.dtype(dtype).itemsize)
            self._reduce_n_kernels[(dtype, op)] = found
        return found

    def fused_kernel(self, dtype: str, op: ReduceOp) -> Any:
        """The one-kernel collective for (dtype, op) on this GPU; looked up once."""
        found = self._fused_kernels.get((dtype, op))
        if found is None:
            found = _kernels.get_fused_kernel(dtype, op, self.device_id)
            self._fused_kernels[(dtype, op)] = found
        return found

    def grid_for(self, kernel: Any, n: int, per_thread: int) -> int:
        """Blocks of `kernel`'s grid-stride loop over n elements, per_thread elements a
        thread: enough to cover n, but at most one wave (the blocks that fit on all SMs at
        once), so that no SM runs a second, partial round of blocks."""
        blocks = -(-n // (_THREADS * per_thread))
        return max(1, min(blocks, self._sm_count * self.blocks_per_sm(kernel)))

    def blocks_per_sm(self, kernel: Any) -> int:
        """Blocks of _THREADS threads of `kernel` that fit on one SM at once (its registers
        decide: the kernels of reduce.cu fit 4 to 8); asked of the driver once per kernel,
        `_FALLBACK_BLOCKS_PER_SM` when it cannot say."""
        found = self._blocks_per_sm.get(kernel)
        if found is None:
            with self.scope():
                found = occupancy(kernel, _THREADS) or _FALLBACK_BLOCKS_PER_SM
            self._blocks_per_sm[kernel] = found
        return found

    def note_wait_word(self, addr: int) -> None:
        """A stream of this device waits on the word at `addr` (abort releases it)."""
        if addr not in self._wait_words:
            with self._lock:
                self._wait_words.add(addr)

    def _side_chore(self, what: str, seconds: float = 10.0) -> None:
        """Wait, bounded, for what was just queued on the side stream (a stream that shares a
        hardware queue with one blocked in a flag wait may itself stall: never hang on it)."""
        with self.scope():
            done = _CudaEvent(self._side.record(), self)
        if not self._poll([done], seconds):
            raise CollectiveTimeoutError(f"CUDA device {self.device_id}: {what} did not "
                                         f"finish within {seconds} s")

    def read_u64(self, addr: int) -> int:
        """The 8-byte word at a device address, read on the side stream into pinned memory
        (a copy into pageable memory would block the host), bounded."""
        runtime = _cupy().cuda.runtime
        with self.scope():
            runtime.memcpyAsync(self._readback_ptr, addr, 8, _MEMCPY_DEFAULT, self._side.ptr)
        self._side_chore("reading a flag")
        return int(ctypes.c_uint64.from_address(self._readback_ptr).value)

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
            [s for s in [*self._streams, *self._callers.values()] if s is not first]
        for stream in streams:
            yield from stream.waits

    def timeout_error(self, stream: _CudaStream | None) -> Exception:
        """FlagWaitTimeout for the peer a one-kernel collective gave up on, else for the first
        recent wait whose flag is still short (this stream's first), else a
        CollectiveTimeoutError."""
        peer = self._fused_peer.value - 1
        if peer >= 0:
            return FlagWaitTimeout(Flag(CudaMemory(0, 0, "peer"), 0), -1, -1,
                                   (peer, "its part of a one-kernel collective"))
        last = None
        for flag, value, tag in self._recent_waits(stream):
            try:
                observed = self.read_u64(_addr(flag))
            except Exception:  # e.g. a CUDA error
                return FlagWaitTimeout(flag, value, -1, tag)
            if observed < value:
                return FlagWaitTimeout(flag, value, observed, tag)
            last = (flag, value, observed, tag)
        if last is not None and self._status.value == _STATUS_TIMED_OUT:
            return FlagWaitTimeout(*last)  # the flag arrived after the kernel gave up
        return CollectiveTimeoutError(
            f"CUDA stream did not finish within {self.timeout} s on device {self.device_id}")

    # -- one-kernel collective ------------------------------------------------------------------
    @classmethod
    def capability_settings(cls) -> tuple[tuple[str, str], ...]:
        return ((FUSED_ENV, str(settings.get(FUSED_ENV)).lower()),
                (GRAPH_PIECE_ENV, str(settings.get(GRAPH_PIECE_ENV))))

    def fused_region_bytes(self, limit: int) -> int:
        """Two slots of `limit` bytes, or of a graph's piece where that is larger (at most
        `fused_max_bytes`)."""
        if str(settings.get(FUSED_ENV)).lower() == "off":
            return 0
        slot = max(limit, settings.get(GRAPH_PIECE_ENV))
        slot = -(-min(slot, self.fused_max_bytes) // 16) * 16
        return _kernels.fused_region_bytes(slot) if slot > 0 else 0

    def capabilities(self, handles: Any) -> Capabilities:
        """Small all_reduces as one operation (GPURING_CUDA_FUSED): `kernel`, one kernel that
        spins on its peers' flags; `memops`, stream operations that wait with stream memory
        operations; `auto`, memops where two ranks share a GPU and every rank has them
        (processes that share a GPU without MPS take turns on it, and a spinning kernel
        holds its turn), else the kernel; `off`, in rounds. Where ranks share a GPU, pieces
        are whole buffer regions: a rank's piece never runs beside a peer's there, and every
        piece costs driver calls and a turn."""
        mode = str(settings.get(FUSED_ENV)).lower()
        found = [CudaHandle(*h) for h in handles]
        shared = len({(h.host, h.gpu) for h in found}) < len(found)
        memops = all(h.memops for h in found)
        if mode == "auto":
            mode = "memops" if shared and memops else "kernel"
        if mode == "memops" and not memops:
            raise GpuringError(f"{FUSED_ENV}=memops, but not every rank's GPU has stream "
                               "memory operations")
        # the kernel's grid: the same on every rank, and on every GPU all of it at once (its
        # blocks wait for the peers' blocks of the same index: one left waiting for an SM
        # that a spinning block holds would never run)
        self.fused_blocks = min(_kernels.FUSED_MAX_BLOCKS, *(h.fused_blocks for h in found))
        self.fused_form = mode if mode == "memops" or self.fused_blocks > 0 else "off"
        kinds = {"kernel": frozenset(_kernels.DIRECT_KINDS), "memops": frozenset({"all_reduce"})}
        return Capabilities(0 if self.fused_form == "off" else self.fused_max_bytes,
                        whole_pieces=shared, fused_kinds=kinds.get(self.fused_form, frozenset()),
                        fused_capturable=self.fused_form == "kernel",
                        ring=_ring_order([h.gpu for h in found]))

    def _fused_fits(self) -> int:
        """Blocks of the one-kernel collective that fit on this GPU at once (0 where
        GPURING_CUDA_FUSED is off: its kernels are then never compiled)."""
        if str(settings.get(FUSED_ENV)).lower() == "off":
            return 0
        return self._sm_count * self.blocks_per_sm(self.fused_kernel("float32",
                                                                          ReduceOp.SUM))

    def prepare_fused(self, kind: str, regions: Sequence[Span], rank: int, root: int,
                       dtype: str, op: ReduceOp, divisor: int, nbytes: int, *,
                       pieces: bool = False) -> FusedOp:
        """In the job's form (`fused_form`): see `_cuda_fused`."""
        return prepare_fused(self, kind, regions, rank, root, dtype, op, divisor, nbytes,
                              pieces=pieces)

    def capturing(self) -> bool:
        with self.scope():
            return bool(self._current_stream(self.device_id).is_capturing())

    def caller_stream(self) -> _CudaStream:
        """The caller's current CuPy stream on this GPU, wrapped once per stream handle, so
        that the same stream is the same wrapper whichever object names it (an
        ExternalStream for a torch stream is a new one every call). The wrapper keeps the
        first object alive: a CuPy stream is not destroyed, so its handle not reused, while
        this device may still order work after it (a stream another library destroys could
        be). The per-thread default stream is one handle for every thread, but each thread's
        own stream: its wrappers are per thread."""
        raw = self._current_stream(self.device_id)
        key = raw.ptr
        if key == _PER_THREAD_STREAM:
            key = (key, threading.get_ident())
        stream = self._callers.get(key)
        if stream is None:
            with self._lock:
                if len(self._callers) >= _CALLER_STREAMS:
                    del self._callers[next(iter(self._callers))]
                stream = _CudaStream(self, raw, caller=True)
                self._callers[key] = stream
        return stream

    # -- caller ordering ------------------------------------------------------------------------
    def caller_event(self) -> Event | None:
        cupy = _cupy()
        with self.scope():
            raw = self._event()
            raw.record(cupy.cuda.get_current_stream())
        self.operations += 1
        return _CudaEvent(raw, self, reuse=True)

    def _event(self) -> Any:
        """An event to record: one given back by a collected `_CudaEvent`, else a new one
        (a driver call, counted). Call inside `scope()`."""
        try:
            return self._spare_events.pop()
        except IndexError:
            self.operations += 1
            return _cupy().cuda.Event(block=False, disable_timing=True)

    def order_caller_after(self, event: Event) -> None:
        if not isinstance(event, _CudaEvent):
            raise TypeError(f"not a CUDA event: {event!r}")
        with self.scope():
            _cupy().cuda.get_current_stream().wait_event(event.raw)
        self.operations += 1

    # -- memory -----------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> CudaMemory:
        cupy = _cupy()
        with self.scope():
            raw = cupy.cuda.Memory(max(nbytes, 1))
            cupy.cuda.runtime.memsetAsync(raw.ptr, 0, max(nbytes, 1), self._side.ptr)
        self._side_chore("zeroing new memory")
        mem = CudaMemory(int(raw.ptr), nbytes, "local", raw)
        self._owned.append(mem)
        return mem

    def export(self, mem: Memory) -> CudaHandle:
        if not isinstance(mem, CudaMemory) or mem.kind != "local":
            raise TypeError(f"only memory from CudaDevice.alloc can be exported, not {mem!r}")
        with self.scope():
            ipc = bytes(_cupy().cuda.runtime.ipcGetMemHandle(mem.ptr))
        return CudaHandle(_PROCESS_TOKEN, socket.gethostname(), self._pci_bus_id,
                          self._fused_fits(), self.flags_mode == "memops", self.device_id,
                          mem.ptr, mem.nbytes, ipc)

    def open(self, handle: Any) -> CudaMemory:
        handle = CudaHandle(*handle)
        if handle.process == _PROCESS_TOKEN:  # a process cannot open its own handle
            return CudaMemory(handle.ptr, handle.nbytes, "peer")
        here = socket.gethostname()
        if handle.host != here:
            raise GpuringError(
                f"CUDA IPC maps memory of processes on this host only; a rank on {handle.host!r} "
                f"shares a node with this one on {here!r} (ranks that report one node name, "
                "GPURING_HOSTNAME or the host's, must run on one host)")
        if handle.gpu != self._pci_bus_id:
            why = _unreachable(self.device_id, self._pci_bus_id, handle.gpu)
            if why is not None:
                raise GpuringError(
                    f"CUDA IPC between GPUs needs peer-to-peer access, and {why}: run these "
                    "ranks on one GPU, or their CuPy collectives on NCCL "
                    "(GPURING_TRANSPORT=nccl)")
        mem = self._opened.get(handle.ipc)
        if mem is None:
            with self.scope():
                ptr = _cupy().cuda.runtime.ipcOpenMemHandle(handle.ipc)
            mem = CudaMemory(int(ptr), handle.nbytes, "peer")
            self._opened[handle.ipc] = mem
        return mem

    def array(self, mem: Memory, shape: tuple[int, ...], dtype: Any) -> Any:
        if not isinstance(mem, CudaMemory) or mem.kind != "local" or mem._owner is None:
            raise TypeError(f"only memory from CudaDevice.alloc can hold an array, not {mem!r}")
        cupy = _cupy()
        with self.scope():  # the pointer holds the cupy.cuda.Memory: cudaFree once both go
            return cupy.ndarray(shape, dtype, memptr=cupy.cuda.MemoryPointer(mem._owner, 0))

    def wrap(self, array: Any) -> CudaMemory:
        if not isinstance(array, _cupy().ndarray) or not array.flags.c_contiguous:
            raise TypeError("CudaDevice wraps C-contiguous CuPy arrays only")
        data = array.data
        if data.device_id != self.device_id:
            raise ValueError(f"array is on device {data.device_id}, "
                             f"the communicator uses device {self.device_id}")
        return CudaMemory(data.ptr, array.nbytes, "borrowed", array)

    def seal(self, mem: Memory) -> None:
        """Nothing to do on CUDA (HostDevice unlinks its shared-memory file here)."""

    # -- streams ------------------------------------------------------------------------------
    def create_stream(self, *, inline: bool = False) -> Stream:
        """A non-blocking CuPy stream. `inline` is ignored: GPU work is always asynchronous."""
        with self.scope():
            stream = _CudaStream(self, _cupy().cuda.Stream(non_blocking=True))
        self._streams.append(stream)
        return stream

    # -- abort and close -------------------------------------------------------------------------
    @property
    def aborted(self) -> str | None:
        return self._abort_reason

    def abort(self, reason: str) -> None:
        """Fail every pending and future wait, from any thread: spinning waits return, every
        kernel queued from now on does nothing, and every word a stream waits on is raised to
        RELEASED, so no stream stays blocked (see the module docstring)."""
        with self._closing:  # not while close() frees what a release uses
            if self._abort_reason is not None:
                return
            self._abort_reason = reason
            if self._closed:
                return
            # the device's abort word first: a spinning wait released by the status word
            # should find the kernels behind it disabled (the wait kernel also sets the abort
            # word itself when the status word stops it)
            self._release_waits()
            self._status.value = _STATUS_ABORTED

    def _release_waits(self) -> bool:
        """Set the device's abort word, then raise every waited-on word to RELEASED, in that
        order on the side stream (no kernel may run on released data); True once done."""
        runtime = _cupy().cuda.runtime
        with self._lock:
            words = sorted(self._wait_words)
        try:
            with self.scope():
                side = self._side.ptr
                runtime.memsetAsync(self.abort_ptr, 1, 4, side)
                for addr in words:
                    runtime.memcpyAsync(addr, self._released_ptr, 8, _MEMCPY_DEFAULT, side)
                done = _cupy().cuda.Event(block=False, disable_timing=True)
                done.record(self._side)
            return self._poll([_CudaEvent(done, self)], 5.0)
        except Exception as exc:  # a sticky CUDA error: nothing more can be done here
            warnings.warn(f"gpuring: could not release the GPU's flag waits: {exc}",
                          RuntimeWarning, stacklevel=3)
            return False

    def _poll(self, events: list[Event], seconds: float, *, release: bool = False) -> bool:
        """Wait up to `seconds` for `events`, with backoff. `release`: while the device is
        aborted, release the waits again at every poll (a peer that has not aborted yet may
        have written its ordinary value into a released word since)."""
        deadline = time.monotonic() + seconds
        delay = 1e-5
        while not all(e.query() for e in events):
            if time.monotonic() > deadline:
                return False
            if release and self._abort_reason is not None:
                self._release_waits()
            time.sleep(delay)
            delay = min(delay * 2, 1e-2)
        return True

    def _drain(self, seconds: float) -> bool:
        """Wait up to `seconds` for every stream (the side stream too) to be idle; True if
        they are. False also when the GPU reports an error (a failed kernel): then nothing is
        known to be idle."""
        try:
            with self.scope():
                events: list[Event] = [_CudaEvent(self._side.record(), self)]
            events += [s.record() for s in self._streams]
            if self.last_on_caller is not None:
                events.append(self.last_on_caller)
            return self._poll(events, seconds, release=True)
        except Exception as exc:
            warnings.warn(f"gpuring: CUDA error while closing: {exc}", RuntimeWarning,
                          stacklevel=3)
            return False

    def detach_peers(self) -> None:
        runtime = _cupy().cuda.runtime
        with self.scope():
            for mem in self._opened.values():
                runtime.ipcCloseMemHandle(mem.ptr)
                mem.release()
            self._opened.clear()

    def close(self, *, peers_may_read: bool = False) -> None:
        """Wait for the streams (bounded; after an abort they drain at once), close peer
        mappings, free memory. Idempotent. `peers_may_read`: a failed job, where a peer may
        still read this device's exported memory; that memory is then kept (never freed, a
        warning says how much) while everything else is freed, so the process can go on using
        the GPU. If the streams stay busy even after an abort (a CUDA error), everything is
        leaked rather than the process hung (cudaFree would wait for them)."""
        with self._closing:
            self._close(peers_may_read)

    def _close(self, peers_may_read: bool) -> None:
        if self._closed:
            return
        drained = self._drain(min(self.timeout, 10.0))
        if not drained:
            self.abort("CudaDevice closed while streams were still busy")
            drained = self._drain(10.0)
        self._closed = True
        if not drained:
            warnings.warn("gpuring: CUDA streams still busy at close; leaking their memory",
                          RuntimeWarning, stacklevel=2)
            return
        if not self.captured:  # a graph's kernels read the peers' regions through these
            self.detach_peers()
        runtime = _cupy().cuda.runtime
        with self.scope():
            if self.captured:  # ... and read and write the abort word
                _LEAKED.append(self._abort_mem)
            if (peers_may_read or self.captured) and self._owned:
                _LEAKED.extend(mem._owner for mem in self._owned)
                nbytes = sum(mem.nbytes for mem in self._owned)
                why = ("a peer of the failed job may still read them" if peers_may_read else
                       "a CUDA graph captured a collective that uses them")
                warnings.warn(f"gpuring: keeping {nbytes} bytes of GPU communication buffers "
                              f"allocated: {why}", RuntimeWarning, stacklevel=2)
            for mem in self._owned:
                mem.release()  # drops the cupy.cuda.Memory: cudaFree (unless leaked above)
            self._owned.clear()
            self._streams.clear()
            self._callers.clear()
            self._side = None
            self._abort_mem = None
            self._status = None  # type: ignore[assignment]
            if not self.captured:  # a graph's kernels hold the status word's address
                runtime.freeHost(self.status_ptr)
            runtime.freeHost(self._released_ptr)
            runtime.freeHost(self._readback_ptr)
            self.status_ptr = self._released_ptr = self._readback_ptr = 0


def _unreachable(device_id: int, own_bus: str, bus_id: str) -> str | None:
    """Why GPU `device_id` (at PCI bus `own_bus`) cannot read the GPU at PCI bus `bus_id`
    directly (None: it can)."""
    runtime = _cupy().cuda.runtime
    try:
        peer = int(runtime.deviceGetByPCIBusId(bus_id))
    except Exception:
        return f"GPU {bus_id} is not visible to this process (CUDA_VISIBLE_DEVICES)"
    if peer != device_id and not runtime.deviceCanAccessPeer(device_id, peer):
        return f"GPU {device_id} ({own_bus}) cannot access GPU {peer} ({bus_id}) peer to peer"
    return None


def _ring_order(bus_ids: list[str]) -> tuple[int, ...]:
    """The ranks (on the GPUs at `bus_ids`, of this host) in the order the ring visits
    them, along NVLink where NVML tells (`_topology`): the same on every rank, which reads
    the same host's topology; () for rank order (one GPU, or no NVML)."""
    if len(set(bus_ids)) < 2:
        return ()
    topology = _topology.read()
    return () if topology is None else topology.ring(bus_ids)
