"""Uneven collectives: all_gather_v, all_to_all_v and reduce_scatter_v, made of the even ones.

The shapes go first, in a small all_gather of int64 headers on the data's device (every rank
then knows every rank's shapes, and checks them alike: a mismatch is found by every rank at
once); then the data moves in one even collective, each block padded to the largest, and
each result is a view of its block. Costs: one more collective per call (on a GPU its result
is read by the host, which waits for it), and the padding's bytes: uneven blocks move as many
bytes as if every block were the largest. The host's reading of the shapes is why a CUDA graph
cannot capture them: under capture they are refused before anything is enqueued.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import _argcheck, _arrays
from ._errors import CollectiveMismatchError, GpuringError
from ._ops import ReduceOp

if TYPE_CHECKING:
    from ._protocols import Collectives

__all__ = ["all_gather_v", "all_to_all_v", "reduce_scatter_v", "MAX_DIMS"]

#: the most dimensions a block of all_gather_v or all_to_all_v may have
MAX_DIMS = 8


def _header(shape: tuple[int, ...], name: str) -> list[int]:
    if len(shape) > MAX_DIMS:
        raise ValueError(f"{name}: at most {MAX_DIMS} dimensions, got {len(shape)}")
    return [len(shape), *shape, *[0] * (MAX_DIMS - len(shape))]


def _shape(row: np.ndarray) -> tuple[int, ...]:
    return tuple(int(d) for d in row[1:1 + int(row[0])])


def _refuse_capture(name: str, x: Any) -> None:
    """Refuse a call whose array `x` is on a GPU whose current stream captures a graph
    (before anything is enqueued: a contiguous copy of the input would be)."""
    if _arrays.capturing(x):
        raise GpuringError(f"{name} cannot be captured into a CUDA graph: the host reads "
                           "every rank's shapes first")


def _gathered(comm: Collectives, like: Any, headers: list[list[int]]) -> np.ndarray:
    """Every rank's `headers` (rows of int64), as a host array (rank, row, field), through
    an all_gather on the device of `like` (the call's array)."""
    mine = _arrays.array_module(like).asarray(np.asarray(headers, np.int64))
    return _arrays.to_host(comm.all_gather(mine))


def _mismatch(name: str, what: str, values: dict[int, object]) -> CollectiveMismatchError:
    shown = ", ".join(f"rank {r} {v}" for r, v in values.items())
    return CollectiveMismatchError(f"ranks called {name} with different {what}: {shown}",
                                   differences={what: values})


def all_gather_v(comm: Collectives, x: Any) -> list[Any]:
    """Every rank's `x` in rank order; first dimensions may differ, the rest and the dtype
    must match."""
    _refuse_capture("all_gather_v", x)
    x = _argcheck.input_array(x)
    if x.ndim == 0:
        raise ValueError("all_gather_v needs x with a first dimension")
    xp = _arrays.array_module(x)
    headers = _gathered(comm, x, [_header(tuple(x.shape), "all_gather_v")])[:, 0]
    shapes = [_shape(row) for row in headers]
    trailing: dict[int, object] = {r: s[1:] for r, s in enumerate(shapes)}
    if len(set(trailing.values())) > 1:
        raise _mismatch("all_gather_v", "trailing dimensions", trailing)
    rows = [s[0] for s in shapes]
    most = max(rows)
    if min(rows) == most:  # even after all
        return list(comm.all_gather(x))
    padded = xp.zeros((most, *x.shape[1:]), dtype=x.dtype)
    padded[:x.shape[0]] = x
    out = comm.all_gather(padded)
    return [out[q, :rows[q]] for q in range(comm.size)]


def all_to_all_v(comm: Collectives, blocks: Sequence[Any]) -> list[Any]:
    """`blocks[j]` (any shape, one dtype) goes to rank j; returns what every rank sent this
    one, `result[j]` from rank j with the shape rank j gave it."""
    n, rank = comm.size, comm.rank
    if isinstance(blocks, (str, bytes)) or len(blocks) != n:
        raise ValueError(f"all_to_all_v needs a sequence of {n} arrays, one per rank")
    for block in blocks:
        _refuse_capture("all_to_all_v", block)
    arrays = [_argcheck.input_array(b) for b in blocks]
    dtypes = {str(a.dtype) for a in arrays}
    kinds = {_arrays.device_kind(a) for a in arrays}
    if len(dtypes) > 1 or len(kinds) > 1:
        raise ValueError(f"all_to_all_v: the blocks must share one dtype and device, got "
                         f"{sorted(dtypes)} on {sorted(kinds)}")
    xp = _arrays.array_module(arrays[0])
    headers = _gathered(comm, arrays[0], [_header(tuple(a.shape), "all_to_all_v")
                                          for a in arrays])
    sizes = [[int(np.prod(_shape(headers[q, j]), dtype=np.int64)) for j in range(n)]
             for q in range(n)]
    most = max(max(row) for row in sizes)
    send = xp.zeros((n, most), dtype=arrays[0].dtype)
    for j, a in enumerate(arrays):
        send[j, :a.size] = a.reshape(-1)
    received = comm.all_to_all(send) if most else send
    return [received[q, :sizes[q][rank]].reshape(_shape(headers[q, rank])) for q in range(n)]


def reduce_scatter_v(comm: Collectives, x: Any, counts: Sequence[int],
                     op: ReduceOp | str = "sum") -> Any:
    """Elements `[sum(counts[:rank]), sum(counts[:rank + 1]))` of the flattened reduction of
    `x` over the ranks; `counts` the same on every rank, summing to `x.size`."""
    n, rank = comm.size, comm.rank
    _refuse_capture("reduce_scatter_v", x)
    x = _argcheck.input_array(x)
    mine = [int(c) for c in counts]
    if len(mine) != n or any(c < 0 for c in mine) or sum(mine) != x.size:
        raise ValueError(f"reduce_scatter_v needs {n} non-negative counts summing to x.size "
                         f"= {x.size}, got {list(counts)}")
    xp = _arrays.array_module(x)
    every = _gathered(comm, x, [mine])[:, 0]
    if any(list(row) != mine for row in every):
        seen: dict[int, object] = {r: list(map(int, row)) for r, row in enumerate(every)}
        raise _mismatch("reduce_scatter_v", "counts", seen)
    most = max(mine)
    flat = x.reshape(-1)
    padded = xp.zeros((n, most), dtype=x.dtype)
    start = 0
    for j, c in enumerate(mine):
        padded[j, :c] = flat[start:start + c]
        start += c
    block = comm.reduce_scatter(padded, op=op) if most else padded[rank]
    return block[:mine[rank]]
