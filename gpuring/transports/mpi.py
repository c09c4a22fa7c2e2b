"""NumPy collectives carried by MPI: the path between nodes, where peers cannot map each other's
shared memory. Non-blocking MPI calls, polled with backoff, keep every wait bounded.

float16 and bfloat16 have no MPI datatype: they are reduced in float32 and rounded once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._ops import ReduceOp
from ..rendezvous.mpi import MpiControl

__all__ = ["MpiCollectives"]

_NARROW = ("float16", "bfloat16")


class MpiCollectives:
    """The collectives of a Communicator on MPI's own algorithms (same arguments, checked)."""

    def __init__(self, control: MpiControl, timeout: float):
        from mpi4py import MPI

        self._MPI = MPI
        self._control = control
        self._comm = control.comm
        self._timeout = timeout
        self._ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.PROD: MPI.PROD,
                     ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX}

    def _wait(self, request: Any, what: str, *buffers: Any) -> None:
        self._control.wait(request, self._timeout, what, buffers)

    def run(self, name: str, x: np.ndarray, out: np.ndarray | None, op: ReduceOp,
            root: int) -> None:
        """Run collective `name` of C-contiguous `x` into `out` (`out` may be `x`, or for
        all_gather hold x as its rank's slot, or for reduce_scatter be x's block of this
        rank)."""
        size = self._comm.Get_size()
        narrow = x.dtype.name in _NARROW
        if name in ("gather", "scatter", "all_to_all"):  # bytes: narrow floats as uint16
            raw = x.view(np.uint16) if narrow else x
            raw_out = None if out is None else out.view(np.uint16) if narrow else out
            if name == "gather":
                request = self._comm.Igather(raw, raw_out, root=root)
            elif name == "scatter":
                request = self._comm.Iscatter(raw, raw_out, root=root)
            else:
                request = self._comm.Ialltoall(raw, raw_out)
            self._wait(request, name, raw, raw_out)
            return
        if name in ("broadcast", "all_gather"):  # bytes only: narrow floats travel as uint16
            assert out is not None
            raw = x.view(np.uint16) if narrow else x
            raw_out = out.view(np.uint16) if narrow else out
            if name == "broadcast":
                if out is not x and self._comm.Get_rank() == root:
                    out[...] = x
                self._wait(self._comm.Ibcast(raw_out, root=root), name, raw_out)
            else:  # in place (x is out's slot of this rank): MPI reads that slot itself
                source = self._MPI.IN_PLACE if np.may_share_memory(x, out) else raw
                self._wait(self._comm.Iallgather(source, raw_out), name, raw, raw_out)
            return
        if name == "reduce_scatter" and out is not None and np.may_share_memory(x, out):
            x = x.copy()  # in place: out is this rank's block of x, and MPI needs them apart
        send = x.astype(np.float32) if narrow else x
        mpi_op = self._ops[op]
        if name == "reduce" and self._comm.Get_rank() != root:
            self._wait(self._comm.Ireduce(send, None, op=mpi_op, root=root), name, send)
            return
        assert out is not None
        target = np.empty(out.shape, np.float32) if narrow else out
        if name == "all_reduce":
            in_place = not narrow and np.may_share_memory(target, x)
            source = self._MPI.IN_PLACE if in_place else send
            self._wait(self._comm.Iallreduce(source, target, op=mpi_op), name, send, target)
        elif name == "reduce_scatter":
            self._wait(self._comm.Ireduce_scatter_block(send, target, op=mpi_op), name, send,
                       target)
        else:  # reduce, on root
            self._wait(self._comm.Ireduce(send, target, op=mpi_op, root=root), name, send,
                       target)
        if op is ReduceOp.AVG:
            _divide(target, size)
        if narrow:
            out[...] = target

    def barrier(self) -> None:
        self._wait(self._comm.Ibarrier(), "barrier")


def _divide(a: np.ndarray, n: int) -> None:
    """a /= n in place; integers rounded toward zero (as the ring's avg does)."""
    if a.dtype.kind in "fc":
        a /= n
        return
    quotient, remainder = np.divmod(a, a.dtype.type(n))
    if a.dtype.kind == "i":
        quotient += (remainder != 0) & (a < 0)
    a[...] = quotient
