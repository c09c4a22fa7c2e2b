"""torch tensors as the arrays a gpuring Communicator takes, for the torch.distributed
backend, and torch's reduce ops as gpuring's.

A tensor becomes a NumPy array (CPU) or a CuPy array (CUDA) viewing its memory. Two dtypes
the communicator lacks travel as others, as gloo serves them: bool as uint8 (SUM and MAX
reduce as MAX, a logical or; PRODUCT and MIN as MIN, a logical and), bfloat16 as its 16 bits
(int16) where nothing is added up, and where something is, as ml_dtypes' bfloat16 on the CPU
(each step rounded to bfloat16, as gloo's sums are) and through float32 on a GPU (rounded once
at the end). torch's bitwise ops (BAND, BOR, BXOR), which gpuring's communicator lacks, fold
every rank's tensor after an all_gather (`Reduction.fold`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from . import interop

__all__ = ["Reduction", "Staged", "from_array", "readable", "reduction", "same_dtype"]

_RedOp = dist.ReduceOp
_GPURING_OPS = {_RedOp.SUM: "sum", _RedOp.PRODUCT: "prod", _RedOp.MIN: "min",
                _RedOp.MAX: "max", _RedOp.AVG: "avg"}
_BITWISE: dict[Any, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    _RedOp.BAND: torch.bitwise_and, _RedOp.BOR: torch.bitwise_or,
    _RedOp.BXOR: torch.bitwise_xor}
#: on bool tensors (as uint8 0/1): the op that gives the same truth values
_ON_BOOL = {"sum": "max", "max": "max", "prod": "min", "min": "min"}


class Reduction(NamedTuple):
    """How a torch reduce op (`name`) runs on a dtype: the communicator's op `op`, or where
    `fold` is set, that torch function combining two ranks' tensors (after an all_gather)."""

    name: str
    op: str
    fold: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def combine(self, gathered: torch.Tensor) -> torch.Tensor:
        """The fold of `gathered` (every rank's tensor stacked on dimension 0), in rank
        order."""
        assert self.fold is not None
        return functools.reduce(self.fold, gathered.unbind(0))


def reduction(opts: Any, dtype: torch.dtype) -> Reduction:
    """The Reduction for `opts.reduceOp` on tensors of `dtype`; RuntimeError (as c10d's) for
    an op the dtype has not, ValueError for an op gpuring has not (PREMUL_SUM)."""
    kind = getattr(opts.reduceOp, "op", opts.reduceOp)
    name = str(kind).rpartition(".")[2]
    if kind in _BITWISE:
        if dtype.is_floating_point or dtype.is_complex:
            raise RuntimeError(f"Cannot use ReduceOp.{name} with non-integral dtype")
        return Reduction(name, name.lower(), _BITWISE[kind])
    op = _GPURING_OPS.get(kind)
    if op is None:
        raise ValueError(f"the gpuring backend has no reduce op {name}: use SUM, PRODUCT, "
                         "MIN, MAX, AVG, BAND, BOR or BXOR")
    if dtype == torch.bool:
        if op not in _ON_BOOL:
            raise RuntimeError(f"ReduceOp.{name} is not defined on bool tensors")
        op = _ON_BOOL[op]
    return Reduction(name, op)


@functools.cache
def _ml_bfloat16() -> Any:
    try:
        import ml_dtypes
    except ImportError:
        raise ImportError("reducing bfloat16 tensors on the CPU needs ml_dtypes: "
                          "pip install ml_dtypes") from None
    return ml_dtypes.bfloat16


def _reduced_through_float32(tensor: torch.Tensor, reduce: bool) -> bool:
    return reduce and tensor.dtype == torch.bfloat16 and tensor.device.type != "cpu"


def native(tensor: torch.Tensor, reduce: bool = False) -> Any:
    """A NumPy/CuPy array sharing the memory of `tensor` (contiguous), in a dtype the
    communicator takes (`reduce`: one it can add up, where the two differ)."""
    t = tensor.detach()
    if t.dtype == torch.bool:
        return interop.to_native(t.view(torch.uint8))
    if t.dtype == torch.bfloat16:
        bits = interop.to_native(t.view(torch.int16))
        return bits.view(_ml_bfloat16()) if reduce else bits
    return interop.to_native(t)


def readable(tensor: torch.Tensor, reduce: bool = False) -> Any:
    """`tensor`'s content as an array (a contiguous copy where it is not contiguous, or is
    bfloat16 to be reduced on a GPU)."""
    if _reduced_through_float32(tensor, reduce):
        return native(tensor.float())
    return native(tensor.contiguous(), reduce)


def from_array(array: Any, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of `dtype` sharing the memory of `array` (as `native` made it)."""
    if dtype == torch.bfloat16 and array.dtype.itemsize == 2:
        return torch.from_dlpack(array.view("int16")).view(torch.bfloat16)
    if dtype == torch.bfloat16:  # reduced through float32
        return torch.from_dlpack(array).to(torch.bfloat16)
    tensor = torch.from_dlpack(array)
    return tensor.view(torch.bool) if dtype == torch.bool else tensor


class Staged:
    """A writable array for `tensor`: its own memory where it is contiguous (and needs no
    float32 stand-in), else a staged copy written back at `done()`."""

    def __init__(self, tensor: torch.Tensor, reduce: bool = False):
        self.tensor = tensor
        if _reduced_through_float32(tensor, reduce):
            self.staged = tensor.float()
        else:
            self.staged = tensor if tensor.is_contiguous() else tensor.contiguous()
        self.array = native(self.staged, reduce)

    def done(self) -> None:
        if self.staged is not self.tensor:
            self.tensor.copy_(self.staged)


def same_dtype(tensors: Sequence[torch.Tensor]) -> bool:
    return len({t.dtype for t in tensors}) <= 1
