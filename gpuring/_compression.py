"""Compressed all_reduce: float32/float64 cast to fp16 or bf16 for the ring, back after.

Half the bytes (a quarter from float64) cross the ring, at a price in accuracy. With u the
unit roundoff of the wire format (2^-11 for fp16, 2^-8 for bf16) and n ranks, each element's
error is at most about n·u·Σ|x_r| (each rank's value is rounded once, each of the n-1 partial
sums once), i.e. a relative error of about n·u when the values do not cancel. fp16 also
overflows to inf above 65504, keeps fewer digits below 6.1e-5 and rounds values below
about 3e-8 to zero; bf16 has float32's range.
`avg` sums in the wire format and divides after casting back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from . import _arrays
from ._ops import ReduceOp

if TYPE_CHECKING:
    from ._protocols import Collectives

__all__ = ["COMPRESSIONS", "wire_dtype", "unit_roundoff", "all_reduce_compressed"]

COMPRESSIONS = ("fp16", "bf16")
_ROUNDOFF = {"fp16": 2.0 ** -11, "bf16": 2.0 ** -8}


def wire_dtype(compression: str) -> Any:
    """The dtype sent through the ring for `compression` ("fp16" or "bf16")."""
    if compression == "fp16":
        return np.dtype(np.float16)
    if compression == "bf16":
        try:
            import ml_dtypes
        except ImportError:
            raise ImportError("compression='bf16' on the CPU needs ml_dtypes: "
                              "pip install ml_dtypes") from None
        return np.dtype(ml_dtypes.bfloat16)
    raise ValueError(f"unknown compression {compression!r}; use one of "
                     f"{', '.join(map(repr, COMPRESSIONS))} or None")


def unit_roundoff(compression: str) -> float:
    """u of the wire format: 2^-11 for fp16, 2^-8 for bf16."""
    wire_dtype(compression)
    return _ROUNDOFF[compression]


def all_reduce_compressed(comm: Collectives, x: Any, *, op: ReduceOp, out: Any,
                          compression: str, chunk_bytes: int | None,
                          channels: int | None, algorithm: str | None = None) -> Any:
    """all_reduce of float32/float64 `x` (C-contiguous) into `out` (checked by the caller:
    `x`'s shape and dtype) through the `compression` wire format, on the schedule
    `algorithm` (None: the communicator's)."""
    dtype = _arrays.dtype_name(x)
    if dtype not in ("float32", "float64"):
        raise TypeError(f"compression={compression!r} applies to float32 and float64 arrays, "
                        f"got {dtype}; call all_reduce without compression")
    wire = wire_dtype(compression)  # bf16 on CUDA: CuPy >= 14 with ml_dtypes
    ring_op = ReduceOp.SUM if op is ReduceOp.AVG else op
    low = x.astype(wire)
    comm.all_reduce(low, op=ring_op, out=low, chunk_bytes=chunk_bytes, channels=channels,
                    algorithm=algorithm)
    out[...] = low
    if op is ReduceOp.AVG:
        out /= comm.size
    return out
