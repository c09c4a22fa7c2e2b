"""The GPU code paths on the CPU: the GPU tests (tests/gpu) and `gpuring bench --device cuda`
run against the CUDA simulator of tests/cudasim, whose kernels are those of kernels/reduce.cu
built for the CPU. This runs CudaDevice, the scheduler's GPU path and the benchmark's CUDA
path on every CI run; it says nothing of speed, and a real GPU still runs tests/gpu itself."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ..cudasim import kernels_host_build

pytest.importorskip("cuda.bindings.nvrtc", reason=kernels_host_build.NVRTC_MISSING)

ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = ROOT / "tests" / "gpu"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sim_env(host_build_dir: Path) -> dict[str, str]:
    try:
        return kernels_host_build.simulator_env(host_build_dir,
                                                GPURING_CUDASIM_JITTER="1")
    except kernels_host_build.Unavailable as exc:
        pytest.skip(str(exc))


def _run_gpu_tests(env: dict[str, str], *paths: str) -> str:
    """Run tests/gpu paths in a pytest of their own on the simulator; its output."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-n", "2",
         *paths],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    summary = output.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, summary
    assert "instead of NVRTC" not in output, output[-3000:]  # our own kernel build was used
    return output


def test_gpu_tests_pass_on_the_simulator(sim_env: dict[str, str]) -> None:
    """All of tests/gpu on one GPU with stream memory operations: the device tests run in
    both flag modes (memops and spin kernels), the multi-process ones with memops."""
    env = dict(sim_env, GPURING_CUDASIM_MEMOPS="1")
    _run_gpu_tests(env, str(GPU_TESTS))
    assert "[memops-" in subprocess.run(  # the device really used stream memory operations
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         str(GPU_TESTS / "test_cuda_device.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300).stdout


def test_two_gpus_without_stream_memory_operations(sim_env: dict[str, str]) -> None:
    """Two simulated GPUs whose driver has no stream memory operations: each rank uses GPU
    local_rank % 2, its arrays live there, IPC maps buffers across devices (with peer
    access), waits spin in kernels, and the device says why it fell back. Small collectives
    run as one kernel here (GPURING_CUDA_FUSED=auto without stream memory operations), so the
    collectives' case checks that form too (mismatches on 2 ranks). The other multi-process
    cases (odd sizes, the tests of the forms themselves, the training features, calls that
    come again, back-to-back collectives, deterministic mode, messages,
    sub-communicators, the cupyx drop-in, simulated nodes: nothing of them depends on the
    GPU count) ran above."""
    env = dict(sim_env, GPURING_CUDASIM_DEVICES="2", GPURING_CUDASIM_MEMOPS="0")
    _run_gpu_tests(env, str(GPU_TESTS / "test_multiproc_cuda.py"),
                   str(GPU_TESTS / "test_cuda_device.py"), "-k",
                   "spin or clear_error or legacy or fault or (cuda_collectives and "
                   "mismatch-2)")


@pytest.mark.parametrize("collective", ["broadcast"])  # (all_reduce: with -G below)
def test_bench_cuda_path_on_the_simulator(sim_env: dict[str, str], collective: str,
                                          tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "gpuring", "bench", collective, "--ranks", "2",
         "--device", "cuda", "-b", "1K", "-e", "256K", "-f", "16", "-n", "2", "-w", "1",
         "--peers", "nccl,gloo", "--json", str(tmp_path / "r.json")],
        cwd=ROOT, env=sim_env, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "# Wrong elements    : 0 OK" in output, output[-3000:]
    assert "nccl: skipped" in output and "gloo: skipped" in output  # no NCCL, no CUDA torch
    # every gpuring line says how many driver calls one collective made, and its host time
    doc = json.loads((tmp_path / "r.json").read_text())
    mine = [r for r in doc["results"] if r["system"] == "gpuring"]
    assert mine and all(r["driver_calls"] >= 1 and r["host_us"] > 0 for r in mine)
    assert "# Host cost per collective" in output


def test_bench_cuda_graph_replays_on_the_simulator(sim_env: dict[str, str],
                                                   tmp_path: Path) -> None:
    """-G: all_reduce captured into a CUDA graph of -n calls and timed over graph launches
    (the kernel form, GPURING_CUDA_FUSED=kernel): sizes that run as one kernel, and one that
    runs in rounds outside a graph (as kernels in it); the results are still checked."""
    done = subprocess.run(
        [sys.executable, "-m", "gpuring", "bench", "all_reduce", "--ranks", "2",
         "--device", "cuda", "-b", "1K", "-e", "256K", "-f", "16", "-n", "3", "-w", "1",
         "-G", "2", "--json", str(tmp_path / "g.json")],
        cwd=ROOT, env=dict(sim_env, GPURING_CUDA_FUSED="kernel"), capture_output=True,
        text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "# Wrong elements    : 0 OK" in output, output[-3000:]
    assert "captured into one CUDA graph" in output
    assert "not captured into a CUDA graph" not in output, output[-3000:]
    doc = json.loads((tmp_path / "g.json").read_text())
    assert doc["settings"]["graph_launches"] == 2
    timed = {(r["size"], r["placement"]) for r in doc["results"]
             if r["system"] == "gpuring" and r["time_us"] > 0}
    assert timed == {(size, placement) for size in (1024, 16384, 262144)
                     for placement in ("out-of-place", "in-place")}
    schedules = {r["size"]: r["schedule"] for r in doc["results"] if r["system"] == "gpuring"}
    assert schedules[1024] == "fused" and schedules[262144] == "kernels", schedules
