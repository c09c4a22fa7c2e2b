"""The multi-process suite on CuPy arrays: 2 and 4 ranks sharing one GPU (CUDA IPC between
processes on the same device)."""

from __future__ import annotations

import pytest

from ..conftest import WORKER, launch

TRAINING = WORKER.parent / "worker_training.py"

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _need_a_gpu():
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        pytest.skip(f"no CUDA device: {exc}")
    if count < 1:
        pytest.skip("no CUDA device")


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", ["dtypes_ops", "sizes", "back_to_back", "mismatch"])
def test_cuda_collectives(case, n, tmp_path):
    proc = launch("gpuring", n, [str(WORKER), case, str(tmp_path), "cuda"],
                  env={"GPURING_JITTER": "0"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    digests = [(tmp_path / f"{case}-{r}.txt").read_text() for r in range(n)]
    assert all(d == digests[0] for d in digests), "ranks differ bitwise"


@pytest.mark.parametrize("case", ["async", "async_mismatch", "fusion", "compression"])
def test_cuda_training_features(case, tmp_path):
    """Async work, fusion and compression on CuPy arrays, 2 ranks sharing a GPU."""
    n = 2
    proc = launch("gpuring", n, [str(TRAINING), case, str(tmp_path), "cuda"],
                  env={"GPURING_JITTER": "0"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    digests = [(tmp_path / f"{case}-{r}.txt").read_text() for r in range(n)]
    assert all(d == digests[0] for d in digests), "ranks differ bitwise"
