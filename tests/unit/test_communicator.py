"""The Communicator facade in a world of one: its lifetime and its async verbs."""

from __future__ import annotations

import gc
import inspect
from typing import Any

import numpy as np
import pytest

from gpuring import CommunicatorClosedError, PeerFailureError
from gpuring._communicator import Communicator
from gpuring.rendezvous.local import SingleProcess


def test_a_dropped_communicator_is_closed_by_its_finalizer() -> None:
    """Nothing the communicator registers elsewhere (control-plane and watchdog callbacks)
    keeps it alive, so dropping it releases its resources; after a failure too."""
    for fail in (False, True):
        comm = Communicator(SingleProcess())
        comm.all_reduce(np.ones(3))
        if fail:
            comm.abort("test")
            with pytest.raises(CommunicatorClosedError):
                comm.all_reduce(np.ones(3))
        finalizer = comm._finalizer
        del comm
        gc.collect()
        assert not finalizer.alive


class _LeftBeforeAgreeing(SingleProcess):
    """A world whose collectives fail to agree: a peer left (the watchdog still runs)."""

    def exchange(self, what: str, obj: Any, timeout: float | None = None) -> list[Any]:
        if what == "a collective":
            raise PeerFailureError("rank 1 left", peer=1)
        return super().exchange(what, obj, timeout)


def test_a_failed_communicator_with_a_watchdog_is_still_collected() -> None:
    """The watchdog's thread outlives the communicator's frames: what it keeps of a failure
    must not hold them (the failure's traceback does)."""
    comm = Communicator(_LeftBeforeAgreeing())
    comm._path.ensure_watchdog()
    with pytest.raises(PeerFailureError):
        comm.all_reduce(np.ones(3))
    finalizer = comm._finalizer
    del comm
    gc.collect()
    assert not finalizer.alive


def test_async_verbs_check_their_call_at_once() -> None:
    comm = Communicator(SingleProcess())
    try:
        signature = inspect.signature(comm.all_reduce_async)
        assert signature.return_annotation == "Work"
        assert list(signature.parameters) == list(inspect.signature(comm.all_reduce).parameters)
        with pytest.raises(TypeError):
            comm.all_reduce_async(np.ones(2), "max")  # op is keyword-only
        with pytest.raises(TypeError):
            comm.reduce_async()
        x = np.arange(4.0)
        assert np.array_equal(comm.all_reduce_async(x=x).wait(), x)
        assert comm.reduce_async(x, root=0).wait() is not None
    finally:
        comm.close()


def test_a_barrier_alone_counts_no_collective() -> None:
    comm = Communicator(SingleProcess())
    comm.barrier()
    assert comm._path.seq == 0
    comm.close()
    with pytest.raises(CommunicatorClosedError):
        comm.barrier()


class _TwoNodes(SingleProcess):
    single_node = False


@pytest.mark.parametrize("kind, arrays", [("cpu", "NumPy"), ("cuda", "CuPy")])
def test_devices_refuse_ranks_on_other_nodes(kind: str, arrays: str) -> None:
    """A device maps its peers' memory: ranks on other nodes are a clear error, before any
    device is made (no GPU or CuPy needed to say so)."""
    from gpuring import GpuringError
    from gpuring.devices import device_class

    with pytest.raises(GpuringError, match=f"a {arrays} engine serves the ranks of one node"):
        device_class(kind).for_job(_TwoNodes(), timeout=5)


def test_registered_arrays_in_a_world_of_one_are_ordinary_arrays() -> None:
    """Nobody to map them: comm.empty/zeros are ordinary zero-filled arrays; a bad device
    or shape is refused before anything is made; after close, nothing can be made."""
    comm = Communicator(SingleProcess())
    x = comm.zeros((3, 4), "float32")
    assert isinstance(x, np.ndarray) and x.shape == (3, 4) and x.dtype == np.float32
    assert not x.any() and comm.empty(5).dtype == np.float64
    assert np.array_equal(comm.all_reduce(x + 1), np.ones((3, 4), np.float32))
    with pytest.raises(ValueError, match="device"):
        comm.empty(4, device="tpu")
    with pytest.raises(ValueError, match="shape"):
        comm.zeros((2, -1))
    comm.close()
    with pytest.raises(CommunicatorClosedError):
        comm.empty(4)


class _Reporting(SingleProcess):
    """A world of one that keeps what it reports to its peers."""

    def __init__(self) -> None:
        super().__init__()
        self.reports: list[tuple[str, int | None, int | None]] = []

    def report_failure(self, reason: str, peer: int | None = None, timed_out: bool = False,
                       job_peer: int | None = None) -> None:
        self.reports.append((reason, peer, job_peer))


def test_an_abort_because_of_another_rank_tells_the_peers_whom() -> None:
    """A communicator that is a part of another (a level across nodes) aborts because of a
    rank of the job it may have no rank for: its report to its peers names that rank; a
    user's abort names nobody."""
    for job_peer in (None, 0, 7):
        control = _Reporting()
        comm = Communicator(control)
        comm._abort("the job failed", job_peer)
        assert control.reports == [("rank 0 aborted: the job failed", None, job_peer)]
        comm.close()
