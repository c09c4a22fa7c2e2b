"""Every example in examples/ runs, as its docstring says to run it, with small sizes: NumPy on
the CPU, CuPy (on the CUDA simulator), torch DDP under torchrun, processes started by hand as
cupyx.distributed users start them, and the benchmark with its plot. (The data-parallel
example is checked against single-process training in test_training.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import launch, start_by_hand
from ..cudasim import kernels_host_build

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _ok(proc: subprocess.CompletedProcess[str]) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    return proc.stdout


def test_numpy_quickstart() -> None:
    out = _ok(launch("gpuring", 4, [str(EXAMPLES / "quickstart.py")]))
    for rank in range(4):
        assert f"[{rank}] rank {rank} of 4: sum 10, avg 2.5" in out, out


def test_cupy_quickstart_on_the_simulator(host_build_dir: Path) -> None:
    try:
        env = kernels_host_build.simulator_env(host_build_dir, GPURING_CUDASIM_MEMOPS="1")
    except kernels_host_build.Unavailable as exc:
        pytest.skip(str(exc))
    out = _ok(launch("gpuring", 2, [str(EXAMPLES / "cupy_quickstart.py")], env=env))
    for rank in range(2):
        assert f"[{rank}] rank {rank} of 2: sum 3, avg 1.5, GPU 0" in out, out


def test_torch_ddp_under_torchrun() -> None:
    pytest.importorskip("torch.distributed", reason="torch is not installed")
    env = dict(os.environ, OMP_NUM_THREADS="1", GPURING_TIMEOUT="60")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(EXAMPLES / "torch_ddp.py"),
                           "--steps", "5"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert "2 ranks, 5 steps on cpu: loss " in _ok(proc)


def test_cupyx_style_processes_started_by_hand() -> None:
    done = start_by_hand(3, [str(EXAMPLES / "cupyx_style.py"), "--device", "cpu"])
    for rank, proc in enumerate(done):
        assert f"rank {rank} of 3 (cpu): sum [3.0, 6.0, 9.0]..." in _ok(proc)


def test_benchmark_with_its_plot(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="matplotlib is not installed")
    env = dict(os.environ, GPURING_TIMEOUT="60")
    for name in ("GPURING_STORE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, str(EXAMPLES / "benchmark.py"), "--max-bytes", "1K",
                           "--iters", "2", "--out", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=300)
    out = _ok(proc)
    rows = [line.split() for line in out.split("of the floor", 1)[1].splitlines()[1:]
            if line.strip() and not line.startswith("plot:")]
    assert [int(row[0]) for row in rows] == [8 << i for i in range(8)]
    assert (tmp_path / "allreduce.png").stat().st_size > 0
    assert (tmp_path / "allreduce.json").is_file()
