"""PyTorch integration (optional: `pip install 'gpuring[torch]'`; importing this module
imports torch).

Importing it registers the torch.distributed backend "gpuring" (CPU and CUDA tensors):

    import gpuring.torch
    torch.distributed.init_process_group("gpuring")   # env:// (torchrun's variables)
    model = torch.nn.parallel.DistributedDataParallel(model)

and `allreduce_gradients` reduces a model's gradients with gpuring's own communicator:

    loss.backward()
    gpuring.torch.allreduce_gradients(model)   # every rank now holds the mean gradient
    optimizer.step()
"""

from __future__ import annotations

from typing import Any

import torch.distributed

from ._ops import ReduceOp
from ._torch_pg import BACKEND, GpuringProcessGroup, create

__all__ = ["allreduce_gradients", "GpuringProcessGroup", "BACKEND"]

if BACKEND.upper() not in torch.distributed.Backend._plugins:  # imported once per process
    torch.distributed.Backend.register_backend(BACKEND, create, devices=["cpu", "cuda"])


def allreduce_gradients(module: Any, *, op: ReduceOp | str = "avg", comm: Any = None,
                        fusion_bytes: int | None = None) -> None:
    """Reduce the gradients of `module` (a torch.nn.Module) over all ranks, in place, with
    fused all_reduces (`Communicator.all_reduce_many`); `op="avg"` averages them.

    Every parameter that requires grad takes part; one without a gradient yet gets zeros, so
    every rank reduces the same list. `comm` defaults to the communicator `gpuring.init()` made.
    """
    import torch

    from . import _world

    comm = _world.current() if comm is None else comm
    grads = []
    for param in module.parameters():
        if not param.requires_grad:
            continue
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        if param.grad.is_sparse:
            raise TypeError("allreduce_gradients supports dense gradients only")
        grads.append(param.grad)
    if not grads:
        return
    with torch.no_grad():
        reduced = comm.all_reduce_many([g.detach() for g in grads], op=op,
                                       fusion_bytes=fusion_bytes)
        for grad, result in zip(grads, reduced, strict=True):
            grad.copy_(result)
