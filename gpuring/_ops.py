"""Reduction operators and the dtypes each one accepts."""

from __future__ import annotations

import enum
from typing import Any

import numpy as np

from ._arrays import array_module

__all__ = ["ReduceOp", "SUPPORTED_DTYPES", "check_op_dtype", "divide_toward_zero", "fold"]

INTEGER_DTYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")  # bfloat16: ml_dtypes
COMPLEX_DTYPES = ("complex64", "complex128")
SUPPORTED_DTYPES = INTEGER_DTYPES + FLOAT_DTYPES + COMPLEX_DTYPES


class ReduceOp(str, enum.Enum):
    """Element-wise reduction applied across ranks."""

    SUM = "sum"
    PROD = "prod"
    MIN = "min"
    MAX = "max"
    AVG = "avg"

    # equal to its value ("sum"), so it hashes like it too (Enum would hash the name, in Python)
    __hash__ = str.__hash__

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        """Accept a member or its name ("sum", "SUM", ...)."""
        try:
            return _BY_NAME[op]
        except (KeyError, TypeError):
            pass
        if isinstance(op, str) and op.lower() in _BY_NAME:
            return _BY_NAME[op.lower()]
        choices = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"unknown reduction op {op!r}; use one of {choices} or a gpuring.ReduceOp")


_BY_NAME: dict[object, ReduceOp] = {**{m.value: m for m in ReduceOp}, **{m: m for m in ReduceOp}}
_VALID = {(op, dtype) for op in ReduceOp for dtype in SUPPORTED_DTYPES
          if not (dtype in COMPLEX_DTYPES and op in (ReduceOp.MIN, ReduceOp.MAX))}


def check_op_dtype(op: ReduceOp, dtype_name: str) -> None:
    """Raise TypeError when `op` is not defined for `dtype_name`."""
    if (op, dtype_name) in _VALID:
        return
    if dtype_name not in SUPPORTED_DTYPES:
        raise TypeError(
            f"dtype {dtype_name} is not supported; use one of {', '.join(SUPPORTED_DTYPES)}"
        )
    if dtype_name in COMPLEX_DTYPES and op in (ReduceOp.MIN, ReduceOp.MAX):
        raise TypeError(f"op {op.value!r} is not defined for {dtype_name}; use sum, prod or avg")


def divide_toward_zero(a: Any, n: int) -> None:
    """Integer `a` //= n in place, rounded toward zero as C's division (the most negative
    value too: no absolute value is taken), NumPy or CuPy arrays."""
    quotient = a // n  # rounded down
    if a.dtype.kind == "i":
        remainder = a - quotient * n  # (may wrap where it is not 0: still not 0)
        quotient += ((remainder != 0) & (a < 0)).astype(a.dtype)
    a[...] = quotient


def fold(arrays: list[Any], op: ReduceOp) -> Any:
    """arrays[0] op arrays[1] op ... in order, each step rounded to the dtype (16-bit floats
    computed in float32), as the engines' folds (NumPy or CuPy arrays)."""
    xp = array_module(arrays[0])
    dtype = arrays[0].dtype
    wide = np.float32 if dtype.name in ("float16", "bfloat16") else dtype
    ufunc = {ReduceOp.SUM: xp.add, ReduceOp.PROD: xp.multiply, ReduceOp.MIN: xp.minimum,
             ReduceOp.MAX: xp.maximum}[op]
    acc = arrays[0].copy()
    for a in arrays[1:]:
        acc = ufunc(acc.astype(wide), a.astype(wide)).astype(dtype)
    return acc
