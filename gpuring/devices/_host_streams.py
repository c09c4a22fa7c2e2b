"""The host device's streams: an inline stream that runs each operation in the calling thread,
and a threaded stream (a worker thread per stream) that runs them in order; their events; and
the element-wise operations both use."""

from __future__ import annotations

import collections
import random
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from .._ops import ReduceOp
from . import _host_attach
from ._host_memory import check_local
from ._streams import Event, Flag, Span, Stream

__all__ = ["UFUNCS", "fold_into", "average_into", "HostEvent", "InlineStream", "ThreadStream",
           "StreamOwner"]


class StreamOwner(Protocol):
    """What a stream asks of its device (`HostDevice`)."""

    #: sleep a random few hundred microseconds before some operations (see `HostDevice`)
    jitter: bool

    def check_aborted(self, tag: Any) -> None:
        """Raise FlagWaitAborted(tag) once the device is aborted."""

    def wait_flag(self, flag: Flag, value: int, tag: Any) -> None:
        """Block until the flag reaches value (bounded, cut short by abort)."""

    def abort(self, reason: str) -> None:
        """Fail every pending and future flag wait."""


UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


class HostEvent(Event):
    def __init__(self, done: bool = False):
        self._done = threading.Event()
        if done:
            self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def set(self) -> None:
        self._done.set()

    def wait(self, device: StreamOwner) -> None:
        while not self.wait_for(0.05):
            device.check_aborted(("event",))

    def wait_for(self, seconds: float) -> bool:
        """Block until the event completes or `seconds` pass; whether it completed."""
        return self._done.wait(seconds)


class _StreamBase(Stream):
    """Operation bodies shared by inline and threaded streams."""

    def __init__(self, device: StreamOwner):
        self._device = device
        self._rng = random.Random(secrets.randbits(32)) if device.jitter else None
        if self._rng is None:
            self.jitter = self._no_jitter  # type: ignore[method-assign]

    def jitter(self) -> None:
        """Sleep a random few hundred microseconds, now and then, in jitter mode."""
        if self._rng is not None and self._rng.random() < 0.3:
            time.sleep(self._rng.random() * 300e-6)

    def _no_jitter(self) -> None:
        pass

    def _do_copy(self, dst: Span, src: Span) -> None:
        self.jitter()
        if _host_attach.attached(dst):  # into a peer's array (from one of this process)
            _host_attach.write(dst, _local(src, "u1"))
            return
        d = dst.mem.u8[dst.offset:dst.offset + dst.nbytes]  # type: ignore[attr-defined]
        if _host_attach.attached(src):
            _host_attach.read(src, d)
            return
        s = src.mem.u8[src.offset:src.offset + src.nbytes]  # type: ignore[attr-defined]
        np.copyto(d, s)

    def _do_reduce(self, dst: Span, a: Span, b: Span, dtype: str, op: ReduceOp,
                   divisor: int) -> None:
        self.jitter()
        d = dst.mem.view(dst.offset, dst.nbytes, dtype)  # type: ignore[attr-defined]
        x, y = _local(a, dtype), _local(b, dtype)
        if divisor == 1:
            UFUNCS[op](x, y, out=d)
        else:
            average_into(d, x, y, divisor)

    def _do_reduce_n(self, dst: Span, srcs: Sequence[Span], dtype: str, op: ReduceOp,
                     divisor: int) -> None:
        self.jitter()
        d = dst.mem.view(dst.offset, dst.nbytes, dtype)  # type: ignore[attr-defined]
        fold_into(d, [_local(s, dtype) for s in srcs], op, divisor)

    def _do_wait(self, flag: Flag, value: int, tag: Any) -> None:
        self.jitter()
        self._device.wait_flag(flag, value, tag)

    def _do_write(self, flag: Flag, value: int) -> None:
        self.jitter()
        flag.mem.i64[flag.offset >> 3] = value  # type: ignore[attr-defined]


def _local(span: Span, dtype: str) -> np.ndarray:
    """`span` as an array of `dtype`: a view of it, or, for a peer's array that only
    cross-memory attach reaches, a copy of it read now."""
    if _host_attach.attached(span):
        got = np.empty(span.nbytes, np.uint8)
        _host_attach.read(span, got)
        return got.view(dtype)
    return span.mem.view(span.offset, span.nbytes, dtype)  # type: ignore[attr-defined]


def fold_into(d: np.ndarray, xs: Sequence[np.ndarray], op: ReduceOp, divisor: int) -> None:
    """d = xs[0] op xs[1] op ... op xs[-1], each step one binary reduce (rounded to the
    dtype), the divisor at the last step only: exactly the chain d = xs[0] op xs[1], d = d op
    xs[2], ... d may be the same memory as any operand (an in-place fold): where it is one
    that the first step would overwrite before it is read (xs[2:]), the steps before the last
    go through a temporary."""
    if len(xs) < 2:
        raise ValueError(f"a fold needs at least two operands, not {len(xs)}")
    ufunc = UFUNCS[op]
    acc = xs[0]
    last = len(xs) - 1
    into = d
    if last > 1 and any(np.may_share_memory(d, x) for x in xs[2:]):
        into = np.empty_like(d)
    for k in range(1, len(xs)):
        step_out = d if k == last else into
        if k == last and divisor != 1:
            average_into(step_out, acc, xs[k], divisor)
        else:
            ufunc(acc, xs[k], out=step_out)
        acc = step_out


