"""`lazy_parent.py DIR COMMAND...`: run COMMAND as a child, and if a signal kills it, leave it
unreaped (a zombie) until DIR/release.txt exists or a minute has passed; then exit with its
status. Put under each rank by `mpiexec`, it hides a rank's death from the launcher the way
hydra's proxy does until it handles the SIGCHLD (or a rank started through a wrapper script
would): the peers can only see the death in the rank's process id, so this tests that path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def main() -> None:
    directory, command = sys.argv[1], sys.argv[2:]
    child = subprocess.Popen(command, close_fds=False)  # keep the PMI descriptors
    release = os.path.join(directory, "release.txt")
    deadline = time.monotonic() + 60
    while not os.path.exists(release) and time.monotonic() < deadline:
        # peek without reaping: a rank that exited normally needs no hiding
        info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None and info.si_code == os.CLD_EXITED:
            break
        time.sleep(0.02)
    code = child.wait()
    sys.exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main()
