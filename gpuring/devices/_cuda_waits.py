"""What a CUDA device's flag waits depend on, and how abort ends them (`FlagWords`).

A stream waits only on words in memory its device allocated (the engine puts every flag
with its reader; producers write through their IPC mappings). That is what makes abort work:
a stream memory wait cannot be cancelled, only satisfied, so abort (1) sets a word in device
memory that every kernel checks first (data kernels then read nothing, a dead peer's memory
may be gone, and flag writes publish nothing), then (2) raises every word this device's
streams wait on to the largest flag value (`RELEASED`), with local writes on a side stream.
The streams then drain through no-op kernels, and the process can synchronize, free memory
and use the GPU again. Peers that have not aborted yet may still write into those words;
closing releases them again until the streams are idle (`FlagWords.poll`). A spinning wait
kernel gives up by itself after the device's timeout and says so in the status word."""

from __future__ import annotations

import ctypes
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

from .._errors import CollectiveTimeoutError
from ._cuda_driver import MEMCPY_DEFAULT, cupy_module
from ._cuda_memory import CudaMemory, keep_forever
from ._cuda_streams import CudaEvent, addr
from ._streams import Event, Flag, FlagWaitTimeout

__all__ = ["FlagWords", "RELEASED", "STATUS_TIMED_OUT"]

# CUDA runtime constants (stable ABI values)
_HOST_ALLOC_PORTABLE = 1
_HOST_ALLOC_MAPPED = 2
# status word values (kernels/reduce.cu: gpuring_wait_flag)
_STATUS_OK = 0
STATUS_TIMED_OUT = 1
_STATUS_ABORTED = 2
#: what abort writes into the words a stream waits on: at or above every flag value (they stay
#: below 2^63, where the stream wait's cyclic comparison still holds)
RELEASED = 2**63 - 1


