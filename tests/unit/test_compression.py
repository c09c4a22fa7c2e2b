"""Compression: wire formats, argument errors, and the rounding bound in a world of one."""

from __future__ import annotations

import numpy as np
import pytest

from gpuring._compression import unit_roundoff, wire_dtype

try:
    import ml_dtypes  # noqa: F401
    HAVE_BF16 = True
except ImportError:
    HAVE_BF16 = False
needs_bf16 = pytest.mark.skipif(not HAVE_BF16, reason="ml_dtypes is not installed")


def test_wire_formats():
    assert wire_dtype("fp16") == np.float16
    assert unit_roundoff("fp16") == 2.0 ** -11
    with pytest.raises(ValueError, match="unknown compression"):
        wire_dtype("int8")


@needs_bf16
def test_bf16_wire_format():
    assert wire_dtype("bf16").name == "bfloat16"
    assert unit_roundoff("bf16") == 2.0 ** -8


@needs_bf16
def test_host_ufuncs_work_on_bfloat16():
    a = np.array([1.5, -2.0, 3.25], np.float32).astype(wire_dtype("bf16"))
    for ufunc in (np.add, np.multiply, np.minimum, np.maximum):
        out = np.empty_like(a)
        ufunc(a.view(np.uint8).view("bfloat16"), a, out=out)
        np.testing.assert_array_equal(out.astype(np.float32),
                                      ufunc(a.astype(np.float32), a.astype(np.float32)))


@pytest.mark.parametrize("compression", ["fp16", pytest.param("bf16", marks=needs_bf16)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_round_trip_within_one_rounding(comm, compression, dtype):
    x = np.random.default_rng(1).uniform(-100, 100, 10_000).astype(dtype)
    got = comm.all_reduce(x, compression=compression)
    assert got.dtype == x.dtype
    assert np.all(np.abs(got - x) <= unit_roundoff(compression) * np.abs(x))
    y = x.copy()
    assert comm.all_reduce(y, op="avg", compression=compression, out=y) is y
    np.testing.assert_array_equal(y, got)


def test_argument_errors(comm):
    with pytest.raises(TypeError, match="float32 and float64"):
        comm.all_reduce(np.ones(3, np.int32), compression="fp16")
    with pytest.raises(TypeError, match="float32 and float64"):
        comm.all_reduce(np.ones(3, np.float16), compression="bf16")
    with pytest.raises(ValueError, match="unknown compression"):
        comm.all_reduce(np.ones(3), compression="zip")
