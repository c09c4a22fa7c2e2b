"""The two-shot schedule (deterministic mode's) beside the ring, in the same processes.

    gpuring run -n 2 python bench/two_shot_vs_ring.py [--sizes 1M,4M,16M,64M] [--reps 15]

NumPy float32 sum all_reduce, out of place, on the same arrays: at each size the two
schedules alternate call by call (`algorithm="ring"`, `algorithm="two_shot"`), each call timed
from a barrier to its return, the slowest rank's time counting (a MAX all_reduce of the
times, outside the timed span). Reported: each schedule's median and the ratio two_shot/ring
of the medians. Both results are checked against a float64 reference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import gpuring
from gpuring._config import parse_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1M,4M,16M,64M", help="bytes, comma-separated")
    p.add_argument("--reps", type=int, default=15, help="calls of each schedule per size")
    args = p.parse_args()
    with gpuring.init() as comm:
        for text in args.sizes.split(","):
            count = parse_size(text) // 4
            x = np.random.default_rng(comm.rank).standard_normal(count).astype(np.float32)
            out = np.empty_like(x)
            want = comm.all_reduce(x.astype(np.float64))
            times: dict[str, list[float]] = {"ring": [], "two_shot": []}
            for rep in range(args.reps + 1):  # the first of each: warm-up, not counted
                for algorithm in ("ring", "two_shot") if rep % 2 else ("two_shot", "ring"):
                    comm.barrier()
                    t0 = time.perf_counter()
                    comm.all_reduce(x, out=out, algorithm=algorithm)
                    took = np.array([time.perf_counter() - t0])
                    comm.all_reduce(took, op="max", out=took)
                    if rep:
                        times[algorithm].append(float(took[0]))
                    error = float(np.abs(out - want).max())
                    assert error < 1e-3 * comm.size, f"{algorithm}: error {error}"
            ring, two_shot = (statistics.median(times[a]) for a in ("ring", "two_shot"))
            if comm.rank == 0:
                print(f"{text:>5} float32 sum on {comm.size} ranks: ring {ring * 1e3:8.2f} ms, "
                      f"two_shot {two_shot * 1e3:8.2f} ms, two_shot/ring {two_shot / ring:5.2f} "
                      f"(medians of {args.reps})", flush=True)


if __name__ == "__main__":
    main()