class FlagWords:
    """The words of one device (GPU `device_id`, made current by `scope()`) that its waits
    and kernels read: the status word, in mapped pinned memory that host and kernels read and
    write (`status`; a spinning wait that gave up sets it, and `fused_peer` then says which
    peer a one-kernel collective gave up on, plus one), the abort word every kernel checks
    first (device memory, at `abort_ptr`), and every word a stream of the device waits on
    (`note`). Releasing them and reading a word back run on a side stream of their own
    (`side`), bounded."""

    def __init__(self, device_id: int, scope: Callable[[], AbstractContextManager[Any]]):
        cupy = cupy_module()
        runtime = cupy.cuda.runtime
        self.device_id = device_id
        self._scope = scope
        with scope():
            self.side = cupy.cuda.Stream(non_blocking=True)  # small host<->device chores
            self.status_ptr = int(runtime.hostAlloc(
                8, _HOST_ALLOC_PORTABLE | _HOST_ALLOC_MAPPED))
            # the source of the released value that abort copies into waited-on words, and
            # where read_u64 copies a word to
            self._released_ptr = int(runtime.hostAlloc(8, _HOST_ALLOC_PORTABLE))
            self._readback_ptr = int(runtime.hostAlloc(8, _HOST_ALLOC_PORTABLE))
            self._abort_mem = cupy.cuda.Memory(256)
            self.abort_ptr = int(self._abort_mem.ptr)
            runtime.memsetAsync(self.abort_ptr, 0, 256, self.side.ptr)
            self.side.synchronize()
        self.status = ctypes.c_int32.from_address(self.status_ptr)
        self.status.value = _STATUS_OK
        self.fused_peer = ctypes.c_int32.from_address(self.status_ptr + 4)
        self.fused_peer.value = 0
        ctypes.c_uint64.from_address(self._released_ptr).value = RELEASED
        self._words: set[int] = set()  # every word a stream of this device waits on
        self._lock = threading.Lock()
        #: `abort` ran: `poll` releases the waits again at every turn
        self.aborted = False

    def note(self, word: int) -> None:
        """A stream of this device waits on the word at address `word` (abort releases
        it)."""
        if word not in self._words:
            with self._lock:
                self._words.add(word)

    def abort(self) -> None:
        """End every wait: release the waited-on words (`release`), then tell spinning
        waits through the status word (a spinning wait released by it should find the
        kernels behind it disabled; the wait kernel also sets the abort word itself when the
        status word stops it)."""
        self.aborted = True
        self.release()
        self.status.value = _STATUS_ABORTED

    def release(self) -> bool:
        """Set the abort word, then raise every waited-on word to RELEASED, in that order on
        the side stream (no kernel may run on released data); True once done."""
        runtime = cupy_module().cuda.runtime
        with self._lock:
            words = sorted(self._words)
        try:
            with self._scope():
                side = self.side.ptr
                runtime.memsetAsync(self.abort_ptr, 1, 4, side)
                for word in words:
                    runtime.memcpyAsync(word, self._released_ptr, 8, MEMCPY_DEFAULT, side)
                done = self.side_event()
            return self.poll([done], 5.0)
        except Exception as exc:  # a sticky CUDA error: nothing more can be done here
            warnings.warn(f"gpuring: could not release the GPU's flag waits: {exc}",
                          RuntimeWarning, stacklevel=4)
            return False

    def side_event(self) -> CudaEvent:
        """An event after what is queued on the side stream so far (inside `scope()`)."""
        return CudaEvent(self.side.record(), self._scope)

    def poll(self, events: list[Event], seconds: float, *, release: bool = False) -> bool:
        """Wait up to `seconds` for `events`, with backoff. `release`: once aborted, release
        the waits again at every turn (a peer that has not aborted yet may have written its
        ordinary value into a released word since)."""
        deadline = time.monotonic() + seconds
        delay = 1e-5
        while not all(e.query() for e in events):
            if time.monotonic() > deadline:
                return False
            if release and self.aborted:
                self.release()
            time.sleep(delay)
            delay = min(delay * 2, 1e-2)
        return True

    def chore(self, what: str, seconds: float = 10.0) -> None:
        """Wait, bounded, for what was just queued on the side stream (a stream that shares a
        hardware queue with one blocked in a flag wait may itself stall: never hang on it)."""
        with self._scope():
            done = self.side_event()
        if not self.poll([done], seconds):
            raise CollectiveTimeoutError(f"CUDA device {self.device_id}: {what} did not "
                                         f"finish within {seconds} s")

    def zero(self, ptr: int, nbytes: int) -> None:
        """Fill `nbytes` of device memory at `ptr` with zeros, on the side stream, bounded."""
        with self._scope():
            cupy_module().cuda.runtime.memsetAsync(ptr, 0, nbytes, self.side.ptr)
        self.chore("zeroing new memory")

    def read_u64(self, word: int) -> int:
        """The 8-byte word at a device address, read on the side stream into pinned memory
        (a copy into pageable memory would block the host), bounded."""
        runtime = cupy_module().cuda.runtime
        with self._scope():
            runtime.memcpyAsync(self._readback_ptr, word, 8, MEMCPY_DEFAULT, self.side.ptr)
        self.chore("reading a flag")
        return int(ctypes.c_uint64.from_address(self._readback_ptr).value)

    def timeout_error(self, waits: Iterable[tuple[Flag, int, Any]], timeout: float
                      ) -> Exception:
        """FlagWaitTimeout for the peer a one-kernel collective gave up on, else for the first
        of the recent `waits` whose flag is still short, else a CollectiveTimeoutError."""
        peer = self.fused_peer.value - 1
        if peer >= 0:
            return FlagWaitTimeout(Flag(CudaMemory(0, 0, "peer"), 0), -1, -1,
                                   (peer, "its part of a one-kernel collective"))
        last = None
        for flag, value, tag in waits:
            try:
                observed = self.read_u64(addr(flag))
            except Exception:  # e.g. a CUDA error
                return FlagWaitTimeout(flag, value, -1, tag)
            if observed < value:
                return FlagWaitTimeout(flag, value, observed, tag)
            last = (flag, value, observed, tag)
        if last is not None and self.status.value == STATUS_TIMED_OUT:
            return FlagWaitTimeout(*last)  # the flag arrived after the kernel gave up
        return CollectiveTimeoutError(
            f"CUDA stream did not finish within {timeout} s on device {self.device_id}")

    def free(self, *, captured: bool) -> None:
        """Free the words (inside `scope()`, once every stream is idle). `captured`: a CUDA
        graph's kernels hold the status and abort words' addresses, which are kept."""
        runtime = cupy_module().cuda.runtime
        if captured:
            keep_forever(self._abort_mem)
        else:
            runtime.freeHost(self.status_ptr)
        self._abort_mem = None
        self.status = None  # type: ignore[assignment]
        self.side = None
        runtime.freeHost(self._released_ptr)
        runtime.freeHost(self._readback_ptr)
        self.status_ptr = self._released_ptr = self._readback_ptr = 0
