"""Sparse matrices through a communicator, as cupyx.distributed moves them: a CSR, CSC or COO
matrix (cupyx.scipy.sparse's, or scipy.sparse's on the CPU) travels as its three arrays
(data and two index arrays) after a small message of its shape and their sizes. A received
matrix is the caller's matrix with those arrays and shape put in (`data`, `indptr`,
`indices` or `row`, `col`, and the shape), as cupyx does.

The semantics are cupyx's: `reduce` folds every rank's matrix into root's in rank order with
the matrices' own `+` (sum) or `*` (prod: a matrix product for spmatrix classes, element-wise
for sparray ones); `all_reduce` reduces to rank 0 and broadcasts; `reduce_scatter` takes a
list of n matrices, reduces each to rank 0 and scatters them; `gather`, `all_gather` and
`all_to_all` append to the list given. Only the public verbs of the communicator are used;
the shapes and sizes go as small NumPy arrays, so no GPU waits for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from . import _arrays
from ._errors import ArgumentError

__all__ = ["is_sparse", "all_reduce", "reduce", "broadcast", "reduce_scatter", "all_gather",
           "send", "recv", "send_recv", "scatter", "gather", "all_to_all"]

#: the formats that travel, and their index arrays (after `data`)
_INDICES = {"coo": ("row", "col"), "csr": ("indptr", "indices"), "csc": ("indptr", "indices")}
#: the metadata of one matrix: its two dimensions, then the sizes of its three arrays
_META = 5


class Verbs(Protocol):
    """What moving a matrix asks of a communicator."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def send(self, x: Any, dst: int) -> None: ...

    def recv(self, x: Any, src: int) -> Any: ...

    def sendrecv(self, x: Any, dst: int, out: Any, src: int) -> Any: ...

    def broadcast(self, x: Any, *, root: int = 0) -> Any: ...

    def gather(self, x: Any, *, root: int = 0) -> Any: ...

    def all_to_all(self, x: Any) -> Any: ...


def is_sparse(x: Any) -> bool:
    """Whether `x` is a sparse matrix or array (scipy.sparse's or cupyx.scipy.sparse's)."""
    return not hasattr(x, "flags") and hasattr(x, "format") and hasattr(x, "tocsr")


def _parts(matrix: Any) -> tuple[Any, Any, Any]:
    """The three arrays of `matrix` (a COO one in canonical form first, as cupyx does)."""
    fmt = _format(matrix)
    if fmt == "coo":
        matrix.sum_duplicates()
    first, second = _INDICES[fmt]
    return matrix.data, getattr(matrix, first), getattr(matrix, second)


def _format(matrix: Any) -> str:
    fmt = getattr(matrix, "format", None) if is_sparse(matrix) else None
    if fmt not in _INDICES:
        raise TypeError(f"sparse matrices of format {fmt!r} cannot be sent: use CSR, CSC or "
                        f"COO, not {type(matrix).__name__}")
    return str(fmt)


def _assign(matrix: Any, arrays: Sequence[Any], shape: Sequence[int]) -> None:
    """Put `arrays` and `shape` into `matrix` (as cupyx does: its arrays and shape)."""
    first, second = _INDICES[_format(matrix)]
    matrix.data = arrays[0]
    setattr(matrix, first, arrays[1])
    setattr(matrix, second, arrays[2])
    matrix._shape = tuple(int(s) for s in shape)


def _empty_like(model: Any) -> Any:
    """An empty matrix of `model`'s class, dtype and index dtype (shape (0, 0))."""
    fmt = _format(model)
    data, first, _ = _parts(model)
    xp = _arrays.array_module(data)
    values = xp.empty(0, dtype=data.dtype)
    if fmt == "coo":
        none = xp.empty(0, dtype=first.dtype)
        return type(model)((values, (none, none.copy())), shape=(0, 0))
    return type(model)((values, xp.empty(0, dtype=first.dtype), xp.zeros(1, dtype=first.dtype)),
                       shape=(0, 0))


def _meta(matrix: Any) -> np.ndarray:
    return np.array([*matrix.shape, *(a.size for a in _parts(matrix))], dtype=np.int64)


def _like(model: Any, meta: np.ndarray) -> list[Any]:
    """Arrays to receive a matrix of `meta` into: `model`'s arrays' kinds and dtypes."""
    return [_arrays.array_module(a).empty(int(n), dtype=a.dtype)
            for a, n in zip(_parts(model), meta[2:], strict=True)]


def _check_op(op: str) -> str:
    if op not in ("sum", "prod"):
        raise ValueError("Sparse matrix only supports sum/prod reduction")
    return op


# -- point to point --------------------------------------------------------------------------
def send(comm: Verbs, matrix: Any, peer: int) -> None:
    comm.send(_meta(matrix), peer)
    for array in _parts(matrix):
        comm.send(array, peer)


