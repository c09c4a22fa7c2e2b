"""Async collectives: `Work` handles, and the per-communicator thread that runs them in order.

Each communicator gets one background thread when its first async verb is called. Work runs
there one item at a time, in submission order, which every rank must share (as for the
synchronous verbs). A synchronous verb called while async work is outstanding first waits for
that work, so the order across ranks stays the order of the calls.

CUDA: the caller's current stream (torch's for a torch tensor) is marked when the work is
submitted; the collective runs on a side stream that waits for that mark, and `Work.wait()`
makes the caller's current stream wait for the collective instead of blocking the host.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from ._errors import CommunicatorClosedError

__all__ = ["Work", "Executor", "public_verb"]

F = TypeVar("F", bound=Callable[..., Any])


def _cupy() -> Any:
    return sys.modules["cupy"]


class Work:
    """The handle of an async collective: `wait()` for its result, `done()` to poll.

    The arrays passed in belong to the collective until `wait()` returns: do not change or
    free them before. On CUDA, `done()` means the collective is enqueued, and `wait()` orders
    the caller's current stream after it without blocking the host.
    """

    def __init__(self, name: str, keep: Any = None, cuda_device: int | None = None,
                 caller_stream: Callable[[], Any] | None = None):
        self.name = name
        self._caller_stream = caller_stream or contextlib.nullcontext
        self._finished = threading.Event()
        self._result: Any = None
        self._error: BaseException | None = None
        self._keep = keep  # the call and its arrays, alive until wait()
        self._cuda_device = cuda_device
        self._cuda_event: Any = None

    def __repr__(self) -> str:
        state = "done" if self._finished.is_set() else "pending"
        return f"<gpuring.Work {self.name} {state}>"

    def done(self) -> bool:
        """True once the collective completed (host) or was enqueued (CUDA), or failed."""
        return self._finished.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """The collective's result, once complete; raises the error it failed with.

        `timeout` bounds this wait in seconds (TimeoutError; the work goes on). On CUDA the
        caller's current stream is ordered after the collective; the host does not block.
        """
        if not self._finished.wait(timeout):
            raise TimeoutError(f"{self.name} did not complete within {timeout} s; "
                               "it is still running, call wait() again")
        self._keep = None
        if self._error is not None:
            raise self._error
        if self._cuda_event is not None:
            with _cupy().cuda.Device(self._cuda_device), self._caller_stream():
                _cupy().cuda.get_current_stream().wait_event(self._cuda_event)
        return self._result

    def result(self) -> Any:
        """The same as `wait()` without a timeout."""
        return self.wait()

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._finished.set()


class Executor:
    """One thread that runs submitted calls in order. Started on the first submission."""

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[Work, Callable[[], Any]]] = collections.deque()
        self._cond = threading.Condition()
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._closed = False
        self._side_streams: dict[int, Any] = {}

    def submit(self, fn: Callable[[], Any], name: str, *, cuda_device: int | None = None,
               caller_stream: Callable[[], Any] | None = None) -> Work:
        """Queue `fn()`; its result or error goes to the returned Work. `cuda_device`: the
        call runs on a side stream ordered after the caller's current stream on that GPU;
        `caller_stream()` makes the caller's stream CuPy's current one when `wait()` orders
        it after the call (CuPy's current stream when not given)."""
        work = Work(name, fn, cuda_device, caller_stream)
        if cuda_device is not None:
            fn = self._on_side_stream(fn, work, cuda_device)
        with self._cond:
            if self._closed:
                raise CommunicatorClosedError("the communicator is closed; call gpuring.init() "
                                              "for a new one")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="gpuring-async",
                                                daemon=True)
                self._thread.start()
            self._queue.append((work, fn))
            self._pending += 1
            self._cond.notify_all()
        return work

    def _on_side_stream(self, fn: Callable[[], Any], work: Work,
                        device_id: int) -> Callable[[], Any]:
        cupy = _cupy()
        with cupy.cuda.Device(device_id):
            before = cupy.cuda.Event(block=False, disable_timing=True)
            before.record(cupy.cuda.get_current_stream())

        def run() -> Any:
            # this thread is the executor's own: make the array's GPU current for good (a
            # `with Device(...)` would restore device 0 on exit and create a context there)
            cupy.cuda.runtime.setDevice(device_id)
            side = self._side_streams.get(device_id)
            if side is None:
                side = self._side_streams[device_id] = cupy.cuda.Stream(non_blocking=True)
            side.wait_event(before)
            with side:
                result = fn()
            work._cuda_event = side.record()
            return result

        return run

    def busy(self) -> bool:
        """True when work is outstanding and the caller is not the executor's own thread."""
        return self._pending > 0 and threading.current_thread() is not self._thread

    def drain(self) -> None:
        """Wait until every submitted call has finished (each is bounded by its timeout)."""
        with self._cond:
            while self._pending:
                self._cond.wait()

    def close(self) -> None:
        """Finish the outstanding work, then stop the thread. Idempotent."""
        self.drain()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue:
                    if self._closed:
                        return
                    self._cond.wait()
                work, fn = self._queue.popleft()
            try:
                work._finish(result=fn())
            except BaseException as exc:
                work._finish(error=exc)
            del work, fn  # hold nothing of the communicator while idle
            with self._cond:
                self._pending -= 1
                self._cond.notify_all()


#: NumPy's array type, and CuPy's once CuPy is imported
_native_types: list[type] = [np.ndarray]


def _native(a: Any) -> bool:
    kind = type(a)
    if kind in _native_types:
        return True
    cupy = sys.modules.get("cupy")
    if cupy is None or kind is not cupy.ndarray:
        return False
    _native_types.append(kind)
    return True


def public_verb(method: F) -> F:
    """Wrap a Communicator collective: it runs after outstanding async work, and accepts
    arrays of other libraries (DLPack, CUDA array interface) through `gpuring.interop`."""

    @functools.wraps(method)
    def verb(self: Any, *args: Any, **kwargs: Any) -> Any:
        executor = self._executor
        if executor is not None and executor.busy():
            executor.drain()
        if args:  # the common case first: a CuPy or NumPy array (and out of its type)
            kind = type(args[0])
            if kind in _native_types:
                out = kwargs.get("out")
                if out is None or type(out) is kind:
                    return method(self, *args, **kwargs)
        out = kwargs.get("out")
        if args and not (_native(args[0]) and (out is None or _native(out))):
            from . import interop

            return interop.call(method, self, args, kwargs)
        return method(self, *args, **kwargs)

    return verb  # type: ignore[return-value]
