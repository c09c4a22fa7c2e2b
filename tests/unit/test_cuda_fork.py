"""The CUDA simulator (tests/cudasim) and fork, as CUDA and CuPy behave: importing CuPy
initializes nothing, so a child forked before the first CUDA call runs on the GPU as any
process does; a child forked after it gets cudaErrorInitializationError ("initialization
error") from every runtime call (CUDA_ERROR_NOT_INITIALIZED from the driver), at once, never
a wait; the parent keeps working either way. Children are forked by `multiprocessing` (its
default start method on Linux) in a Python of their own, so that a hang is a timeout here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np

CUDASIM = Path(__file__).resolve().parents[1] / "cudasim"
#: how long one script may take (a child that hangs is killed by the script after a third)
TIMEOUT = 120

#: what each script starts with: the simulator as `cupy`, a forked child that reports what it
#: returned (or raised) through a pipe, and the arithmetic the tests check on fresh data
PRELUDE = f"CHILD_TIMEOUT = {TIMEOUT // 3}\n" + textwrap.dedent("""
    import json, multiprocessing, sys, threading
    import numpy as np
    import cupy as cp

    assert cp.__version__.endswith("+cudasim"), cp.__file__
    FORK = multiprocessing.get_context("fork")

    def in_child(body, *args):
        \"\"\"body(*args) in a forked child: its result, or {"raised": ...}.\"\"\"
        def run(conn):
            try:
                conn.send(body(*args))
            except BaseException as exc:
                conn.send({"raised": type(exc).__name__, "text": str(exc)})
        mine, theirs = FORK.Pipe()
        child = FORK.Process(target=run, args=(theirs,))
        child.start()
        child.join(CHILD_TIMEOUT)
        if child.is_alive():
            child.kill()
            child.join()
            return {"hung": True}
        return mine.recv() if mine.poll() else {"exitcode": child.exitcode}

    def arithmetic(seed):
        \"\"\"x * 3 + 1 on a non-blocking stream, from fresh random data: the first wrong
        element, or None.\"\"\"
        host = np.random.default_rng(seed).standard_normal(4099).astype(np.float32)
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:  # (the copy in too: nothing orders the legacy stream before this one)
            x = cp.asarray(host)
            y = x * 3 + 1
        stream.synchronize()
        got, expected = y.get(), host * np.float32(3) + np.float32(1)
        wrong = np.flatnonzero(got != expected)
        return None if not wrong.size else (int(wrong[0]), float(got[wrong[0]]),
                                            float(expected[wrong[0]]))

    def report(**facts):
        print(json.dumps(facts))
