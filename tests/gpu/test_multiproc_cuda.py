"""The multi-process suite on CuPy arrays (tests/gpu/multiproc_cuda.py), on this machine's
GPUs. Skipped without CuPy and a GPU; tests/multiproc/test_cuda_simulated.py runs the same
tests on the CUDA simulator."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy", reason="CuPy is not installed")

try:
    _GPUS = int(cp.cuda.runtime.getDeviceCount())
except Exception:  # no driver, no device
    _GPUS = 0
if _GPUS == 0:
    pytest.skip("no CUDA device", allow_module_level=True)

from .multiproc_cuda import *  # noqa: E402, F403 - every test_* of it, collected here
from .multiproc_cuda import CudaPlatform, real_gpus  # noqa: E402


@pytest.fixture(scope="module")
def cuda_platform() -> CudaPlatform:
    return real_gpus()