def average_into(d: np.ndarray, x: np.ndarray, y: np.ndarray, divisor: int) -> None:
    """d = (x + y) / divisor: float16 and bfloat16 computed in float32 and rounded once;
    other floats in their own type; complex parts each divided by the divisor (as the CUDA
    kernel does; NumPy's complex division would multiply by a rounded reciprocal); integers
    truncated toward zero (as C and NCCL do)."""
    kind = d.dtype.kind
    if d.dtype == np.float16 or d.dtype.name == "bfloat16":
        d[...] = (x.astype(np.float32) + y) / np.float32(divisor)
    elif kind == "f":
        np.add(x, y, out=d)
        np.divide(d, divisor, out=d)
    elif kind == "c":
        np.add(x, y, out=d)
        parts = d.view(d.real.dtype)
        np.divide(parts, divisor, out=parts)
    else:
        total = np.add(x, y)
        quotient, remainder = np.divmod(total, d.dtype.type(divisor))
        if kind == "i":  # floor -> toward zero for negative sums with a remainder
            quotient += (remainder != 0) & (total < 0)
        d[...] = quotient


class InlineStream(_StreamBase):
    """Runs each operation at once in the calling thread; errors raise from the call."""

    def __init__(self, device: StreamOwner):
        super().__init__(device)
        self._scratch: dict[int, np.ndarray] = {}

    def scratch(self, slot: int, nbytes: int) -> np.ndarray:
        """`nbytes` of this stream's scratch memory number `slot` (uint8): where its compiled
        steps read a peer's piece before they reduce it (a step runs at a time, so steps
        share them: at most one per source of a reduction)."""
        held = self._scratch.get(slot)
        if held is None or held.nbytes < nbytes:
            held = self._scratch[slot] = np.empty(nbytes, np.uint8)
        return held[:nbytes]

    def copy(self, dst: Span, src: Span) -> None:
        self._do_copy(dst, src)

    def reduce(self, dst: Span, a: Span, b: Span, dtype: str, op: ReduceOp,
               divisor: int = 1) -> None:
        self._do_reduce(dst, a, b, dtype, op, divisor)

    def reduce_n(self, dst: Span, srcs: Sequence[Span], dtype: str, op: ReduceOp,
                 divisor: int = 1) -> None:
        self._do_reduce_n(dst, srcs, dtype, op, divisor)

    def wait_flag(self, flag: Flag, value: int, tag: Any = None) -> None:
        check_local(flag)
        self._do_wait(flag, value, tag)

    def write_flag(self, flag: Flag, value: int) -> None:
        self._do_write(flag, value)

    def record(self) -> Event:
        return HostEvent(done=True)

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, HostEvent)
        event.wait(self._device)

    def synchronize(self) -> None:
        pass


class ThreadStream(_StreamBase):
    """A worker thread that runs operations in order. After an error it skips the rest,
    still completing events, and `synchronize` raises the error."""

    def __init__(self, device: StreamOwner):
        super().__init__(device)
        self._queue: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = (
            collections.deque())
        self._ready = threading.Condition()
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="gpuring-stream", daemon=True)
        self._thread.start()

    def _put(self, fn: Callable[..., None], *args: Any) -> None:
        with self._ready:
            if self._closed:
                raise RuntimeError("stream is closed")
            self._queue.append((fn, args))
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    if self._closed:
                        return
                    self._ready.wait()
                fn, args = self._queue.popleft()
            if fn is HostEvent.set:
                fn(*args)
                continue
            if self._error is not None:
                continue
            try:
                fn(*args)
            except BaseException as exc:
                self._error = exc
                self._device.abort(f"stream failed: {exc!r}")

    def copy(self, dst: Span, src: Span) -> None:
        self._put(self._do_copy, dst, src)

    def reduce(self, dst: Span, a: Span, b: Span, dtype: str, op: ReduceOp,
               divisor: int = 1) -> None:
        self._put(self._do_reduce, dst, a, b, dtype, op, divisor)

    def reduce_n(self, dst: Span, srcs: Sequence[Span], dtype: str, op: ReduceOp,
                 divisor: int = 1) -> None:
        self._put(self._do_reduce_n, dst, tuple(srcs), dtype, op, divisor)

    def wait_flag(self, flag: Flag, value: int, tag: Any = None) -> None:
        check_local(flag)
        self._put(self._do_wait, flag, value, tag)

    def write_flag(self, flag: Flag, value: int) -> None:
        self._put(self._do_write, flag, value)

    def record(self) -> HostEvent:
        event = HostEvent()
        self._put(HostEvent.set, event)
        return event

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, HostEvent)
        self._put(event.wait, self._device)

    def synchronize(self) -> None:
        event = self.record()
        while not event.query():
            event.wait_for(0.05)
            if not self._thread.is_alive():
                raise RuntimeError("stream worker died")
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify()
        self._thread.join(timeout=5)
