"""Interop: DLPack producers in and out of the collectives, without copies."""

from __future__ import annotations

import numpy as np
import pytest

from gpuring import interop


class Producer:
    """A foreign array that only speaks DLPack (its package has no from_dlpack)."""

    def __init__(self, array: np.ndarray):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_to_native_shares_memory():
    base = np.arange(6.0)
    view = interop.to_native(Producer(base))
    assert isinstance(view, np.ndarray) and np.shares_memory(view, base)
    assert interop.to_native(base) is base
    assert interop.device_kind(Producer(base)) == "cpu"
    assert interop.device_kind(object()) is None
    with pytest.raises(TypeError, match="__dlpack__"):
        interop.to_native([1, 2, 3])


def test_collectives_accept_dlpack_producers(comm):
    base = np.arange(6, dtype=np.float32)
    got = comm.all_reduce(Producer(base))
    assert isinstance(got, np.ndarray)  # no from_dlpack in the producer's package
    np.testing.assert_array_equal(got, base)
    out = Producer(np.zeros(6, np.float32))
    assert comm.all_reduce(Producer(base), out=out) is out
    np.testing.assert_array_equal(out.array, base)
    x = Producer(base.copy())
    assert comm.broadcast(x) is x
    assert comm.all_gather(Producer(base)).shape == (1, 6)
    assert comm.all_reduce_async(Producer(base)).wait().shape == (6,)


@pytest.mark.slow  # importing torch
def test_torch_tensors_round_trip(comm):
    torch = pytest.importorskip("torch")
    t = torch.arange(6, dtype=torch.float64)
    got = comm.all_reduce(t, op="avg")
    assert isinstance(got, torch.Tensor) and torch.equal(got, t)
    assert comm.all_reduce(t, out=t) is t
    many = comm.all_reduce_many([t, torch.ones(2, dtype=torch.int32)])
    assert [type(m) for m in many] == [torch.Tensor, torch.Tensor]
    assert many[1].dtype == torch.int32


def test_allreduce_gradients_alone(comm):
    torch = pytest.importorskip("torch")
    import gpuring.torch

    model = torch.nn.Linear(3, 2)
    model(torch.ones(4, 3)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    gpuring.torch.allreduce_gradients(model, comm=comm)
    for p, b in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.grad, b)
    frozen = torch.nn.Linear(2, 2)
    frozen.weight.requires_grad_(False)
    gpuring.torch.allreduce_gradients(frozen, comm=comm)  # missing grads become zeros
    assert frozen.weight.grad is None and torch.equal(frozen.bias.grad, torch.zeros(2))
