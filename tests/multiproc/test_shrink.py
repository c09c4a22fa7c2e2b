"""Survivors that shrink and carry on: a data-parallel training run on 4 ranks loses one to
SIGKILL mid-step; the 3 others shrink their communicator, redo the step and finish with the
loss of a 3-rank run from that step, under `gpuring run --keep-going` (on NumPy arrays and on
CuPy arrays of the CUDA simulator) and in ranks started by hand, as torchrun starts them."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ..conftest import free_port
from ..cudasim import kernels_host_build

WORKER = str(Path(__file__).parent / "worker_shrink.py")
TIMEOUT = 60


def _environment(device: str, host_build_dir: Path) -> dict[str, str]:
    if device == "cpu":
        return dict(os.environ)
    pytest.importorskip("cuda.bindings.nvrtc", reason=kernels_host_build.NVRTC_MISSING)
    try:
        return kernels_host_build.simulator_env(host_build_dir, GPURING_CUDASIM_JITTER="1",
                                                GPURING_CUDASIM_MEMOPS="1",
                                                SHRINK_DEVICE="cuda")
    except kernels_host_build.Unavailable as exc:
        pytest.skip(str(exc))


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "cuda-simulator"])
def test_survivors_of_a_killed_rank_shrink_and_finish_the_run(
        device: str, tmp_path: Path, host_build_dir: Path) -> None:
    env = _environment(device, host_build_dir)
    proc = subprocess.run(
        [sys.executable, "-m", "gpuring", "run", "-n", "4", "--keep-going", "--",
         sys.executable, WORKER, str(tmp_path), "12", "3", "5"],
        env=dict(env, GPURING_TIMEOUT=str(TIMEOUT), GPURING_JITTER="1"),
        capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "gpuring run: rank 3 was killed by SIGKILL" in proc.stderr, out
    assert "gpuring run: ranks 0-2 went on (--keep-going) and ended well" in proc.stderr, out
    results = {int(p.stem.split("-")[1]): json.loads(p.read_text())
               for p in tmp_path.glob("result-*.json")}
    _check(results, proc.stdout, out)


def _check(results: dict[int, dict[str, object]], stdout: str, out: str) -> None:
    assert sorted(results) == [0, 1, 2], out
    for result in results.values():
        assert result["size"] == 3
        # the same loss as a 3-rank run from the step that failed (within rounding), and
        # one that training lowered (the run did train)
        assert np.isclose(result["loss"], result["reference"], rtol=1e-9, atol=0), result
        assert result["loss"] < 0.5 * result["first_loss"], result  # type: ignore[operator]
        assert result["recovered_after"] < 2 * TIMEOUT, result  # type: ignore[operator]
    assert len({r["digest"] for r in results.values()}) == 1  # the same parameters everywhere
    job = re.search(r"JOB (\w+)", stdout).group(1)  # type: ignore[union-attr]
    assert glob.glob(f"/dev/shm/gpuring-{job}-*") == []


@pytest.mark.slow
def test_ranks_started_by_hand_shrink_too(tmp_path: Path) -> None:
    """No launcher: ranks with torchrun's variables, rank 0 serving the control plane, whose
    server sees rank 3's connection drop when it is SIGKILLed."""
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, WORKER, str(tmp_path), "12", "3", "5"],
        env=dict(os.environ, RANK=str(r), WORLD_SIZE="4", LOCAL_RANK=str(r),
                 LOCAL_WORLD_SIZE="4", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 GPURING_TIMEOUT=str(TIMEOUT), GPURING_JITTER="1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(4)]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=600))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    out = "\n".join(o + e for o, e in outputs)
    assert [p.returncode for p in procs] == [0, 0, 0, -9], out
    results = {int(p.stem.split("-")[1]): json.loads(p.read_text())
               for p in tmp_path.glob("result-*.json")}
    _check(results, outputs[0][0], out)
