"""Processes started by hand, as a cupyx.distributed user starts them, with one import changed:

    python examples/cupyx_style.py 0 2 &  python examples/cupyx_style.py 1 2

Arguments: this process's rank, the number of processes, and optionally the rendezvous port
(default 13333, cupyx's) and `--device cpu|cuda` (default: cuda where CuPy sees a GPU). Rank 0
serves the rendezvous on 127.0.0.1; the others connect to it. On a shared machine give every
process the same GPURING_JOB_KEY (a hex string), so that only they may join.
"""

import argparse

import numpy as np

import gpuring.distributed as dist  # was: import cupyx.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rank", type=int)
    parser.add_argument("n_devices", type=int)
    parser.add_argument("port", type=int, nargs="?", default=dist.DEFAULT_PORT)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None)
    args = parser.parse_args()
    xp = np
    device = args.device or ("cuda" if _gpus() else "cpu")
    if device == "cuda":
        import cupy

        xp = cupy
        cupy.cuda.Device(args.rank % cupy.cuda.runtime.getDeviceCount()).use()

    comm = dist.init_process_group(args.n_devices, args.rank, port=args.port)
    n, rank = args.n_devices, args.rank
    x = xp.arange(8, dtype=xp.float32) + rank
    total = xp.empty_like(x)
    comm.all_reduce(x, total, op="sum")  # results go into the arrays given; returns None
    peer = rank ^ 1  # pairs of processes (0, 1), (2, 3), ... swap their x
    theirs = xp.empty_like(x)
    if peer < n:
        comm.send_recv(x, theirs, peer)
    gathered = xp.empty((n, 8), dtype=xp.float32)
    comm.all_gather(x, gathered, 8)
    comm.broadcast(x, root=0)  # in place: rank 0's x everywhere
    comm.barrier()
    comm.stop()

    base = np.arange(8, dtype=np.float32)
    assert np.array_equal(_host(total), base * n + n * (n - 1) / 2)
    assert peer >= n or np.array_equal(_host(theirs), base + peer)
    assert np.array_equal(_host(gathered), base + np.arange(n, dtype=np.float32)[:, None])
    assert np.array_equal(_host(x), base)
    print(f"rank {rank} of {n} ({device}): sum {_host(total)[:3].tolist()}...")


def _gpus() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no CuPy, no driver, no GPU
        return 0


def _host(array: object) -> np.ndarray:
    return array.get() if hasattr(array, "get") else np.asarray(array)


if __name__ == "__main__":
    main()
