"""Ranks that fail on purpose: `worker_faults.py CASE`. Each survivor prints one line
`RESULT <rank> <ExceptionName> peer=<peer> after=<seconds>` and exits 0 when it saw the error
the case expects; the test reads those lines."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

import gpuring


def report(comm: gpuring.Communicator, exc: BaseException, since: float) -> None:
    peer = getattr(exc, "peer", None)
    after = time.monotonic() - since
    print(f"RESULT {comm.rank} {type(exc).__name__} peer={peer} after={after:.2f} :: {exc}",
          flush=True)


def case_kill(comm: gpuring.Communicator) -> None:
    """Rank 1 is SIGKILLed while every rank is inside large all_reduces."""
    x = np.random.default_rng(comm.rank).standard_normal(8 << 20).astype(np.float32)  # 32 MiB
    comm.all_reduce(x)  # everyone set up
    print(f"JOB {os.environ.get('GPURING_JOB_ID', '')}", flush=True)
    if comm.rank == 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    since = time.monotonic()
    try:
        for _ in range(10_000):
            comm.all_reduce(x)
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
        return
    raise AssertionError("no error although rank 1 was killed")


def case_kill_cuda(comm: gpuring.Communicator) -> None:
    """Rank 1 is SIGKILLed while every rank is inside all_reduces of CuPy arrays. Each
    survivor raises, closes, and then uses its GPU as a program saving a checkpoint would:
    a device-wide synchronize, new arrays, freeing the pool. None of it may hang on a stream
    still waiting for the dead rank."""
    import cupy

    cupy.cuda.Device(comm.local_rank % cupy.cuda.runtime.getDeviceCount()).use()
    rng = np.random.default_rng(comm.rank)
    x = cupy.asarray(rng.standard_normal(1 << 20).astype(np.float32))  # 4 MiB
    comm.all_reduce(x, op="avg", out=x)
    comm.synchronize()
    print(f"JOB {os.environ.get('GPURING_JOB_ID', '')}", flush=True)
    if comm.rank == 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    since = time.monotonic()
    try:
        for i in range(100_000):
            comm.all_reduce(x, op="avg", out=x)
            if i % 4 == 3:
                comm.synchronize()
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
        comm.close()
        cupy.cuda.Device().synchronize()
        checkpoint = cupy.asnumpy(x)  # what a survivor saves
        y = cupy.arange(1000, dtype=cupy.float32) * 2
        assert float(y.sum()) == 999000.0 and checkpoint.shape == (1 << 20,)
        del x, y
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.cuda.Device().synchronize()
        print(f"RECOVERED {comm.rank} after={time.monotonic() - since:.2f}", flush=True)
        return
    raise AssertionError("no error although rank 1 was killed")


def case_sleep(comm: gpuring.Communicator) -> None:
    """Rank 1 sleeps past the timeout before a collective."""
    x = np.ones(1000, np.float64)
    comm.all_reduce(x)
    since = time.monotonic()
    if comm.rank == 1:
        time.sleep(comm.config.timeout * 2 + 1)
    try:
        comm.all_reduce(x)
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
        return
    raise AssertionError("no error although rank 1 slept past the timeout")


def case_order(comm: gpuring.Communicator) -> None:
    """Rank 0 calls all_reduce while the others call broadcast: first with fresh signatures
    (control-plane agreement), then with cached ones (status board)."""
    x = np.arange(64, dtype=np.float32)
    since = time.monotonic()
    try:
        comm.all_reduce(x) if comm.rank == 0 else comm.broadcast(x)
    except gpuring.CollectiveMismatchError as exc:
        report(comm, exc, since)
    else:
        raise AssertionError("fresh mismatch not detected")
    # both signatures are now known everywhere: the cached path must catch it too
    comm2 = comm
    comm2.close()
    comm = gpuring.init(timeout=comm2.config.timeout)
    comm.all_reduce(x)
    comm.broadcast(x)
    since = time.monotonic()
    try:
        comm.all_reduce(x) if comm.rank == 0 else comm.broadcast(x)
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
    else:
        raise AssertionError("cached mismatch not detected")


def case_abort(comm: gpuring.Communicator) -> None:
    """Rank 0 aborts from another thread while waiting for rank 1; then everyone re-inits."""
    x = np.ones(1000, np.float64)
    comm.all_reduce(x)
    since = time.monotonic()
    if comm.rank == 0:
        threading.Timer(0.5, comm.abort, ("test abort",)).start()
    else:
        time.sleep(1.5)
    try:
        comm.all_reduce(x)
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
    else:
        raise AssertionError("abort did not fail the collective")
    try:
        comm.all_reduce(x)
    except gpuring.CommunicatorClosedError:
        pass
    comm.close()
    with gpuring.init() as fresh:
        got = fresh.all_reduce(np.full(5, fresh.rank + 1.0))
        assert np.all(got == sum(range(1, fresh.size + 1))), got
        print(f"REINIT {fresh.rank} ok", flush=True)


def case_interrupt(comm: gpuring.Communicator) -> None:
    """A KeyboardInterrupt lands inside rank 1's collective (injected through the host
    device's jitter hook); rank 1 catches it and carries on. Nobody may get stale data."""
    comm.barrier()
    x = np.full(16, comm.rank + 1.0, np.float32)
    if comm.rank == 1:
        stream = comm._engines["cpu"]._inline
        calls = [0]

        def interrupt() -> None:
            calls[0] += 1
            if calls[0] == 2:
                raise KeyboardInterrupt

        stream._jitter = interrupt
    since = time.monotonic()
    for _ in range(2):
        try:
            got = comm.all_reduce(x)
            raise AssertionError(f"rank {comm.rank} got {got} from a broken collective")
        except KeyboardInterrupt:
            continue
        except gpuring.GpuringError as exc:
            report(comm, exc, since)
            return


