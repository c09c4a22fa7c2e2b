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

import dataclasses
from typing import Any

import numpy as np

__all__ = ["Reduction", "first_wrong", "node_major_fold", "pairwise", "rank_order_fold",
           "reduction", "rounding_bound"]


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


# ------------------------------------------------------------------ results of n ranks
# What the multi-process tests hold each rank's result to. Two kinds of reference:
# - `reduction`: the exact value of a reduction of every rank's array (integers exactly,
#   floats in float64/complex128) with the error allowed on each element by the rounding
#   model (`rounding_bound`), for schedules whose order of operations is not fixed (a ring's
#   chain starts on each rank's own block, MPI folds in a tree);
# - `rank_order_fold` (and `node_major_fold` across nodes): the bits of a fold in rank order,
#   each step one `pairwise` operation, for the schedules that promise them (deterministic
#   mode, the one-shot and two-shot schedules, registered memory, a GPU's one operation).

#: unit roundoff of each float dtype (of the real parts for complex)
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24,
                 "float64": 2.0 ** -53, "complex64": 2.0 ** -24, "complex128": 2.0 ** -53}
#: spacing of the subnormals: the most one rounding can lose near zero, whatever the value
SUBNORMAL = {"float16": 2.0 ** -24, "bfloat16": 2.0 ** -133, "float32": 2.0 ** -149,
             "float64": 2.0 ** -1074, "complex64": 2.0 ** -149, "complex128": 2.0 ** -1074}


@dataclasses.dataclass(frozen=True)
class Reduction:
    """The exact result of a reduction (`value`, float64/complex128 for floats), the error
    allowed on each element (`bound`; zeros where the result is exact) and the result's
    dtype."""

    value: np.ndarray
    bound: np.ndarray
    dtype: np.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape

    def reshape(self, *shape: int) -> Reduction:
        return Reduction(self.value.reshape(*shape), self.bound.reshape(*shape), self.dtype)

    def __getitem__(self, key: Any) -> Reduction:
        return Reduction(self.value[key], self.bound[key], self.dtype)


def rounding_bound(arrays: list[np.ndarray], op: str) -> np.ndarray:
    """Per element, the most by which a float reduction of `arrays` (one per rank) may differ
    from `reduction`'s value, from the rounding model: every step rounds once, with unit
    roundoff u (float16 and bfloat16: reduced in float32, then rounded to 16 bits, so u is
    that of both roundings together), in whatever order the algorithm takes (a ring's chain,
    the one-shot's rank order, MPI's tree). n ranks take n-1 steps.

    - sum: step k rounds a partial sum of k+1 of the ranks' values, at most the sum of the k+1
      largest |x_r| (M_{k+1}); rounding errors grow the partials by at most (1+u)^n. So the
      error is at most u·(1+u)^n·(M_2 + ... + M_n).
    - avg: that sum's error over n, plus two more roundings of the quotient (the division, and
      the cast to 16 bits; or the reciprocal and the product): 2·u·(1+u)^n·M_n/n.
    - prod: each step multiplies the result by at most (1+c·u) (c = 1; complex: c = sqrt(5),
      the bound of a complex product): ((1+c·u)^(n-1) - 1)·prod|x_r|.
    - min, max: no rounding at all, 0.

    Values that reach the subnormals lose up to the subnormal spacing per rounding, absolutely.
    The reference, computed in float64 in rank order, has an error of its own, bounded the
    same way with float64's u; both are added."""
    dtype = arrays[0].dtype
    n = len(arrays)
    bound = np.zeros(arrays[0].shape)
    if op in ("min", "max") or dtype.kind in "iu" or bound.size == 0:
        return bound
    u = UNIT_ROUNDOFF[dtype.name]
    if dtype.name in ("float16", "bfloat16"):
        u = (1 + u) * (1 + UNIT_ROUNDOFF["float32"]) - 1
    c = np.sqrt(5.0) if dtype.kind == "c" else 1.0
    flat = [a.reshape(-1) for a in arrays]
    out = bound.reshape(-1)
    for lo in range(0, out.size, 1 << 20):  # in pieces: a 64 MiB result needs no more memory
        mags = np.stack([np.abs(a[lo:lo + (1 << 20)].astype(
            np.complex128 if dtype.kind == "c" else np.float64)) for a in flat])
        piece = out[lo:lo + mags.shape[1]]
        for step_u in (u, UNIT_ROUNDOFF["float64"]):  # the library's, then the reference's
            grow = (1 + step_u) ** n
            if op == "prod":
                growth = np.expm1((n - 1) * np.log1p(c * step_u))  # (1+c·u)^(n-1) - 1
                piece += growth * np.prod(mags, axis=0)
                continue
            mags.sort(axis=0)  # ascending: M_j sums the last j rows
            largest = np.cumsum(mags[::-1], axis=0)
            partials = largest[1:].sum(axis=0)  # M_2 + ... + M_n
            if op == "avg":
                piece += step_u * grow * (partials + 2 * largest[-1]) / n
            else:
                piece += step_u * grow * partials
        spread = np.maximum(mags.max(axis=0), 1.0) ** n if op == "prod" else 1.0
        piece += (n + 1) * SUBNORMAL[dtype.name] * spread
    return bound


