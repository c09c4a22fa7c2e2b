"""The torch.distributed backend "gpuring": a Python ProcessGroup over a Communicator.

`gpuring.torch` registers it. Each process group torch makes with it (the default group,
`new_group`s) gets a communicator of its own: group rank 0 serves a control plane (as
`gpuring run` does) and publishes its address and a fresh key in the group's c10d store
(`env://`'s TCPStore, say); the others read them there and connect. Tensors are viewed as
NumPy arrays (CPU) or CuPy arrays (CUDA, queued on torch's current stream) without copies,
except where a torch argument is not contiguous or is a list the collective takes as one
array.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (  # type: ignore[attr-defined]
    _create_work_from_future,
)

from . import _torch_p2p, interop
from ._communicator import Communicator
from ._config import Config
from .rendezvous.store import StoreServer, leave_and_stop
from .rendezvous.store_client import StoreClient

__all__ = ["GpuringProcessGroup", "create"]

BACKEND = "gpuring"
_ADDRESS_KEY = "gpuring/control-plane"

_OPS = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.PRODUCT: "prod", dist.ReduceOp.MIN: "min",
        dist.ReduceOp.MAX: "max", dist.ReduceOp.AVG: "avg"}  # keyed by ReduceOp.RedOpType


def create(store: Any, rank: int, size: int, timeout: datetime.timedelta
           ) -> GpuringProcessGroup:
    """torch's creator function of the backend: (group store, group rank, group size,
    timeout)."""
    seconds = timeout.total_seconds() if timeout is not None else None
    config = Config.from_env(timeout=seconds)
    server = None
    if rank == 0:
        key = secrets.token_bytes(32)
        server = StoreServer(size, key, "127.0.0.1")
        host, port = server.address
        store.set(_ADDRESS_KEY, f"{host} {port} {key.hex()} {secrets.token_hex(8)}")
    with contextlib.ExitStack() as undo:  # (the server goes if this rank cannot join)
        if server is not None:
            undo.callback(server.close)
        host, port, key_hex, job = store.get(_ADDRESS_KEY).decode().split()
        local_size = int(os.environ.get("LOCAL_WORLD_SIZE", size))
        local_rank = int(os.environ.get("LOCAL_RANK", rank)) if local_size != size else rank
        control = StoreClient(rank, size, local_rank, local_size, (host, int(port)),
                              bytes.fromhex(key_hex), job, timeout=config.timeout)
        undo.pop_all()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        control.device_slot = torch.cuda.current_device()  # the GPU the caller set
    return GpuringProcessGroup(Communicator(control, config), server)


def _op(opts: Any) -> str:
    op = _OPS.get(getattr(opts.reduceOp, "op", opts.reduceOp))
    if op is None:
        raise ValueError(f"the gpuring backend has no reduce op {opts.reduceOp}: use SUM, "
                         "PRODUCT, MIN, MAX or AVG")
    return op


def _view(tensor: torch.Tensor) -> Any:
    """A NumPy/CuPy array sharing `tensor`'s memory (contiguous tensors only)."""
    return interop.to_native(tensor.detach())


