"""Messages between two ranks: gpuring's send/recv beside MPI's, in the same processes.

    mpiexec -n 2 python bench/p2p_vs_mpi.py [--sizes 4K,1M,16M,64M] [--reps 15]

NumPy float32 arrays, a ping-pong: rank 0 sends, rank 1 receives and sends back, rank 0
receives; the two systems alternate round trip by round trip on the same arrays
(`comm.send`/`comm.recv`, and mpi4py's `Send`/`Recv` on MPI_COMM_WORLD). Reported: the median
round trip of each, the one-way bandwidth that gives (size / half the round trip), and the
ratio MPI/gpuring of the medians (above 1: gpuring faster). Every message received is checked
bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from mpi4py import MPI

import gpuring
from gpuring._config import parse_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4K,1M,16M,64M", help="bytes, comma-separated")
    p.add_argument("--reps", type=int, default=15, help="round trips of each system per size")
    args = p.parse_args()
    world = MPI.COMM_WORLD
    with gpuring.init() as comm:
        assert comm.size == 2, "two ranks"
        peer = 1 - comm.rank
        if comm.rank == 0:
            print(f"{'bytes':>10} {'gpuring us':>11} {'mpi us':>11} {'gpuring GB/s':>13} "
                  f"{'mpi GB/s':>9} {'mpi/gpuring':>12}")
        for text in args.sizes.split(","):
            nbytes = parse_size(text)
            x = np.random.default_rng(nbytes).standard_normal(nbytes // 4).astype(np.float32)
            y = np.empty_like(x)
            times: dict[str, list[float]] = {"gpuring": [], "mpi": []}
            for rep in range(args.reps + 1):  # the first of each: warm-up, not counted
                for system in ("gpuring", "mpi") if rep % 2 else ("mpi", "gpuring"):
                    y.fill(0)
                    world.Barrier()
                    t0 = time.perf_counter()
                    if system == "gpuring":
                        if comm.rank == 0:
                            comm.send(x, peer)
                            comm.recv(y, peer)
                        else:
                            comm.recv(y, peer)
                            comm.send(y, peer)
                    else:
                        if comm.rank == 0:
                            world.Send(x, dest=peer)
                            world.Recv(y, source=peer)
                        else:
                            world.Recv(y, source=peer)
                            world.Send(y, dest=peer)
                    elapsed = time.perf_counter() - t0
                    assert np.array_equal(y, x), f"{system}: wrong data at {nbytes} bytes"
                    if rep:
                        times[system].append(elapsed)
            if comm.rank == 0:
                ours, theirs = (statistics.median(times[s]) for s in ("gpuring", "mpi"))
                print(f"{nbytes:>10} {ours * 1e6:>11.1f} {theirs * 1e6:>11.1f} "
                      f"{nbytes / (ours / 2) / 1e9:>13.2f} {nbytes / (theirs / 2) / 1e9:>9.2f} "
                      f"{theirs / ours:>12.2f}", flush=True)


if __name__ == "__main__":
    main()
