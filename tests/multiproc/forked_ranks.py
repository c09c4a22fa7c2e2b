"""`forked_ranks.py SIZE PORT SEED`: a program that imports CuPy and gpuring, then forks SIZE
ranks with `multiprocessing` (the fork start method, Linux's default) before any CUDA call,
as a user's script may. The ranks meet as torchrun's would (gpuring serves on PORT) and each
all_reduces CuPy arrays of fresh random data on the GPU `local_rank % device count`, checking
its own result against tests/reference.py; then the parent runs on the GPU itself. Prints one
JSON object: each rank's first wrong element (None where right) or what it raised, and the
parent's."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import traceback
from typing import Any

import cupy
import numpy as np

import gpuring

from ..reference import first_wrong, reduction

ELEMENTS = 100_003


def _data(seed: int, rank: int) -> np.ndarray:
    return np.random.default_rng([seed, rank]).standard_normal(ELEMENTS).astype(np.float32)


def _rank(rank: int, size: int, port: int, seed: int, conn: Any) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port - 1))
    try:
        with gpuring.init(timeout=60) as comm:
            cupy.cuda.Device(comm.local_rank % cupy.cuda.runtime.getDeviceCount()).use()
            got = comm.all_reduce(cupy.asarray(_data(seed, rank))).get()
            want = reduction([_data(seed, r) for r in range(size)], "sum")
            conn.send(first_wrong(got, want))
    except BaseException:
        conn.send(f"raised: {traceback.format_exc()}")


def main() -> None:
    size, port, seed = (int(a) for a in sys.argv[1:4])
    fork = multiprocessing.get_context("fork")
    pipes = [fork.Pipe() for _ in range(size)]
    ranks = [fork.Process(target=_rank, args=(r, size, port, seed, pipes[r][1]))
             for r in range(size)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(240)
    outcomes: list[Any] = []
    for process, (mine, _) in zip(ranks, pipes, strict=True):
        if process.is_alive():
            process.kill()
            process.join()
            outcomes.append("hung")
        else:
            outcomes.append(mine.recv() if mine.poll() else f"exit {process.exitcode}")
    host = _data(seed, size)
    parent = first_wrong((cupy.asarray(host) * 2).get(), host * np.float32(2))
    print(json.dumps({"ranks": outcomes, "parent": parent}))


if __name__ == "__main__":
    main()
