"""The rounding bound the multi-process tests hold float results to (tests/reference.py,
`rounding_bound`): it holds for reductions in any order (chains from any rank, trees), and it
is tight enough that a 3 % bias in a 16-bit average, or a float32 result off by a few hundred
ulps, breaks it."""

from __future__ import annotations

import itertools

import ml_dtypes
import numpy as np
import pytest

from tests.reference import reduction, rounding_bound

FLOATS = ["float16", "bfloat16", "float32", "float64", "complex64", "complex128"]


def _dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _step(a: np.ndarray, b: np.ndarray, op: str, divisor: int = 1) -> np.ndarray:
    """One reduction step as the library takes it: 16-bit floats in float32, rounded once."""
    dtype = a.dtype
    if dtype.name in ("float16", "bfloat16"):
        a, b = a.astype(np.float32), b.astype(np.float32)
    r = a * b if op == "prod" else a + b
    if divisor != 1:
        r = r / r.real.dtype.type(divisor)
    return np.asarray(r).astype(dtype)


def _chain(arrays: list[np.ndarray], order: tuple[int, ...], op: str) -> np.ndarray:
    acc = arrays[order[0]]
    for k, r in enumerate(order[1:]):
        last = k == len(order) - 2
        acc = _step(acc, arrays[r], op, len(arrays) if op == "avg" and last else 1)
    return acc


def _tree(arrays: list[np.ndarray], op: str) -> np.ndarray:
    """Pairwise, as MPI's algorithms may reduce; avg divides after (in the dtype)."""
    level = list(arrays)
    while len(level) > 1:
        level = [_step(level[i], level[i + 1], op) if i + 1 < len(level) else level[i]
                 for i in range(0, len(level), 2)]
    if op == "avg":
        return _step(level[0], np.zeros_like(level[0]), "sum", len(arrays))
    return level[0]


def _inputs(dtype: np.dtype, n: int, op: str, scale: float, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng([seed, n])
    lo, hi = (0.5, 1.5) if op == "prod" else (-2.0, 2.0)
    out = []
    for _ in range(n):
        a = rng.uniform(lo, hi, 4000) * (1.0 if op == "prod" else scale)
        if dtype.kind == "c":
            a = a + 1j * rng.uniform(lo, hi, 4000)
        out.append(a.astype(dtype))
    return out


@pytest.mark.parametrize("name", FLOATS)
@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
def test_bound_holds_in_every_order(name, op):
    dtype = _dtype(name)
    for n in (2, 3, 4, 5):
        for scale in (1.0, 1e-5):  # 1e-5: float16 partial sums reach the subnormals
            arrays = _inputs(dtype, n, op, scale, seed=n)
            ref = reduction(arrays, op)
            orders = [tuple(range(s, n)) + tuple(range(s)) for s in range(n)]
            orders += list(itertools.islice(itertools.permutations(range(n)), 24))
            results = [_chain(arrays, order, op) for order in orders] + [_tree(arrays, op)]
            for got in results:
                err = np.abs(got.astype(ref.value.dtype) - ref.value)
                assert np.all(err <= ref.bound), (n, scale, float((err / ref.bound).max()))


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_a_three_percent_bias_in_avg_breaks_the_bound(name):
    dtype = _dtype(name)
    for n in (2, 3, 4, 5):
        arrays = _inputs(dtype, n, "avg", 1.0, seed=7)
        bound = rounding_bound(arrays, "avg")
        exact = sum(a.astype(np.float64) for a in arrays) / n
        biased = (exact * 1.03).astype(dtype).astype(np.float64)
        assert (np.abs(biased - exact) > bound).mean() > 0.05, n


def test_float32_off_by_a_few_hundred_ulps_breaks_the_bound():
    arrays = _inputs(np.dtype(np.float32), 5, "sum", 1.0, seed=3)
    bound = rounding_bound(arrays, "sum")
    exact = sum(a.astype(np.float64) for a in arrays)
    off = exact * (1 + 300 * 2.0 ** -24)
    assert (np.abs(off - exact) > bound).mean() > 0.05


def test_min_max_and_integers_are_exact():
    arrays = _inputs(np.dtype(np.float16), 3, "sum", 1.0, seed=1)
    assert not rounding_bound(arrays, "min").any() and not rounding_bound(arrays, "max").any()
    ints = [np.arange(10, dtype=np.int32) * r for r in range(3)]
    assert not rounding_bound(ints, "sum").any()
