"""Arguments of every collective, in a world of one: a call that docs/api.md ("API", "Arrays")
allows must succeed and give the result a NumPy reference computes; any other call must raise
TypeError or ValueError saying what is wrong. The argument checks run before any rank talks to
another, so one rank sees them all."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gpuring
from gpuring._communicator import Communicator
from gpuring.rendezvous.local import SingleProcess

# docs/api.md "Dtypes", written out here rather than taken from the library
SUPPORTED = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
             "float16", "bfloat16", "float32", "float64", "complex64", "complex128")
UNSUPPORTED = ("bool", "object", "datetime64[s]", "U3", "longdouble")
OP_NAMES = ("sum", "prod", "min", "max", "avg")  # "SUM" too: ReduceOp.parse takes any case
OPS: list[Any] = [*OP_NAMES, "SUM", gpuring.ReduceOp.MAX, gpuring.ReduceOp.AVG,
                  "mean", "", None, 3]
ROOTS: list[Any] = [0, 1, -1, "0", 1.5, True, None]
SIZE = 1  # the world of these tests


def dtype_of(name: str) -> np.dtype[Any]:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


@pytest.fixture(scope="module")
def comm():
    with Communicator(SingleProcess()) as c:
        yield c


def make_array(dtype: str, shape: tuple[int, ...], contiguous: bool) -> np.ndarray:
    a = np.zeros(shape, dtype=dtype_of(dtype)) if dtype != "object" else np.empty(shape, object)
    if dtype in SUPPORTED and a.size:
        a[...] = (np.arange(a.size).reshape(shape) % 100 + 1).astype(a.dtype)
    if not contiguous and a.ndim and a.shape[-1] > 1:
        a = a[..., ::2]
    return a


arrays = st.builds(make_array, st.sampled_from(SUPPORTED + UNSUPPORTED),
                   st.lists(st.integers(0, 4), max_size=3).map(tuple), st.booleans())
inputs = st.one_of(arrays, arrays, st.sampled_from([None, 3, "x", [1, 2, 3], (1.0,)]))
ops = st.one_of(st.sampled_from(OP_NAMES), st.sampled_from(OPS))
roots = st.one_of(st.just(0), st.sampled_from(ROOTS))
# "fit": a fresh C-contiguous array of the shape and dtype the call needs; "same": x itself
outs = st.one_of(st.sampled_from([None, "fit", "fit", "same"]), arrays)


# ------------------------------------------------------------------------ the documented rules

def op_name(op: Any) -> str | None:
    """The op's name if `op` names one ("sum", "SUM" or a gpuring.ReduceOp), else None."""
    if isinstance(op, str) and op.lower() in OP_NAMES:
        return op.lower()
    return None


