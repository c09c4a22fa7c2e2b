"""gpuring.distributed, the drop-in for cupyx.distributed, used as its users use cupyx:
processes started by hand that meet on a port, every backend method checked against
NumPy; a killed process fails the others with PeerFailureError."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from ..conftest import free_port, launch, start_as, start_by_hand, torchrun_env

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


LEAVING = str(Path(__file__).parent / "worker_leaving.py")


@pytest.mark.parametrize("launcher", ["hand", "gpuring", "torchrun"])
def test_rank0_may_end_after_its_last_call(launcher):
    """Rank 0 ends its process right after its last call (os._exit: no atexit, no close, as a
    multiprocessing child ends) while its peers have yet to make that call: they get its
    data, close without error, and only a later call, which needs rank 0, fails
    (PeerFailureError naming rank 0, at once). Where rank 0 serves the control plane (by
    hand, torchrun), its server outlives rank 0's process. (Not under mpiexec: MPI's launcher
    ends the whole job when a process exits without finalizing MPI.)"""
    if launcher == "hand":
        done = start_by_hand(3, [LEAVING, "leave"])
        outs = [p.stdout + p.stderr for p in done]
        assert done[0].returncode == 0, outs[0][-3000:]
        assert [p.stderr for p in done[1:]] == ["", ""], outs
    elif launcher == "torchrun":
        done = start_as(torchrun_env(3, free_port()), [LEAVING, "launched", "leave"])
        outs = [p.stdout + p.stderr for p in done]
        assert [p.returncode for p in done] == [0, 0, 0], outs
    else:
        proc = launch(launcher, 3, [LEAVING, "launched", "leave"])
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        outs = [proc.stdout + proc.stderr] * 3
    for rank in (1, 2):
        out = outs[rank]
        assert f"RESULT {rank} broadcast-after-rank0-left ok" in out, out[-3000:]
        later = re.search(rf"RESULT {rank} later-call (\w+) peer=(\S+) after=([\d.]+)", out)
        assert later and later.groups()[:2] == ("PeerFailureError", "0"), out[-3000:]
        assert float(later.group(3)) < 10, out[-3000:]
        assert f"RESULT {rank} stopped" in out, out[-3000:]


def test_rank0_dying_mid_call_fails_its_peers():
    """Rank 0 is SIGKILLed inside all_reduces: every peer raises PeerFailureError naming it
    within seconds (the control server, in a process of its own, reports it too)."""
    done = start_by_hand(3, [LEAVING, "die"],
                         env={"GPURING_TIMEOUT": "600"})
    assert done[0].returncode != 0  # killed
    for rank in (1, 2):
        out = done[rank].stdout + done[rank].stderr
        found = re.search(rf"RESULT {rank} (\w+) peer=(\S+) after=([\d.]+)", out)
        assert found and found.groups()[:2] == ("PeerFailureError", "0"), out[-3000:]
        assert float(found.group(3)) < 30, out


def test_the_same_job_twice_on_one_port():
    """Ranks forked by multiprocessing meet on a port, end without closing, and the program
    starts the same job again on that port, eight times: each launch meets on its own rank 0's
    server (the one before takes no new rank once its rank 0 ended) and succeeds; nothing is
    written to stderr."""
    proc = subprocess.run([sys.executable, str(Path(__file__).parent / "forked_twice.py"),
                           str(free_port())], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split("\n")[:8] == [f"launch {k} ok" for k in range(8)], proc.stdout
    assert proc.stderr == "", proc.stderr
