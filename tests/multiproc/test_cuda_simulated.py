"""The GPU code paths on the CPU: the GPU tests (tests/gpu) and `gpuring bench --device cuda`
run against the CUDA simulator of tests/cudasim, whose kernels are those of kernels/reduce.cu
built for the CPU. This runs CudaDevice, the scheduler's GPU path and the benchmark's CUDA
path on every CI run; it says nothing of speed, and a real GPU still runs tests/gpu itself.

The multi-process tests of tests/gpu/multiproc_cuda.py run in this pytest, named as
there (`...-4ranks-gpu_per_rank-memops`): their ranks alone need the simulator. The
in-process ones run in a pytest of their own, whose `import cupy` finds the simulator."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ..cudasim import kernels_host_build

pytest.importorskip("cuda.bindings.nvrtc", reason=kernels_host_build.NVRTC_MISSING)

ROOT = Path(__file__).resolve().parents[2]
GPU_TESTS = ROOT / "tests" / "gpu"

pytestmark = pytest.mark.slow

# The multi-process CuPy tests of tests/gpu, collected here: on the simulator they take
# `cuda_platform` from this module (its environment for the ranks)
from ..gpu.multiproc_cuda import (  # noqa: E402, F401
    CudaPlatform,
    test_a_killed_rank_on_a_simulated_node,
    test_back_to_back,
    test_capture_where_ranks_share_a_gpu,
    test_close_waits_until_every_peer_unmapped,
    test_collectives_captured_in_a_cuda_graph,
    test_cuda_training_features,
    test_cupyx_distributed_drop_in,
    test_dtypes_and_ops,
    test_fusion_and_compression,
    test_gather_scatter_all_to_all,
    test_gpus_without_peer_access_run_on_nccl,
    test_messages_queued_on_the_stream,
    test_mismatch_raises_on_every_rank,
    test_nccl_refuses_ranks_that_share_a_gpu_alike,
    test_persistent_collectives,
    test_point_to_point,
    test_registered_memory,
    test_simulated_nodes,
    test_sizes,
    test_small_all_reduce_as_one_operation,
    test_sub_communicators,
    test_survivors_of_a_killed_rank_keep_their_gpu,
    test_the_same_arrays_again,
    test_two_shot_and_deterministic,
    test_uneven_collectives,
)


@pytest.fixture(scope="module")
def sim_env(host_build_dir: Path) -> dict[str, str]:
    try:
        return kernels_host_build.simulator_env(host_build_dir,
                                                GPURING_CUDASIM_JITTER="1")
    except kernels_host_build.Unavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def cuda_platform(sim_env: dict[str, str]) -> CudaPlatform:
    """The simulator as the multi-process CuPy tests' GPUs: as many as a form asks for, with
    stream memory operations or without, as the form asks."""
    return CudaPlatform(True, sim_env, 0, True)


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
    """The in-process tests of tests/gpu (CudaDevice, the training features on one rank) on
    one GPU with stream memory operations, in a pytest whose `import cupy` finds the
    simulator: the device tests run in both flag modes (memops and spin kernels). (Its
    multi-process tests run above, in this pytest.)"""
    env = dict(sim_env, GPURING_CUDASIM_MEMOPS="1")
    _run_gpu_tests(env, str(GPU_TESTS / "test_cuda_device.py"),
                   str(GPU_TESTS / "test_training_gpu.py"))
    assert "[memops-" in subprocess.run(  # the device really used stream memory operations
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         str(GPU_TESTS / "test_cuda_device.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300).stdout


def test_two_gpus_without_stream_memory_operations(sim_env: dict[str, str]) -> None:
    """Two simulated GPUs whose driver has no stream memory operations: the device's spin
    waits, IPC across devices (with peer access), a sticky error cleared, the legacy default
    stream, faults; the device says why it fell back. (The multi-process tests' gpu_per_rank
    forms run the collectives on such GPUs above.)"""
    env = dict(sim_env, GPURING_CUDASIM_DEVICES="2", GPURING_CUDASIM_MEMOPS="0")
    _run_gpu_tests(env, str(GPU_TESTS / "test_cuda_device.py"), "-k",
                   "spin or clear_error or legacy or fault")


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


@pytest.mark.parametrize("gpus", [1, 2], ids=["2ranks-shared_gpu", "2ranks-gpu_per_rank"])
def test_all_reduce_float32_sum_out_of_place_on_ranks_forked_by_multiprocessing(
        sim_env: dict[str, str], gpus: int) -> None:
    """Ranks forked by `multiprocessing` from a program that imported CuPy and gpuring (and
    made no CUDA call) run CUDA collectives, each checking its own result; the program then
    runs on the GPU itself (tests/multiproc/forked_ranks.py). On the simulator, a child that
    inherited a stream's thread would wait forever."""
    from ..conftest import free_port

    done = subprocess.run(
        [sys.executable, "-m", "tests.multiproc.forked_ranks", "2", str(free_port()),
         str(np.random.default_rng().integers(1 << 31))],
        cwd=ROOT, env=dict(sim_env, GPURING_CUDASIM_DEVICES=str(gpus)), capture_output=True,
        text=True, timeout=300)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "ranks": [None, None], "parent": None}, done.stdout[-6000:]
