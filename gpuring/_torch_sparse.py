"""all_reduce of sparse COO tensors for the torch.distributed backend, as gloo serves it: the
sum only; every rank's coalesced indices and values are gathered, joined in rank order and
coalesced, and the result replaces the tensor's content (coalesced)."""

from __future__ import annotations

from typing import Any

import torch

from ._torch_arrays import Reduction, from_array, readable

__all__ = ["all_reduce_sparse"]


def all_reduce_sparse(comm: Any, tensor: torch.Tensor, reduction: Reduction) -> None:
    """Sum the sparse COO `tensor` over `comm`'s ranks, in place."""
    if reduction.op != "sum":
        raise RuntimeError(f"the gpuring backend reduces sparse tensors with ReduceOp.SUM "
                           f"only, not {reduction.name}")
    if tensor.layout != torch.sparse_coo:
        raise RuntimeError(f"the gpuring backend reduces sparse tensors of the COO layout "
                           f"only, not {tensor.layout}")
    local = tensor.detach().coalesce()
    indices = comm.all_gather_v(readable(local.indices().t()))  # (nnz, sparse dims) each
    values = comm.all_gather_v(readable(local.values()))
    joined = torch.sparse_coo_tensor(
        torch.cat([from_array(i, torch.int64) for i in indices]).t(),
        torch.cat([from_array(v, local.dtype) for v in values]),
        tensor.shape)
    with torch.no_grad():
        tensor.copy_(joined.coalesce())
