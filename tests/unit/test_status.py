"""The status board's view of a peer's process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from gpuring._status import _alive


def test_a_dead_process_is_dead_even_before_its_parent_reaps_it() -> None:
    """A rank killed under mpiexec stays a zombie until hydra's proxy reaps it (and a rank
    started through a wrapper until the wrapper does): signal 0 still reaches it, but it is
    dead, and its peers must see that at once."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # exited, not reaped: a zombie
            info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                break
            time.sleep(0.01)
        os.kill(child.pid, 0)  # still there for signals...
        assert not _alive(child.pid)  # ...yet dead
    finally:
        child.wait()
    assert not _alive(child.pid)  # and once reaped


def test_a_live_process_is_alive() -> None:
    assert _alive(os.getpid())
    assert _alive(os.getppid())
    assert _alive(0)  # not published yet
