"""Ranks that fail on purpose: `worker_faults.py CASE [DIR]`. Each survivor prints one line
`RESULT <rank> <ExceptionName> peer=<peer> after=<seconds>` and exits 0 when it saw the error
the case expects; the test reads those lines. With DIR, the line also goes to
DIR/result-<rank>.txt (for cases where stdout may be gone), and ranks that must act in a given
order wait for each other's files there: no sleeps decide what happens, and every wait is
bounded."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import numpy as np

import gpuring

DIR = sys.argv[2] if len(sys.argv) > 2 else None


def report(comm: gpuring.Communicator, exc: BaseException, since: float) -> None:
    peer = getattr(exc, "peer", None)
    after = time.monotonic() - since
    line = f"RESULT {comm.rank} {type(exc).__name__} peer={peer} after={after:.2f} :: {exc}"
    if DIR is not None:
        mark(f"result-{comm.rank}", line)
    try:
        print(line, flush=True)
    except OSError:  # the launcher (our stdout's reader) is gone
        pass


def mark(name: str, text: str = "") -> None:
    """Create DIR/name.txt atomically (a rank waiting for it never reads half of it)."""
    assert DIR is not None, "this case needs a directory argument"
    path = os.path.join(DIR, f"{name}.txt")
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def wait_for(*names: str, timeout: float = 60.0) -> None:
    """Wait until DIR/name.txt exists for every name (bounded: a missing one fails the rank)."""
    assert DIR is not None, "this case needs a directory argument"
    deadline = time.monotonic() + timeout
    for name in names:
        while not os.path.exists(os.path.join(DIR, f"{name}.txt")):
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} never came (waited {timeout} s)")
            time.sleep(0.01)


def exit_when_survivors_reported(comm: gpuring.Communicator, dead: int) -> None:
    """Under mpiexec, leave once every survivor has reported, without MPI_Finalize: hydra
    kills the remaining ranks as soon as it reaps one that a signal killed (which the first
    survivor's exit makes it do), and MPI_Finalize may wait for the dead rank."""
    if os.environ.get("GPURING_STORE"):
        return
    wait_for(*(f"result-{r}" for r in range(comm.size) if r != dead))
    mark("release")  # lazy_parent.py may reap the dead rank now
    sys.stdout.flush()
    os._exit(0)


def case_kill(comm: gpuring.Communicator) -> None:
    """Rank 1 is SIGKILLed while every rank is inside large collectives: all_reduces, or the
    verb GPURING_TEST_VERB names (all_to_all, gather, scatter, sendrecv: a ring shift,
    split: all_reduces of a sub-communicator of every rank, attached: all_reduces that read
    and write the peers' arrays by cross-memory attach)."""
    n = comm.size
    x = np.random.default_rng(comm.rank).standard_normal(n * (2 << 20)).astype(np.float32)
    verb = os.environ.get("GPURING_TEST_VERB", "all_reduce")
    out = np.empty_like(x)
    sub = comm.split(0, key=-comm.rank) if verb == "split" else None  # in reverse order
    calls = {"all_reduce": lambda: comm.all_reduce(x),
             "all_to_all": lambda: comm.all_to_all(x.reshape(n, -1)),
             "gather": lambda: comm.gather(x, root=n - 1),
             "scatter": lambda: comm.scatter(x.reshape(n, -1), root=0),
             "sendrecv": lambda: comm.sendrecv(x, (comm.rank + 1) % n, out,
                                               (comm.rank - 1) % n),
             "split": lambda: sub.all_reduce(x),  # type: ignore[union-attr]
             "attached": lambda: comm.all_reduce(x)}
    call = calls[verb]
    call()  # everyone set up
    if verb == "attached" and comm.last_schedule != "attached two_shot":
        raise AssertionError(f"the all_reduce ran {comm.last_schedule!r}, not attached")
    print(f"JOB {comm._control.job_id}", flush=True)
    if comm.rank == 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    since = time.monotonic()
    try:
        for _ in range(10_000):
            call()
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
        if DIR is not None:
            exit_when_survivors_reported(comm, dead=1)
        return
    raise AssertionError("no error although rank 1 was killed")


def case_kill_irecv(comm: gpuring.Communicator) -> None:
    """Rank 1 is SIGKILLed while every other rank waits in irecv: rank 0 for a message from
    rank 1, the others for one from any rank (GPURING_TEST_VERB=send: rank 0 in a large send
    to rank 1 instead, which waits for rank 1's receive)."""
    n = comm.size
    comm.sendrecv(np.ones(4), (comm.rank + 1) % n, np.zeros(4), (comm.rank - 1) % n)
    print(f"JOB {comm._control.job_id}", flush=True)
    if comm.rank == 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
        time.sleep(120)
        raise AssertionError("rank 1 outlived its SIGKILL")
    since = time.monotonic()
    try:
        if comm.rank == 0 and os.environ.get("GPURING_TEST_VERB") == "send":
            comm.isend(np.ones(1 << 22, np.float32), 1).wait()
        else:
            comm.irecv(np.zeros(4), 1 if comm.rank == 0 else None).wait()
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
        if DIR is not None:
            exit_when_survivors_reported(comm, dead=1)
        return
    raise AssertionError("no error although rank 1 was killed")


def case_leave_while_waited_for(comm: gpuring.Communicator) -> None:
    """Rank 0 closes while rank 1 waits in irecv for a message from it (which never
    comes): rank 1 raises PeerFailureError naming rank 0 at once, not at the timeout."""
    comm.sendrecv(np.ones(4), 1 - comm.rank, np.zeros(4), 1 - comm.rank)
    since = time.monotonic()
    if comm.rank == 0:
        comm.close()
        return
    try:
        comm.recv(np.zeros(4), 0)
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
        return
    raise AssertionError("no error although rank 0 left")


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
    """Rank 0 aborts from another thread while its all_reduce waits for rank 1, inside the
    flag wait (a hook on the device shows it got there); rank 1 enters only once it has heard
    of the abort. Then everyone re-inits."""
    x = np.ones(1000, np.float64)
    comm.all_reduce(x)
    since = time.monotonic()
    ended: list[str] = []
    if comm.rank == 0:
        device = comm._path.engines["cpu"].device
        wait_flag = device.wait_flag
        waiting = threading.Event()

        def watched_wait(flag, value, tag):
            waiting.set()
            try:
                wait_flag(flag, value, tag)
            except BaseException as exc:
                ended.append(type(exc).__name__)
                raise

        device.wait_flag = watched_wait  # type: ignore[method-assign]
        threading.Thread(target=lambda: waiting.wait(60) and comm.abort("test abort"),
                         daemon=True).start()
    else:
        deadline = time.monotonic() + 60
        while comm._path.life.cause is None:  # rank 0's abort, passed on by the launcher
            assert time.monotonic() < deadline, "rank 0's abort never arrived"
            time.sleep(0.01)
    try:
        comm.all_reduce(x)
    except gpuring.GpuringError as exc:
        if comm.rank == 0:  # the abort ended the wait itself, not a later check
            assert ended == ["FlagWaitAborted"], ended
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
    if comm.rank == 1:  # the all_reduce, compiled after this, calls the hook between steps
        engine = comm._path.engines["cpu"]
        engine.device.jitter = True
        stream = engine._inline
        calls = [0]

        def interrupt() -> None:
            calls[0] += 1
            if calls[0] == 2:
                raise KeyboardInterrupt

        stream.jitter = interrupt
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

    def settled() -> tuple[int, int, int]:
        """The fewest descriptors and mappings of a few samples: the watchdog opens a peer's
        /proc/<pid>/stat for a moment now and then, while a leak stays."""
        samples = []
        for _ in range(5):
            samples.append(usage())
            time.sleep(0.005)
        return (min(s[0] for s in samples), min(s[1] for s in samples), samples[-1][2])

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
    before = settled()
    for i in range(200, count):
        one(i)
    after = settled()
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


def case_late_failure(comm: gpuring.Communicator) -> None:
    """GPURING_TEST_NONBLOCKING=1, FAULT_CALL=synchronize|close, FAULT_WHEN=during|before.
    The survivors' all_reduce returns before it completes (it cannot: rank 1 never enters it);
    only then, once every survivor said so, does rank 1 give up: while the survivors wait in
    synchronize() or close() (during), or before they call it, once their watchdog recorded
    the failure (before). That call must raise PeerFailureError naming rank 1; after
    synchronize() raised, close() raises nothing more."""
    call, when = os.environ["FAULT_CALL"], os.environ["FAULT_WHEN"]
    x = np.ones(1000, np.float64)
    comm.all_reduce(x)
    comm.synchronize()
    assert not comm._path.engines["cpu"].device.blocking
    survivors = [r for r in range(comm.size) if r != 1]
    if comm.rank == 1:
        wait_for(*(f"returned-{r}" for r in survivors))
        comm.abort("planted failure after the others' call returned")
        mark("failed")
        comm.close()
        return
    since = time.monotonic()
    comm.all_reduce(x)  # returns at once: nothing has failed yet
    mark(f"returned-{comm.rank}")
    if when == "before":
        wait_for("failed")
        deadline = time.monotonic() + 30
        while comm._path.life.cause is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert comm._path.life.cause is not None, "the watchdog did not see rank 1 give up"
    try:
        comm.synchronize() if call == "synchronize" else comm.close()
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
    else:
        raise AssertionError(f"{call}() did not raise the failure of a collective in flight")
    comm.close()  # the failure was raised once: close() stays quiet
    print(f"CLOSED {comm.rank}", flush=True)


def case_agree_failure(comm: gpuring.Communicator) -> None:
    """FAULT_HOW=abort|kill. Ranks 1 and 2 agree on a signature not seen before (an exchange
    on the control plane) while rank 1 gives up or dies; rank 0 calls only after that. Ranks 0
    and 2 must raise PeerFailureError naming rank 1."""
    how = os.environ["FAULT_HOW"]
    comm.all_reduce(np.ones(1000, np.float64))  # everything set up, watchdog running
    new = np.ones(1001, np.float64)  # a signature nobody agreed on yet
    since = time.monotonic()
    if comm.rank == 1:
        def fail() -> None:
            wait_for("entering-1", "entering-2")
            mark("failing")
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            comm.abort("planted failure while agreeing")

        threading.Thread(target=fail, daemon=True).start()
    if comm.rank == 0:
        wait_for("failing")
    else:
        mark(f"entering-{comm.rank}")
    try:
        comm.all_reduce(new)
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
        if how == "kill":
            exit_when_survivors_reported(comm, dead=1)
        return
    raise AssertionError("agreement succeeded although rank 1 failed")


def case_agree_timeout(comm: gpuring.Communicator) -> None:
    """Rank 1 calls a new signature only after the others gave up waiting for it in the
    control-plane exchange (GPURING_TIMEOUT small). They raise CollectiveTimeoutError; rank 1
    must raise too (not run a collective the others have left), and nobody may hang."""
    x = np.ones(1000, np.float64)
    comm.all_reduce(x)
    new = np.ones(1001, np.float64)
    if comm.rank == 1:
        wait_for(*(f"result-{r}" for r in range(comm.size) if r != 1))
    since = time.monotonic()
    try:
        got = comm.all_reduce(new)
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
    else:
        raise AssertionError(f"rank {comm.rank} got {got[:3]} from an exchange that timed out")
    if comm.rank != 1:
        wait_for("result-1")  # rank 1 must not need us gone to find out


def case_first_call_stall(comm: gpuring.Communicator) -> None:
    """Rank 2 makes its first collective only once the others gave up waiting for it there
    (GPURING_TIMEOUT small: they time out while the ranks set the call up); it must raise too,
    at once (told), and nobody may hang."""
    x = np.random.default_rng(comm.rank).standard_normal(1000)
    if comm.rank == 2:
        wait_for(*(f"result-{r}" for r in range(comm.size) if r != 2))
    since = time.monotonic()
    try:
        got = comm.all_reduce(x)
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
    else:
        raise AssertionError(f"rank {comm.rank} got {got[:3]} from a call that timed out")
    if comm.rank != 2:
        wait_for("result-2")  # rank 2 must not need us gone to find out


def case_launcher_lost(comm: gpuring.Communicator) -> None:
    """The test SIGKILLs `gpuring run` while ranks 0 and 2 wait in a control-plane exchange
    for rank 1, which calls only once they raised. Every rank must raise a clear error."""
    mark(f"pid-{comm.rank}", f"{os.getpid()} {comm._control.job_id}")
    comm.all_reduce(np.ones(1000, np.float64))
    new = np.ones(1001, np.float64)
    if comm.rank == 1:
        wait_for("launcher-killed")
    else:
        mark(f"entering-{comm.rank}")
    since = time.monotonic()
    try:
        comm.all_reduce(new)
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
        return
    raise AssertionError("agreement succeeded without the launcher")


def case_channels(comm: gpuring.Communicator) -> None:
    """Two channels, two streams, both waiting for rank 1, which comes only after the others
    gave up (GPURING_TIMEOUT small). On ranks 0 and 2, stream 0 is held until the device is
    aborted, so it fails with that abort while stream 1 fails with the timeout that caused it:
    the error raised must be the timeout naming rank 1. Blocking device: from the call;
    GPURING_TEST_NONBLOCKING=1: from synchronize()."""
    x = np.ones(1 << 20, np.float32)  # 4 MiB: several pieces on each channel
    comm.all_reduce(x, channels=2)
    comm.synchronize()
    engine = comm._path.engines["cpu"]
    if comm.rank == 1:
        wait_for(*(f"result-{r}" for r in range(comm.size) if r != 1))
    else:
        stream0 = engine._streams[0]
        assert len(engine._streams) == 2
        if not engine.device.blocking:  # the streams' timeout, not the watchdog's, fires
            comm._path.watchdog._timeout = 3600.0
        deadline = time.monotonic() + 10 * comm.config.timeout
        original = stream0.jitter

        def hold() -> None:
            while engine.device.aborted is None and time.monotonic() < deadline:
                time.sleep(0.005)
            stream0.jitter = original

        stream0.jitter = hold
    since = time.monotonic()
    try:
        comm.all_reduce(x, channels=2)
        comm.synchronize()
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
        return
    raise AssertionError("no error although rank 1 never came")


def case_mpi_sleep(comm: gpuring.Communicator) -> None:
    """GPURING_TRANSPORT=mpi: rank 1 enters an all_reduce only after the others timed out in
    it (GPURING_TIMEOUT small)."""
    x = np.ones(1000, np.float64)
    comm.all_reduce(x)
    if comm.rank == 1:
        wait_for(*(f"result-{r}" for r in range(comm.size) if r != 1))
    since = time.monotonic()
    try:
        got = comm.all_reduce(x)
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
        return
    print(f"RESULT {comm.rank} returned peer=None after={time.monotonic() - since:.2f} :: "
          f"{got[:3]}", flush=True)


def case_mpi_kill(comm: gpuring.Communicator) -> None:
    """GPURING_TRANSPORT=mpi: rank 1 is SIGKILLed while every rank is in MPI all_reduces."""
    x = np.ones(1 << 20, np.float32)
    comm.all_reduce(x)
    if comm.rank == 1:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGKILL)).start()
    since = time.monotonic()
    try:
        for _ in range(100_000):
            comm.all_reduce(x)
    except gpuring.GpuringError as exc:
        report(comm, exc, since)
        exit_when_survivors_reported(comm, dead=1)
        return
    raise AssertionError("no error although rank 1 was killed")


