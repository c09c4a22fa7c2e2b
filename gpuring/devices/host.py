"""HostDevice: the device interface on the CPU, for NumPy arrays.

Memory is POSIX shared memory (files under /dev/shm, mode 0600, unguessable names) that peers
map, so a peer's buffer is read in place: no copies through pipes or sockets. Each stream is a
worker thread that runs its operations in order (NumPy releases the GIL in large ufuncs);
an inline stream runs them in the calling thread, which saves the hand-off for small
messages. Flags are int64 words in shared memory. Stores become visible to other processes in
program order on x86-64 (TSO), which the flag protocol relies on.

Jitter mode (`jitter=True` or GPURING_JITTER=1) sleeps a random few hundred microseconds
before some operations, so a missing dependency in a schedule shows up in tests.
"""

from __future__ import annotations

import collections
import mmap
import os
import platform
import random
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import settings
from .._errors import GpuringError
from .._ops import ReduceOp
from .base import (
    Arg,
    CopyI,
    Device,
    Event,
    Flag,
    FlagWaitAborted,
    FlagWaitTimeout,
    Instruction,
    Memory,
    ReduceI,
    ReduceNI,
    Runner,
    Span,
    Stream,
    WaitI,
)

if TYPE_CHECKING:
    from ..rendezvous.base import ControlPlane

__all__ = ["HostDevice", "SHM_DIR", "SHM_PREFIX"]

SHM_DIR = "/dev/shm"
#: machines whose stores become visible to other cores in program order (TSO)
_TSO_MACHINES = ("x86_64", "amd64", "i686", "i386")
#: how long a flag wait yields before it starts to sleep (sleeping costs ~50 us of latency)
_SPIN_SECONDS = 2e-4
SHM_PREFIX = "gpuring-"

_UFUNCS = {
    ReduceOp.SUM: np.add,
    ReduceOp.AVG: np.add,
    ReduceOp.PROD: np.multiply,
    ReduceOp.MIN: np.minimum,
    ReduceOp.MAX: np.maximum,
}


