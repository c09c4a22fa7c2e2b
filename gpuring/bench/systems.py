"""The arrays one measurement uses, and gpuring as a system under test."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .data import poison
from .metrics import IN_PLACE
from .timing import Backend

__all__ = ["Buffers", "make_buffers", "Unsupported", "System", "Gpuring"]


class Unsupported(Exception):
    """A system cannot run this collective, op or dtype; the message says why."""


@dataclass
class Buffers:
    """Input `x` and output `out` of one rank (`out is x` in place; None: nothing arrives)."""

    x: Any
    out: Any | None
    source: np.ndarray
    backend: Backend

    def reset(self) -> None:
        """Restore the input and poison a separate output, before a checked call."""
        self.backend.fill(self.x, self.source)
        if self.out is not None and self.out is not self.x:
            poison(self.out)


def make_buffers(kind: str, placement: str, source: np.ndarray, *, rank: int, root: int,
                 n: int, backend: Backend) -> Buffers:
    """Arrays for `kind` with this rank's input `source` (host)."""
    x = backend.to_device(source)
    dtype = str(source.dtype)
    out: Any | None
    if placement == IN_PLACE:
        out = x if kind != "reduce" or rank == root else None
    elif kind == "all_reduce":
        out = backend.empty(source.size, dtype)
    elif kind == "reduce_scatter":
        out = backend.empty(source.size // n, dtype)
    elif kind == "all_gather":
        out = backend.empty((n, source.size), dtype)
    elif kind == "reduce":
        out = backend.empty(source.size, dtype) if rank == root else None
    else:
        raise Unsupported(f"{kind} has no out-of-place form")
    buffers = Buffers(x, out, source, backend)
    buffers.reset()
    return buffers


class System:
    """Something that runs collectives: gpuring or a peer."""

    name = "?"

    def placement(self, kind: str) -> str | None:
        """The placement measured for `kind` (None: use gpuring's)."""
        return None

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
        comm, t = self.comm, self.tuning
        if kind == "all_reduce":
            return lambda: comm.all_reduce(b.x, op=op, out=b.out, **t)
        if kind == "reduce_scatter":
            return lambda: comm.reduce_scatter(b.x, op=op, out=b.out, **t)
        if kind == "all_gather":
            return lambda: comm.all_gather(b.x, out=b.out, **t)
        if kind == "broadcast":
            return lambda: comm.broadcast(b.x, root=root, **t)
        if kind == "reduce":
            return lambda: comm.reduce(b.x, op=op, root=root, out=b.out, **t)
        raise Unsupported(f"unknown collective {kind!r}")

    def sync(self) -> None:
        self.comm.barrier()
