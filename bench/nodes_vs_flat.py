"""all_reduce across nodes: gpuring in two levels beside gpuring flat on MPI and MPI's own
Allreduce, in the same processes.

    mpiexec -n 2 -env GPURING_HOSTNAME a python bench/nodes_vs_flat.py : \\
            -n 2 -env GPURING_HOSTNAME b python bench/nodes_vs_flat.py [--sizes ...] [--reps 15]

NumPy float32 sum. The three systems take turns call by call on the same arrays, every rank
starting each call together (an MPI barrier before it, not timed); reported per size: the
median over `--reps` calls of the slowest rank's time, and the ratios. Every result is
checked against MPI's (within float32 rounding of a 4-term sum).

On simulated nodes (one machine) "the network" is MPI's shared memory: this measures the
software of each route, not a network. bench/README.md has the model for real nodes.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import numpy as np
from mpi4py import MPI

import gpuring
from gpuring._config import parse_size
from gpuring.rendezvous.mpi import MpiControl


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4K,64K,1M,16M", help="bytes, comma-separated")
    p.add_argument("--reps", type=int, default=15, help="calls of each system per size")
    args = p.parse_args()
    world = MPI.COMM_WORLD
    with gpuring.init() as nodes:
        flat = gpuring.Communicator(MpiControl(),
                                    dataclasses.replace(nodes.config, transport="mpi"))
        layout = nodes._path.layout
        if nodes.rank == 0:
            where = "one node" if layout is None else (
                f"{layout.nodes} nodes of {layout.local_size} ranks")
            print(f"# {nodes.size} ranks on {where}; median of {args.reps} calls each, the "
                  "slowest rank's time")
            print(f"{'bytes':>10} {'two levels us':>14} {'flat us':>10} {'mpi us':>10} "
                  f"{'flat/two':>9} {'mpi/two':>8}")

        def two_levels(x: np.ndarray) -> np.ndarray:
            return nodes.all_reduce(x)

        def flat_mpi(x: np.ndarray) -> np.ndarray:
            return flat.all_reduce(x)

        def mpi(x: np.ndarray) -> np.ndarray:
            out = np.empty_like(x)
            world.Allreduce(x, out, op=MPI.SUM)
            return out

        systems = [two_levels, flat_mpi, mpi]
        for text in args.sizes.split(","):
            nbytes = parse_size(text)
            x = np.random.default_rng([nbytes, nodes.rank]).standard_normal(
                nbytes // 4).astype(np.float32)
            times: dict[str, list[float]] = {s.__name__: [] for s in systems}
            for rep in range(args.reps + 2):  # two warm-up calls each
                for system in systems:
                    world.Barrier()
                    start = time.perf_counter()
                    got = system(x)
                    took = world.allreduce(time.perf_counter() - start, op=MPI.MAX)
                    want = mpi(x)
                    assert np.allclose(got, want, rtol=1e-5, atol=1e-5), system.__name__
                    if rep >= 2:
                        times[system.__name__].append(took * 1e6)
            if nodes.rank == 0:
                med = {name: statistics.median(t) for name, t in times.items()}
                print(f"{nbytes:>10} {med['two_levels']:>14.1f} {med['flat_mpi']:>10.1f} "
                      f"{med['mpi']:>10.1f} {med['flat_mpi'] / med['two_levels']:>9.2f} "
                      f"{med['mpi'] / med['two_levels']:>8.2f}", flush=True)
        flat.close()


if __name__ == "__main__":
    main()
