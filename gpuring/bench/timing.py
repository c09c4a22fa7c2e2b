"""Where arrays live and how a call is timed: perf_counter on the CPU, CUDA events on a GPU."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["Backend", "resolve_device", "host_backend", "cuda_backend", "time_calls",
           "time_loop", "rotating", "blocking", "DEFAULT_CACHE_BYTES"]

#: the cache size assumed when the machine does not say (--off-cache rotates over twice it)
DEFAULT_CACHE_BYTES = 64 << 20


def resolve_device(choice: str) -> str:
    """`auto` is cuda when CuPy imports and sees a GPU, else cpu."""
    if choice != "auto":
        return choice
    try:
        import cupy

        return "cuda" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:  # no CuPy, no driver, no GPU
        return "cpu"


class Backend:
    """Array module, host/device transfers, a timer and a memory-bandwidth probe."""

    name = "cpu"
    xp: Any = np

    def to_device(self, host: np.ndarray) -> Any:
        return host.copy()

    def to_host(self, array: Any) -> np.ndarray:
        return np.asarray(array)

    def fill(self, array: Any, host: np.ndarray) -> None:
        """Copy `host` into the device array `array` (same size)."""
        np.copyto(array, host.reshape(array.shape))

    def empty(self, shape: int | tuple[int, ...], dtype: str) -> Any:
        return self.xp.empty(shape, dtype=dtype)

    def timed(self, fn: Callable[[], object]) -> float:
        """Seconds one call of `fn` takes."""
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    def synchronize(self) -> None:
        pass

    def graph(self, fn: Callable[[], object], calls: int) -> Callable[[], object]:
        """A function that launches one CUDA graph of `calls` calls of `fn` (-G): GPU only."""
        raise NotImplementedError("CUDA graphs need the GPU")

    def use_device(self, local_rank: int) -> None:
        """Pick this rank's device (nothing to pick on the CPU)."""

    def memory_of(self, local_rank: int) -> int:
        """Which memory of this node the rank's arrays live in: the host's, for every rank."""
        return 0

    def cache_bytes(self) -> int:
        """The largest cache in front of this memory (the CPU's last level here)."""
        best = 0
        for index in range(8):
            path = f"/sys/devices/system/cpu/cpu0/cache/index{index}/size"
            try:
                with open(path) as f:
                    text = f.read().strip()
            except OSError:
                break
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            best = max(best, int(text.rstrip("KMG") or 0) * scale)
        return best or DEFAULT_CACHE_BYTES

    def compute(self, nbytes: int) -> Callable[[], object]:
        """Work that keeps this rank's device busy without communicating (--overlap): one
        pass of a multiply-add over `nbytes` of float32 per call."""
        a = self.xp.ones(max(nbytes // 4, 1), dtype=np.float32)

        def work() -> None:
            self.xp.multiply(a, 1.0000001, out=a)
            self.xp.add(a, 1e-7, out=a)

        return work

    def copy_seconds(self, nbytes: int, repeats: int,
                     sync: Callable[[], None]) -> tuple[float, float]:
        """(bytes moved, seconds) of `repeats` copies of `nbytes` in a row, read + write
        counted, on the host's clock to the end of the last; `sync` (a barrier) runs first so
        every rank copies at the same time."""
        src = self.xp.ones(nbytes // 8, dtype=np.float64)
        dst = self.xp.zeros_like(src)
        self.xp.copyto(dst, src)
        self.synchronize()
        sync()
        t0 = time.perf_counter()
        for _ in range(repeats):
            self.xp.copyto(dst, src)
        self.synchronize()
        return 2.0 * src.nbytes * repeats, time.perf_counter() - t0


class _CudaBackend(Backend):  # pragma: no cover - needs a GPU
    name = "cuda"

    def __init__(self) -> None:
        import cupy

        self.xp = cupy
        self._cupy = cupy

    def use_device(self, local_rank: int) -> None:
        """Make GPU `local_rank % count` current, the one gpuring's CudaDevice picks."""
        self._cupy.cuda.Device(self.memory_of(local_rank)).use()

    def memory_of(self, local_rank: int) -> int:
        """The GPU of this node the rank uses: `local_rank % count`, as CudaDevice."""
        return local_rank % self._cupy.cuda.runtime.getDeviceCount()

    def to_device(self, host: np.ndarray) -> Any:
        return self._cupy.asarray(host)

    def to_host(self, array: Any) -> np.ndarray:
        return np.asarray(self._cupy.asnumpy(array))

    def fill(self, array: Any, host: np.ndarray) -> None:
        array.set(np.ascontiguousarray(host.reshape(array.shape)))

    def timed(self, fn: Callable[[], object]) -> float:
        cuda = self._cupy.cuda
        stream = cuda.get_current_stream()
        start, end = cuda.Event(), cuda.Event()
        start.record(stream)
        fn()
        end.record(stream)
        end.synchronize()
        return float(cuda.get_elapsed_time(start, end)) / 1e3

    def synchronize(self) -> None:
        self._cupy.cuda.Device().synchronize()

    def graph(self, fn: Callable[[], object], calls: int) -> Callable[[], object]:
        """`calls` calls of `fn` captured into one graph on a stream of its own, after one
        call on that stream outside the capture (which orders the stream after the work
        before it, as capturing collectives needs); the function returned launches the
        graph there. Whatever `fn` raises under the capture ends the capture and is raised."""
        cuda = self._cupy.cuda
        stream = cuda.Stream(non_blocking=True)
        with stream:
            fn()
            stream.synchronize()
            stream.begin_capture()
            try:
                for _ in range(calls):
                    fn()
            finally:
                graph = stream.end_capture()
        graph.upload(stream)

        def launch() -> None:
            graph.launch(stream)

        return launch

    def cache_bytes(self) -> int:
        """The GPU's L2 cache."""
        attributes = self._cupy.cuda.Device().attributes
        return int(attributes.get("L2CacheSize", 0)) or DEFAULT_CACHE_BYTES

    def compute(self, nbytes: int) -> Callable[[], object]:
        """The multiply-add of the CPU's, on a stream of its own, so that it can run beside
        the collectives of the current stream."""
        side = self._cupy.cuda.Stream(non_blocking=True)
        with side:
            a = self._cupy.ones(max(nbytes // 4, 1), dtype=np.float32)

        def work() -> None:
            with side:
                self._cupy.multiply(a, 1.0000001, out=a)
                self._cupy.add(a, 1e-7, out=a)

        return work


def host_backend() -> Backend:
    return Backend()


def cuda_backend() -> Backend:  # pragma: no cover - needs a GPU
    return _CudaBackend()


def rotating(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call after another of `calls`, round and round (--off-cache: each call works on
    the next set of buffers)."""
    if len(calls) == 1:
        return calls[0]
    turn = [0]

    def call() -> object:
        i = turn[0]
        turn[0] = i + 1 if i + 1 < len(calls) else 0
        return calls[i]()

    return call


def blocking(fn: Callable[[], object], backend: Backend,
             sync: Callable[[], None]) -> Callable[[], object]:
    """`fn`, then wait until the device has finished it and every rank has (`sync`, a
    barrier): nccl-tests' blocking mode (-z 1)."""
    def call() -> None:
        fn()
        backend.synchronize()
        sync()

    return call


def time_calls(fn: Callable[[], object], *, iters: int, warmup: int, backend: Backend,
               sync: Callable[[], None]) -> np.ndarray:
    """Seconds of each of `iters` calls after `warmup` untimed ones; `sync` (a barrier)
    precedes every timed call and is not timed."""
    for _ in range(warmup):
        fn()
    backend.synchronize()
    times = np.empty(iters, dtype=np.float64)
    for i in range(iters):
        backend.synchronize()
        sync()
        times[i] = backend.timed(fn)
    return times


def time_loop(fn: Callable[[], object], *, iters: int, backend: Backend,
              sync: Callable[[], None]) -> float:
    """Seconds per call of `iters` back-to-back calls, nccl-tests' way: one untimed call to
    completion, one barrier (`sync`), then the calls in a row on the host clock until the
    last has completed."""
    fn()
    backend.synchronize()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    backend.synchronize()
    return (time.perf_counter() - t0) / iters