def reduction(arrays: list[np.ndarray], op: str) -> Reduction:
    """The reduction of every rank's array (list indexed by rank): its exact value for
    integers (wrapped to the dtype; avg divides the wrapped sum, truncating toward zero), and
    for floats its float64/complex128 value with the error the library may make on each
    element (`rounding_bound`)."""
    dtype = arrays[0].dtype
    exact = dtype.kind in "iu"
    wide = [a if exact else a.astype(np.complex128 if dtype.kind == "c" else np.float64)
            for a in arrays]
    acc = wide[0].copy()
    with np.errstate(over="ignore"):
        for a in wide[1:]:
            if op in ("sum", "avg"):
                acc = acc + a
            elif op == "prod":
                acc = acc * a
            elif op == "min":
                acc = np.minimum(acc, a)
            else:
                acc = np.maximum(acc, a)
    if op == "avg":
        n = len(arrays)
        if exact:
            q = np.abs(acc.astype(np.int64) if dtype.kind == "i" else acc) // n
            acc = (np.sign(acc) * q).astype(dtype) if dtype.kind == "i" else q.astype(dtype)
        else:
            acc = acc / n
    if exact:
        return Reduction(acc.astype(dtype), np.zeros(acc.shape), dtype)
    return Reduction(acc, rounding_bound(arrays, op), dtype)


def rank_order_fold(arrays: list[np.ndarray], op: str) -> np.ndarray:
    """arrays[0] op arrays[1] op ... in rank order, each step one `pairwise` operation (16-bit
    floats computed in float32, rounded once), avg a sum whose last step divides by the
    number of ranks: the bits of deterministic mode and of the schedules that fold in rank
    order."""
    step = "sum" if op == "avg" else op
    fold = arrays[0].copy()
    for k, a in enumerate(arrays[1:], 2):
        if op in ("min", "max") and a.dtype.kind in "iu":  # exact: NumPy's, for speed
            fold = np.minimum(fold, a) if op == "min" else np.maximum(fold, a)
            continue
        last = k == len(arrays)
        fold = pairwise(fold, a, step, len(arrays) if op == "avg" and last else 1)
    return fold


def node_major_fold(arrays: list[np.ndarray], op: str, nodes: list[str]) -> np.ndarray:
    """The bits of deterministic mode across nodes (`nodes[r]`: rank r's node): each node's
    ranks folded in rank order, those folds in the order the nodes first appear, avg dividing
    the whole sum once at the end (16-bit floats: in float32, rounded once)."""
    order = list(dict.fromkeys(nodes))
    step = "sum" if op == "avg" else op
    per_node = [rank_order_fold([a for a, node in zip(arrays, nodes, strict=True)
                                 if node == name], step) for name in order]
    folded = rank_order_fold(per_node, step)
    if op != "avg":
        return folded
    if folded.dtype.itemsize == 2:  # float16, bfloat16: divided in float32, rounded once
        return (folded.astype(np.float32) / np.float32(len(nodes))).astype(folded.dtype)
    return folded / folded.dtype.type(len(nodes))


def first_wrong(got: np.ndarray, want: np.ndarray | Reduction) -> str | None:
    """None if `got` is what it must be, else what is wrong: the shape, the dtype, or how
    many elements are wrong and the first of them (its index, its value, the value expected).
    `want`: a Reduction (within its per-element bound: exactly for integers, min and max),
    or an array (bit for bit; NaNs equal where both hold one)."""
    if got.shape != want.shape:
        return f"shape {got.shape}, expected {want.shape}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype}"
    if isinstance(want, Reduction):
        if got.dtype.kind in "iu":
            bad = got != want.value
            extra = ""
        else:
            with np.errstate(invalid="ignore", over="ignore"):
                err = np.abs(got.astype(want.value.dtype) - want.value)
                bad = ~(err <= want.bound)  # NaN too
            extra = ""
            if bad.any():
                at = tuple(np.argwhere(bad)[0])
                extra = f" (error {err[at]:.3g} > bound {want.bound[at]:.3g})"
        expected = want.value
    else:  # bit for bit
        expected, extra = np.asarray(want), ""
        width = got.dtype.itemsize
        mine = np.ascontiguousarray(got).reshape(-1).view(np.uint8).reshape(-1, width)
        theirs = np.ascontiguousarray(expected).reshape(-1).view(np.uint8).reshape(-1, width)
        bad = (mine != theirs).any(axis=1).reshape(got.shape)
    if not bad.any():
        return None
    at = tuple(int(i) for i in np.argwhere(bad)[0])
    return (f"{int(bad.sum())} of {got.size} elements wrong, the first at index "
            f"{list(at)}: got {_shown(got[at])}, expected {_shown(expected[at])}{extra}")


def _shown(x: Any) -> str:
    """An element as Python writes its value (NumPy's scalar types say their type too)."""
    try:
        return repr(x.item())
    except (AttributeError, ValueError, TypeError):
        return repr(x)