def case_stall(comm: gpuring.Communicator) -> None:
    """Rank 1 arrives late (within the timeout): the others log that it is missing."""
    x = np.ones(100, np.float64)
    comm.all_reduce(x)
    if comm.rank == 1:
        time.sleep(2.0)
    got = comm.all_reduce(x)
    assert np.all(got == comm.size)
    print(f"RESULT {comm.rank} ok stall", flush=True)


def case_verify(comm: gpuring.Communicator) -> None:
    """GPURING_VERIFY=1: results that differ across ranks raise on every rank. The difference
    is faked by corrupting what rank 1 checksums."""
    assert comm.config.verify
    x = np.arange(50, dtype=np.float32)
    comm.all_reduce(x)  # agreeing results pass
    if comm.rank == 1:
        from gpuring import _arrays

        real = _arrays.to_host
        _arrays.to_host = lambda a: real(a) + 1
    since = time.monotonic()
    try:
        comm.all_reduce(x)
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
    else:
        raise AssertionError("differing results were not detected")


def case_soak(comm: gpuring.Communicator) -> None:
    """Thousands of mixed collectives of random sizes, all verified; no growth in open files,
    mappings or memory."""
    count = int(os.environ.get("SOAK_COUNT", "10000"))
    n, r = comm.size, comm.rank
    rng = np.random.default_rng(11)  # same sequence on every rank

    def usage() -> tuple[int, int, int]:
        fds = len(os.listdir("/proc/self/fd"))
        with open("/proc/self/maps") as f:
            maps = sum("gpuring-" in line for line in f)
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return fds, maps, rss

    def one(i: int) -> None:
        size = int(rng.integers(0, 3000)) * n + int(rng.integers(0, n))
        kind = int(rng.integers(0, 5))
        base = np.arange(size, dtype=np.int64) * (i + 1)
        mine = base + r
        total = base * n + n * (n - 1) // 2
        if kind == 0:
            assert np.array_equal(comm.all_reduce(mine), total)
        elif kind == 1:
            m = size - size % n
            got = comm.reduce_scatter(mine[:m])
            assert np.array_equal(got, total[:m].reshape(n, -1)[r])
        elif kind == 2:
            got = comm.all_gather(mine)
            assert np.array_equal(got, np.stack([base + k for k in range(n)]))
        elif kind == 3:
            y = mine.copy()
            comm.broadcast(y, root=i % n)
            assert np.array_equal(y, base + i % n)
        else:
            got = comm.reduce(mine, root=i % n)
            assert got is None if r != i % n else np.array_equal(got, total)

    for i in range(200):  # warm up caches and buffers
        one(i)
    before = usage()
    for i in range(200, count):
        one(i)
    after = usage()
    print(f"USAGE {r} before={before} after={after}", flush=True)
    assert after[0] <= before[0] and after[1] <= before[1], (before, after)
    assert after[2] < before[2] + (64 << 20), (before, after)
    print(f"RESULT {r} ok soak {count}", flush=True)


def case_leave_early(comm: gpuring.Communicator) -> None:
    """Rank 0 closes after the first collective while the others start a second one. They
    raise PeerFailureError at once, not at the timeout: from the call, or (a device whose
    collectives return before completing) from close()."""
    x = np.ones(1000, np.float64)
    comm.all_reduce(x)
    since = time.monotonic()
    if comm.rank == 0:
        comm.close()
        return
    try:
        comm.all_reduce(x)
        comm.close()
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
        return
    raise AssertionError("no error although rank 0 left")


def case_fail_while_idle(comm: gpuring.Communicator) -> None:
    """Rank 0 aborts after every rank's collectives completed: nobody lost a result, so
    close() raises on no rank, and everyone re-inits."""
    x = np.ones(1000, np.float64)
    comm.all_reduce(x)
    comm.synchronize()
    comm.barrier()
    if comm.rank == 0:
        comm.abort("recovering")
    time.sleep(1.0)  # the others learn of it while idle
    comm.close()
    with gpuring.init(timeout=comm.config.timeout) as again:
        again.all_reduce(x)
        again.synchronize()
    print(f"CLEAN {comm.rank}", flush=True)


def main() -> None:
    if os.environ.get("GPURING_TEST_NONBLOCKING") == "1":
        from worker import use_nonblocking_host_device

        use_nonblocking_host_device()
    case = sys.argv[1]
    timeout = float(os.environ.get("GPURING_TIMEOUT", "600"))
    comm = gpuring.init(timeout=timeout)
    globals()[f"case_{case}"](comm)


if __name__ == "__main__":
    main()
