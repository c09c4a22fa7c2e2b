"""The arrays one measurement uses, and gpuring as a system under test."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .data import poison
from .metrics import IN_PLACE, OUT_OF_PLACE
from .timing import Backend

__all__ = ["Buffers", "make_buffers", "Unsupported", "System", "Gpuring"]


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


def make_buffers(kind: str, placement: str, source: np.ndarray, *, rank: int, root: int,
                 n: int, backend: Backend) -> Buffers:
    """Arrays for `kind` in `placement` with this rank's input `source` (host), laid out as
    nccl-tests lays them out."""
    dtype = str(source.dtype)
    in_place = placement == IN_PLACE
    out: Any | None
    if kind == "all_gather":
        out = backend.empty((n, source.size), dtype)
        x = out[rank] if in_place else backend.to_device(source)
    else:
        x = backend.to_device(source)
        if kind == "reduce_scatter":
            out = (x.reshape(n, source.size // n)[rank] if in_place
                   else backend.empty(source.size // n, dtype))
        elif kind == "reduce" and rank != root:
            out = None
        else:  # all_reduce, broadcast, the root of reduce
            out = x if in_place else backend.empty(source.size, dtype)
    buffers = Buffers(x, out, source, backend, placement)
    buffers.reset()
    return buffers


class System:
    """Something that runs collectives: gpuring or a peer."""

    name = "?"

    def placements(self, kind: str) -> tuple[str, ...]:
        """The placements measured for `kind` (every system runs the barrier once)."""
        return (OUT_OF_PLACE,) if kind == "barrier" else (OUT_OF_PLACE, IN_PLACE)

    def operations(self) -> int | None:
        """Driver calls this system has made so far (None: it does not say)."""
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

    def call(self, kind: str, b: Buffers, op: str, root: int) -> Callable[[], object]:
        return self._verb(kind, b, op, root, "")

    def operations(self) -> int | None:
        return int(self.comm.device_operations)

    def overlap(self, kind: str, b: Buffers, op: str,
                root: int) -> Callable[[], Callable[[], object]]:
        start = self._verb(kind, b, op, root, "_async")
        return lambda: start().wait  # type: ignore[attr-defined]

    def _verb(self, kind: str, b: Buffers, op: str, root: int,
              suffix: str) -> Callable[[], Any]:
        comm, t = self.comm, self.tuning
        if kind == "barrier":
            if suffix:
                raise Unsupported("gpuring has no barrier_async")
            return comm.barrier
        verb = getattr(comm, kind + suffix, None)
        if verb is None:
            raise Unsupported(f"unknown collective {kind!r}")
        if kind == "all_gather":
            return lambda: verb(b.x, out=b.out, **t)
        if kind == "broadcast":
            return lambda: verb(b.x, root=root, out=b.out, **t)
        if kind == "reduce":
            return lambda: verb(b.x, op=op, root=root, out=b.out, **t)
        return lambda: verb(b.x, op=op, out=b.out, **t)

    def sync(self) -> None:
        self.comm.barrier()
