"""An element-wise reduction written from the documented arithmetic rules alone (docs/api.md,
kernels/reduce.cu), sharing no code with gpuring: the reference the kernels are checked
against, so a rule broken in both the kernels and the host device still fails.

- integers wrap modulo 2^bits; avg divides the wrapped sum truncating toward zero;
- float16 and bfloat16: the op (then the division) in float32, rounded once to the type;
- float32 and float64: each IEEE operation in the type itself;
- min/max propagate NaN (the first operand's NaN if both are NaN);
- complex: sum part by part; product re = ar*br - ai*bi, im = ar*bi + ai*br with every
  multiply and add rounded on its own (no fused multiply-add); avg divides each part.
"""

from __future__ import annotations

import numpy as np

__all__ = ["pairwise"]


def _integers(a: np.ndarray, b: np.ndarray, op: str, divisor: int) -> np.ndarray:
    bits = a.dtype.itemsize * 8
    signed = a.dtype.kind == "i"

    def wrap(v: int) -> int:
        v &= (1 << bits) - 1
        return v - (1 << bits) if signed and v >= 1 << (bits - 1) else v

    out = []
    for x, y in zip(a.tolist(), b.tolist(), strict=True):
        if op in ("sum", "avg"):
            v = wrap(x + y)
        elif op == "prod":
            v = wrap(x * y)
        else:
            v = min(x, y) if op == "min" else max(x, y)
        if divisor != 1:
            v = abs(v) // divisor * (1 if v >= 0 else -1)
        out.append(v)
    return np.array(out, dtype=a.dtype)


def _reals(a: np.ndarray, b: np.ndarray, op: str, divisor: int) -> np.ndarray:
    work = np.dtype(np.float32) if a.dtype.itemsize == 2 else a.dtype
    x, y = a.astype(work), b.astype(work)
    with np.errstate(all="ignore"):
        if op in ("sum", "avg"):
            r = x + y
        elif op == "prod":
            r = x * y
        else:
            smaller = y < x if op == "min" else x < y
            r = np.where(smaller, y, x)
            r = np.where(np.isnan(y), y, r)
            r = np.where(np.isnan(x), x, r)
        if divisor != 1:
            r = r / work.type(divisor)
    return r.astype(a.dtype)


def _complexes(a: np.ndarray, b: np.ndarray, op: str, divisor: int) -> np.ndarray:
    ar, ai, br, bi = a.real.copy(), a.imag.copy(), b.real.copy(), b.imag.copy()
    with np.errstate(all="ignore"):
        if op == "prod":
            re = (ar * br) - (ai * bi)  # each product a rounded array first: no FMA
            im = (ar * bi) + (ai * br)
        else:
            re, im = ar + br, ai + bi
        if divisor != 1:
            re, im = re / re.dtype.type(divisor), im / im.dtype.type(divisor)
    out = np.empty_like(a)
    out.real, out.imag = re, im
    return out


def pairwise(a: np.ndarray, b: np.ndarray, op: str, divisor: int = 1) -> np.ndarray:
    """op(a, b) element-wise, then divided by `divisor` (avg is "sum" with the divisor)."""
    if a.dtype.kind in "iu":
        return _integers(a, b, op, divisor)
    if a.dtype.kind == "c":
        return _complexes(a, b, op, divisor)
    return _reals(a, b, op, divisor)
