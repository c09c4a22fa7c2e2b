"""Work and Executor: order, results, errors, draining; async verbs in a world of one."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import gpuring
from gpuring._work import Executor, Work


def test_executor_runs_in_submission_order():
    executor = Executor()
    gate = threading.Event()
    seen: list[int] = []

    def job(i: int):
        if i == 0:
            gate.wait()
        seen.append(i)
        return i * 10

    works = [executor.submit(lambda i=i: job(i), f"job {i}") for i in range(20)]
    assert not works[0].done() and executor.busy()
    gate.set()
    assert [w.wait() for w in reversed(works)] == [i * 10 for i in reversed(range(20))]
    assert seen == list(range(20))
    executor.drain()
    assert not executor.busy()
    executor.close()
    executor.close()  # idempotent
    with pytest.raises(gpuring.CommunicatorClosedError):
        executor.submit(lambda: None, "late")


def test_error_surfaces_from_wait_every_time_and_later_work_still_runs():
    executor = Executor()

    def boom():
        raise gpuring.CollectiveMismatchError("different", differences={"dtype": {0: "a"}})

    bad = executor.submit(boom, "bad")
    good = executor.submit(lambda: 5, "good")
    for _ in range(2):
        with pytest.raises(gpuring.CollectiveMismatchError):
            bad.wait()
    with pytest.raises(gpuring.CollectiveMismatchError):
        bad.result()
    assert bad.done() and good.wait() == 5
    executor.close()


def test_wait_timeout_leaves_the_work_running():
    executor = Executor()
    gate = threading.Event()
    work = executor.submit(lambda: gate.wait() and "done", "gated")
    with pytest.raises(TimeoutError):
        work.wait(timeout=0)
    assert "pending" in repr(work)
    gate.set()
    assert work.wait() == "done" and "done" in repr(work)
    executor.close()


def test_close_finishes_outstanding_work():
    executor = Executor()
    gate = threading.Event()
    work = executor.submit(lambda: gate.wait(), "gated")
    threading.Timer(0.05, gate.set).start()
    executor.close()
    assert work.done()


def test_async_verbs_in_a_world_of_one(comm):
    x = np.arange(6, dtype=np.float32)
    works = [comm.all_reduce_async(x), comm.reduce_scatter_async(x, op="max"),
             comm.all_gather_async(x), comm.broadcast_async(x.copy()),
             comm.reduce_async(x, op="min"), comm.all_reduce_async(x, compression="fp16")]
    assert all(isinstance(w, Work) for w in works)
    for w in works[1:5]:
        np.testing.assert_array_equal(np.asarray(w.wait()).reshape(-1), x)
    np.testing.assert_array_equal(works[0].wait(), x)
    np.testing.assert_array_equal(works[5].wait(), x)
    assert comm.all_reduce(x, out=x) is x  # a sync call after async work


def test_async_argument_errors_surface_from_wait(comm):
    work = comm.all_reduce_async(np.ones(3, np.complex64), op="max")
    with pytest.raises(TypeError):
        work.wait()


def test_async_after_close_raises(comm):
    comm.all_reduce_async(np.ones(2)).wait()
    comm.close()
    with pytest.raises(gpuring.CommunicatorClosedError):
        comm.all_reduce_async(np.ones(2))
