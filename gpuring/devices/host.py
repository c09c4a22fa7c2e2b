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

import contextlib
import mmap
import os
import platform
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import _cma, settings
from .._errors import GpuringError
from .._ops import ReduceOp
from . import _host_attach
from ._host_memory import AttachedMemory, HostArray, HostMemory, check_local, unlink_quietly
from ._host_streams import UFUNCS, InlineStream, ThreadStream, average_into, fold_into
from ._program import CopyI, Instruction, ReduceI, ReduceNI, Runner, WaitI
from ._streams import Arg, Flag, FlagWaitAborted, FlagWaitTimeout, Memory, Span, Stream
from .base import Capabilities, Device

if TYPE_CHECKING:
    from ..rendezvous.base import ControlPlane

__all__ = ["HostDevice", "HostMemory", "SHM_DIR", "SHM_PREFIX"]

SHM_DIR = "/dev/shm"
#: machines whose stores become visible to other cores in program order (TSO)
_TSO_MACHINES = ("x86_64", "amd64", "i686", "i386")
#: how long a flag wait yields before it starts to sleep (sleeping costs ~50 us of latency)
_SPIN_SECONDS = 2e-4
SHM_PREFIX = "gpuring-"


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
        self._streams: list[ThreadStream] = []
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
        with contextlib.ExitStack() as undo:
            undo.callback(os.close, fd)  # (always: the mapping outlives the descriptor)
            undo.callback(unlink_quietly, path)  # (only if the mapping is not made)
            try:  # reserve the pages now: a full /dev/shm is an error here, not a SIGBUS later
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as exc:
                raise GpuringError(
                    f"cannot reserve {nbytes} bytes of shared memory in {SHM_DIR} ({exc}); "
                    "make it larger (docker: --shm-size) or lower GPURING_BUFFER_BYTES"
                ) from exc
            mapping = mmap.mmap(fd, nbytes)
            undo.pop_all()
        os.close(fd)
        mem = HostMemory(np.frombuffer(mapping, np.uint8), mapping=mapping, path=path,
                         owner=True)
        self._owned.append(mem)
        return mem

    def export(self, mem: Memory) -> Any:
        """(this process, the file, its size, what a peer reads to find out whether it may
        reach this process's memory by cross-memory attach: `_cma.Probe`)."""
        assert isinstance(mem, HostMemory) and mem.path is not None
        return (os.getpid(), mem.path, mem.nbytes, tuple(_cma.probe()))

    def open(self, handle: Any) -> HostMemory:
        path, nbytes = handle[1], handle[2]
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

    def capabilities(self, handles: Any) -> Capabilities:
        """The defaults, and whether this process may read and write every peer's memory by
        cross-memory attach (probed here, once per peer)."""
        refused = None
        for handle in handles:
            if handle[0] == os.getpid() or refused is not None:
                continue  # (this rank's own)
            why = _cma.refusal(_cma.Probe(*handle[3]), writes=True)
            if why is not None:
                refused = f"{why} (process {handle[0]})"
        return Capabilities(attach=True, attach_refused=refused)

    def attach(self, peer: int, handle: Any, mapped: Memory, word: int,
               nbytes: int) -> AttachedMemory:
        """Peer `peer`'s array of `nbytes` (its export `handle`, its buffer `mapped` here),
        which it publishes at every call as the address in the word at byte `word` of that
        buffer."""
        assert isinstance(mapped, HostMemory) and mapped.i64 is not None
        return AttachedMemory(peer, int(handle[0]), mapped.i64, word >> 3, nbytes)

    def address(self, mem: Memory) -> int:
        """Where a wrapped array (`wrap`) starts in this process."""
        assert isinstance(mem, HostArray)
        return int(mem.flat.ctypes.data)

    def seal(self, mem: Memory) -> None:
        assert isinstance(mem, HostMemory)
        if mem.owner and mem.path is not None:
            unlink_quietly(mem.path)

    def array(self, mem: Memory, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        assert isinstance(mem, HostMemory) and mem.mapping is not None
        count = int(np.prod(shape, dtype=np.int64))
        # a view of the mapping: it stays mapped while the array lives (see HostMemory.release)
        return np.frombuffer(mem.mapping, dtype=dtype, count=count).reshape(shape)

    def wrap(self, array: Any) -> HostArray:
        if not isinstance(array, np.ndarray) or not array.flags.c_contiguous:
            raise TypeError("HostDevice wraps C-contiguous NumPy arrays only")
        return HostArray(array if array.ndim == 1 else array.reshape(-1))

    # -- programs -----------------------------------------------------------------------
    def compile(self, program: tuple[Instruction, ...], dtype: str, op: ReduceOp,
                stream: Stream) -> Runner:
        """On an inline stream, bind every buffer view once and run the program as a list of
        small closures; elsewhere, the generic enqueueing."""
        if not isinstance(stream, InlineStream):
            return super().compile(program, dtype, op, stream)
        steps = [self._step(ins, dtype, op, stream) for ins in program]

        def run(inp: Memory | None, out: Memory | None, seq: int) -> None:
            mems = (inp, out)
            for step in steps:
                step(mems, seq)

        return run

    def _step(self, ins: Instruction, dtype: str, op: ReduceOp,
              stream: InlineStream) -> Callable[[tuple[Any, Any], int], Any]:
        step = self._bare_step(ins, dtype, op, stream)
        if not self.jitter:
            return step
        jitter = stream.jitter

        def jittered(mems: tuple[Any, Any], seq: int) -> Any:
            jitter()
            return step(mems, seq)

        return jittered

    def _bare_step(self, ins: Instruction, dtype: str, op: ReduceOp,
                   stream: InlineStream) -> Callable[[tuple[Any, Any], int], Any]:
        itemsize = np.dtype(dtype).itemsize

        def view(o: Span | Arg, slot: int = 0) -> Callable[[tuple[Any, Any]], np.ndarray]:
            """Every span of a collective holds its dtype: input and output arguments are
            sliced in elements (HostArray.flat; the whole of it when the span starts at 0 and
            covers it), buffers viewed once here; a peer's array that only cross-memory
            attach reaches is read into the stream's scratch `slot` at each run."""
            if _host_attach.attached(o):
                assert isinstance(o, Span)
                scratch = stream.scratch(slot, o.nbytes)
                typed = scratch.view(dtype)

                def read(mems: tuple[Any, Any]) -> np.ndarray:
                    _host_attach.read(o, scratch)
                    return typed

                return read
            if isinstance(o, Arg):
                which, lo, hi = o.which, o.offset // itemsize, (o.offset + o.nbytes) // itemsize

                def argument(mems: tuple[Any, Any]) -> np.ndarray:
                    flat = mems[which].flat
                    return flat if lo == 0 and hi == flat.size else flat[lo:hi]

                return argument
            fixed = o.mem.view(o.offset, o.nbytes, dtype)  # type: ignore[attr-defined]
            return lambda mems: fixed

        if isinstance(ins, CopyI) and _host_attach.attached(ins.dst):
            into, local = ins.dst, view(ins.src)
            assert isinstance(into, Span)

            def send(mems: tuple[Any, Any], seq: int) -> None:
                _host_attach.write(into, local(mems))

            return send
        if isinstance(ins, CopyI) and _host_attach.attached(ins.src):
            source, target = ins.src, view(ins.dst)
            assert isinstance(source, Span)

            def fetch(mems: tuple[Any, Any], seq: int) -> None:
                _host_attach.read(source, target(mems))

            return fetch
        if isinstance(ins, CopyI):
            dst, src = view(ins.dst), view(ins.src)

            def copy(mems: tuple[Any, Any], seq: int) -> None:
                np.copyto(dst(mems), src(mems))

            return copy
        if isinstance(ins, ReduceI):
            d, a, b = view(ins.dst), view(ins.a, 0), view(ins.b, 1)
            divisor = ins.divisor
            ufunc = UFUNCS[op]

            def reduce(mems: tuple[Any, Any], seq: int) -> None:
                if divisor == 1:
                    ufunc(a(mems), b(mems), out=d(mems))
                else:
                    average_into(d(mems), a(mems), b(mems), divisor)

            return reduce
        if isinstance(ins, ReduceNI):
            return self._fold_step(ins, view(ins.dst),
                                   [view(o, k) for k, o in enumerate(ins.srcs)], op)
        words = ins.flag.mem.i64  # type: ignore[attr-defined]
        index, rel, shift = ins.flag.offset >> 3, ins.rel, ins.shift
        if isinstance(ins, WaitI):
            flag, tag = ins.flag, ins.tag
            check_local(flag)

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
            fold_into(d(mems), [src(mems) for src in srcs], op, divisor)

        return reduce_n

    # -- streams and flags ------------------------------------------------------------------
    def create_stream(self, *, inline: bool = False) -> Stream:
        if inline:
            return InlineStream(self)
        stream = ThreadStream(self)
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
