"""Dead, stalled and diverging ranks: every survivor raises a clear error, nothing hangs, and
nothing is left in /dev/shm."""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import launch

WORKER = str(Path(__file__).parent / "worker_faults.py")


def results(stdout: str) -> dict[int, tuple[str, str, float]]:
    found = {}
    for m in re.finditer(r"RESULT (\d+) (\w+) peer=(\S+) after=([\d.]+)", stdout):
        found[int(m.group(1))] = (m.group(2), m.group(3), float(m.group(4)))
    return found


@pytest.mark.parametrize("n", [3, 4])
def test_sigkill_mid_allreduce(n):
    proc = launch("gpuring", n, [WORKER, "kill"], env={"GPURING_TIMEOUT": "600",
                                                       "GPURING_JITTER": "0"}, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "rank 1 failed first: it was killed by SIGKILL" in proc.stderr, out
    got = results(proc.stdout)
    survivors = set(range(n)) - {1}
    assert set(got) == survivors, out
    for rank, (name, peer, after) in got.items():
        assert name == "PeerFailureError", out
        assert peer == "1", out
        assert after < 60, f"rank {rank} took {after} s (timeout is 600 s)"
    job = re.search(r"JOB (\w+)", proc.stdout).group(1)
    assert glob.glob(f"/dev/shm/gpuring-{job}-*") == []


def test_sleeper_times_out_the_others():
    proc = launch("gpuring", 3, [WORKER, "sleep"], env={"GPURING_TIMEOUT": "2"}, timeout=120)
    out = proc.stdout + proc.stderr
    got = results(proc.stdout)
    for rank in (0, 2):
        name, peer, _ = got[rank]
        assert name == "CollectiveTimeoutError", out
        assert peer == "1", out
    assert "RESULT 1" in proc.stdout, out  # the sleeper learns it was left behind


@pytest.mark.parametrize("n", [2, 3])
def test_mismatched_order_is_an_error_not_a_hang(n):
    proc = launch("gpuring", n, [WORKER, "order"], env={"GPURING_TIMEOUT": "60"}, timeout=120)
    out = proc.stdout + proc.stderr
    lines = re.findall(r"RESULT (\d+) (\w+)", proc.stdout)
    # every rank reports twice: the fresh and the cached mismatch
    assert sorted(lines) == sorted([(str(r), "CollectiveMismatchError")
                                    for r in range(n)] * 2), out


@pytest.mark.parametrize(("launcher", "nonblocking"),
                         [("gpuring", "0"), ("gpuring", "1"), ("mpiexec", "1")])
def test_a_rank_that_closes_early_fails_the_others_fast(launcher, nonblocking):
    proc = launch(launcher, 3, [WORKER, "leave_early"],
                  env={"GPURING_TIMEOUT": "600", "GPURING_TEST_NONBLOCKING": nonblocking},
                  timeout=300)
    out = proc.stdout + proc.stderr
    got = results(proc.stdout)
    assert set(got) == {1, 2}, out
    for name, peer, after in got.values():
        assert name == "PeerFailureError" and peer == "0", out
        assert after < 60, out


@pytest.mark.parametrize("launcher", ["gpuring", "mpiexec"])
def test_a_failure_while_idle_lets_every_rank_close_and_reinit(launcher):
    proc = launch(launcher, 3, [WORKER, "fail_while_idle"],
                  env={"GPURING_TIMEOUT": "60", "GPURING_TEST_NONBLOCKING": "1"}, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert all(f"CLEAN {r}" in proc.stdout for r in range(3)), out


def test_abort_unblocks_and_reinit_works():
    proc = launch("gpuring", 2, [WORKER, "abort"], env={"GPURING_TIMEOUT": "60"}, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    got = results(proc.stdout)
    assert got[0][0] == "CommunicatorClosedError", out
    assert got[0][2] < 30, out
    assert got[1][0] in ("PeerFailureError", "CommunicatorClosedError"), out
    assert "REINIT 0 ok" in proc.stdout and "REINIT 1 ok" in proc.stdout, out


def test_interrupt_inside_a_collective_breaks_it_everywhere():
    proc = launch("gpuring", 3, [WORKER, "interrupt"], env={"GPURING_TIMEOUT": "60",
                                                            "GPURING_JITTER": "0"}, timeout=120)
    out = proc.stdout + proc.stderr
    got = results(proc.stdout)
    assert got[0][0] == "PeerFailureError" and got[2][0] == "PeerFailureError", out
    assert got[1][0] == "CommunicatorClosedError", out


def test_stall_warning_names_the_missing_rank():
    proc = launch("gpuring", 3, [WORKER, "stall"], env={"GPURING_STALL_WARNING": "0.5"},
                  timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"rank [02] has waited \d+ s in all_reduce #2; ranks \[1\] have not "
                     r"entered it", proc.stderr), out


def test_verify_mode_catches_results_that_differ():
    proc = launch("gpuring", 2, [WORKER, "verify"], env={"GPURING_VERIFY": "1"}, timeout=120)
    out = proc.stdout + proc.stderr
    got = results(proc.stdout)
    assert set(got) == {0, 1}, out
    assert all(name == "GpuringError" for name, _, _ in got.values()), out
    assert "results differ across ranks" in proc.stdout, out


@pytest.mark.slow
def test_soak_4_ranks():
    proc = launch("gpuring", 4, [WORKER, "soak"], env={"GPURING_JITTER": "0"}, timeout=900)
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    assert proc.stdout.count("ok soak 10000") == 4, out


def test_sigterm_to_launcher_reaches_every_rank(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import os, time\nprint('PID', os.getpid(), flush=True)\ntime.sleep(600)\n")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "gpuring", "run", "-n", "3", "--grace", "1", "--",
         sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    assert launcher.stdout is not None
    while len(pids) < 3:
        line = launcher.stdout.readline()
        assert line, "launcher ended early"
        pids += [int(p) for p in re.findall(r"PID (\d+)", line)]
    launcher.send_signal(signal.SIGTERM)
    code = launcher.wait(timeout=60)
    assert code != 0
    for pid in pids:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"rank process {pid} survived SIGTERM to the launcher")
