"""Ranks of a training loop in which one rank goes its own way: `worker_forensics.py CASE DIR`.

Each step all_reduces a gradient (one line) and all_gathers a metric (the next line). Rank
HIDDEN (an environment variable) skips the all_gather of step 2:
- `next`: it goes on with the all_reduce of step 3, which meets its peers' all_gather;
- `stall`: it stops calling collectives there, and waits (bounded) until every other rank
  has written DIR/result-RANK.txt (so it stalls for as long as they take to time out), then
  makes its next call.
Every rank writes DIR/result-RANK.txt with the error it raised and exits 1 with it, as a
training script would.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

import gpuring

CASE, DIR = sys.argv[1], sys.argv[2]
HIDDEN = int(os.environ["HIDDEN"])


def wait_for_the_others(comm: gpuring.Communicator) -> None:
    deadline = time.monotonic() + 300
    others = [os.path.join(DIR, f"result-{r}.txt") for r in range(comm.size) if r != comm.rank]
    while not all(os.path.exists(p) for p in others):
        assert time.monotonic() < deadline, "the others never reported"
        time.sleep(0.05)


def main() -> None:
    comm = gpuring.init()
    grad = np.random.default_rng(comm.rank).standard_normal(64).astype(np.float32)
    metric = np.array([comm.rank], np.float32)
    try:
        for step in range(5):
            comm.all_reduce(grad, out=grad)
            if step == 2 and comm.rank == HIDDEN:
                if CASE == "stall":
                    wait_for_the_others(comm)
                continue
            comm.all_gather(metric)
    except gpuring.GpuringError as exc:
        path = os.path.join(DIR, f"result-{comm.rank}.txt")
        with open(path + ".tmp", "w") as f:
            f.write(f"{type(exc).__name__} peer={getattr(exc, 'peer', None)}")
        os.replace(path + ".tmp", path)
        raise
    comm.close()


if __name__ == "__main__":
    main()
