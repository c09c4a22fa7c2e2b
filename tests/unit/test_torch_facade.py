"""The torch backend's pieces that need no ranks: gpuring's errors as c10d's, torch's reduce
ops as gpuring's, and tensors of the dtypes the communicator lacks as arrays it takes."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import gpuring  # noqa: E402
from gpuring._torch_arrays import Staged, from_array, readable, reduction  # noqa: E402
from gpuring._torch_errors import FailedWork, as_c10d, c10d_errors  # noqa: E402


def test_a_timeout_becomes_a_dist_backend_error_that_keeps_its_fields() -> None:
    exc = gpuring.CollectiveTimeoutError("exchange #3 timed out", collective="all_reduce",
                                         seq=3, peer=1)
    twin = as_c10d(exc, 2.5, "allreduce")
    assert isinstance(twin, dist.DistBackendError)
    assert isinstance(twin, gpuring.CollectiveTimeoutError)
    assert (twin.collective, twin.seq, twin.peer) == ("all_reduce", 3, 1)
    assert str(twin) == ("gpuring: Timed out waiting 2500ms for all_reduce #3 to complete: "
                         "exchange #3 timed out")
    assert as_c10d(twin, 2.5) is twin  # already one


@pytest.mark.parametrize(("error", "words"), [
    (gpuring.PeerFailureError("rank 1 died", peer=1), "Connection closed by peer rank 1"),
    (gpuring.CollectiveMismatchError("shapes differ", differences={"shape": {0: 3, 1: 4}}),
     "Detected mismatch between collectives on ranks in barrier"),
    (gpuring.CommunicatorClosedError("closed"), "barrier: the process group's communicator"),
    (gpuring.GpuringError("odd"), "barrier failed"),
])
def test_every_gpuring_error_has_a_c10d_twin(error: gpuring.GpuringError, words: str) -> None:
    twin = as_c10d(error, 60, "barrier")
    assert isinstance(twin, dist.DistBackendError) and isinstance(twin, type(error))
    assert str(twin).startswith(f"gpuring: {words}") and str(error) in str(twin)
    assert twin.__dict__ == error.__dict__


class _Group:
    class comm:  # what the decorator asks of a process group
        class config:
            timeout = 1.0

    @c10d_errors(lambda group: group.comm.config.timeout)
    def barrier(self, opts: object = None) -> None:
        raise gpuring.CollectiveTimeoutError("late", collective="barrier", seq=1)


def test_a_failed_call_raises_and_a_failed_async_call_returns_a_work_that_raises() -> None:
    """torch sets `asyncOp` to the caller's async_op (its options' default: True)."""
    opts = dist.BarrierOptions()
    opts.asyncOp = False
    with pytest.raises(dist.DistBackendError, match="Timed out waiting 1000ms") as raised:
        _Group().barrier(opts)
    assert isinstance(raised.value.__cause__, gpuring.CollectiveTimeoutError)
    work = _Group().barrier(dist.BarrierOptions())
    assert isinstance(work, FailedWork) and work.is_completed() and not work.is_success()
    with pytest.raises(gpuring.CollectiveTimeoutError, match=" Timed out "):
        work.wait()


@pytest.mark.parametrize(("op", "dtype", "want"), [
    (dist.ReduceOp.SUM, torch.float32, "sum"), (dist.ReduceOp.AVG, torch.int32, "avg"),
    (dist.ReduceOp.SUM, torch.bool, "max"), (dist.ReduceOp.PRODUCT, torch.bool, "min"),
    (dist.ReduceOp.MIN, torch.bool, "min"), (dist.ReduceOp.MAX, torch.bool, "max"),
])
def test_reduce_ops_map_to_gpurings(op: object, dtype: object, want: str) -> None:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    how = reduction(opts, dtype)
    assert (how.op, how.fold) == (want, None)


def test_bitwise_ops_fold_integers_and_refuse_floats() -> None:
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp.BXOR
    how = reduction(opts, torch.int16)
    stacked = torch.tensor([[0b1100, 7], [0b1010, 1], [0b0001, 2]], dtype=torch.int16)
    assert how.combine(stacked).tolist() == [0b0111, 4]
    with pytest.raises(RuntimeError, match="non-integral"):
        reduction(opts, torch.float32)
    opts.reduceOp = dist.ReduceOp.AVG
    with pytest.raises(RuntimeError, match="bool"):
        reduction(opts, torch.bool)


def test_bool_and_bfloat16_tensors_travel_as_arrays_the_communicator_takes() -> None:
    flags = torch.tensor([True, False, True])
    assert readable(flags).dtype == np.uint8
    assert torch.equal(from_array(readable(flags), torch.bool), flags)
    half = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    assert readable(half).dtype == np.int16  # its bits, where nothing is added up
    ml_dtypes = pytest.importorskip("ml_dtypes")
    summed = readable(half, reduce=True)
    assert summed.dtype == ml_dtypes.bfloat16 and summed.astype(np.float32).tolist() == \
        [1.5, -2.25, 3.0]
    assert torch.equal(from_array(summed, torch.bfloat16), half)


def test_a_staged_tensor_is_written_back() -> None:
    base = torch.zeros(3, 4)
    view = base.t()  # not contiguous: staged, then copied back
    into = Staged(view, reduce=True)
    into.array[...] = np.arange(12, dtype=np.float32).reshape(4, 3)
    into.done()
    assert torch.equal(view, torch.arange(12, dtype=torch.float32).reshape(4, 3))
