"""NumPy all_reduce on plain arrays read and written where they lie (cross-memory attach)
beside the ring staged through the shared buffers, in the same processes: where
GPURING_ATTACH_BYTES belongs.

    GPURING_ATTACH_BYTES=64K gpuring run -n 2 python bench/attach_vs_ring.py \
        [--sizes 256K,512K,1M,2M,4M,8M,16M] [--reps 15] [--calls 10]

float32 sum, out of place, the same arrays: at each size the two alternate, `--calls` calls
back to back after a barrier for each (`algorithm="ring"`, then the communicator's choice,
which is attached from GPURING_ATTACH_BYTES on: the script says what ran), the slowest rank's
time per call counting (a MAX all_reduce of the times, outside the timed span); the first
round of each is a warm-up. Reported: each one's median and the ratio ring/attached of the
medians (> 1: attached is faster). Every result is checked against a float64 reference.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import gpuring
from gpuring.settings import parse_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="256K,512K,1M,2M,4M,8M,16M",
                   help="bytes, comma-separated")
    p.add_argument("--reps", type=int, default=15, help="timed rounds of each per size")
    p.add_argument("--calls", type=int, default=10, help="calls per timed round")
    args = p.parse_args()
    with gpuring.init() as comm:
        for text in args.sizes.split(","):
            count = parse_size(text) // 4
            x = np.random.default_rng(comm.rank).standard_normal(count).astype(np.float32)
            out = np.empty_like(x)
            want = comm.all_reduce(x.astype(np.float64))
            times: dict[str, list[float]] = {"ring": [], "chosen": []}
            ran = ""
            for rep in range(args.reps + 1):  # the first of each: warm-up, not counted
                for which in ("ring", "chosen") if rep % 2 else ("chosen", "ring"):
                    algorithm = "ring" if which == "ring" else None
                    comm.barrier()
                    t0 = time.perf_counter()
                    for _ in range(args.calls):
                        comm.all_reduce(x, out=out, algorithm=algorithm)
                    took = np.array([(time.perf_counter() - t0) / args.calls])
                    if which == "chosen":
                        ran = comm.last_schedule
                    comm.all_reduce(took, op="max", out=took)
                    if rep:
                        times[which].append(float(took[0]))
                    error = float(np.abs(out - want).max())
                    assert error < 1e-3 * comm.size, f"{which}: error {error}"
            ring, chosen = (statistics.median(times[w]) for w in ("ring", "chosen"))
            if comm.rank == 0:
                print(f"{text:>5} float32 sum on {comm.size} ranks: ring {ring * 1e6:9.1f} us, "
                      f"{ran} {chosen * 1e6:9.1f} us, ring/{ran.split()[0]} "
                      f"{ring / chosen:5.2f} (medians of {args.reps})", flush=True)


if __name__ == "__main__":
    main()