def recv(comm: Verbs, out: Any, peer: int) -> None:
    meta = comm.recv(np.empty(_META, np.int64), peer)
    arrays = _like(out, meta)
    for array in arrays:
        comm.recv(array, peer)
    _assign(out, arrays, meta[:2])


def send_recv(comm: Verbs, matrix: Any, out: Any, peer: int) -> None:
    """Both at once (neither waits for the other: `peer` may send first too)."""
    meta = comm.sendrecv(_meta(matrix), peer, np.empty(_META, np.int64), peer)
    arrays = _like(out, meta)
    for mine, theirs in zip(_parts(matrix), arrays, strict=True):
        comm.sendrecv(mine, peer, theirs, peer)
    _assign(out, arrays, meta[:2])


# -- collectives -----------------------------------------------------------------------------
def broadcast(comm: Verbs, matrix: Any, root: int) -> None:
    meta = comm.broadcast(_meta(matrix) if comm.rank == root else np.zeros(_META, np.int64),
                          root=root)
    arrays = list(_parts(matrix)) if comm.rank == root else _like(matrix, meta)
    for array in arrays:
        comm.broadcast(array, root=root)
    _assign(matrix, arrays, meta[:2])


def reduce(comm: Verbs, matrix: Any, out: Any, root: int, op: str) -> None:
    """Root's out: root's matrix, then each other rank's in rank order, folded with `op`."""
    _check_op(op)
    metas = comm.gather(_meta(matrix), root=root)
    if comm.rank != root:
        for array in _parts(matrix):
            comm.send(array, root)
        return
    if _format(matrix) != _format(out):
        raise ValueError("in_array and out_array must be the same format")
    result = matrix
    for peer in range(comm.size):
        if peer == root:
            continue
        arrays = _like(matrix, metas[peer])
        for array in arrays:
            comm.recv(array, peer)
        partial = _empty_like(matrix)
        _assign(partial, arrays, metas[peer][:2])
        result = result + partial if op == "sum" else result * partial
    _assign(out, _parts(result), result.shape)


def all_reduce(comm: Verbs, matrix: Any, out: Any, op: str) -> None:
    reduce(comm, matrix, out, 0, op)
    broadcast(comm, out, 0)


def reduce_scatter(comm: Verbs, matrices: Sequence[Any], out: Any, op: str) -> None:
    _check_op(op)
    if len(matrices) != comm.size:
        raise ValueError(f"reduce_scatter needs a list of {comm.size} sparse matrices, got "
                         f"{len(matrices)}")
    reduced = []
    for matrix in matrices:
        partial = _empty_like(matrix)
        reduce(comm, matrix, partial, 0, op)
        reduced.append(partial)
    scatter(comm, reduced, out, 0)


def scatter(comm: Verbs, matrices: Sequence[Any], out: Any, root: int) -> None:
    if comm.rank != root:
        recv(comm, out, root)
        return
    if len(matrices) != comm.size:
        raise ValueError(f"scatter needs a list of {comm.size} sparse matrices on the root, "
                         f"got {len(matrices)}")
    for peer, matrix in enumerate(matrices):
        if peer != root:
            send(comm, matrix, peer)
    _assign(out, _parts(matrices[root]), matrices[root].shape)


def gather(comm: Verbs, matrix: Any, out: list[Any], root: int) -> None:
    if comm.rank != root:
        send(comm, matrix, root)
        return
    for peer in range(comm.size):
        got = _empty_like(matrix)
        if peer == root:
            _assign(got, _parts(matrix), matrix.shape)
        else:
            recv(comm, got, peer)
        out.append(got)


def all_gather(comm: Verbs, matrix: Any, out: list[Any]) -> None:
    gathered: list[Any] = []
    gather(comm, matrix, gathered, 0)
    if comm.rank != 0:
        gathered = [_empty_like(matrix) for _ in range(comm.size)]
    for got in gathered:
        broadcast(comm, got, 0)
        out.append(got)


def all_to_all(comm: Verbs, matrices: Sequence[Any], out: list[Any]) -> None:
    """Matrix j of every rank to rank j: `out[i]` is rank i's matrix for this rank. The pairs
    exchange in the order of their higher rank, then their lower one: no cycle of waits."""
    if len(matrices) != comm.size:
        raise ArgumentError(f"all_to_all requires in_array to have {comm.size} elements, "
                            f"found {len(matrices)}")
    metas = comm.all_to_all(np.stack([_meta(m) for m in matrices]))
    received = []
    for peer in range(comm.size):
        arrays = _like(matrices[peer], metas[peer])
        for mine, theirs in zip(_parts(matrices[peer]), arrays, strict=True):
            comm.sendrecv(mine, peer, theirs, peer)
        got = _empty_like(matrices[peer])
        _assign(got, arrays, metas[peer][:2])
        received.append(got)
    out.extend(received)