def out_shape(name: str, x: np.ndarray) -> tuple[int, ...]:
    if name == "all_gather":
        return (SIZE, *x.shape)
    if name == "reduce_scatter":
        return (x.size // SIZE,)
    return tuple(x.shape)


def problem(name: str, x: Any, *, op: Any = "sum", out: Any = None, root: Any = 0) -> str | None:
    """Why the call is invalid by docs/api.md's rules, or None when it is valid."""
    if not isinstance(x, np.ndarray):
        return "x is not an array"
    if x.dtype.name not in SUPPORTED:
        return f"dtype {x.dtype} is not supported"
    if name in ("all_reduce", "reduce", "reduce_scatter"):
        if op_name(op) is None:
            return f"op {op!r} is not an op"
        if x.dtype.kind == "c" and op_name(op) in ("min", "max"):
            return "min and max are not defined for complex numbers"
    if name in ("broadcast", "reduce"):
        if isinstance(root, bool) or not isinstance(root, int):
            return f"root {root!r} is not an int"
        if not 0 <= root < SIZE:
            return f"root {root} is not a rank"
    if name == "broadcast" and out is None and not x.flags.c_contiguous:
        return "broadcast in place needs a C-contiguous array"
    if name == "reduce_scatter" and x.size % SIZE:
        return "x.size is not a multiple of the number of ranks"
    if out is not None:
        if not isinstance(out, np.ndarray):
            return "out is not an array"
        if out.dtype != x.dtype:
            return "out has another dtype"
        if out.shape != out_shape(name, x):
            return "out has the wrong shape"
        if not out.flags.c_contiguous:
            return "out is not C-contiguous"
        if not out.flags.writeable:
            return "out is read-only"
        if np.shares_memory(out, x) and not in_place_form(name, x, out):
            return "out overlaps x"
    return None


def in_place_form(name: str, x: np.ndarray, out: np.ndarray) -> bool:
    """docs/api.md's in-place forms: `out` covers exactly x's bytes (all_reduce, reduce,
    broadcast), x is out's slot of this rank (all_gather), out is this rank's block of x
    (reduce_scatter); the rank is 0 here."""
    def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
        return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
                and a.nbytes == b.nbytes)

    if name == "all_gather":
        return same_bytes(out[0], x)
    if name == "reduce_scatter":
        return x.flags.c_contiguous and same_bytes(out, x.reshape(SIZE, x.size // SIZE)[0])
    return same_bytes(out, x)


# ------------------------------------------------------------------------ the reference

def reduce_ranks(per_rank: list[np.ndarray], op: str) -> np.ndarray:
    """docs/api.md's reduction of every rank's array, element by element, computed by NumPy in the
    array's dtype (avg: the sum divided by the number of ranks, integers toward zero)."""
    stack = np.stack(per_rank)
    if op == "avg":
        total = np.add.reduce(stack, axis=0, dtype=stack.dtype)
        if stack.dtype.kind in "iu":
            quotient = np.abs(total.astype(object)) // len(per_rank) * np.sign(total)
            return np.asarray(quotient, dtype=stack.dtype).reshape(total.shape)
        return np.asarray(total / len(per_rank)).astype(stack.dtype)
    ufunc = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}[op]
    return np.asarray(ufunc.reduce(stack, axis=0, dtype=stack.dtype))


def expected(name: str, x: np.ndarray, op: Any) -> np.ndarray:
    """The result of collective `name` on this rank, given every rank's x (here: one)."""
    per_rank = [x]
    if name == "all_gather":
        return np.stack(per_rank)
    if name == "broadcast":
        return per_rank[0].copy()
    total = reduce_ranks(per_rank, op_name(op) or "sum")
    if name == "reduce_scatter":
        return total.reshape(SIZE, -1)[0]
    return total


def same_bits(got: Any, want: np.ndarray) -> bool:
    return (isinstance(got, np.ndarray) and got.dtype == want.dtype
            and got.shape == want.shape and got.tobytes() == want.tobytes())


def check(comm: Communicator, name: str, x: Any, **kwargs: Any) -> None:
    """Call collective `name` with x and kwargs: an invalid call must raise TypeError or
    ValueError with a message; a valid one must return docs/api.md's result."""
    out = kwargs.get("out")
    why = problem(name, x, **kwargs)
    before = x.copy() if isinstance(x, np.ndarray) else None
    call = getattr(comm, name)
    if why is not None:
        with pytest.raises((TypeError, ValueError)) as info:
            call(x, **kwargs)
        assert str(info.value), "errors must say what is wrong"
        if before is not None:
            assert same_bits(x, before), f"{name} changed its input, then raised"
        return
    try:
        got = call(x, **kwargs)
    except Exception as exc:
        raise AssertionError(f"{name}{kwargs} raised {exc!r} for valid arguments") from exc
    want = expected(name, before, kwargs.get("op", "sum"))
    assert same_bits(got, want), f"{name}{kwargs}: {got!r} != {want!r}"
    if name == "broadcast" and out is None:
        assert got is x, "broadcast returns x itself, written in place"
    elif out is not None:
        assert got is out, f"{name} must return out"
    else:
        assert not np.shares_memory(got, x), f"{name} must return a new array"
        assert same_bits(x, before), f"{name} changed its input"


def resolve_out(out: Any, name: str, x: Any) -> Any:
    if isinstance(out, str):
        if out == "same":
            return x
        if isinstance(x, np.ndarray) and x.dtype.name in SUPPORTED:  # "fit"
            return np.empty(out_shape(name, x), dtype=x.dtype)
        return None
    return out


# ------------------------------------------------------------------------ tests

@settings(max_examples=150, deadline=None)
@given(x=inputs, op=ops, out=outs)
def test_all_reduce_and_reduce(comm, x, op, out):
    check(comm, "all_reduce", x, op=op, out=resolve_out(out, "all_reduce", x))
    check(comm, "reduce", x, op=op, out=resolve_out(out, "reduce", x), root=0)


@settings(max_examples=150, deadline=None)
@given(x=inputs, op=ops, out=outs, root=roots)
def test_gather_scatter_broadcast(comm, x, op, out, root):
    check(comm, "all_gather", x, out=resolve_out(out, "all_gather", x))
    check(comm, "reduce_scatter", x, op=op, out=resolve_out(out, "reduce_scatter", x))
    check(comm, "broadcast", x, root=root)
    check(comm, "broadcast", x, root=root, out=resolve_out(out, "broadcast", x))


@pytest.mark.parametrize("dtype", SUPPORTED)
def test_every_dtype_and_op_works(comm, dtype):
    """Every supported dtype with every op it takes, each collective, in and out of place,
    0-d to 3-d, contiguous or not: every valid call succeeds with the right result (and
    out=x of a non-contiguous x, or broadcast of one, is refused)."""
    for shape in ((), (6,), (2, 3, 4)):
        for contiguous in (True, False):
            x = make_array(dtype, shape, contiguous)
            for op in OP_NAMES:
                if x.dtype.kind == "c" and op in ("min", "max"):
                    continue
                for out in (None, "fit", "same"):
                    check(comm, "all_reduce", x, op=op, out=resolve_out(out, "all_reduce", x))
                    check(comm, "reduce", x, op=op, out=resolve_out(out, "reduce", x))
                for out in (None, "fit"):
                    check(comm, "reduce_scatter", x, op=op,
                          out=resolve_out(out, "reduce_scatter", x))
            for out in (None, "fit"):
                check(comm, "all_gather", x, out=resolve_out(out, "all_gather", x))
            check(comm, "broadcast", x, root=0)
            for out in ("fit", "same"):
                check(comm, "broadcast", x, root=0, out=resolve_out(out, "broadcast", x))


def test_the_rules_reject_what_they_should():
    """The test's own model of docs/api.md's rules, on cases whose verdict is known."""
    x = np.ones(4, np.float32)
    assert problem("all_reduce", x) is None
    assert problem("all_reduce", x, out=x) is None
    assert problem("reduce_scatter", x, out=x) is None  # one rank: its block is all of x
    assert problem("reduce_scatter", x, out=x[:2]) is not None
    assert problem("all_gather", x, out=x.reshape(1, 4)) is None  # x is out's slot 0
    assert problem("broadcast", x[::2], out=np.empty(2, np.float32)) is None
    assert problem("all_reduce", x[::2]) is None
    assert problem("broadcast", x[::2]) is not None
    assert problem("all_reduce", x.astype(np.complex64), op="max") is not None
    assert problem("all_reduce", x, op="mean") is not None
    assert problem("reduce", x, root=True) is not None
    assert problem("all_gather", x, out=np.empty((1, 4), np.float32)) is None
    assert problem("all_gather", x, out=np.empty(4, np.float32)) is not None
    assert problem("all_reduce", x, out=np.empty((4, 2), np.float32)[:, 0]) is not None
    assert problem("all_reduce", x.astype(bool)) is not None


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
    frozen = np.zeros(4, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        comm.all_reduce(x, out=frozen)
    assert not frozen.any()


def test_algorithms_are_checked(comm):
    """A schedule the collective lacks, or an unknown one, is refused with the choices; the
    settings refuse the ring in deterministic mode."""
    from gpuring._config import Config

    x = np.ones(4, np.float32)
    for verb, algorithm in ((comm.all_reduce, "tree"), (comm.reduce_scatter, "one_shot"),
                            (comm.reduce, "one_shot")):
        with pytest.raises(ValueError, match="algorithm must be one of"):
            verb(x, algorithm=algorithm)
    with pytest.raises(ValueError, match="algorithm must be one of"):
        comm.all_reduce(x, compression="fp16", algorithm="tree")
    assert comm.all_reduce(x, compression="fp16", algorithm="two_shot").tolist() == [1.0] * 4
    for algorithm in ("ring", "two_shot", "one_shot"):
        assert comm.all_reduce(x, algorithm=algorithm).tolist() == [1.0] * 4
    with pytest.raises(ValueError, match="algorithm must be"):
        Config(algorithm="tree").validate()
    with pytest.raises(ValueError, match="deterministic mode"):
        Config(algorithm="ring", deterministic=True).validate()


def test_direct_is_two_shot_under_its_former_name(comm, monkeypatch):
    """algorithm="direct" (what "two_shot" was called before): accepted by every verb that
    takes an algorithm with a DeprecationWarning saying to use "two_shot", pointing at the
    caller; the call carries "two_shot" (what the ranks compare, so a rank passing "direct"
    agrees with one passing "two_shot", and what is planned: the two-shot schedule). So do
    GPURING_ALGORITHM=direct and init(algorithm="direct"); "two_shot" itself warns of
    nothing."""
    import warnings

    from gpuring import _argcheck, settings
    from gpuring._choices import Choices
    from gpuring._config import Config
    from gpuring.algorithms.collectives import plan_collective

    for verb in (comm.all_reduce, comm.reduce_scatter, comm.reduce, comm.all_reduce_init):
        x = np.ones(4, np.float32)
        with pytest.warns(DeprecationWarning, match="use 'two_shot'") as caught:
            got = verb(x, algorithm="direct")
            if verb == comm.all_reduce_init:  # a persistent one: checked once, here
                got = got()
        assert got.tolist() == [1.0] * 4
        assert {w.filename for w in caught} == {__file__}, [w.filename for w in caught]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = comm.all_reduce(np.ones(4, np.float32), algorithm="two_shot")
    assert got.tolist() == [1.0] * 4

    x = np.ones(6, np.float32)
    with pytest.warns(DeprecationWarning, match="use 'two_shot'"):
        old = _argcheck.all_reduce(x, "sum", None, None, None, "direct")
    new = _argcheck.all_reduce(x, "sum", old.out, None, None, "two_shot")
    assert old.algorithm == new.algorithm == "two_shot" and old.key() == new.key()
    for name in ("reduce_scatter", "reduce"):
        with pytest.warns(DeprecationWarning, match="use 'two_shot'"):
            assert _argcheck.check_algorithm(name, "direct") == "two_shot"
    picked = Choices(Config(), 2).pick(old, "cpu", x.nbytes)
    assert picked.algorithm == "two_shot"
    plan = plan_collective("all_reduce", 2, 0, x.size, itemsize=4, capacity_bytes=4096,
                           chunk_bytes=8, channels=1, algorithm=picked.algorithm)
    assert [r.schedule for r in plan] == ["two_shot"]

    monkeypatch.setenv("GPURING_ALGORITHM", "direct")
    with pytest.warns(DeprecationWarning, match="GPURING_ALGORITHM=direct.*use 'two_shot'"):
        assert settings.get("GPURING_ALGORITHM") == "two_shot"
    with pytest.warns(DeprecationWarning, match="use 'two_shot'"):
        config = Config.from_env(deterministic=True)
    assert config.algorithm == "two_shot"
    monkeypatch.setenv("GPURING_ALGORITHM", "two_shot")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Config.from_env().algorithm == "two_shot"
    monkeypatch.delenv("GPURING_ALGORITHM")
    with pytest.warns(DeprecationWarning, match="use 'two_shot'"):
        assert Config.from_env(algorithm="direct").algorithm == "two_shot"
    with pytest.raises(ValueError, match="GPURING_ALGORITHM='tree'"):
        settings.SETTINGS["GPURING_ALGORITHM"].read({"GPURING_ALGORITHM": "tree"})


def test_closed_communicator_refuses_work():
    c = Communicator(SingleProcess())
    c.close()
    c.close()  # idempotent
    with pytest.raises(gpuring.CommunicatorClosedError):
        c.all_reduce(np.ones(3))


def test_in_place_forms(comm):
    """x as out's slot (all_gather, also of a 0-d x), out as x's block (reduce_scatter),
    broadcast into out or into a view of x's own memory; any other overlap is refused."""
    out = np.arange(3, dtype=np.float32).reshape(1, 3)
    assert comm.all_gather(out[0], out=out) is out
    assert out.tolist() == [[0.0, 1.0, 2.0]]
    scalar_out = np.full(1, 7.0, np.float32)
    assert comm.all_gather(scalar_out[0, ...], out=scalar_out) is scalar_out
    assert scalar_out.tolist() == [7.0]
    x = np.arange(4, dtype=np.int32)
    assert comm.reduce_scatter(x, out=x.reshape(1, 4)[0]).tolist() == [0, 1, 2, 3]
    big = np.arange(5, dtype=np.int32)
    with pytest.raises(ValueError, match=r"out=x.reshape\(size, -1\)\[rank\]"):
        comm.reduce_scatter(big[:4], out=big[1:])
    dest = np.zeros(4, np.int32)
    assert comm.broadcast(x, out=dest) is dest and dest.tolist() == [0, 1, 2, 3]
    assert comm.broadcast(x, out=x.view()) is x  # the same memory: in place
