"""gpuring.distributed, the drop-in for cupyx.distributed, used as its users use cupyx:
processes started by hand that meet on a port, every backend method checked against
NumPy; a killed process fails the others with PeerFailureError."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest

from ..conftest import start_by_hand

WORKER = str(Path(__file__).parent / "worker_distributed.py")


@pytest.mark.parametrize("n", [1, 2, pytest.param(3, marks=pytest.mark.slow)])
def test_the_calls_of_a_cupyx_user_on_numpy_arrays(n):
    done = start_by_hand(n, [WORKER, "cpu"])
    for rank, proc in enumerate(done):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"rank {rank}: ok" in proc.stdout


@pytest.mark.slow
def test_a_killed_process_fails_the_others():
    done = start_by_hand(3, [WORKER, "cpu", "kill"], env={"GPURING_TIMEOUT": "600"})
    assert done[1].returncode != 0  # killed
    for rank in (0, 2):
        out = done[rank].stdout + done[rank].stderr
        found = re.search(r"RESULT \d+ (\w+) peer=(\S+) after=([\d.]+)", out)
        assert found, out[-3000:]
        assert found.group(1) == "PeerFailureError" and float(found.group(3)) < 60, out


def test_the_job_key_and_where_the_rendezvous_listens(monkeypatch):
    from gpuring import distributed
    from gpuring.rendezvous.launchers import job_key

    monkeypatch.setenv("GPURING_JOB_KEY", "00ff")
    assert job_key("10.0.0.1", 1, "test") == b"\x00\xff"  # given: no warning
    monkeypatch.setenv("GPURING_JOB_KEY", "not hex")
    with pytest.raises(ValueError, match="hex"):
        job_key("127.0.0.1", 1, "test")
    monkeypatch.delenv("GPURING_JOB_KEY")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loopback = job_key("127.0.0.1", 13333, "test")  # loopback: no warning
    assert loopback != job_key("127.0.0.1", 13334, "test")
    with pytest.warns(RuntimeWarning, match="no job key"):
        job_key("10.0.0.1", 13333, "test")
    with pytest.raises(ValueError, match="Invalid rank"):
        distributed.init_process_group(2, 2)
    with pytest.raises(ValueError, match="not supported"):
        distributed.init_process_group(2, 0, backend="mpi")
