"""gpuring.distributed against cupyx.distributed's documented contracts: every NCCLBackend
method with the argument forms cupyx documents (count arguments, C and F order, NumPy
integers, larger outputs, in place, streams, sparse matrices, cupyx's error types), on NumPy
arrays and on the CUDA simulator, 2 and 3 processes started by hand.

Each launch runs every item of worker_cupyx_conformance.py once (several bodies per launch);
each test reads one item's results on every rank: its pytest id names the method, the form
and the rank count (`all_gather-count-3ranks-cupyx`, `...-2ranks-cupyx_sim`). Every launch
must end cleanly with an empty stderr on every rank but rank 0, which on the simulator's
GPUs without 64-bit stream memory operations says so once (a RuntimeWarning) for the job.
"""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import pytest

from ..conftest import start_by_hand
from ..cudasim import kernels_host_build

HERE = Path(__file__).resolve().parent
WORKER = HERE / "worker_cupyx_conformance.py"
#: (device, rank count, id tag); the simulator's launches are slow
LAUNCHES = [("cpu", 2, "cupyx"), ("cpu", 3, "cupyx"), ("cuda", 2, "cupyx_sim"),
            ("cuda", 3, "cupyx_sim")]
#: what rank 0 alone may write to stderr on the simulator (GPUs without stream memory ops)
SPIN_WARNING = r".*RuntimeWarning: gpuring: GPU flag waits fall back to spinning kernels.*"


def _item_ids() -> list[str]:
    spec = importlib.util.spec_from_file_location("worker_cupyx_conformance", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [name for name, _ in module.ITEMS]


def _params() -> list[Any]:
    out = []
    for device, n, tag in LAUNCHES:
        marks = [pytest.mark.xdist_group(f"{n}ranks-{tag}")]
        if device == "cuda":
            marks.append(pytest.mark.slow)
        out += [pytest.param(device, n, name, id=f"{name}-{n}ranks-{tag}", marks=marks)
                for name in _item_ids()]
    return out


def _launch(named_launches: Any, host_build_dir: Path, device: str, n: int) -> Path:
    """The directory of the launch's results (made once for the session)."""
    env = None
    if device == "cuda":
        pytest.importorskip("cuda.bindings.nvrtc", reason=kernels_host_build.NVRTC_MISSING)
        try:
            env = kernels_host_build.simulator_env(
                host_build_dir, GPURING_CUDASIM_DEVICES=str(n), GPURING_CUDASIM_MEMOPS="0",
                GPURING_BUFFER_BYTES="1M", GPURING_CUDA_FLAGS="auto")
        except kernels_host_build.Unavailable as exc:
            pytest.skip(str(exc))

    def make(home: Path) -> None:
        done = start_by_hand(n, [str(WORKER), device, str(home)], env=env, timeout=600)
        (home / "launch.json").write_text(json.dumps(
            [{"returncode": p.returncode, "stdout": p.stdout, "stderr": p.stderr}
             for p in done]))

    return named_launches.once(f"cupyx-conformance-{device}-{n}", make, timeout=600)


def _launch_problems(home: Path, device: str) -> list[str]:
    found = []
    for rank, proc in enumerate(json.loads((home / "launch.json").read_text())):
        if proc["returncode"] != 0:
            found.append(f"rank {rank} exited {proc['returncode']}:\n{proc['stderr'][-3000:]}")
        stderr = proc["stderr"]
        if rank == 0 and device == "cuda":
            stderr = re.sub(rf"^{SPIN_WARNING}\n(  .*\n)?", "", stderr, count=1, flags=re.M)
        if stderr.strip():
            found.append(f"rank {rank} wrote to stderr:\n{stderr[-3000:]}")
    return found


@pytest.mark.parametrize(("device", "n", "name"), _params())
def test_cupyx_contract(device, n, name, named_launches, host_build_dir):
    home = _launch(named_launches, host_build_dir, device, n)
    found = _launch_problems(home, device)
    checked = 0
    for rank in range(n):
        path = home / f"results-{rank}.jsonl"
        records = {}
        if path.is_file():
            records = {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}
        rec = records.get(name)
        if rec is None:
            found.append(f"rank {rank} has no result for {name}")
            continue
        if rec["not_run"] or rec["error"]:
            found.append(f"rank {rank}: {rec['not_run'] or rec['error']}")
        found += [f"rank {rank}: {failure}" for failure in rec["failures"]]
        checked += rec["checked"]
    if not found and not checked:
        found.append("no rank checked anything")
    assert not found, "\n".join(found)


@pytest.mark.slow
def test_the_spin_warning_is_said_once_per_job(named_launches, host_build_dir):
    """On GPUs without 64-bit stream memory operations rank 0 says so once, as a
    RuntimeWarning (a warnings filter silences it); the other ranks' stderr stays clean."""
    home = _launch(named_launches, host_build_dir, "cuda", 3)
    procs = json.loads((home / "launch.json").read_text())
    assert len(re.findall(SPIN_WARNING, procs[0]["stderr"])) == 1, procs[0]["stderr"]
    for rank, proc in enumerate(procs[1:], 1):
        assert proc["stderr"] == "", f"rank {rank}: {proc['stderr']}"


def test_init_process_group_checks_as_cupyx():
    """cupyx's documented ValueErrors, before any rendezvous; NumPy integers are integers."""
    import numpy as np

    from gpuring import distributed

    for n, rank in ((0, 0), (-1, 0), (2, -1), (2, 3), (np.int64(2), np.int64(2))):
        with pytest.raises(ValueError):
            distributed.init_process_group(n, rank)
        with pytest.raises(ValueError):
            distributed.NCCLBackend(n, rank)
    with pytest.raises(ValueError, match="not supported"):
        distributed.init_process_group(1, 0, backend="mpi")
    with pytest.raises(TypeError):
        distributed.init_process_group(2.0, 0)
    assert issubclass(distributed.ArgumentError, RuntimeError)
    assert issubclass(distributed.ArgumentError, ValueError)
