"""cupyx.scipy.sparse on the CUDA simulator: CSR, CSC and COO matrices (and their sparray
twins) whose arrays are the simulator's device arrays, with what code that moves them
between processes uses: the constructors from arrays (`(data, indices, indptr)`,
`(data, (row, col))`) or from a dense 2-D array, `data`, `indices`, `indptr`, `row`, `col`,
`shape`, `dtype`, `nnz`, `format`, `sum_duplicates`, `todense`/`toarray`, `tocsr`/`tocsc`/
`tocoo`, `copy`, `+`, `-`, `*` (a matrix product between spmatrix classes, element-wise
between sparray ones, as in CuPy and SciPy; by a scalar it scales) and `@`, and `issparse`.

Arithmetic goes through the dense matrix on the host and back to the format (so explicit
zeros are dropped, as canonical results have none): the values are exact, the speed is not
a GPU's. It is not CuPy's module: what it lacks fails with AttributeError.

Made from NumPy arrays, a matrix keeps NumPy arrays (as scipy.sparse's do): the tests use it
so as a scipy-like matrix on the CPU, where CuPy need not be importable.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["spmatrix", "sparray", "csr_matrix", "csc_matrix", "coo_matrix", "csr_array",
           "csc_array", "coo_array", "issparse", "isspmatrix"]

_INDEX = np.int32


def _host(x: Any) -> np.ndarray:
    return x.get() if hasattr(x, "get") else np.asarray(x)


def _on_device(*arrays: Any) -> bool:
    """Whether the arrays a matrix is made of are the simulator's (else NumPy's)."""
    return not all(isinstance(a, np.ndarray) for a in arrays)


def _to(x: np.ndarray, device: bool) -> Any:
    x = np.ascontiguousarray(x)
    return sys.modules["cupy"].asarray(x) if device else x


class _Sparse:
    format = ""
    _is_array = False
    _device = True

    def __init__(self, arg1: Any, shape: Any = None, dtype: Any = None, copy: bool = False):
        if isinstance(arg1, _Sparse):
            self._device = arg1._device
            self._set_dense(arg1._dense(), dtype)
        elif isinstance(arg1, tuple):
            self._device = _on_device(*(a for part in arg1 for a in (
                part if isinstance(part, tuple) else (part,))))
            self._from_parts(arg1)
            if dtype is not None:
                self.data = self.data.astype(dtype)
        else:
            self._device = _on_device(arg1)
            self._set_dense(_host(arg1), dtype)
            shape = self._shape if shape is None else shape
        if shape is None:
            raise ValueError("cudasim's sparse matrices need a shape with their arrays")
        self._shape = tuple(int(s) for s in shape)

    # -- what each format defines
    def _from_parts(self, parts: tuple[Any, ...]) -> None:
        raise NotImplementedError

    def _dense(self) -> np.ndarray:
        raise NotImplementedError

    def _set_dense(self, dense: np.ndarray, dtype: Any = None) -> None:
        raise NotImplementedError

    # -- common
    def _put(self, x: Any) -> Any:
        """`x` as one of this matrix's arrays (the simulator's, or NumPy's)."""
        return _to(_host(x), self._device)

    @property
    def shape(self) -> tuple[int, int]:
        return self._shape  # type: ignore[return-value]

    ndim = 2

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.data.dtype  # type: ignore[no-any-return]

    @property
    def nnz(self) -> int:
        return int(self.data.size)

    def todense(self, order: Any = None) -> Any:
        return _to(self._dense(), self._device)

    toarray = todense

    def _new(self, dense: np.ndarray, cls: type[_Sparse] | None = None) -> Any:
        out = (cls or type(self)).__new__(cls or type(self))
        out._device = self._device
        out._set_dense(dense)
        out._shape = tuple(dense.shape)
        return out

    def copy(self) -> Any:
        return self._new(self._dense())

    def tocsr(self) -> Any:
        return self._new(self._dense(), csr_array if self._is_array else csr_matrix)

    def tocsc(self) -> Any:
        return self._new(self._dense(), csc_array if self._is_array else csc_matrix)

    def tocoo(self) -> Any:
        return self._new(self._dense(), coo_array if self._is_array else coo_matrix)

    def sum_duplicates(self) -> None:
        pass

    def _operand(self, other: Any) -> np.ndarray:
        return other._dense() if isinstance(other, _Sparse) else _host(other)

    def __add__(self, other: Any) -> Any:
        return self._new(self._dense() + self._operand(other))

    __radd__ = __add__

    def __sub__(self, other: Any) -> Any:
        return self._new(self._dense() - self._operand(other))

    def __neg__(self) -> Any:
        return self._new(-self._dense())

    def __mul__(self, other: Any) -> Any:
        if np.isscalar(other):
            return self._new(self._dense() * other)
        if isinstance(other, _Sparse) and not self._is_array:
            return self @ other
        return self._new(self._dense() * self._operand(other))

    def __rmul__(self, other: Any) -> Any:
        if np.isscalar(other):
            return self._new(other * self._dense())
        return NotImplemented

    def __matmul__(self, other: Any) -> Any:
        return self._new(self._dense() @ self._operand(other))

    def __repr__(self) -> str:
        return (f"<cudasim {type(self).__name__} of shape {self.shape}, dtype {self.dtype}, "
                f"{self.nnz} stored elements>")


