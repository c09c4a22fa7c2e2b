"""Training features on 2 to 4 ranks: async work, fusion, compression, timeline, interop,
and the data-parallel example against single-process training."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from ..conftest import launch, run_worker

HERE = Path(__file__).parent
WORKER = HERE / "worker_training.py"
EXAMPLE = HERE.parent.parent / "examples" / "data_parallel.py"
LAUNCHERS = ["gpuring", pytest.param("mpiexec", marks=pytest.mark.mpi)]


def run_case(launcher: str, n: int, case: str, tmp_path,
             env: dict[str, str] | None = None) -> list[str]:
    return run_worker(WORKER, launcher, n, case, tmp_path, env)


@pytest.mark.parametrize("launcher", ["gpuring", pytest.param(
    "mpiexec", marks=[pytest.mark.mpi, pytest.mark.slow])])
@pytest.mark.parametrize("n", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_async(launcher, n, tmp_path):
    assert len(run_case(launcher, n, "async", tmp_path)) > 100


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_async_mismatch_raises_from_wait_on_every_rank(launcher, tmp_path):
    assert run_case(launcher, 2, "async_mismatch", tmp_path).count("mismatch raised") == 2


@pytest.mark.parametrize("n", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_fusion(n, tmp_path):
    run_case("gpuring", n, "fusion", tmp_path, env={"GPURING_FUSION_BYTES": "256"})


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 3])
def test_compression_within_bound(n, tmp_path):
    run_case("gpuring", n, "compression", tmp_path)


def _check_trace(path: Path, n: int, min_rounds: int) -> list[dict]:
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in events} == set(range(n))
    named = {e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "process_name"}
    assert named == {f"rank {r}" for r in range(n)}
    for r in range(n):
        mine = [e for e in events if e["pid"] == r]
        collectives = [e for e in mine if e["tid"] == 0]
        rounds = [e for e in mine if e["tid"] == 1]
        assert [e["args"]["seq"] for e in collectives] == sorted(
            e["args"]["seq"] for e in collectives)
        assert all({"bytes", "dtype", "seq"} <= e["args"].keys() for e in collectives)
        assert len(rounds) >= len(collectives) + min_rounds
        assert all(e["dur"] >= 0 for e in mine)
        assert sum(e["args"]["rounds"] for e in collectives) == len(rounds)
    return events


def test_timeline(tmp_path):
    run_case("gpuring", 3, "timeline", tmp_path, env={"GPURING_BUFFER_BYTES": "64K"})
    events = _check_trace(tmp_path / "trace.json", 3, min_rounds=3)
    names = [e["name"] for e in events if e["pid"] == 0 and e["tid"] == 0]
    assert names == ["all_reduce", "all_reduce", "all_gather", "all_reduce", "barrier"]
    big = [e for e in events if e["tid"] == 0 and e["args"]["bytes"] == 1_200_000]
    assert len(big) == 3 and all(e["args"]["dtype"] == "float32" for e in big)


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_timeline_from_environment(launcher, tmp_path):
    trace = tmp_path / "env-trace.json"
    run_case(launcher, 2, "timeline_env", tmp_path,
             env={"GPURING_TIMELINE": str(trace), "GPURING_BUFFER_BYTES": "64K"})
    events = _check_trace(trace, 2, min_rounds=1)
    assert {e["name"] for e in events if e["tid"] == 0} == {"all_reduce", "reduce_scatter"}


@pytest.mark.slow
@pytest.mark.parametrize("n", [2])
def test_torch_interop(n, tmp_path):
    pytest.importorskip("torch")
    run_case("gpuring", n, "torch", tmp_path, env={"OMP_NUM_THREADS": "1"})


def _example():
    spec = importlib.util.spec_from_file_location("data_parallel_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
def test_data_parallel_equals_full_batch(n, tmp_path):
    steps, samples = 30, 96
    proc = launch("gpuring", n, [str(EXAMPLE), "--steps", str(steps), "--samples", str(samples),
                                 "--out", str(tmp_path)])
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ex = _example()
    x, y = ex.make_data(samples)
    want, _ = ex.train(ex.init_params(x.shape[1]), x, y, steps=steps, lr=0.1)
    per_rank = [np.load(tmp_path / f"weights-{r}.npz") for r in range(n)]
    for r, weights in enumerate(per_rank):
        got = [weights[f"arr_{i}"] for i in range(len(want))]
        for g, w, ref in zip(got, want, [per_rank[0][f"arr_{i}"] for i in range(len(want))],
                             strict=True):
            assert np.array_equal(g, ref), f"rank {r}'s weights differ from rank 0's"
            np.testing.assert_allclose(g, w, rtol=1e-11, atol=1e-13)
