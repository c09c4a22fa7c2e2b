"""CudaDevice: the device interface on an NVIDIA GPU, for CuPy arrays.

Memory is plain `cudaMalloc` shared with peer processes through CUDA IPC (`_cuda_memory`).
Streams are CuPy non-blocking streams; reductions are the kernels of `kernels/reduce.cu`;
flags are 64-bit words in device memory (`_cuda_streams`).

Flag waits use stream memory operations (`cuStreamWaitValue64`): the stream's front end holds
later work, costing nothing on the GPU while it waits. Where they are unavailable, one-thread
kernels spin on the flag instead (with a loud warning: on a GPU shared by processes without
MPS a spinning kernel holds the GPU for its whole time slice). `GPURING_CUDA_FLAGS=
memops|kernel|auto` (default auto) chooses. Flag writes are always a one-thread kernel, which
publishes nothing once the device is aborted; consecutive writes of one value (a round's DONE
to every rank, a piece for several readers) are one launch. A stream waits only on words in
memory this device allocated, which is what lets abort end every wait (`_cuda_waits`).

Every driver call a stream operation makes to enqueue work or make an event is counted in
`operations` (the host cost of a collective in calls; `Communicator.device_operations`; setup,
abort and close are not counted). Events are reused: once
nothing holds an event recorded earlier, the next record takes it instead of creating one.

A small collective may run as one operation on the caller's stream (`Device.prepare_fused`;
`_cuda_forms` says in which form and why, `_cuda_fused` runs them), with one event record per
call; a CUDA graph records the kernel form, with no event (the watchdog does not track it).

The device never synchronizes the host in a collective: `blocking` is False, and the caller's
stream is ordered with events (`caller_event`, `order_caller_after`). Every CUDA call runs with
this device current in the calling thread, and a thread that had no CUDA context is left with
this device's, never given another GPU's (`CudaDevice.scope`).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import settings
from .._ops import ReduceOp
from . import _cuda_forms, _kernels
from ._cuda_driver import FLAGS_ENV, Scope, cupy_module, flag_waits, occupancy
from ._cuda_forms import FUSED_ENV, Slots
from ._cuda_fused import HostEpoch, prepare_fused
from ._cuda_memory import CudaHandle, CudaMemory, IpcMemory, bus_id_of, unreachable_peer
from ._cuda_streams import THREADS, CudaEvent, CudaStream, new_event, record_on
from ._cuda_waits import RELEASED, STATUS_TIMED_OUT, FlagWords
from ._streams import Event, FlagWaitAborted, Memory, Span, Stream
from .base import Capabilities, Device, FusedOp

if TYPE_CHECKING:
    from ..rendezvous.base import ControlPlane

__all__ = ["CudaDevice", "CudaMemory", "CudaHandle", "FLAGS_ENV", "FUSED_ENV", "RELEASED"]

#: environment variable that selects how copies run: "memcpy" (default) or "kernel"
COPY_ENV = "GPURING_CUDA_COPY"
#: caller's streams remembered (`caller_stream`): each holds its CuPy stream alive
_CALLER_STREAMS = 64
#: events made with the device (what a collective, the watchdog and the caller hold at once)
_SPARE_EVENTS_AT_START = 8
#: cudaStreamPerThread's handle
_PER_THREAD_STREAM = 2
#: blocks of THREADS per SM assumed when the driver cannot say how many of a kernel fit
#: (`occupancy`): every data kernel of reduce.cu fits at least this many on sm_80 and sm_90
#: (tests/unit/test_kernels_compile.py checks their NVRTC builds' registers), so the grid is
#: still at most one wave, at the cost of occupancy
_FALLBACK_BLOCKS_PER_SM = 4


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
        return cls(local_rank=control.device_slot, timeout=timeout, announce=control.rank == 0)

    @classmethod
    def place(cls, control: ControlPlane) -> str:
        """The PCI bus id of the GPU this rank uses (as `__init__` picks it)."""
        return bus_id_of(control.device_slot)

    @classmethod
    def unreachable(cls, control: ControlPlane, places: Sequence[str]) -> str | None:
        """CUDA IPC maps a peer's memory on another GPU only with peer-to-peer access."""
        return unreachable_peer(control.device_slot, places[control.rank], places)

    def __init__(self, device_id: int | None = None, *, local_rank: int | None = None,
                 timeout: float = 300.0, flags: str | None = None, copy: str | None = None,
                 announce: bool = True):
        cupy = cupy_module()
        count = cupy.cuda.runtime.getDeviceCount()
        if count == 0:
            raise RuntimeError("CudaDevice: no CUDA device is visible")
        if device_id is None:
            if local_rank is None:
                local_rank = int(os.environ.get("GPURING_LOCAL_RANK", "0"))
            device_id = local_rank % count
        self.device_id = device_id
        self.gpu = cupy.cuda.Device(device_id)
        self._current_stream = cupy.cuda.get_current_stream  # on every call's path
        #: `with device.scope():` this device is current in the calling thread (see `Scope`)
        self.scope: Callable[[], AbstractContextManager[Any]] = Scope(device_id).enter
        self.timeout = timeout
        self.timeout_ns = int(timeout * 1e9)

        #: how streams wait for flags: "memops" or "kernel" (`flag_waits`)
        #: (`announce`: say why where they spin, as a warning; else in the log: rank 0 says
        #: it for the job)
        self.flags_mode = flag_waits(flags or settings.get(FLAGS_ENV), device_id, announce)
        self.copy_mode = (copy or settings.get(COPY_ENV)).lower()
        if self.copy_mode not in ("memcpy", "kernel"):
            raise ValueError(f"{COPY_ENV}={self.copy_mode!r}: use memcpy or kernel")

        with self.scope():
            self._sm_count = int(self.gpu.attributes["MultiProcessorCount"])
            #: events recorded before, free to record again; a few made with the device, so
            #: that calls seldom make one
            self.spare_events: list[Any] = [new_event() for _ in range(_SPARE_EVENTS_AT_START)]
        #: the status and abort words, and every word a stream waits on (`_cuda_waits`)
        self._words = FlagWords(device_id, self.scope)
        self.status_ptr, self.abort_ptr = self._words.status_ptr, self._words.abort_ptr
        self._status = self._words.status  # (read by `check`, on every call's path)
        self.note_wait_word: Callable[[int], None] = self._words.note
        self._memory = IpcMemory(device_id, str(self.gpu.pci_bus_id), self.scope)
        self._streams: list[CudaStream] = []
        self._callers: dict[int | tuple[int, int], CudaStream] = {}  # caller's streams
        self._lock = threading.Lock()
        self._closing = threading.RLock()  # abort (any thread) and close exclude each other
        self._abort_reason: str | None = None
        self._closed = False
        self._reduce_kernels: dict[tuple[str, ReduceOp], tuple[Any, int]] = {}
        self._reduce_n_kernels: dict[tuple[str, ReduceOp], tuple[Any, int]] = {}
        self._fused_kernels: dict[tuple[str, ReduceOp], Any] = {}
        self._blocks_per_sm: dict[Any, int] = {}  # kernel -> blocks that fit on one SM
        #: the last event recorded on a caller's stream after a one-kernel collective (each
        #: such call orders after the one before: this one covers them all)
        self.last_on_caller: CudaEvent | None = None
        #: a one-kernel collective was captured into a graph, which holds this device's
        #: memory: it is never freed (a replay after close would touch it)
        self.captured = False
        #: the form of the one-operation collectives outside graphs ("kernel", "memops" or
        #: "off"), the one kernel's most blocks, and the slots of their region, for the job
        #: (`fused_region_bytes`, `capabilities`; see `_cuda_forms`)
        self.fused_form = "off"
        self.fused_blocks = 0
        self.slots = Slots()
        #: the memops form's calls so far
        self.fused_epoch = HostEpoch()

    # -- kernels --------------------------------------------------------------------------------
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
        blocks = -(-n // (THREADS * per_thread))
        return max(1, min(blocks, self._sm_count * self.blocks_per_sm(kernel)))

    def blocks_per_sm(self, kernel: Any) -> int:
        """Blocks of THREADS threads of `kernel` that fit on one SM at once (its registers
        decide: the kernels of reduce.cu fit 4 to 8); asked of the driver once per kernel,
        `_FALLBACK_BLOCKS_PER_SM` when it cannot say."""
        found = self._blocks_per_sm.get(kernel)
        if found is None:
            with self.scope():
                found = occupancy(kernel, THREADS) or _FALLBACK_BLOCKS_PER_SM
            self._blocks_per_sm[kernel] = found
        return found

    # -- waits ------------------------------------------------------------------------------------
    def read_u64(self, word: int) -> int:
        """The 8-byte word at a device address (`FlagWords.read_u64`)."""
        return self._words.read_u64(word)

    def check(self, tag: Any = None, stream: CudaStream | None = None) -> None:
        """Raise if the device was aborted or a spinning wait timed out."""
        if self._abort_reason is not None:
            raise FlagWaitAborted(self._abort_reason, tag)
        if self._closed:
            raise RuntimeError("CudaDevice is closed")
        if self._status.value == STATUS_TIMED_OUT:
            raise self.timeout_error(stream)

    def timeout_error(self, stream: CudaStream | None) -> Exception:
        """What a wait that ran out of time says (`FlagWords.timeout_error`), from the recent
        waits of `stream` first, then of every other stream of this device."""
        streams = ([stream] if stream is not None else []) + \
            [s for s in [*self._streams, *self._callers.values()] if s is not stream]
        return self._words.timeout_error((w for s in streams for w in s.waits), self.timeout)

    # -- one-operation collectives ----------------------------------------------------------------
    @classmethod
    def capability_settings(cls) -> tuple[tuple[str, str], ...]:
        return _cuda_forms.capability_settings()

    def fused_region_bytes(self, limit: int) -> int:
        """Two slots of each form that may run (`_cuda_forms.Slots`, kept for
        `prepare_fused`)."""
        self.slots = Slots.for_limit(limit, self.fused_max_bytes)
        return self.slots.region_bytes()

    def capabilities(self, handles: Any) -> Capabilities:
        """The job's forms (`_cuda_forms.choose`)."""
        forms = _cuda_forms.choose([CudaHandle(*h) for h in handles], self.slots,
                                   self.fused_max_bytes)
        self.fused_form, self.fused_blocks = forms.form, forms.blocks
        return forms.capabilities

    def _fused_fits(self) -> int:
        """Blocks of the one-kernel collective that fit on this GPU at once (0 where
        GPURING_CUDA_FUSED is off: its kernels are then never compiled)."""
        if _cuda_forms.fused_setting() == "off":
            return 0
        return self._sm_count * self.blocks_per_sm(self.fused_kernel("float32", ReduceOp.SUM))

    def prepare_fused(self, kind: str, regions: Sequence[Span], rank: int, root: int,
                      dtype: str, op: ReduceOp, divisor: int, nbytes: int, *,
                      graph: bool = False) -> FusedOp:
        """In the job's form (`fused_form`), or the kernel form for a graph: see
        `_cuda_fused`."""
        return prepare_fused(self, kind, regions, rank, root, dtype, op, divisor, nbytes,
                             graph=graph)

    # -- the caller's stream --------------------------------------------------------------------
    def capturing(self) -> bool:
        with self.scope():
            return bool(self._current_stream(self.device_id).is_capturing())

    def caller_stream(self) -> CudaStream:
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
                stream = CudaStream(self, raw, caller=True)
                self._callers[key] = stream
        return stream

    def caller_event(self) -> Event | None:
        with self.scope():
            return record_on(self, cupy_module().cuda.get_current_stream())

    def order_caller_after(self, event: Event) -> None:
        if not isinstance(event, CudaEvent):
            raise TypeError(f"not a CUDA event: {event!r}")
        with self.scope():
            cupy_module().cuda.get_current_stream().wait_event(event.raw)
        self.operations += 1

    # -- memory (`_cuda_memory`) ----------------------------------------------------------------
    def alloc(self, nbytes: int) -> CudaMemory:
        return self._memory.alloc(nbytes, self._words.zero)

    def export(self, mem: Memory) -> CudaHandle:
        return self._memory.export(mem, self._fused_fits(), self.flags_mode == "memops")

    def open(self, handle: Any) -> CudaMemory:
        return self._memory.open(handle)

    def array(self, mem: Memory, shape: tuple[int, ...], dtype: Any) -> Any:
        return self._memory.array(mem, shape, dtype)

    def wrap(self, array: Any) -> CudaMemory:
        return self._memory.wrap(array)

    def seal(self, mem: Memory) -> None:
        """Nothing to do on CUDA (HostDevice unlinks its shared-memory file here)."""

    def detach_peers(self) -> None:
        self._memory.detach()

    # -- streams ------------------------------------------------------------------------------
    def create_stream(self, *, inline: bool = False) -> Stream:
        """A non-blocking CuPy stream. `inline` is ignored: GPU work is always asynchronous."""
        with self.scope():
            stream = CudaStream(self, cupy_module().cuda.Stream(non_blocking=True))
        self._streams.append(stream)
        return stream

    # -- abort and close -------------------------------------------------------------------------
    @property
    def aborted(self) -> str | None:
        return self._abort_reason

    def abort(self, reason: str) -> None:
        """Fail every pending and future wait, from any thread: spinning waits return, every
        kernel queued from now on does nothing, and every word a stream waits on is raised to
        RELEASED, so no stream stays blocked (`FlagWords.abort`)."""
        with self._closing:  # not while close() frees what a release uses
            if self._abort_reason is not None:
                return
            self._abort_reason = reason
            if not self._closed:
                self._words.abort()

    def _drain(self, seconds: float) -> bool:
        """Wait up to `seconds` for every stream (the side stream too) to be idle; True if
        they are. False also when the GPU reports an error (a failed kernel): then nothing is
        known to be idle."""
        try:
            with self.scope():
                events: list[Event] = [self._words.side_event()]
            events += [s.record() for s in self._streams]
            if self.last_on_caller is not None:
                events.append(self.last_on_caller)
            return self._words.poll(events, seconds, release=True)
        except Exception as exc:
            warnings.warn(f"gpuring: CUDA error while closing: {exc}", RuntimeWarning,
                          stacklevel=3)
            return False

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
        with self.scope():
            kept = self._memory.free(keep=peers_may_read or self.captured)
            if kept:
                why = ("a peer of the failed job may still read them" if peers_may_read else
                       "a CUDA graph captured a collective that uses them")
                warnings.warn(f"gpuring: keeping {kept} bytes of GPU communication buffers "
                              f"allocated: {why}", RuntimeWarning, stacklevel=2)
            self._streams.clear()
            self._callers.clear()
            self._words.free(captured=self.captured)  # (a graph's kernels hold the words)
            self._status = None  # type: ignore[assignment]
            self.status_ptr = 0

