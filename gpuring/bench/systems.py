"""The arrays one measurement uses, and gpuring as a system under test."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .data import poison
from .metrics import IN_PLACE, MESSAGES, OUT_OF_PLACE, REDUCING, STEADY
from .timing import Backend

__all__ = ["Buffers", "Arena", "make_buffers", "Unsupported", "System", "Gpuring",
           "GpuringPersistent"]


class Unsupported(Exception):
    """A system cannot run this collective, op or dtype; the message says why."""


@dataclass
class Buffers:
    """Input `x` and output `out` of one rank in one placement (in place: `out is x`, or
    for all_gather `x` is out's slot of this rank, for reduce_scatter `out` is x's block of
    this rank; None: nothing arrives here)."""

    x: Any
    out: Any | None
    source: np.ndarray
    backend: Backend
    placement: str = OUT_OF_PLACE

    def reset(self) -> None:
        """Poison the output, then restore the input (in place, the input's part of the
        output is the input again), before a checked call."""
        if self.out is not None and self.out is not self.x:
            poison(self.out)
        self.backend.fill(self.x, self.source)

    def steady(self, kind: str, op: str) -> None:
        """Before untimed and timed calls (not checked ones): in place, a sum or a product
        reduces its own last result again at every call, so the values grow (or shrink)
        without bound: a 2-rank float32 sum overflows after about 130 calls, a product
        reaches subnormals, which some processors compute far more slowly. Those calls work
        on the op's fixed point instead (`STEADY`: zeros for sum, ones for prod), which every
        call keeps: the same arrays, bytes and arithmetic, with values that stay finite. A
        checked call restores the input first (`reset`)."""
        value = STEADY.get(op)
        if value is not None and self.placement == IN_PLACE and kind in REDUCING:
            self.x.fill(value)


class Arena:
    """Registered memory (`Communicator.empty`, made once by every rank) that a
    measurement's arrays are carved from (-R 1): `rewind` before making a measurement's
    arrays, each rank in step, so every rank's arrays lie at the same offsets."""

    ALIGN = 256

    def __init__(self, comm: Any, nbytes: int, device: str):
        self.block = comm.empty(nbytes, "uint8", device=device)
        self.used = 0

    def rewind(self) -> None:
        self.used = 0

    def take(self, shape: int | tuple[int, ...], dtype: str) -> Any:
        dims = (shape,) if isinstance(shape, int) else shape
        nbytes = int(np.prod(dims, dtype=np.int64)) * np.dtype(dtype).itemsize
        start = -(-self.used // self.ALIGN) * self.ALIGN
        if start + nbytes > self.block.nbytes:
            raise ValueError(f"the registered arena of {self.block.nbytes} bytes is full")
        self.used = start + nbytes
        return self.block[start:start + nbytes].view(dtype).reshape(dims)

    @staticmethod
    def bytes_for(size: int, sets: int) -> int:
        """Enough for `sets` buffer sets of a collective of `size` bytes (input and output:
        at most twice the size; all_gather's input is one rank's block)."""
        return sets * (2 * size + 2 * Arena.ALIGN)


def make_buffers(kind: str, placement: str, source: np.ndarray, *, rank: int, root: int,
                 n: int, backend: Backend, arena: Arena | None = None) -> Buffers:
    """Arrays for `kind` in `placement` with this rank's input `source` (host), laid out as
    nccl-tests lays them out; from `arena` (registered memory) where given."""
    dtype = str(source.dtype)
    in_place = placement == IN_PLACE
    empty = arena.take if arena is not None else backend.empty

    def to_device(host: np.ndarray) -> Any:
        if arena is None:
            return backend.to_device(host)
        array = arena.take(host.shape, dtype)
        backend.fill(array, host)
        return array

    out: Any | None
    if kind in MESSAGES:  # ranks beyond 1 take no part in a ping-pong
        x = to_device(source)
        out = None if kind == "pingpong" and rank > 1 else empty(source.size, dtype)
    elif kind == "all_gather":
        out = empty((n, source.size), dtype)
        x = out[rank] if in_place else to_device(source)
    else:
        x = to_device(source)
        if kind == "reduce_scatter":
            out = (x.reshape(n, source.size // n)[rank] if in_place
                   else empty(source.size // n, dtype))
        elif kind == "reduce" and rank != root:
            out = None
        else:  # all_reduce, broadcast, the root of reduce
            out = x if in_place else empty(source.size, dtype)
    buffers = Buffers(x, out, source, backend, placement)
    buffers.reset()
    return buffers


class System:
    """Something that runs collectives: gpuring or a peer."""

    name = "?"

    def placements(self, kind: str) -> tuple[str, ...]:
        """The placements measured for `kind` (every system runs the barrier and the
        messages once)."""
        return (OUT_OF_PLACE,) if kind == "barrier" or kind in MESSAGES else (
            OUT_OF_PLACE, IN_PLACE)

    def operations(self) -> int | None:
        """Driver calls this system has made so far (None: it does not say)."""
        return None

    def schedule(self) -> str | None:
        """What its last call ran, in words (None: it does not say)."""
        return None

    def overlap(self, kind: str, b: Buffers, op: str,
                root: int) -> Callable[[], Callable[[], object]]:
        """The collective started without waiting: calling the result starts it and returns
        what waits for it (for --overlap); Unsupported where the system has no such form."""
        raise Unsupported("no non-blocking form measured")

    def call(self, kind: str, b: Buffers, op: str, root: int) -> Callable[[], object]:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class Gpuring(System):
    name = "gpuring"

    def __init__(self, comm: Any, chunk_bytes: int | None, channels: int | None):
        self.comm = comm
        self.tuning = {"chunk_bytes": chunk_bytes, "channels": channels}
        self._messages = False  #: the last call made was of messages

    def call(self, kind: str, b: Buffers, op: str, root: int) -> Callable[[], object]:
        self._messages = kind in MESSAGES
        return self._verb(kind, b, op, root, "")

    def operations(self) -> int | None:
        return int(self.comm.device_operations)

    def schedule(self) -> str | None:
        return "messages" if self._messages else str(self.comm.last_schedule)

    def overlap(self, kind: str, b: Buffers, op: str,
                root: int) -> Callable[[], Callable[[], object]]:
        start = self._verb(kind, b, op, root, "_async")
        return lambda: start().wait  # type: ignore[attr-defined]

    def _verb(self, kind: str, b: Buffers, op: str, root: int,
              suffix: str) -> Callable[[], Any]:
        """The call of `kind` + `suffix` (the verb, its `_async` twin or its `_init` form)
        on these buffers, ready to call (for `_init`, called once here: what it made)."""
        comm, t = self.comm, self.tuning
        if kind in MESSAGES:
            if suffix:
                raise Unsupported(f"messages are measured without {suffix} forms")
            return message_call(kind, b, comm.rank, comm.size, comm.send, comm.recv,
                                comm.sendrecv)
        if kind == "barrier":
            if suffix == "_async":
                raise Unsupported("gpuring has no barrier_async")
            return comm.barrier_init() if suffix == "_init" else comm.barrier
        verb = getattr(comm, kind + suffix, None)
        if verb is None:
            raise Unsupported(f"unknown collective {kind!r}")
        if kind == "all_gather":
            args: dict[str, Any] = {"out": b.out}
        elif kind == "broadcast":
            args = {"root": root, "out": b.out}
        elif kind == "reduce":
            args = {"op": op, "root": root, "out": b.out}
        else:
            args = {"op": op, "out": b.out}
        if suffix == "_init":
            made: Callable[[], Any] = verb(b.x, **args, **t)
            return made
        return lambda: verb(b.x, **args, **t)

    def sync(self) -> None:
        self.comm.barrier()


def message_call(kind: str, b: Buffers, rank: int, n: int, send: Callable[..., Any],
                 recv: Callable[..., Any], sendrecv: Callable[..., Any]) -> Callable[[], Any]:
    """One call of a message benchmark with these verbs (`send(x, dst)`, `recv(out, src)`,
    `sendrecv(x, dst, out, src)`): sendrecv, each rank to the next and from the previous; a
    ping-pong, rank 0 sending `x` to rank 1 and receiving it back, the others idle."""
    if kind == "sendrecv":
        right, left = (rank + 1) % n, (rank - 1) % n
        return lambda: sendrecv(b.x, right, b.out, left)
    if n < 2:
        raise Unsupported("a ping-pong needs 2 ranks")
    if rank == 0:
        def ping() -> None:
            send(b.x, 1)
            recv(b.out, 1)

        return ping
    if rank == 1:
        def pong() -> None:
            recv(b.out, 0)
            send(b.out, 0)

        return pong
    return lambda: None


class GpuringPersistent(Gpuring):
    """gpuring's persistent form (`-P`): each measurement makes its collective once on its
    arrays (`comm.all_reduce_init` and its twins: checked and agreed on there) and times
    `op()`, a start and a wait, per call."""

    name = "persist"

    def call(self, kind: str, b: Buffers, op: str, root: int) -> Callable[[], object]:
        return self._verb(kind, b, op, root, "_init")

    def overlap(self, kind: str, b: Buffers, op: str,
                root: int) -> Callable[[], Callable[[], object]]:
        raise Unsupported("the persistent form is measured without --overlap")
