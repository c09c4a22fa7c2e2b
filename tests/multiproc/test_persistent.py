"""Persistent collectives (`comm.all_reduce_init` and its twins): every verb started several
times on refilled inputs, checked by every rank against the reference, on 2 and 3 ranks;
under mpiexec too; and the errors around them."""

from __future__ import annotations

from pathlib import Path

import pytest

from ..conftest import run_worker

WORKER = Path(__file__).resolve().parent / "worker_persistent.py"

VERBS = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather",
         "scatter", "all_to_all", "barrier"]


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("verb", [VERBS[0], *(pytest.param(v, marks=pytest.mark.slow)
                                              for v in VERBS[1:])])
def test_persistent_verb(verb, n, tmp_path):
    run_worker(WORKER, "gpuring", n, f"persistent_{verb}", tmp_path)


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("verb", ["all_reduce", "broadcast"])
def test_persistent_verb_under_mpiexec(verb, tmp_path):
    run_worker(WORKER, "mpiexec", 2, f"persistent_{verb}", tmp_path)


@pytest.mark.parametrize("n", [1, 2])
def test_persistent_refusals_and_close(n, tmp_path):
    """A start again before wait() and a strided input are refused with a clear error;
    plain calls interleave with starts; a start after close() raises
    CommunicatorClosedError."""
    run_worker(WORKER, "gpuring", n, "persistent_lifecycle", tmp_path)


def test_a_repeated_call_reaches_the_engine_in_few_frames(tmp_path):
    """The call path's weight, checked from the source's behaviour: a repeated small
    all_reduce and a persistent start reach `Engine.run` in at most 6 Python frames."""
    run_worker(WORKER, "gpuring", 2, "call_depth", tmp_path)
