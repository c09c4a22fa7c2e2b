"""Inputs every rank can regenerate, the reference result, and counting wrong elements.

Inputs are random and never zero: integers in [1, 8), floats in [0.5, 1.5) (complex: both
parts). Integers compare exactly (wrap-around is the same in any order); floats within
`tolerance`, which grows with the number of ranks (the reduction order differs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np

__all__ = ["SEED", "make_input", "reference", "expected_for_rank", "tolerance", "count_wrong",
           "poison", "corrupt"]

SEED = 20240611
_CHUNK = 1 << 22


def make_input(rank: int, count: int, dtype: str, *, salt: int = 0) -> np.ndarray:
    """Rank `rank`'s input of `count` elements; the same on every process."""
    rng = np.random.default_rng([SEED, salt, rank, count])
    dt = np.dtype(dtype)
    if _kind(dt) in "iu":
        return rng.integers(1, 8, size=count, dtype=dt)
    if _kind(dt) == "c":
        part = np.float64 if dt.itemsize == 16 else np.float32
        out = np.empty(count, dt)
        out.real = rng.random(count, dtype=part) + 0.5
        out.imag = rng.random(count, dtype=part) + 0.5
        return out
    if dt == np.float64:
        return rng.random(count, dtype=np.float64) + 0.5
    values = rng.random(count, dtype=np.float32) + np.float32(0.5)
    return values.astype(dt, copy=False)


def _kind(dt: np.dtype) -> str:
    """NumPy's kind letter, with ml_dtypes' bfloat16 counted as the float it is."""
    return "f" if dt.name == "bfloat16" else dt.kind


def _wide(dt: np.dtype) -> np.dtype:
    if _kind(dt) == "f":
        return np.dtype(np.float64)
    if _kind(dt) == "c":
        return np.dtype(np.complex128)
    return dt


def reference(op: str, inputs: Iterable[np.ndarray]) -> np.ndarray:
    """The element-wise reduction of `inputs` (rank order) as gpuring defines `op`; inputs
    may be generated one at a time.

    Floats accumulate in double precision; integers in their own type (wrapping), and avg of
    integers truncates toward zero."""
    ufunc = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum,
             "max": np.maximum}[op]
    acc: np.ndarray | None = None
    dt = np.dtype(np.float64)
    n = 0
    for x in inputs:
        n += 1
        if acc is None:
            dt = x.dtype
            acc = x.astype(_wide(dt))
        else:
            ufunc(acc, x, out=acc)
    if acc is None:
        raise ValueError("no inputs")
    if op == "avg" and n > 1:
        if _kind(dt) in "fc":
            acc /= n
        else:
            quotient, remainder = np.divmod(acc, dt.type(n))
            if _kind(dt) == "i":
                quotient += ((remainder != 0) & (acc < 0)).astype(dt)
            acc = quotient
    return acc.astype(dt, copy=False)


def expected_for_rank(kind: str, op: str, make: Callable[[int], np.ndarray], n: int,
                      rank: int, root: int) -> np.ndarray | None:
    """What `rank` must hold after the collective, from `make(r)` = rank r's input; None
    when it receives nothing."""
    ranks = range(n)
    if kind == "all_reduce":
        return reference(op, map(make, ranks))
    if kind == "reduce_scatter":
        full = reference(op, map(make, ranks))
        block = full.size // n
        return full[rank * block:(rank + 1) * block].copy()
    if kind == "all_gather":
        return np.stack([make(r) for r in ranks])
    if kind == "broadcast":
        return make(root)
    if kind == "reduce":
        return reference(op, map(make, ranks)) if rank == root else None
    if kind == "sendrecv":  # from the previous rank
        return make((rank - 1) % n)
    if kind == "pingpong":  # rank 0's, there and back
        return make(0) if rank < 2 else None
    raise ValueError(f"unknown collective {kind!r}")


def tolerance(dtype: str, n: int) -> float:
    """Relative tolerance for a reduction over n ranks (0 for integers: exact)."""
    dt = np.dtype(dtype)
    if _kind(dt) in "iu":
        return 0.0
    eps = 2.0 ** -7 if dt.name == "bfloat16" else float(np.finfo(dt).eps)
    return (8.0 if _kind(dt) == "c" else 4.0) * max(n, 1) * eps


def count_wrong(result: np.ndarray, expected: np.ndarray, rtol: float) -> int:
    """Elements of `result` that differ from `expected` (NaN always counts as wrong)."""
    got = np.asarray(result).reshape(-1)
    want = np.asarray(expected).reshape(-1)
    if got.size != want.size:
        return max(got.size, want.size)
    if rtol == 0.0:
        return int(np.count_nonzero(got != want))
    wide = _wide(want.dtype)
    wrong = 0
    for start in range(0, want.size, _CHUNK):
        g = got[start:start + _CHUNK].astype(wide)
        w = want[start:start + _CHUNK].astype(wide)
        ok = np.abs(g - w) <= rtol * np.abs(w)
        wrong += int(ok.size - np.count_nonzero(ok))
    return wrong


def poison(array: object) -> None:
    """Fill an output with values no correct result has (NaN, or the type's maximum)."""
    dt = np.dtype(array.dtype)  # type: ignore[attr-defined]
    value = np.nan if _kind(dt) in "fc" else np.iinfo(dt).max  # type: ignore[type-var]
    array.fill(value)  # type: ignore[attr-defined]


def corrupt(array: object) -> None:
    """Spoil one element (the testing hook GPURING_BENCH_CORRUPT=1 uses it)."""
    flat = array.reshape(-1)  # type: ignore[attr-defined]
    flat[0] = flat[0] + 1 if _kind(np.dtype(flat.dtype)) in "iu" else flat[0] * 2 + 1