class _Into:
    """A writable contiguous array for `tensor`: its own memory where it is contiguous,
    else a contiguous copy written back at `done()`."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.staged = tensor if tensor.is_contiguous() else tensor.contiguous()
        self.array = _view(self.staged)

    def done(self) -> None:
        if self.staged is not self.tensor:
            self.tensor.copy_(self.staged)


#: torch's stubs give ProcessGroup's C++ overloads, which a Python process group replaces
#: with the signatures torch's trampoline calls
_ProcessGroup: Any = dist.ProcessGroup


class GpuringProcessGroup(_ProcessGroup):
    """torch.distributed's calls on a gpuring Communicator (`.comm`). Every call runs when
    made: on the CPU it has completed when it returns; on CUDA it is queued on torch's
    current stream, and its work's future carries the tensors on their devices, so `wait()`
    orders the caller's stream after it without blocking the host."""

    def __init__(self, comm: Communicator, server: StoreServer | None = None):
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self._server = server

    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"GpuringProcessGroup(rank {self.comm.rank} of {self.comm.size})"

    # -- results ---------------------------------------------------------------------------
    @staticmethod
    def _work(tensors: Sequence[torch.Tensor], result: Any = None) -> Any:
        devices: list[Any] = sorted({t.device for t in tensors if t.is_cuda}, key=str)
        future: torch.futures.Future[Any] = torch.futures.Future(devices=devices or None)
        future.set_result(list(tensors) if result is None else result)
        return _create_work_from_future(future)

    # -- collectives -----------------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        op = _op(opts or dist.AllreduceOptions())
        for tensor in tensors:
            with interop.caller_stream(tensor):
                into = _Into(tensor)
                self.comm.all_reduce(into.array, op=op, out=into.array)
                into.done()
        return self._work(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = (opts or dist.BroadcastOptions()).rootRank
        for tensor in tensors:
            with interop.caller_stream(tensor):
                into = _Into(tensor)
                self.comm.broadcast(into.array, root=root)
                into.done()
        return self._work(tensors)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.ReduceOptions()
        op, root = _op(opts), opts.rootRank
        for tensor in tensors:
            with interop.caller_stream(tensor):
                into = _Into(tensor)
                self.comm.reduce(into.array, op=op, root=root,
                                 out=into.array if self.comm.rank == root else None)
                if self.comm.rank == root:
                    into.done()
        return self._work(tensors)

    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        for outputs, tensor in zip(output_tensors, input_tensors, strict=True):
            with interop.caller_stream(tensor):
                gathered = self.comm.all_gather(_view(tensor.contiguous()))
                for q, output in enumerate(outputs):
                    output.copy_(torch.from_dlpack(gathered[q]).view(output.shape))
        return self._work([t for outputs in output_tensors for t in outputs])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> Any:
        with interop.caller_stream(input):
            into = _Into(output)
            self.comm.all_gather(_view(input.contiguous()),
                                 out=into.array.reshape(self.comm.size, *input.shape))
            into.done()
        return self._work([output])

    _allgather_base = all_gather_single

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        op = _op(opts or dist.ReduceScatterOptions())
        for output, inputs in zip(output_tensors, input_tensors, strict=True):
            with interop.caller_stream(output):
                into = _Into(output)
                stacked = torch.stack([t.reshape(output.shape) for t in inputs])
                self.comm.reduce_scatter(_view(stacked).reshape(-1), op=op,
                                         out=into.array.reshape(-1))
                into.done()
        return self._work(output_tensors)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> Any:
        op = _op(opts or dist.ReduceScatterOptions())
        with interop.caller_stream(output):
            into = _Into(output)
            self.comm.reduce_scatter(_view(input.contiguous()).reshape(-1), op=op,
                                     out=into.array.reshape(-1))
            into.done()
        return self._work([output])

    _reduce_scatter_base = reduce_scatter_single

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Any:
        with interop.caller_stream(input_tensors[0]):
            got = self.comm.all_to_all_v([_view(t.contiguous()) for t in input_tensors])
            for output, block in zip(output_tensors, got, strict=True):
                output.copy_(torch.from_dlpack(block).view(output.shape))
        return self._work(output_tensors)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int] | None,
                          input_split_sizes: list[int] | None, opts: Any = None) -> Any:
        n = self.comm.size
        with interop.caller_stream(input):
            if not output_split_sizes and not input_split_sizes:  # even blocks: one call
                into = _Into(output)
                self.comm.all_to_all(_view(input.contiguous()).reshape(n, -1),
                                     out=into.array.reshape(n, -1))
                into.done()
            else:
                blocks = list(torch.split(input, list(input_split_sizes or
                                                      [input.shape[0] // n] * n)))
                got = self.comm.all_to_all_v([_view(b.contiguous()) for b in blocks])
                received = [torch.from_dlpack(g) for g in got]
                want = list(output_split_sizes or [output.shape[0] // n] * n)
                if [r.shape[0] for r in received] != want:
                    raise ValueError(f"all_to_all_single: received blocks of "
                                     f"{[r.shape[0] for r in received]} rows, "
                                     f"output_split_sizes says {want}")
                output.copy_(torch.cat(received).view(output.shape))
        return self._work([output])

    alltoall_base = all_to_all_single

    def gather(self, output_tensors: list[list[torch.Tensor]],
               input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = (opts or dist.GatherOptions()).rootRank
        tensor = input_tensors[0]
        with interop.caller_stream(tensor):
            got = self.comm.gather(_view(tensor.contiguous()), root=root)
            if got is not None:
                for q, output in enumerate(output_tensors[0]):
                    output.copy_(torch.from_dlpack(got[q]).view(output.shape))
        return self._work([t for outputs in output_tensors for t in outputs])

    def scatter(self, output_tensors: list[torch.Tensor],
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        root = (opts or dist.ScatterOptions()).rootRank
        output = output_tensors[0]
        with interop.caller_stream(output):
            if self.comm.rank == root:
                blocks = torch.stack([t.reshape(output.shape) for t in input_tensors[0]])
            else:  # only root's blocks are read: the others pass the shape
                blocks = torch.empty((self.comm.size, *output.shape), dtype=output.dtype,
                                     device=output.device)
            into = _Into(output)
            self.comm.scatter(_view(blocks), root=root, out=into.array)
            into.done()
        return self._work(output_tensors)

    def barrier(self, opts: Any = None) -> Any:
        self.comm.barrier()
        return self._work([])

    # -- point to point --------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> Any:
        """A non-blocking message per tensor (`_torch_p2p`): tags matched, completed by the
        work's `wait()`."""
        return _torch_p2p.send(self.comm, tensors, dstRank, tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> Any:
        return _torch_p2p.recv(self.comm, tensors, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        return _torch_p2p.recv(self.comm, tensors, None, tag)

    # -- lifetime --------------------------------------------------------------------------
    def shutdown(self) -> None:
        """From destroy_process_group(): close the communicator; group rank 0, which serves
        the control plane, then waits (at most the timeout) for the others to leave."""
        server, self._server = self._server, None
        leave_and_stop(self.comm.close, server, self.comm.config.timeout)

    def abort(self) -> None:
        self.comm.abort("aborted through torch.distributed")

