"""`gpuring run`: environment, output prefixes, exit status, and the one summary of a job
whose ranks failed (the root cause, its error and line of code, the others that gave up,
the logs), for a rank that exits, one that is killed, a mismatch, and a stall in the first
call and in a later one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import launch

WORKER = str(Path(__file__).parent / "worker_reports.py")


def run(tmp_path, body: str, n: int = 3, *args: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "rank.py"
    script.write_text(body)
    return subprocess.run([sys.executable, "-m", "gpuring", "run", "-n", str(n), *args, "--",
                           sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)


def test_environment_and_prefixes(tmp_path):
    proc = run(tmp_path, "import os\nprint(os.environ['GPURING_RANK'], "
                         "os.environ['GPURING_WORLD_SIZE'], os.environ['GPURING_LOCAL_RANK'])\n")
    assert proc.returncode == 0, proc.stderr
    lines = sorted(proc.stdout.splitlines())
    assert lines == ["[0] 0 3 0", "[1] 1 3 1", "[2] 2 3 2"]


def test_the_failed_rank_sets_the_exit_status(tmp_path):
    body = ("import os, sys, time\nr = int(os.environ['GPURING_RANK'])\n"
            "sys.exit(3) if r == 2 else time.sleep(60)\n")
    proc = run(tmp_path, body, 3, "--grace", "0.5")
    assert proc.returncode == 3
    lines = proc.stderr.splitlines()
    assert lines[0] == "gpuring run: rank 2 failed: it exited with code 3", proc.stderr
    assert lines[-1] == "gpuring run: exit status 3", proc.stderr


def test_a_py_file_runs_with_this_python(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import sys\nprint(sys.executable)\n")
    proc = subprocess.run([sys.executable, "-m", "gpuring", "run", "-n", "1", str(script)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and sys.executable in proc.stdout


def test_a_traceback_of_a_rank_that_goes_on_is_shown(tmp_path):
    """Only the traceback of a rank that fails is summed up: one a rank prints and then goes
    on (or ends well) is shown as it was written."""
    body = ("import traceback\ntry:\n    1 / 0\nexcept ZeroDivisionError:\n"
            "    traceback.print_exc()\nprint('went on')\n")
    proc = run(tmp_path, body, 1)
    assert proc.returncode == 0, proc.stderr
    assert "[0] Traceback (most recent call last):" in proc.stderr
    assert "[0] ZeroDivisionError: division by zero" in proc.stderr
    assert proc.stdout == "[0] went on\n"


def _summary(case: str, tmp_path: Path, timeout: str = "60") -> tuple[
        subprocess.CompletedProcess[str], list[str]]:
    proc = launch("gpuring", 3, [WORKER, case, str(tmp_path)], grace=120, timeout=600,
                  env={"GPURING_TIMEOUT": timeout, "GPURING_JITTER": "0"})
    lines = proc.stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("gpuring run: rank "))
    assert "Traceback (most recent call last):" not in proc.stderr, proc.stderr
    return proc, lines[start:]


def _logs(summary: list[str]) -> Path:
    (line,) = [line for line in summary if line.startswith("  full output and tracebacks: ")]
    return Path(line.split(": ", 1)[1]).parent


@pytest.mark.slow
def test_the_root_cause_is_the_rank_that_exited_and_its_status_the_jobs(tmp_path):
    """Rank 1 calls sys.exit(3) between two all_reduces: the others raise PeerFailureError
    (maybe before rank 1's process has ended); the summary names rank 1 and the launcher
    exits 3."""
    proc, summary = _summary("exit3", tmp_path)
    assert proc.returncode == 3, proc.stderr
    assert summary[0] == "gpuring run: rank 1 failed: it exited with code 3", proc.stderr
    assert "  why: the failures of ranks 0, 2 blame rank 1" in summary, proc.stderr
    assert "  2 other ranks gave up because of it: ranks 0, 2 (gpuring.PeerFailureError)" \
        in summary, proc.stderr
    assert summary[-1] == "gpuring run: exit status 3", proc.stderr
    logs = _logs(summary)
    assert "Traceback (most recent call last):" in (logs / "rank-0.log").read_text()
    assert f"  what each rank ran: gpuring doctor {logs}" in summary, proc.stderr


@pytest.mark.slow
def test_a_mismatch_names_the_rank_and_what_it_passed(tmp_path):
    """Rank 2 passes float64 where ranks 0-1 pass float32: every rank raises the mismatch;
    the summary names rank 2, its error as gpuring.CollectiveMismatchError saying what
    differs (only what the user set), and its line of code."""
    proc, summary = _summary("mismatch", tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert summary[0] == "gpuring run: rank 2 failed: it exited with code 1", proc.stderr
    assert "  error: gpuring.CollectiveMismatchError: all_reduce #1 on rank 2: rank 2 passed " \
           "float64, ranks 0-1 float32" in summary, proc.stderr
    (at,) = [line for line in summary if line.startswith("  at: ")]
    assert re.fullmatch(r"  at: .*worker_reports\.py:\d+, in main: comm\.all_reduce\(x\)", at)
    assert "  2 other ranks gave up because of it: ranks 0-1 " \
           "(gpuring.CollectiveMismatchError)" in summary, proc.stderr
    for rank in range(3):
        log = (_logs(summary) / f"rank-{rank}.log").read_text()
        assert f"gpuring.CollectiveMismatchError: all_reduce #1 on rank {rank}: rank 2 passed " \
               "float64, ranks 0-1 float32" in log
        assert "one_shot_bytes" not in log and "buffer_bytes" not in log


@pytest.mark.slow
def test_a_killed_rank_is_the_root_cause(tmp_path):
    proc, summary = _summary("kill", tmp_path)
    assert proc.returncode == 128 + 9, proc.stderr
    assert summary[0] == "gpuring run: rank 1 failed: it was killed by SIGKILL", proc.stderr
    assert "  2 other ranks gave up because of it: ranks 0, 2 (gpuring.PeerFailureError)" \
        in summary, proc.stderr
    assert summary[-1] == "gpuring run: exit status 137", proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("case", "seq"), [("stall_first", 1), ("stall_later", 2)])
def test_a_stall_names_the_collective_and_the_missing_rank(case, seq, tmp_path):
    """Rank 1 enters all_reduce #SEQ only once the others have raised: they time out waiting
    for it there (in the first call, while the ranks set the call up), naming the collective
    and rank 1 (`.peer` too); the summary names rank 1."""
    proc, summary = _summary(case, tmp_path, timeout="10")
    assert summary[0] == "gpuring run: rank 1 failed: it exited with code 1", proc.stderr
    assert any(line.startswith("  why: ") and "rank 1" in line for line in summary), summary
    logs = _logs(summary)
    for rank in (0, 2):
        assert "peer=1" in (tmp_path / f"result-{rank}.txt").read_text()
        error = (logs / f"rank-{rank}.log").read_text().rstrip().splitlines()[-1]
        assert error.startswith("gpuring.Collective") or error.startswith(
            "gpuring.PeerFailureError"), error
        assert f"all_reduce #{seq} " in error and f" on rank {rank}" in error, error
        assert re.search(r"rank 1 did not take part|waiting for rank 1", error), error
    assert proc.returncode == 1, proc.stderr
