"""A process of a job (gpuring.distributed, NumPy arrays) where rank 0 ends first:
`worker_leaving.py RANK N PORT leave|die` started by hand, `worker_leaving.py launched
leave|die` under a launcher.

leave: rank 0 calls broadcast #3 (root 0, which needs nothing of its peers) and ends its
  process at once (`os._exit`: no atexit, no close, as a multiprocessing child ends); the
  others wait until its process is gone, then call that broadcast: each must get rank 0's
  data, close without error, and then find any further collective failing with
  PeerFailureError naming rank 0 (it needs rank 0).
die: rank 0 SIGKILLs itself inside all_reduces; the others must raise PeerFailureError
  naming rank 0, within seconds.
Each rank prints `RESULT RANK WHAT ...` lines."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

import gpuring
import gpuring.distributed as dist


def running(pid: int) -> bool:
    """Whether process `pid` runs (a zombie does not: it ended, unreaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")


timeout = float(os.environ.get("GPURING_TIMEOUT", "60"))
if sys.argv[1] == "launched":  # by gpuring run, mpiexec or torchrun: their rendezvous
    mode = sys.argv[2]
    comm = dist.NCCLBackend.over(gpuring.init(timeout=timeout))
    rank, n = comm.rank, comm.comm.size
else:
    rank, n, port, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    comm = dist.NCCLBackend(n, rank, port=port, timeout=timeout)
data = np.random.default_rng(7).standard_normal(1000)
x = data.copy() if rank == 0 else np.zeros_like(data)
comm.broadcast(x, 0)  # agreed and set up with every rank
pids = np.zeros(n, np.int64)
comm.all_gather(np.array([os.getpid()], np.int64), pids, 1)

if mode == "leave":
    x = data * 2 if rank == 0 else np.zeros_like(data)
    if rank == 0:
        comm.broadcast(x, 0)
        os._exit(0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and running(int(pids[0])):  # until rank 0 is gone
        time.sleep(0.01)
    print(f"RESULT {rank} rank0-gone", flush=True)
    time.sleep(0.5)  # (ten watchdog ticks, and the server's notice: they must fail nothing)
    comm.broadcast(x, 0)
    ok = np.array_equal(x, data * 2)
    print(f"RESULT {rank} broadcast-after-rank0-left {'ok' if ok else 'WRONG'}", flush=True)
    since = time.monotonic()
    try:
        comm.all_reduce(np.ones(4), np.zeros(4))
        print(f"RESULT {rank} later-call no-error", flush=True)
    except gpuring.PeerFailureError as exc:
        print(f"RESULT {rank} later-call PeerFailureError peer={exc.peer} "
              f"after={time.monotonic() - since:.2f} :: {exc}", flush=True)
    comm.stop()
    print(f"RESULT {rank} stopped", flush=True)
else:
    big = np.ones(1 << 18)
    if rank == 0:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    since = time.monotonic()
    try:
        for _ in range(100_000):
            comm.all_reduce(big, np.empty_like(big))
    except gpuring.GpuringError as exc:
        print(f"RESULT {rank} {type(exc).__name__} peer={getattr(exc, 'peer', None)} "
              f"after={time.monotonic() - since:.2f} :: {exc}", flush=True)
        sys.exit(0)
    print(f"RESULT {rank} no-error", flush=True)
