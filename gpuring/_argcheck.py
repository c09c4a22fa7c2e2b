"""Argument checks of the verbs: each turns a verb's arguments into a checked `Call` (or
raises TypeError/ValueError naming the argument), before the communicator is involved."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import _arrays
from ._call import Call
from ._ops import ReduceOp, check_op_dtype
from .algorithms.collectives import algorithm_name

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather",
           "scatter", "all_to_all", "input_array", "output_array", "check_algorithm"]


def _op(op: ReduceOp | str, x: Any) -> ReduceOp:
    """`op` parsed and checked against x's dtype. (Not remembered: a call that comes again
    is found by `LastCalls` before any check; on a call that is not, a memo saved 70 of 1,520
    Python opcodes, `bench/host_cost.py --without last-calls [--without op-memo]`.)"""
    rop = ReduceOp.parse(op)
    check_op_dtype(rop, _arrays.dtype_name(x))
    return rop


def _input_and_op(x: Any, op: ReduceOp | str) -> tuple[Any, ReduceOp]:
    """The input array and the op checked against its dtype (a bad op is the first thing to
    hear of, then a bad array)."""
    try:
        x = input_array(x)
    except TypeError:
        ReduceOp.parse(op)
        raise
    return x, _op(op, x)


#: the schedules a call may ask for, per collective
_ALGORITHMS = {"all_reduce": ("ring", "two_shot", "one_shot"),
               "reduce_scatter": ("ring", "two_shot"), "reduce": ("ring", "two_shot")}


def check_algorithm(name: str, algorithm: str | None) -> str | None:
    """`algorithm` checked against what `name` offers (None: the communicator's choice),
    under its current name: a former one ("direct": "two_shot") is translated with a
    DeprecationWarning, so that the ranks compare (and the call runs) the current name."""
    if algorithm is None:
        return None
    algorithm = algorithm_name(algorithm, name)
    offered = _ALGORITHMS[name]
    if algorithm not in offered:
        raise ValueError(f"{name}: algorithm must be one of {', '.join(map(repr, offered))} "
                         f"(or None for the communicator's choice), got {algorithm!r}")
    return algorithm


def all_reduce(x: Any, op: ReduceOp | str, out: Any, chunk_bytes: int | None,
               channels: int | None, algorithm: str | None = None) -> Call:
    algorithm = check_algorithm("all_reduce", algorithm)
    x, rop = _input_and_op(x, op)
    if out is not x:  # out=x is in place: the same array, nothing to check
        out = output_array(out, x, x.shape, "all_reduce", in_place=_same(x), hint="out=x")
    return Call("all_reduce", x, out, rop, 0, chunk_bytes, channels, algorithm=algorithm)


def reduce_scatter(x: Any, op: ReduceOp | str, out: Any, chunk_bytes: int | None,
                   channels: int | None, size: int, rank: int,
                   algorithm: str | None = None) -> Call:
    algorithm = check_algorithm("reduce_scatter", algorithm)
    x, rop = _input_and_op(x, op)
    if x.size % size:
        raise ValueError(f"reduce_scatter needs x.size divisible by the {size} ranks, "
                         f"got {x.size}; pad the array")
    mine = x.reshape(size, x.size // size)[rank]  # in place: out is this rank's block of x
    out = output_array(out, x, (x.size // size,), "reduce_scatter",
                       in_place=lambda out: _arrays.same_memory(out, mine),
                       hint="out=x.reshape(size, -1)[rank]")
    return Call("reduce_scatter", x, out, rop, 0, chunk_bytes, channels, algorithm=algorithm)


def all_gather(x: Any, out: Any, chunk_bytes: int | None, channels: int | None,
               size: int, rank: int) -> Call:
    x = input_array(x)
    check_op_dtype(ReduceOp.SUM, _arrays.dtype_name(x))
    # in place: x is this rank's slot of out
    given = out is not None
    out = output_array(out, x, (size, *x.shape), "all_gather",
                       in_place=lambda out: _arrays.same_memory(out[rank, ...], x),
                       hint="x=out[rank]")
    in_place = given and _arrays.may_overlap(out, x)
    return Call("all_gather", x, out, ReduceOp.SUM, 0, chunk_bytes, channels, in_place)


def broadcast(x: Any, root: Any, out: Any, chunk_bytes: int | None, channels: int | None,
              size: int) -> Call:
    root = _root(root, size)
    if out is None:
        if not _arrays.device_kind(x) or not x.flags.c_contiguous:
            raise TypeError("broadcast without out works in place and needs a C-contiguous "
                            "array; pass numpy.ascontiguousarray(x) and use the returned "
                            "array, or pass out=")
        out = x
    else:
        x = input_array(x)
        out = output_array(out, x, x.shape, "broadcast", in_place=_same(x), hint="out=x")
        if _arrays.same_memory(out, x):  # in place after all: nothing to copy on the root
            out = x
    check_op_dtype(ReduceOp.SUM, _arrays.dtype_name(x))
    return Call("broadcast", x, out, ReduceOp.SUM, root, chunk_bytes, channels, out is x)


def reduce(x: Any, op: ReduceOp | str, root: Any, out: Any, chunk_bytes: int | None,
           channels: int | None, size: int, rank: int, algorithm: str | None = None) -> Call:
    ReduceOp.parse(op)  # a bad op, then a bad root, then a bad array
    root = _root(root, size)
    algorithm = check_algorithm("reduce", algorithm)
    x, rop = _input_and_op(x, op)
    out = (output_array(out, x, x.shape, "reduce", in_place=_same(x), hint="out=x")
           if rank == root else None)
    return Call("reduce", x, out, rop, root, chunk_bytes, channels, algorithm=algorithm)


def gather(x: Any, root: Any, out: Any, chunk_bytes: int | None, channels: int | None,
           size: int, rank: int) -> Call:
    root = _root(root, size)
    x = input_array(x)
    check_op_dtype(ReduceOp.SUM, _arrays.dtype_name(x))
    out = output_array(out, x, (size, *x.shape), "gather") if rank == root else None
    return Call("gather", x, out, ReduceOp.SUM, root, chunk_bytes, channels)


def scatter(x: Any, root: Any, out: Any, chunk_bytes: int | None, channels: int | None,
            size: int) -> Call:
    root = _root(root, size)
    x = _blocks(x, size, "scatter")
    out = output_array(out, x, x.shape[1:], "scatter")
    return Call("scatter", x, out, ReduceOp.SUM, root, chunk_bytes, channels)


def all_to_all(x: Any, out: Any, chunk_bytes: int | None, channels: int | None,
               size: int) -> Call:
    x = _blocks(x, size, "all_to_all")
    out = output_array(out, x, x.shape, "all_to_all")
    return Call("all_to_all", x, out, ReduceOp.SUM, 0, chunk_bytes, channels)


def _blocks(x: Any, size: int, name: str) -> Any:
    """`x` (C-contiguous) of shape (size, *block): one block per rank."""
    x = input_array(x)
    check_op_dtype(ReduceOp.SUM, _arrays.dtype_name(x))
    if x.ndim == 0 or x.shape[0] != size:
        raise ValueError(f"{name} needs x of shape (size, ...) = ({size}, ...), one block per "
                         f"rank; got {tuple(x.shape)}")
    return x


def input_array(x: Any) -> Any:
    """`x` (a NumPy or CuPy array), C-contiguous."""
    _arrays.device_kind(x)
    return _arrays.contiguous(x)


def _root(root: Any, size: int) -> int:
    if isinstance(root, bool) or not isinstance(root, int):
        raise TypeError(f"root must be an int rank, got {type(root).__name__}")
    if not 0 <= root < size:
        raise ValueError(f"root {root} is not a rank of this communicator (0..{size - 1})")
    return root


def _same(x: Any) -> Callable[[Any], bool]:
    """In place means `out` covers exactly x's bytes."""
    return lambda out: _arrays.same_memory(out, x)


def output_array(out: Any, x: Any, shape: tuple[int, ...], name: str,
                 in_place: Callable[[Any], bool] | None = None, hint: str = "") -> Any:
    """`out` checked against `x` (device, dtype, shape, layout, overlap), or a new array.
    `out` may overlap `x` only where `in_place(out)` says it is the collective's in-place
    form (`hint` tells the user how to ask for it)."""
    if out is None:
        return _arrays.array_module(x).empty(shape, dtype=x.dtype)
    if type(out) is not type(x) and _arrays.device_kind(out) != _arrays.device_kind(x):
        raise TypeError(f"{name}: out must live on the same device as x")
    if out.dtype != x.dtype:
        raise TypeError(f"{name}: out has dtype {out.dtype}, x has {x.dtype}; they must match")
    if out.shape != shape and tuple(out.shape) != tuple(shape):
        raise ValueError(f"{name}: out must have shape {tuple(shape)}, got {tuple(out.shape)}")
    if not out.flags.c_contiguous:
        raise ValueError(f"{name}: out must be C-contiguous")
    if not _arrays.is_cupy(out) and not out.flags.writeable:  # (CuPy's are writable)
        raise ValueError(f"{name}: out is read-only")
    if out is not x and _arrays.may_overlap(out, x):
        if in_place is None or not in_place(out):
            how = f"pass {hint} to work in place, or " if hint else "pass "
            raise ValueError(f"{name}: out overlaps x; {how}a separate array")
    return out
