"""gpuring all_reduce beside MPI's Allreduce, same arrays, same ranks, one run.

    mpiexec -n 2 python bench/allreduce_vs_mpi.py [--min 8] [--max 256M] [--iters 20]

Per size and system: median time over iterations (each iteration's time is the slowest
rank's), algbw = bytes / time and busbw = algbw * 2(n-1)/n as nccl-tests reports them, and the
ratio gpuring / MPI (busbw: > 1 means gpuring is faster). Every result is checked.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time

import numpy as np
from mpi4py import MPI

import gpuring
from gpuring._config import parse_size


def timed(fn, comm, iters: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = np.empty(iters)
    for i in range(iters):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - t0
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    return list(slowest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min", default="8")
    parser.add_argument("--max", default="256M")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="write the rows here (rank 0)")
    args = parser.parse_args()
    mpi = MPI.COMM_WORLD
    n = mpi.size
    comm = gpuring.init()
    rows = []
    size = parse_size(args.min)
    factor = 2 * (n - 1) / n
    if mpi.rank == 0:
        print(f"# {n} ranks, float32 sum; python {platform.python_version()}, numpy "
              f"{np.__version__}, {MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"# {platform.processor() or platform.machine()}, {platform.node()}")
        print(f"{'bytes':>12} {'gpuring us':>11} {'busbw GB/s':>10} {'MPI us':>10} "
              f"{'busbw GB/s':>10} {'ratio':>6}")
    while size <= parse_size(args.max):
        count = max(1, size // 4)
        rng = np.random.default_rng(mpi.rank)
        x = rng.standard_normal(count).astype(np.float32)
        out_g = np.empty_like(x)
        out_m = np.empty_like(x)
        iters = args.iters if size < (64 << 20) else max(5, args.iters // 4)
        t_g = timed(lambda x=x, o=out_g: comm.all_reduce(x, out=o), mpi, iters, args.warmup)
        t_m = timed(lambda x=x, o=out_m: mpi.Allreduce(x, o, op=MPI.SUM), mpi, iters,
                    args.warmup)
        assert np.allclose(out_g, out_m, rtol=1e-5, atol=1e-5 * n), "results differ"
        med_g, med_m = statistics.median(t_g), statistics.median(t_m)
        nbytes = count * 4
        row = {"bytes": nbytes, "ranks": n, "gpuring_us": med_g * 1e6, "mpi_us": med_m * 1e6,
               "gpuring_busbw": nbytes / med_g * factor / 1e9,
               "mpi_busbw": nbytes / med_m * factor / 1e9, "ratio": med_m / med_g,
               "gpuring_min_us": min(t_g) * 1e6, "gpuring_max_us": max(t_g) * 1e6,
               "mpi_min_us": min(t_m) * 1e6, "mpi_max_us": max(t_m) * 1e6}
        rows.append(row)
        if mpi.rank == 0:
            print(f"{nbytes:>12} {row['gpuring_us']:>11.1f} {row['gpuring_busbw']:>10.2f} "
                  f"{row['mpi_us']:>10.1f} {row['mpi_busbw']:>10.2f} {row['ratio']:>6.2f}",
                  flush=True)
        size *= 4 if size < (1 << 20) else 2
    if mpi.rank == 0 and args.json:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "machine": platform.node(),
                       "cpus": __import__("os").cpu_count(), "rows": rows}, f, indent=1)
    comm.close()


if __name__ == "__main__":
    sys.exit(main())
