"""`gpuring run`: environment, output prefixes, exit status."""

from __future__ import annotations

import subprocess
import sys


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
    assert "rank 2 failed first: it exited with code 3" in proc.stderr


def test_a_py_file_runs_with_this_python(tmp_path):
    script = tmp_path / "hello.py"
    script.write_text("import sys\nprint(sys.executable)\n")
    proc = subprocess.run([sys.executable, "-m", "gpuring", "run", "-n", "1", str(script)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and sys.executable in proc.stdout
