"""The GPU code paths on the CPU: the GPU tests (tests/gpu) and `gpuring bench --device cuda`
run against the CUDA simulator of tests/cudasim, whose kernels are those of kernels/reduce.cu
built for the CPU. This runs CudaDevice, the scheduler's GPU path and the benchmark's CUDA
path on every CI run; it says nothing of speed, and a real GPU still runs tests/gpu itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..cudasim import kernels_host_build

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) is not installed")

ROOT = Path(__file__).resolve().parents[2]
SIM = ROOT / "tests" / "cudasim"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sim_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    try:
        lib = kernels_host_build.build(tmp_path_factory.mktemp("cudasim"))
    except kernels_host_build.Unavailable as exc:
        pytest.skip(str(exc))
    path = os.pathsep.join(p for p in (str(SIM), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, GPURING_CUDASIM_LIB=str(lib),
                GPURING_CUDASIM_JITTER="1")


@pytest.mark.parametrize("flags", ["kernel", "memops"])
def test_gpu_tests_pass_on_the_simulator(sim_env: dict[str, str], flags: str) -> None:
    env = dict(sim_env, GPURING_CUDASIM_MEMOPS="1" if flags == "memops" else "0")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         str(ROOT / "tests" / "gpu")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    summary = output.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary
    assert "instead of NVRTC" not in output, output[-3000:]  # our own kernel build was used
    if flags == "memops":  # the device really used stream memory operations
        assert "[memops-" in subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
             str(ROOT / "tests" / "gpu" / "test_cuda_device.py")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300).stdout


def test_one_gpu_per_rank_on_the_simulator(sim_env: dict[str, str]) -> None:
    """Two simulated GPUs: each rank uses GPU local_rank % 2, its arrays live there, and IPC
    maps buffers across devices."""
    env = dict(sim_env, GPURING_CUDASIM_DEVICES="2")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         str(ROOT / "tests" / "gpu" / "test_multiproc_cuda.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    summary = output.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "broadcast"])
def test_bench_cuda_path_on_the_simulator(sim_env: dict[str, str], collective: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpuring", "bench", collective, "--ranks", "2",
         "--device", "cuda", "-b", "1K", "-e", "256K", "-f", "16", "-n", "2", "-w", "1",
         "--peers", "nccl,gloo"],
        cwd=ROOT, env=sim_env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "# Wrong elements    : 0 OK" in output, output[-3000:]
    assert "nccl: skipped" in output and "gloo: skipped" in output  # no NCCL, no CUDA torch
