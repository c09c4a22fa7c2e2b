"""Ranks of a job that fails, for `gpuring run`'s summary: `worker_reports.py CASE DIR`.

- `exit3`: rank 1 calls sys.exit(3) after the first all_reduce; the others go on to a second.
- `mismatch`: rank 2 passes float64 to the first all_reduce, the others float32.
- `kill`: rank 1 SIGKILLs itself after the first all_reduce; the others go on to a second.
- `stall_first`: rank 1 makes its first collective only once every other rank has written
  DIR/result-RANK.txt (they time out waiting for it in theirs) and its communicator has
  learnt that they failed (else it could still complete a one-shot all_reduce they left, with
  the data they had posted).
- `stall_later`: the same, before the second all_reduce.
Every rank that raises writes DIR/result-RANK.txt, then lets the error end it (a traceback and
exit status 1, as a script that does not catch it would).
"""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import gpuring

CASE, DIR = sys.argv[1], sys.argv[2]


def wait_for_the_others(comm: gpuring.Communicator) -> None:
    deadline = time.monotonic() + 300
    others = [os.path.join(DIR, f"result-{r}.txt") for r in range(comm.size) if r != comm.rank]
    while not all(os.path.exists(p) for p in others) or comm._path.state == "open":
        assert time.monotonic() < deadline, "the others never reported"
        time.sleep(0.05)


def main() -> None:
    comm = gpuring.init()
    x = np.random.default_rng(comm.rank).standard_normal(1000).astype(
        np.float64 if CASE == "mismatch" and comm.rank == 2 else np.float32)
    try:
        if CASE == "stall_first" and comm.rank == 1:
            wait_for_the_others(comm)
        comm.all_reduce(x)
        if comm.rank == 1:
            if CASE == "exit3":
                sys.exit(3)
            if CASE == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if CASE == "stall_later":
                wait_for_the_others(comm)
        comm.all_reduce(x)
    except gpuring.GpuringError as exc:
        path = os.path.join(DIR, f"result-{comm.rank}.txt")
        with open(path + ".tmp", "w") as f:
            f.write(f"{type(exc).__name__} peer={getattr(exc, 'peer', None)}")
        os.replace(path + ".tmp", path)
        raise
    comm.close()


if __name__ == "__main__":
    main()