def use_async_host_device() -> None:
    """The non-blocking host device of harness.py (the scheduler's GPU path), with one change:
    the caller does not wait for the collective's event either, as with CUDA, where the
    caller's stream waits for it and the host goes on. So a collective returns before it
    completes, and a failure that comes later is raised by synchronize(), the next call or
    close(), never from inside the call that already returned."""
    from harness import use_nonblocking_host_device

    from gpuring import devices

    use_nonblocking_host_device()
    nonblocking = devices.KINDS["cpu"]()
    assert not nonblocking.blocking

    class AsyncHostDevice(nonblocking):  # type: ignore[misc, valid-type]
        def order_caller_after(self, event) -> None:
            pass

    devices.KINDS["cpu"] = lambda: AsyncHostDevice


def main() -> None:
    if os.environ.get("GPURING_TEST_NONBLOCKING") == "1":
        use_async_host_device()
    case = sys.argv[1]
    timeout = float(os.environ.get("GPURING_TIMEOUT", "600"))
    comm = gpuring.init(timeout=timeout)
    if DIR is not None and not os.environ.get("GPURING_STORE"):
        # MPICH's shared memory, which a killed job leaves behind: the test removes it
        with open("/proc/self/maps") as f:
            names = {line.split("/dev/shm/")[1].split()[0] for line in f
                     if "/dev/shm/mpich_shm" in line}
        mark(f"mpich-shm-{comm.rank}", "\n".join(sorted(names)))
    globals()[f"case_{case}"](comm)


if __name__ == "__main__":
    main()