class HostMemory(Memory):
    """Bytes in host memory: a shared-memory mapping or a borrowed array. `i64` indexes the
    64-bit words of a mapping (flags): plain Python ints, cheaper than NumPy scalars."""

    __slots__ = ("i64", "mapping", "nbytes", "owner", "path", "u8")

    def __init__(self, u8: np.ndarray, *, mapping: mmap.mmap | None = None,
                 path: str | None = None, owner: bool = False):
        self.u8 = u8
        self.nbytes = u8.nbytes
        self.mapping = mapping
        self.path = path
        self.owner = owner
        self.i64: memoryview | None = (
            memoryview(mapping)[: (self.nbytes // 8) * 8].cast("q") if mapping is not None
            else None)

    def view(self, offset: int, nbytes: int, dtype: str) -> np.ndarray:
        return self.u8[offset:offset + nbytes].view(dtype)

    def release(self) -> None:
        """Unmap (and remove the file if this process created it and still names it)."""
        if self.owner and self.path is not None:
            _unlink_quietly(self.path)
            self.path = None
        if self.mapping is not None:
            if self.i64 is not None:
                self.i64.release()
            self.u8 = self.i64 = None  # type: ignore[assignment]
            try:
                self.mapping.close()
            except BufferError:  # a view is still alive somewhere: the GC unmaps it later
                pass
            self.mapping = None


class HostArray(Memory):
    """A borrowed C-contiguous NumPy array, seen flat in its own dtype (`flat`) and, on
    demand, as bytes (`u8`)."""

    __slots__ = ("_u8", "flat", "nbytes")

    def __init__(self, flat: np.ndarray):
        self.flat = flat
        self.nbytes = flat.nbytes
        self._u8: np.ndarray | None = None

    @property
    def u8(self) -> np.ndarray:
        if self._u8 is None:
            self._u8 = self.flat.view(np.uint8)
        return self._u8

    def view(self, offset: int, nbytes: int, dtype: str) -> np.ndarray:
        return self.u8[offset:offset + nbytes].view(dtype)


def _check_local(flag: Flag) -> None:
    """Streams wait only on flags in memory this process allocated (see Stream.wait_flag)."""
    if not (isinstance(flag.mem, HostMemory) and flag.mem.owner):
        raise ValueError(f"a stream may only wait on a flag in memory this device allocated, "
                         f"not {flag.mem!r}")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class _HostEvent(Event):
    def __init__(self, done: bool = False):
        self._done = threading.Event()
        if done:
            self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def set(self) -> None:
        self._done.set()

    def wait(self, device: HostDevice) -> None:
        while not self._done.wait(0.05):
            device.check_aborted(("event",))


class _StreamBase(Stream):
    """Operation bodies shared by inline and threaded streams."""

    def __init__(self, device: HostDevice):
        self._device = device
        self._rng = random.Random(secrets.randbits(32)) if device.jitter else None
        if self._rng is None:
            self._jitter = self._no_jitter  # type: ignore[method-assign]

    def _jitter(self) -> None:
        if self._rng is not None and self._rng.random() < 0.3:
            time.sleep(self._rng.random() * 300e-6)

    def _no_jitter(self) -> None:
        pass

    def _do_copy(self, dst: Span, src: Span) -> None:
        self._jitter()
        d = dst.mem.u8[dst.offset:dst.offset + dst.nbytes]  # type: ignore[attr-defined]
        s = src.mem.u8[src.offset:src.offset + src.nbytes]  # type: ignore[attr-defined]
        np.copyto(d, s)

    def _do_reduce(self, dst: Span, a: Span, b: Span, dtype: str, op: ReduceOp,
                   divisor: int) -> None:
        self._jitter()
        d = dst.mem.view(dst.offset, dst.nbytes, dtype)  # type: ignore[attr-defined]
        x = a.mem.view(a.offset, a.nbytes, dtype)  # type: ignore[attr-defined]
        y = b.mem.view(b.offset, b.nbytes, dtype)  # type: ignore[attr-defined]
        if divisor == 1:
            _UFUNCS[op](x, y, out=d)
        else:
            _average_into(d, x, y, divisor)

    def _do_reduce_n(self, dst: Span, srcs: Sequence[Span], dtype: str, op: ReduceOp,
                     divisor: int) -> None:
        self._jitter()
        d = dst.mem.view(dst.offset, dst.nbytes, dtype)  # type: ignore[attr-defined]
        _fold_into(d, [s.mem.view(s.offset, s.nbytes, dtype)  # type: ignore[attr-defined]
                       for s in srcs], op, divisor)

    def _do_wait(self, flag: Flag, value: int, tag: Any) -> None:
        self._jitter()
        self._device.wait_flag(flag, value, tag)

    def _do_write(self, flag: Flag, value: int) -> None:
        self._jitter()
        flag.mem.i64[flag.offset >> 3] = value  # type: ignore[attr-defined]


def _fold_into(d: np.ndarray, xs: Sequence[np.ndarray], op: ReduceOp, divisor: int) -> None:
    """d = xs[0] op xs[1] op ... op xs[-1], each step one binary reduce into d (rounded to the
    dtype), the divisor at the last step only: exactly the chain d = xs[0] op xs[1], d = d op
    xs[2], ... d may be xs[0] but must not overlap a later operand."""
    if len(xs) < 2:
        raise ValueError(f"a fold needs at least two operands, not {len(xs)}")
    ufunc = _UFUNCS[op]
    acc = xs[0]
    for k in range(1, len(xs)):
        if k == len(xs) - 1 and divisor != 1:
            _average_into(d, acc, xs[k], divisor)
        else:
            ufunc(acc, xs[k], out=d)
        acc = d


def _average_into(d: np.ndarray, x: np.ndarray, y: np.ndarray, divisor: int) -> None:
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


class _InlineStream(_StreamBase):
    """Runs each operation at once in the calling thread; errors raise from the call."""

    def copy(self, dst: Span, src: Span) -> None:
        self._do_copy(dst, src)

    def reduce(self, dst: Span, a: Span, b: Span, dtype: str, op: ReduceOp,
               divisor: int = 1) -> None:
        self._do_reduce(dst, a, b, dtype, op, divisor)

    def reduce_n(self, dst: Span, srcs: Sequence[Span], dtype: str, op: ReduceOp,
                 divisor: int = 1) -> None:
        self._do_reduce_n(dst, srcs, dtype, op, divisor)

    def wait_flag(self, flag: Flag, value: int, tag: Any = None) -> None:
        _check_local(flag)
        self._do_wait(flag, value, tag)

    def write_flag(self, flag: Flag, value: int) -> None:
        self._do_write(flag, value)

    def record(self) -> Event:
        return _HostEvent(done=True)

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, _HostEvent)
        event.wait(self._device)

    def synchronize(self) -> None:
        pass


class _ThreadStream(_StreamBase):
    """A worker thread that runs operations in order. After an error it skips the rest,
    still completing events, and `synchronize` raises the error."""

    def __init__(self, device: HostDevice):
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
            if fn is _HostEvent.set:
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
        _check_local(flag)
        self._put(self._do_wait, flag, value, tag)

    def write_flag(self, flag: Flag, value: int) -> None:
        self._put(self._do_write, flag, value)

    def record(self) -> _HostEvent:
        event = _HostEvent()
        self._put(_HostEvent.set, event)
        return event

    def wait_event(self, event: Event) -> None:
        assert isinstance(event, _HostEvent)
        self._put(event.wait, self._device)

    def synchronize(self) -> None:
        event = self.record()
        while not event.query():
            event._done.wait(0.05)
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


class HostDevice(Device):
    """NumPy arrays in host memory, shared with peers through /dev/shm.

    `name_prefix` should be unique per job (the launcher removes files that start with it when
    the job ends); `timeout` bounds every flag wait in seconds. Collectives need x86-64 memory
    ordering; `for_collectives=False` allows other machines for plain shared pages.
    """

    kind = "cpu"
    arrays = "NumPy"
    reach = "the host device maps peers' shared memory"
    default_chunk_bytes = 1 << 20
    default_channels = 1
    blocking = True

    def __init__(self, *, name_prefix: str | None = None, timeout: float = 300.0,
                 jitter: bool | None = None, for_collectives: bool = True):
        if for_collectives and platform.machine().lower() not in _TSO_MACHINES:
            raise GpuringError(
                f"the host device needs x86-64 memory ordering; this is a "
                f"{platform.machine()} machine, where its flags could publish data too early")
        self.name_prefix = name_prefix or f"{SHM_PREFIX}{secrets.token_hex(8)}-"
        self.timeout = timeout
        self.jitter = bool(settings.get("GPURING_JITTER")) if jitter is None else jitter
        self._owned: list[HostMemory] = []
        self._opened: dict[str, HostMemory] = {}
        self._streams: list[_ThreadStream] = []
        self._abort_reason: str | None = None
        self._closed = False

    @classmethod
    def _for_rank(cls, control: ControlPlane, timeout: float) -> HostDevice:
        return cls(name_prefix=f"{SHM_PREFIX}{control.job_id}-r{control.rank}-",
                   timeout=timeout)

    # -- memory ---------------------------------------------------------------------------
    def alloc(self, nbytes: int) -> HostMemory:
        path = os.path.join(SHM_DIR, f"{self.name_prefix}{secrets.token_hex(8)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:  # reserve the pages now: a full /dev/shm is an error here, not a SIGBUS later
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise GpuringError(
                    f"cannot reserve {nbytes} bytes of shared memory in {SHM_DIR} ({exc}); "
                    "make it larger (docker: --shm-size) or lower GPURING_BUFFER_BYTES"
                ) from exc
            mapping = mmap.mmap(fd, nbytes)
        except BaseException:
            _unlink_quietly(path)
            raise
        finally:
            os.close(fd)
        mem = HostMemory(np.frombuffer(mapping, np.uint8), mapping=mapping, path=path,
                         owner=True)
        self._owned.append(mem)
        return mem

    def export(self, mem: Memory) -> Any:
        assert isinstance(mem, HostMemory) and mem.path is not None
        return (os.getpid(), mem.path, mem.nbytes)

    def open(self, handle: Any) -> HostMemory:
        _, path, nbytes = handle
        for mem in self._owned:  # our own allocation: use it directly
            if mem.path == path:
                return mem
        if path in self._opened:
            return self._opened[path]
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        mem = HostMemory(np.frombuffer(mapping, np.uint8), mapping=mapping, path=path)
        self._opened[path] = mem
        return mem

    def seal(self, mem: Memory) -> None:
        assert isinstance(mem, HostMemory)
        if mem.owner and mem.path is not None:
            _unlink_quietly(mem.path)

    def wrap(self, array: Any) -> HostArray:
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            raise TypeError("HostDevice wraps C-contiguous NumPy arrays only")
        return HostArray(array if array.ndim == 1 else array.reshape(-1))

    # -- programs -----------------------------------------------------------------------
    def compile(self, program: tuple[Instruction, ...], dtype: str, op: ReduceOp,
                stream: Stream) -> Runner:
        """On an inline stream, bind every buffer view once and run the program as a list of
        small closures; elsewhere, the generic enqueueing."""
        if not isinstance(stream, _InlineStream):
            return super().compile(program, dtype, op, stream)
        steps = [self._step(ins, dtype, op, stream) for ins in program]

        def run(inp: Memory | None, out: Memory | None, seq: int) -> None:
            mems = (inp, out)
            for step in steps:
                step(mems, seq)

        return run

    def _step(self, ins: Instruction, dtype: str, op: ReduceOp,
              stream: _InlineStream) -> Callable[[tuple[Any, Any], int], Any]:
        step = self._bare_step(ins, dtype, op)
        if not self.jitter:
            return step
        jitter = stream._jitter

        def jittered(mems: tuple[Any, Any], seq: int) -> Any:
            jitter()
            return step(mems, seq)

        return jittered

    def _bare_step(self, ins: Instruction, dtype: str,
                   op: ReduceOp) -> Callable[[tuple[Any, Any], int], Any]:
        itemsize = np.dtype(dtype).itemsize

        def view(o: Span | Arg) -> Callable[[tuple[Any, Any]], np.ndarray]:
            """Every span of a collective holds its dtype: input and output arguments are
            sliced in elements (HostArray.flat; the whole of it when the span starts at 0 and
            covers it), buffers viewed once here."""
            if isinstance(o, Arg):
                which, lo, hi = o.which, o.offset // itemsize, (o.offset + o.nbytes) // itemsize

                def argument(mems: tuple[Any, Any]) -> np.ndarray:
                    flat = mems[which].flat
                    return flat if lo == 0 and hi == flat.size else flat[lo:hi]

                return argument
            fixed = o.mem.view(o.offset, o.nbytes, dtype)  # type: ignore[attr-defined]
            return lambda mems: fixed

        if isinstance(ins, CopyI):
            dst, src = view(ins.dst), view(ins.src)

            def copy(mems: tuple[Any, Any], seq: int) -> None:
                np.copyto(dst(mems), src(mems))

            return copy
        if isinstance(ins, ReduceI):
            d, a, b = view(ins.dst), view(ins.a), view(ins.b)
            divisor = ins.divisor
            ufunc = _UFUNCS[op]

            def reduce(mems: tuple[Any, Any], seq: int) -> None:
                if divisor == 1:
                    ufunc(a(mems), b(mems), out=d(mems))
                else:
                    _average_into(d(mems), a(mems), b(mems), divisor)

            return reduce
        if isinstance(ins, ReduceNI):
            return self._fold_step(ins, view(ins.dst), [view(o) for o in ins.srcs], op)
        words = ins.flag.mem.i64  # type: ignore[attr-defined]
        index, rel, shift = ins.flag.offset >> 3, ins.rel, ins.shift
        if isinstance(ins, WaitI):
            flag, tag = ins.flag, ins.tag
            _check_local(flag)

            def wait(mems: tuple[Any, Any], seq: int) -> None:
                value = rel + (seq << shift)
                if words[index] < value:
                    self.wait_flag(flag, value, tag)

            return wait

        def write(mems: tuple[Any, Any], seq: int) -> None:
            words[index] = rel + (seq << shift)

        return write

    @staticmethod
    def _fold_step(ins: ReduceNI, d: Callable[[tuple[Any, Any]], np.ndarray],
                   srcs: list[Callable[[tuple[Any, Any]], np.ndarray]],
                   op: ReduceOp) -> Callable[[tuple[Any, Any], int], None]:
        """The inline step of an n-input reduce (views bound by `_bare_step`)."""
        divisor = ins.divisor

        def reduce_n(mems: tuple[Any, Any], seq: int) -> None:
            _fold_into(d(mems), [src(mems) for src in srcs], op, divisor)

        return reduce_n

    # -- streams and flags ------------------------------------------------------------------
    def create_stream(self, *, inline: bool = False) -> Stream:
        if inline:
            return _InlineStream(self)
        stream = _ThreadStream(self)
        self._streams.append(stream)
        return stream

    def check_aborted(self, tag: Any) -> None:
        if self._abort_reason is not None:
            raise FlagWaitAborted(self._abort_reason, tag)

    def wait_flag(self, flag: Flag, value: int, tag: Any) -> None:
        """Block until the flag reaches value: yield for a short while, then sleep with growing
        backoff; bounded by the timeout and cut short by abort."""
        words = flag.mem.i64  # type: ignore[attr-defined]
        index = flag.offset >> 3
        if words[index] >= value:
            return
        start = time.monotonic()
        deadline = start + self.timeout
        spin_until = start + _SPIN_SECONDS
        delay = 1e-5
        while words[index] < value:
            if self._abort_reason is not None:
                raise FlagWaitAborted(self._abort_reason, tag)
            now = time.monotonic()
            if now < spin_until:
                os.sched_yield()  # lets any other runnable thread on this core go first
                continue
            if now > deadline:
                raise FlagWaitTimeout(flag, value, int(words[index]), tag)
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def abort(self, reason: str) -> None:
        if self._abort_reason is None:
            self._abort_reason = reason

    @property
    def aborted(self) -> str | None:
        return self._abort_reason

    def close(self, *, peers_may_read: bool = False) -> None:
        """Stop the streams and unmap everything. Peers' mappings keep shared memory alive by
        themselves, so `peers_may_read` changes nothing here."""
        if self._closed:
            return
        self._closed = True
        self.abort("the device was closed")  # a stream still waiting on a flag stops now
        for stream in self._streams:
            stream.close()
        for mem in list(self._opened.values()) + self._owned:
            mem.release()
        self._opened.clear()
        self._owned.clear()