""")


def _run(script: str, **env: str) -> dict:
    """Run PRELUDE + `script` on the simulator; the facts it reported."""
    path = os.pathsep.join(p for p in (str(CUDASIM), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(script)],
                          env=dict(os.environ, PYTHONPATH=path, **env), capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not done.stderr.strip(), done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def _seed() -> int:
    return int(np.random.default_rng().integers(1 << 31))


def test_importing_the_simulator_starts_no_thread_and_initializes_nothing() -> None:
    facts = _run("""
        import gpuring, gpuring.devices.cuda
        report(threads=[t.name for t in threading.enumerate()],
               contexts=sorted(cp.contexts_created()))
    """)
    assert facts == {"threads": ["MainThread"], "contexts": []}


def test_a_child_forked_before_the_first_cuda_call_runs_on_the_gpu() -> None:
    """The child computes on fresh data and gets it right; so does the parent afterwards."""
    seed = _seed()
    facts = _run(f"""
        child = in_child(arithmetic, {seed})
        report(child=child, parent=arithmetic({seed} + 1),
               contexts=sorted(cp.contexts_created()))
    """)
    assert facts == {"child": None, "parent": None, "contexts": [0]}, facts


def test_a_child_forked_after_the_first_cuda_call_gets_initialization_error() -> None:
    """Every kind of call fails in the child with CUDA's error, at once, including a wait for
    an event the parent recorded (its stream's thread is not in the child); the parent's
    arrays and streams keep working after the fork."""
    seed = _seed()
    facts = _run(f"""
        from cuda.bindings import driver

        assert arithmetic({seed}) is None
        x = cp.asarray(np.random.default_rng({seed}).standard_normal(257))
        stream = cp.cuda.Stream(non_blocking=True)
        event = stream.record()

        def calls():
            outcomes = {{}}
            for name, call in [
                    ("array operation", lambda: x * 2),
                    ("new array", lambda: cp.arange(5)),
                    ("getDeviceCount", cp.cuda.runtime.getDeviceCount),
                    ("new stream", cp.cuda.Stream),
                    ("synchronize a stream of the parent", stream.synchronize),
                    ("synchronize an event of the parent", event.synchronize),
                    ("cuInit", lambda: driver.cuInit(0)[0].name)]:
                try:
                    outcomes[name] = repr(call())
                except cp.cuda.runtime.CUDARuntimeError as exc:
                    outcomes[name] = str(exc)
            return outcomes

        child = in_child(calls)
        report(child=child, parent=arithmetic({seed} + 1),
               same=bool((x * 2).get().tolist() == (x.get() * 2).tolist()))
    """)
    error = "cudaErrorInitializationError: initialization error"
    assert facts["child"] == {
        "array operation": error, "new array": error, "getDeviceCount": error,
        "new stream": error, "synchronize a stream of the parent": error,
        "synchronize an event of the parent": error,
        "cuInit": "'CUDA_ERROR_NOT_INITIALIZED'"}, facts
    assert facts["parent"] is None and facts["same"], facts


def test_a_device_count_is_a_first_cuda_call() -> None:
    """As in CUDA, whose runtime initializes on its first call (any but the error and version
    calls): a parent that only counted its GPUs has a child that cannot use one."""
    facts = _run("""
        assert cp.cuda.runtime.getDeviceCount() == 1
        report(child=in_child(lambda: cp.arange(3).get().tolist()),
               contexts=sorted(cp.contexts_created()))
    """)
    assert facts == {"child": {"raised": "CUDARuntimeError",
                               "text": "cudaErrorInitializationError: initialization error"},
                     "contexts": []}, facts


def test_a_child_freeing_what_the_parent_allocated_leaves_it_the_parents() -> None:
    """A forked child that drops the parent's device memory frees nothing of the parent's
    (CUDA's allocations are not the child's): the parent still reads its data afterwards."""
    seed = _seed()
    facts = _run(f"""
        import gc

        host = np.random.default_rng({seed}).integers(0, 255, 1 << 16, dtype=np.uint8)
        memory = cp.cuda.Memory(host.nbytes)
        cp.cuda.runtime.memcpy(memory.ptr, host.ctypes.data, host.nbytes, 1)
        x = cp.asarray(host)

        def drop():
            global memory, x
            del memory, x
            gc.collect()
            return "dropped"

        child = in_child(drop)
        back = np.empty_like(host)
        cp.cuda.runtime.memcpy(back.ctypes.data, memory.ptr, host.nbytes, 2)
        report(child=child, memory=bool((back == host).all()), array=bool((x.get() == host).all()))
    """)
    assert facts == {"child": "dropped", "memory": True, "array": True}, facts


def test_a_fork_while_a_stream_waits_leaves_the_parents_wait_to_finish() -> None:
    """A stream of the parent waits on a flag in pinned memory (a stream memory operation)
    when the parent forks: the child's synchronize fails at once instead of waiting for a
    thread it does not have; the parent sets the flag and its stream finishes what followed
    the wait."""
    seed = _seed()
    facts = _run(f"""
        import ctypes
        from cuda.bindings import driver

        flag = cp.cuda.runtime.hostAlloc(8, 0)
        ctypes.c_uint64.from_address(flag).value = 0
        host = np.random.default_rng({seed}).standard_normal(1000)
        stream = cp.cuda.Stream(non_blocking=True)
        with stream:  # both arrays written on the stream, before what follows on it
            source, target = cp.asarray(host), cp.zeros(1000)
        status, = driver.cuStreamWaitValue64(driver.CUstream(stream.ptr),
                                             driver.CUdeviceptr(flag), driver.cuuint64_t(1), 0)
        assert status == driver.CUresult.CUDA_SUCCESS, status
        cp.cuda.runtime.memcpyAsync(target.data.ptr, source.data.ptr, host.nbytes, 3,
                                    stream.ptr)
        child = in_child(stream.synchronize)
        waited = not stream.done
        ctypes.c_uint64.from_address(flag).value = 1
        stream.synchronize()
        report(child=child, waited=waited, copied=bool((target.get() == host).all()))
    """, GPURING_CUDASIM_MEMOPS="1")
    assert facts == {"child": {"raised": "CUDARuntimeError",
                               "text": "cudaErrorInitializationError: initialization error"},
                     "waited": True, "copied": True}, facts
