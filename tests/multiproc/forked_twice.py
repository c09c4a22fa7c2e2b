"""A program that starts the same job twice on one port, as CuPy's tests of
cupyx.distributed do: `forked_twice.py PORT` forks 2 ranks (multiprocessing, which ends each
without atexit or close) that broadcast from rank 0, joins them, and does it again with root
1, eight launches in all; each rank checks its result and exits 0. Prints `launch K ok`."""

from __future__ import annotations

import multiprocessing
import sys

import numpy as np

from gpuring.distributed import NCCLBackend


def run(rank: int, root: int, port: int) -> None:
    comm = NCCLBackend(2, rank, port=port, timeout=30)
    x = np.arange(24.0) + root if rank == root else np.zeros(24)
    comm.broadcast(x, root)
    if not np.array_equal(x, np.arange(24.0) + root):
        sys.exit(3)


if __name__ == "__main__":
    port = int(sys.argv[1])
    for launch in range(8):
        ranks = [multiprocessing.Process(target=run, args=(r, launch % 2, port))
                 for r in range(2)]
        for p in ranks:
            p.start()
        for p in ranks:
            p.join(120)
        codes = [p.exitcode for p in ranks]
        print(f"launch {launch} {'ok' if codes == [0, 0] else codes}", flush=True)
