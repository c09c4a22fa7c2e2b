"""A process of a job started by hand, as a cupyx.distributed user writes it, with the import
changed: `worker_distributed.py RANK N PORT cpu|cuda [kill]`. Every call's result is checked
against NumPy on random integers (exact in every dtype used); prints `rank R: ok` at the end.
With `kill`, rank 1 SIGKILLs itself inside all_reduces and the others print the error."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

import gpuring
import gpuring.distributed as dist

rank, n, port, device = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
xp = np
if device == "cuda":
    import cupy

    xp = cupy
    cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()


def inputs(shape, seed, dtype="float32"):
    return [np.random.default_rng([seed, r]).integers(-50, 50, shape).astype(dtype)
            for r in range(n)]


def same(got, want, what):
    got = got.get() if hasattr(got, "get") else got
    assert got.dtype == want.dtype and np.array_equal(got, want), (what, got, want)


comm = dist.init_process_group(n, rank, port=port, timeout=60)
assert comm.rank == rank
if len(sys.argv) > 5:  # kill
    x = xp.ones(1 << 20, "float32")
    comm.all_reduce(x, x)
    if rank == 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    since = time.monotonic()
    try:
        for _ in range(100_000):
            comm.all_reduce(x, xp.empty_like(x))
        comm.comm.synchronize()
    except gpuring.GpuringError as exc:
        print(f"RESULT {rank} {type(exc).__name__} peer={getattr(exc, 'peer', None)} "
              f"after={time.monotonic() - since:.2f} :: {exc}", flush=True)
        sys.exit(0)
    raise AssertionError("no error although rank 1 was killed")

stream = cupy.cuda.Stream(non_blocking=True) if device == "cuda" else None
for seed, dtype in enumerate(["float32", "int64", "float64"]):
    ins = inputs((6, 5), seed, dtype)
    total = np.sum(ins, axis=0, dtype=dtype)
    x, y = xp.array(ins[rank]), xp.empty((30,), dtype)  # cupyx reads arrays by their size
    comm.all_reduce(x, y, op="sum", stream=stream)
    if stream is not None:
        stream.synchronize()
    same(y.reshape(6, 5), total, "all_reduce")
    comm.all_reduce(x, y, "max")
    same(y.reshape(6, 5), np.max(ins, axis=0), "all_reduce max")
    comm.all_reduce(x, x)  # in place
    same(x, total, "all_reduce in place")
    for root in range(n):
        out = xp.zeros((6, 5), dtype)
        comm.reduce(xp.array(ins[rank]), out, root, "prod")
        if rank == root:
            same(out, np.prod(ins, axis=0, dtype=dtype), f"reduce root {root}")
        b = xp.array(ins[rank])
        comm.broadcast(b, root)
        same(b, ins[root], f"broadcast root {root}")
    count = 30 // n if 30 % n == 0 else None
    if count is not None:
        out = xp.empty(count, dtype)
        comm.reduce_scatter(xp.array(ins[rank]), out, count)
        same(out, total.reshape(-1)[rank * count:(rank + 1) * count], "reduce_scatter")
    gathered = xp.empty((n * 30,), dtype)
    comm.all_gather(xp.array(ins[rank]), gathered, 30)
    same(gathered.reshape(n, 6, 5), np.stack(ins), "all_gather")
    blocks = inputs((n, 4), 100 + seed, dtype)
    mine = xp.empty(4, dtype)
    comm.scatter(xp.array(blocks[rank]), mine, root=n - 1)
    same(mine, blocks[n - 1][rank], "scatter")
    stacked = xp.zeros((n, 4), dtype)
    comm.gather(xp.array(blocks[rank][0]), stacked, root=0)
    if rank == 0:
        same(stacked, np.stack([b[0] for b in blocks]), "gather")
    swapped = xp.empty((n, 4), dtype)
    comm.all_to_all(xp.array(blocks[rank]), swapped)
    same(swapped, np.stack([blocks[q][rank] for q in range(n)]), "all_to_all")
    if n > 1:
        if rank == 0:
            comm.send(xp.array(ins[0]), 1)
        elif rank == 1:
            got = xp.empty((6, 5), dtype)
            comm.recv(got, 0)
            same(got, ins[0], "recv")
        partner = rank ^ 1
        if partner < n:
            got = xp.empty((6, 5), dtype)
            comm.send_recv(xp.array(ins[rank]), got, partner)
            same(got, ins[partner], "send_recv")
        # any buffer with room: (30,) into (6, 5), and on NumPy arrays into a larger one
        if rank == 0:
            comm.send(xp.array(ins[0]).reshape(-1), 1)
            if device == "cpu":
                comm.send(xp.array(ins[0]).reshape(-1), 1)
        elif rank == 1:
            got = xp.empty((6, 5), dtype)
            comm.recv(got, 0)
            same(got, ins[0], "recv of (30,) into (6, 5)")
            if device == "cpu":
                larger = xp.zeros((4, 10), dtype)
                comm.recv(larger, 0)
                same(larger.reshape(-1)[:30], ins[0].reshape(-1), "recv into a larger buffer")
    comm.barrier()
avg = xp.empty(3, "float64")
comm.all_reduce(xp.full(3, float(rank)), avg, op="avg")  # beyond cupyx
same(avg, np.full(3, (n - 1) / 2), "avg")
if n > 1:
    try:
        comm.all_reduce(xp.ones(3 + (rank == 1)), xp.ones(3 + (rank == 1)))
    except gpuring.CollectiveMismatchError as exc:
        assert "shape" in exc.differences, exc.differences
    else:
        raise AssertionError("no CollectiveMismatchError for another shape")
comm.stop()
print(f"rank {rank}: ok", flush=True)
