"""Where a small NumPy all_reduce spends its time, beside MPI's Allreduce in the same run.

    mpiexec -n 2 python bench/small_message_profile.py [--iters 5000]

For 8 B, 256 B and 4 KiB (float32, sum, `out=` given, back-to-back calls, median of 5
repetitions of the per-call mean; each line is rank 0's view):
  floor       the flag protocol alone in plain Python on one shared page: copy in, publish,
              wait for the peer, add, publish done; nothing of gpuring
  runners     gpuring's compiled steps of the prepared collective, called directly
  engine.run  the scheduler's entry (plus ordering and the program lookup)
  all_reduce  the public call (argument checks, the call path, the status board, wrapping)
  persistent  a persistent all_reduce's start and wait (`comm.all_reduce_init`): the prepared
              call run again, without argument checks or look-ups
  MPI         mpi4py's Allreduce on the same arrays
Each layer includes the ones above it; the difference is that layer's own cost. Two ranks on
two cores: the time of one call is the slower rank's path plus the hand-over between them.
"""

from __future__ import annotations

import argparse
import functools
import mmap
import os
import platform
import statistics
import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

import gpuring


def per_call_us(mpi: MPI.Comm, fn: Callable[[], object], iters: int) -> float:
    for _ in range(iters // 5):
        fn()
    reps = []
    for _ in range(5):
        mpi.Barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        reps.append((time.perf_counter() - t0) / iters * 1e6)
    return statistics.median(reps)


def floor(mpi: MPI.Comm, x: np.ndarray, out: np.ndarray) -> Callable[[], None]:
    """The protocol without any layer: each rank owns a data slot and two words."""
    rank, peer = mpi.rank, 1 - mpi.rank
    path = f"/dev/shm/gpuring-floor-{mpi.bcast(os.getpid())}"
    if rank == 0:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, 1 << 16)
        os.close(fd)
    mpi.Barrier()
    fd = os.open(path, os.O_RDWR)
    mapping = mmap.mmap(fd, 1 << 16)
    os.close(fd)
    mpi.Barrier()
    if rank == 0:
        os.unlink(path)
    words = memoryview(mapping).cast("q")
    u8 = np.frombuffer(mapping, np.uint8)
    slot = 4096 + 16384 * np.arange(2)
    mine = u8[slot[rank]:slot[rank] + x.nbytes].view(x.dtype)
    theirs = u8[slot[peer]:slot[peer] + x.nbytes].view(x.dtype)
    ready, done = (rank, peer), (8 + rank, 8 + peer)
    seq = [0]

    def once() -> None:
        s = seq[0] = seq[0] + 1
        while words[done[1]] < s - 1:  # the peer has read the previous round
            os.sched_yield()
        np.copyto(mine, x)
        words[ready[0]] = s
        while words[ready[1]] < s:
            os.sched_yield()
        np.add(x, theirs, out=out)
        words[done[0]] = s

    return once


def measure(mpi: MPI.Comm, comm: gpuring.Communicator, nbytes: int, iters: int,
            layers: bool) -> dict[str, float]:
    """Microseconds per call of each layer (only the public call and MPI's without
    `layers`) for one size."""
    x = np.random.default_rng(mpi.rank).standard_normal(nbytes // 4).astype(np.float32)
    out, expected = np.empty_like(x), np.empty_like(x)
    comm.all_reduce(x, out=out)
    mpi.Allreduce(x, expected)
    assert np.array_equal(out, expected), "gpuring and MPI disagree"
    nan = float("nan")
    if not layers:
        return {"floor": nan, "runners": nan, "engine": nan,
                "all_reduce": per_call_us(mpi, lambda: comm.all_reduce(x, out=out), iters),
                "persistent": nan,
                "mpi": per_call_us(mpi, lambda: mpi.Allreduce(x, expected), iters)}
    persistent = comm.all_reduce_init(x, out=out)
    prepared = next(p for k, p in comm._path.prepared.items()
                    if k[0] == "all_reduce" and k[1] == x.shape)
    launch = prepared.launch
    assert launch is not None
    engine = launch.engine
    in_mem, out_mem = engine.device.wrap(x), engine.device.wrap(out)
    engine_run = functools.partial(engine.run, launch, in_mem, out_mem, "all_reduce", 0)
    engine_run()

    def runners() -> None:  # the one-shot round's runners, its credits known (2 ranks)
        engine._seq += 1
        seq = engine._seq
        key = (0, seq & 1, True)
        for runner in launch.runners.get(key) or engine._compile_inline(launch, key):
            runner(in_mem, out_mem, seq)

    times = {
        "floor": per_call_us(mpi, floor(mpi, x, out), iters),
        "runners": per_call_us(mpi, runners, iters),
        "engine": per_call_us(mpi, engine_run, iters),
        "all_reduce": per_call_us(mpi, lambda: comm.all_reduce(x, out=out), iters),
        "persistent": per_call_us(mpi, persistent, iters),
        "mpi": per_call_us(mpi, lambda: mpi.Allreduce(x, expected), iters),
    }
    assert np.array_equal(out, expected), "gpuring and MPI disagree"
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=5000)
    parser.add_argument("--public-only", action="store_true",
                        help="time only the public call and MPI's (for commits before the "
                             "layers this script reaches into existed)")
    args = parser.parse_args()
    mpi = MPI.COMM_WORLD
    if mpi.size != 2:
        raise SystemExit("run it on 2 ranks: mpiexec -n 2 python bench/small_message_profile.py")
    comm = gpuring.init()
    if mpi.rank == 0:
        print(f"# 2 ranks, float32 sum, {args.iters} calls x 5; python "
              f"{platform.python_version()}, numpy {np.__version__}, "
              f"{MPI.Get_library_version().splitlines()[0].strip()}")
        print(f"# {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
        print(f"{'bytes':>6} {'floor':>7} {'runners':>8} {'engine':>7} {'all_reduce':>11} "
              f"{'persistent':>11} {'MPI':>6} {'ratio':>6} {'p-ratio':>8}   (us per call; "
              "ratio = all_reduce / MPI, p-ratio = persistent / MPI)")
    for nbytes in (8, 256, 4096):
        times = measure(mpi, comm, nbytes, args.iters, layers=not args.public_only)
        if mpi.rank == 0:
            print(f"{nbytes:6d} {times['floor']:7.2f} {times['runners']:8.2f} "
                  f"{times['engine']:7.2f} {times['all_reduce']:11.2f} "
                  f"{times['persistent']:11.2f} {times['mpi']:6.2f} "
                  f"{times['all_reduce'] / times['mpi']:6.2f} "
                  f"{times['persistent'] / times['mpi']:8.2f}", flush=True)
    mpi.Barrier()
    comm.close()


if __name__ == "__main__":
    main()
