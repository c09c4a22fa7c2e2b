"""Training features on CuPy arrays: async stream ordering, fp16 and bf16 compression,
fusion, and the data-parallel example on GPUs. Skipped without CuPy and a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy", reason="CuPy is not installed")

try:
    _GPUS = int(cp.cuda.runtime.getDeviceCount())
except Exception:  # no driver, no device
    _GPUS = 0
if _GPUS == 0:
    pytest.skip("no CUDA device", allow_module_level=True)

from gpuring._communicator import Communicator  # noqa: E402
from gpuring.rendezvous.local import SingleProcess  # noqa: E402

from ..conftest import launch  # noqa: E402

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "data_parallel.py"


@pytest.fixture
def comm():
    c = Communicator(SingleProcess())
    yield c
    c.close()


def test_async_wait_orders_the_callers_stream(comm):
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        x = cp.arange(1 << 20, dtype=cp.float32)
        work = comm.all_reduce_async(x)
        got = work.wait()
        total = float(got.sum())  # on the caller's stream, after the collective
    assert total == float(cp.arange(1 << 20, dtype=cp.float64).sum())


def test_fp16_compression_and_fusion_on_cupy(comm):
    x = cp.linspace(-10, 10, 1001, dtype=cp.float32)
    got = comm.all_reduce(x, compression="fp16")
    assert isinstance(got, cp.ndarray)
    assert bool(cp.all(cp.abs(got - x) <= 2.0 ** -11 * cp.abs(x)))
    many = comm.all_reduce_many([x, cp.ones(3, cp.int32)], fusion_bytes=64)
    assert all(isinstance(m, cp.ndarray) for m in many)


def test_bf16_compression_on_cuda(comm):
    pytest.importorskip("ml_dtypes")
    x = cp.asarray(np.random.default_rng(0).standard_normal(1000).astype(np.float32))
    got = comm.all_reduce(x, compression="bf16")  # needs CuPy >= 14 for the bf16 dtype
    assert isinstance(got, cp.ndarray)
    assert bool(cp.all(cp.abs(got - x) <= 2.0 ** -8 * cp.abs(x)))


def test_data_parallel_example_on_gpus(tmp_path):
    n = 2 if _GPUS >= 2 else 1
    proc = launch("gpuring", n, [str(EXAMPLE), "--device", "cuda", "--steps", "10",
                                 "--samples", "96", "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    sys.path.insert(0, str(EXAMPLE.parent))
    try:
        import data_parallel as ex
    finally:
        sys.path.pop(0)
    x, y = ex.make_data(96)
    want, _ = ex.train(ex.init_params(x.shape[1]), x, y, steps=10, lr=0.1)
    got = np.load(tmp_path / "weights-0.npz")
    for i, w in enumerate(want):
        np.testing.assert_allclose(got[f"arr_{i}"], w, rtol=1e-9, atol=1e-11)