class _Compressed(_Sparse):
    """CSR (rows compressed) and CSC (columns)."""

    _by_rows = True

    def _from_parts(self, parts: tuple[Any, ...]) -> None:
        data, indices, indptr = parts
        self.data, self.indices, self.indptr = (self._put(data), self._put(indices),
                                                self._put(indptr))

    def _dense(self) -> np.ndarray:
        data, indices, indptr = _host(self.data), _host(self.indices), _host(self.indptr)
        rows, cols = self.shape
        major = rows if self._by_rows else cols
        dense = np.zeros((rows, cols) if self._by_rows else (cols, rows), data.dtype)
        for i in range(major):
            for k in range(int(indptr[i]), int(indptr[i + 1])):
                dense[i, int(indices[k])] += data[k]
        return dense if self._by_rows else dense.T.copy()

    def _set_dense(self, dense: np.ndarray, dtype: Any = None) -> None:
        dense = dense if dtype is None else dense.astype(dtype)
        major = dense if self._by_rows else dense.T
        where = np.nonzero(major)
        counts = np.bincount(where[0], minlength=major.shape[0])
        self.data = self._put(major[where])
        self.indices = self._put(where[1].astype(_INDEX))
        self.indptr = self._put(np.concatenate([[0], np.cumsum(counts)]).astype(_INDEX))
        self._shape = tuple(dense.shape)


class _Coordinates(_Sparse):
    format = "coo"

    def _from_parts(self, parts: tuple[Any, ...]) -> None:
        data, (row, col) = parts
        self.data, self.row, self.col = self._put(data), self._put(row), self._put(col)

    def _dense(self) -> np.ndarray:
        dense = np.zeros(self.shape, _host(self.data).dtype)
        np.add.at(dense, (_host(self.row), _host(self.col)), _host(self.data))
        return dense

    def _set_dense(self, dense: np.ndarray, dtype: Any = None) -> None:
        dense = dense if dtype is None else dense.astype(dtype)
        row, col = np.nonzero(dense)
        self.data = self._put(dense[row, col])
        self.row, self.col = self._put(row.astype(_INDEX)), self._put(col.astype(_INDEX))
        self._shape = tuple(dense.shape)

    def sum_duplicates(self) -> None:
        """Canonical form: sorted by row, then column, each place once."""
        row, col, data = _host(self.row), _host(self.col), _host(self.data)
        if row.size == 0:
            return
        order = np.lexsort((col, row))
        row, col, data = row[order], col[order], data[order]
        first = np.concatenate([[True], (row[1:] != row[:-1]) | (col[1:] != col[:-1])])
        groups = np.cumsum(first) - 1
        summed = np.zeros(int(groups[-1]) + 1, data.dtype)
        np.add.at(summed, groups, data)
        self.data = self._put(summed)
        self.row, self.col = self._put(row[first]), self._put(col[first])


class spmatrix:
    """The matrix classes' base (`*` is a matrix product)."""


class sparray:
    """The array classes' base (`*` is element-wise)."""


class csr_matrix(_Compressed, spmatrix):
    format = "csr"


class csc_matrix(_Compressed, spmatrix):
    format = "csc"
    _by_rows = False


class coo_matrix(_Coordinates, spmatrix):
    pass


class csr_array(_Compressed, sparray):
    format = "csr"
    _is_array = True


class csc_array(_Compressed, sparray):
    format = "csc"
    _by_rows = False
    _is_array = True


class coo_array(_Coordinates, sparray):
    _is_array = True


def issparse(x: Any) -> bool:
    return isinstance(x, _Sparse)


def isspmatrix(x: Any) -> bool:
    return isinstance(x, spmatrix)
