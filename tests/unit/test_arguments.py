"""Bad arguments give a clear TypeError or ValueError (or a correct result), never anything
else. Runs on a world of one: argument checks happen before any rank talks to another."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuring
from gpuring.communicator import Communicator
from gpuring.rendezvous.local import SingleProcess

DTYPES = ["int8", "uint16", "int64", "float16", "float32", "float64", "complex64", "bool",
          "object", "datetime64[s]", "U3"]
OPS = ["sum", "prod", "min", "max", "avg", "SUM", "mean", "", None, 3, gpuring.ReduceOp.MAX]
ROOTS = [0, 1, -1, "0", 1.5, True, None]


@pytest.fixture(scope="module")
def comm():
    with Communicator(SingleProcess()) as c:
        yield c


def make_array(dtype: str, shape: tuple[int, ...], contiguous: bool):
    a = np.zeros(shape, dtype=dtype) if dtype != "object" else np.empty(shape, dtype=object)
    if dtype not in ("object", "U3", "bool", "datetime64[s]"):
        a[...] = np.arange(a.size).reshape(shape).astype(dtype) + 1 if a.size else a
    if not contiguous and a.ndim and a.shape[-1] > 1:
        a = a[..., ::2]
    return a


arrays = st.builds(make_array, st.sampled_from(DTYPES),
                   st.lists(st.integers(0, 4), max_size=3).map(tuple), st.booleans())
inputs = st.one_of(arrays, st.sampled_from([None, 3, "x", [1, 2, 3], (1.0,)]))
outs = st.one_of(st.none(), arrays, st.just("same"))


def check(call, expect):
    try:
        got = call()
    except (TypeError, ValueError) as exc:
        assert str(exc), "errors must say what is wrong"
        return
    expect(got)


@settings(max_examples=150, deadline=None)
@given(x=inputs, op=st.sampled_from(OPS), out=outs)
def test_all_reduce_and_reduce(comm, x, op, out):
    out_arg = x if isinstance(out, str) else out

    def ok(got):
        assert isinstance(x, np.ndarray)
        assert np.array_equal(np.asarray(got), x, equal_nan=False) or x.size == 0

    check(lambda: comm.all_reduce(x, op=op, out=out_arg), ok)
    check(lambda: comm.reduce(x, op=op, out=out_arg, root=0), ok)


@settings(max_examples=100, deadline=None)
@given(x=inputs, out=outs, root=st.sampled_from(ROOTS))
def test_gather_scatter_broadcast(comm, x, out, root):
    out_arg = x if isinstance(out, str) else out
    check(lambda: comm.all_gather(x, out=out_arg),
          lambda got: np.array_equal(got[0], x))
    check(lambda: comm.reduce_scatter(x, out=out_arg),
          lambda got: np.array_equal(got, np.asarray(x).reshape(-1)))
    check(lambda: comm.broadcast(x, root=root), lambda got: got is x)


def test_messages_say_what_to_do(comm):
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="use one of"):
        comm.all_reduce(x, op="mean")
    with pytest.raises(TypeError, match="sum, prod or avg"):
        comm.all_reduce(x.astype(np.complex64), op="max")
    with pytest.raises(ValueError, match="shape"):
        comm.all_reduce(x, out=np.ones(5, np.float32))
    with pytest.raises(TypeError, match="dtype"):
        comm.all_reduce(x, out=np.ones(4, np.float64))
    shared = np.ones(8, np.float32)
    with pytest.raises(ValueError, match="overlaps"):
        comm.all_reduce(shared[:4], out=shared[2:6])
    with pytest.raises(ValueError, match="not a rank"):
        comm.broadcast(x, root=1)
    with pytest.raises(TypeError, match="NumPy or CuPy"):
        comm.all_reduce([1, 2, 3])
    with pytest.raises(TypeError, match="not supported"):
        comm.all_reduce(np.ones(3, bool))


def test_closed_communicator_refuses_work():
    c = Communicator(SingleProcess())
    c.close()
    c.close()  # idempotent
    with pytest.raises(gpuring.CommunicatorClosedError):
        c.all_reduce(np.ones(3))
