"""The torch.distributed backend "gpuring": a Python ProcessGroup over a Communicator.

`gpuring.torch` registers it. Each process group torch makes with it (the default group,
`new_group`s) gets a communicator of its own: group rank 0 serves a control plane (as
`gpuring run` does) and publishes its address and a fresh key in the group's c10d store
(`env://`'s TCPStore, say); the others read them there and connect. Tensors are viewed as
NumPy arrays (CPU) or CuPy arrays (CUDA, queued on torch's current stream) without copies,
except where a torch argument is not contiguous, is a list the collective takes as one
array, or has a dtype the communicator takes in another form (`_torch_arrays`). A gpuring
error of a collective is raised as its c10d twin (`_torch_errors`): a DistBackendError too.
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
from ._torch_arrays import Reduction, Staged, from_array, readable, reduction, same_dtype
from ._torch_errors import c10d_errors
from ._torch_monitored import monitored_barrier
from ._torch_sparse import all_reduce_sparse
from .rendezvous.launchers import Served, start_server
from .rendezvous.store_client import StoreClient

__all__ = ["GpuringProcessGroup", "create"]

BACKEND = "gpuring"
_ADDRESS_KEY = "gpuring/control-plane"


def create(store: Any, rank: int, size: int, timeout: datetime.timedelta
           ) -> GpuringProcessGroup:
    """torch's creator function of the backend: (group store, group rank, group size,
    timeout). The timeout (torch's default where the caller gave none) bounds every wait of
    the group's communicator, as it bounds gloo's."""
    seconds = timeout.total_seconds() if timeout is not None else None
    config = Config.from_env(timeout=seconds)
    server = None
    if rank == 0:  # (its server in a process of its own: the others' calls do not need this
        key = secrets.token_bytes(32)  # process once its part is done)
        server = start_server(size, key, "127.0.0.1", 0, config.timeout,
                              f"torch.distributed backend {BACKEND!r}")
        host, port = server.address
        store.set(_ADDRESS_KEY, f"{host} {port} {key.hex()} {secrets.token_hex(8)}")
    with contextlib.ExitStack() as undo:  # (the server goes if this rank cannot join)
        if server is not None:
            undo.callback(server.process.kill)
        host, port, key_hex, job = store.get(_ADDRESS_KEY).decode().split()
        # one node (the server is on loopback): the group's ranks are its local ranks
        control = StoreClient(rank, size, rank, size, (host, int(port)),
                              bytes.fromhex(key_hex), job, timeout=config.timeout,
                              generation=1)  # the group's own server
        undo.pop_all()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        control.device_slot = torch.cuda.current_device()  # the GPU the caller set
    else:  # the process's GPU, whichever groups it is in: its local rank in the job
        control.device_slot = int(os.environ.get("LOCAL_RANK", rank))
    return GpuringProcessGroup(Communicator(control, config), server, store)


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


def _rows(tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
    """The tensors flattened and joined (one dtype), and their element counts."""
    return torch.cat([t.reshape(-1) for t in tensors]), [t.numel() for t in tensors]


#: torch's stubs give ProcessGroup's C++ overloads, which a Python process group replaces
#: with the signatures torch's trampoline calls
_ProcessGroup: Any = dist.ProcessGroup

#: a gpuring error of a collective, raised as its c10d twin
_c10d = c10d_errors(lambda group: group.comm.config.timeout)


class GpuringProcessGroup(_ProcessGroup):
    """torch.distributed's calls on a gpuring Communicator (`.comm`). Every call runs when
    made: on the CPU it has completed when it returns; on CUDA it is queued on torch's
    current stream, and its work's future carries the tensors on their devices, so `wait()`
    orders the caller's stream after it without blocking the host."""

    def __init__(self, comm: Communicator, server: Served | None = None,
                 store: Any = None):
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self._server = server
        self._store = store  # the group's c10d store (monitored_barrier's)
        self._monitored_barriers = 0
        self._group_name = ""
        self._group_desc = ""

    def getBackendName(self) -> str:
        return BACKEND

    # torch names a group (`group_name`, `group_desc`) through these after making it; a
    # ProcessGroup keeps them in its backends, which a Python process group has none of
    def getGroupName(self) -> str:
        return self._group_name

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupDesc(self) -> str:
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def __repr__(self) -> str:
        return (f"GpuringProcessGroup(rank {self.comm.rank} of {self.comm.size}"
                + (f", {self._group_name!r}" if self._group_name else "") + ")")

    # -- results ---------------------------------------------------------------------------
    @staticmethod
    def _work(tensors: Sequence[torch.Tensor], result: Any = None) -> Any:
        devices: list[Any] = sorted({t.device for t in tensors if t.is_cuda}, key=str)
        future: torch.futures.Future[Any] = torch.futures.Future(devices=devices or None)
        future.set_result(list(tensors) if result is None else result)
        return _create_work_from_future(future)

    # -- reductions ------------------------------------------------------------------------
    def _folded(self, tensor: torch.Tensor, how: Reduction) -> torch.Tensor:
        """Every rank's `tensor` combined by a torch op gpuring lacks (after an all_gather)."""
        gathered = self.comm.all_gather(readable(tensor))
        return how.combine(from_array(gathered, tensor.dtype))

    def _all_reduce(self, tensor: torch.Tensor, how: Reduction) -> None:
        with interop.caller_stream(tensor):
            if tensor.is_sparse:
                all_reduce_sparse(self.comm, tensor, how)
            elif how.fold is not None:
                tensor.copy_(self._folded(tensor, how))
            else:
                into = Staged(tensor, reduce=True)
                self.comm.all_reduce(into.array, op=how.op, out=into.array)
                into.done()

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                        how: Reduction) -> None:
        """Block `rank` of the flattened reduction of `input` (size * output.numel() long)."""
        with interop.caller_stream(output):
            if how.fold is not None:
                whole = self._folded(input, how).reshape(self.comm.size, -1)
                output.copy_(whole[self.comm.rank].view(output.shape))
                return
            into = Staged(output, reduce=True)
            self.comm.reduce_scatter(readable(input, reduce=True).reshape(-1), op=how.op,
                                     out=into.array.reshape(-1))
            into.done()

    @_c10d
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.AllreduceOptions()
        for tensor in tensors:
            self._all_reduce(tensor, reduction(opts, tensor.dtype))
        return self._work(tensors)

    @_c10d
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """One all_reduce of the tensors joined (one dtype, dense), else one each."""
        opts = opts or dist.AllreduceCoalescedOptions()
        if len(tensors) < 2 or not same_dtype(tensors) or any(t.is_sparse for t in tensors):
            return self.allreduce(tensors, opts)
        how = reduction(opts, tensors[0].dtype)
        joined, counts = _rows(tensors)
        self._all_reduce(joined, how)
        for tensor, part in zip(tensors, joined.split(counts), strict=True):
            tensor.copy_(part.view(tensor.shape))
        return self._work(tensors)

    @_c10d
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        opts = opts or dist.ReduceOptions()
        root, mine = opts.rootRank, self.comm.rank == opts.rootRank
        for tensor in tensors:
            how = reduction(opts, tensor.dtype)
            with interop.caller_stream(tensor):
                if how.fold is not None:
                    folded = self._folded(tensor, how)
                    if mine:
                        tensor.copy_(folded)
                    continue
                into = Staged(tensor, reduce=True)
                self.comm.reduce(into.array, op=how.op, root=root,
                                 out=into.array if mine else None)
                if mine:
                    into.done()
        return self._work(tensors)

    @_c10d
    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> Any:
        opts = opts or dist.ReduceScatterOptions()
        for output, inputs in zip(output_tensors, input_tensors, strict=True):
            stacked = torch.stack([t.reshape(output.shape) for t in inputs])
            self._reduce_scatter(output, stacked, reduction(opts, output.dtype))
        return self._work(output_tensors)

    @_c10d
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> Any:
        opts = opts or dist.ReduceScatterOptions()
        self._reduce_scatter(output, input, reduction(opts, output.dtype))
        return self._work([output])

    _reduce_scatter_base = reduce_scatter_single

    @_c10d
    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> Any:
        """reduce_scatter_single of each pair: one reduce_scatter of the inputs' blocks
        joined block by block (one dtype), else one each."""
        opts = opts or dist.ReduceScatterOptions()
        n = self.comm.size
        if len(outputs) < 2 or not same_dtype([*outputs, *inputs]):
            for output, input in zip(outputs, inputs, strict=True):
                self._reduce_scatter(output, input, reduction(opts, output.dtype))
            return self._work(outputs)
        blocks = torch.cat([t.reshape(n, -1) for t in inputs], dim=1)
        mine = torch.empty(blocks.shape[1], dtype=blocks.dtype, device=blocks.device)
        self._reduce_scatter(mine, blocks, reduction(opts, mine.dtype))
        for output, part in zip(outputs, mine.split([t.numel() for t in outputs]), strict=True):
            output.copy_(part.view(output.shape))
        return self._work(outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # -- data movement ---------------------------------------------------------------------
    def _gathered(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` stacked in rank order: shape (size, *tensor.shape)."""
        with interop.caller_stream(tensor):
            return from_array(self.comm.all_gather(readable(tensor)), tensor.dtype)

    @_c10d
    def allgather(self, output_tensors: list[list[torch.Tensor]],
                  input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        for outputs, tensor in zip(output_tensors, input_tensors, strict=True):
            gathered = self._gathered(tensor)
            for q, output in enumerate(outputs):
                output.copy_(gathered[q].view(output.shape))
        return self._work([t for outputs in output_tensors for t in outputs])

    @_c10d
    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        """`output_lists[q][j]`: rank q's `input_tensors[j]`; one all_gather of the inputs
        joined (torch checks that they have one dtype)."""
        joined, counts = _rows(input_tensors)
        gathered = self._gathered(joined)
        for outputs, row in zip(output_lists, gathered, strict=True):
            for output, part in zip(outputs, row.split(counts), strict=True):
                output.copy_(part.view(output.shape))
        return self._work([t for outputs in output_lists for t in outputs])

    @_c10d
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> Any:
        with interop.caller_stream(input):
            into = Staged(output)
            self.comm.all_gather(readable(input),
                                 out=into.array.reshape(self.comm.size, *input.shape))
            into.done()
        return self._work([output])

    _allgather_base = all_gather_single

    @_c10d
    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor], opts: Any = None) -> Any:
        """all_gather_single of each pair: one all_gather of the inputs joined (one dtype),
        else one each."""
        if len(inputs) < 2 or not same_dtype([*outputs, *inputs]):
            for output, input in zip(outputs, inputs, strict=True):
                self.all_gather_single(output, input, opts)
            return self._work(outputs)
        joined, counts = _rows(inputs)
        gathered = self._gathered(joined)  # (size, sum(counts))
        for output, part in zip(outputs, gathered.split(counts, dim=1), strict=True):
            output.copy_(part.reshape(output.shape))
        return self._work(outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_c10d
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = (opts or dist.BroadcastOptions()).rootRank
        for tensor in tensors:
            with interop.caller_stream(tensor):
                into = Staged(tensor)
                self.comm.broadcast(into.array, root=root)
                into.done()
        return self._work(tensors)

    @_c10d
    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Any:
        with interop.caller_stream(input_tensors[0]):
            got = self.comm.all_to_all_v([readable(t) for t in input_tensors])
            for output, block in zip(output_tensors, got, strict=True):
                output.copy_(from_array(block, output.dtype).view(output.shape))
        return self._work(output_tensors)

    @_c10d
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int] | None,
                          input_split_sizes: list[int] | None, opts: Any = None) -> Any:
        n = self.comm.size
        with interop.caller_stream(input):
            if not output_split_sizes and not input_split_sizes:  # even blocks: one call
                into = Staged(output)
                self.comm.all_to_all(readable(input).reshape(n, -1),
                                     out=into.array.reshape(n, -1))
                into.done()
            else:
                blocks = torch.split(input, list(input_split_sizes or
                                                 [input.shape[0] // n] * n))
                got = self.comm.all_to_all_v([readable(b) for b in blocks])
                received = [from_array(g, input.dtype) for g in got]
                want = list(output_split_sizes or [output.shape[0] // n] * n)
                if [r.shape[0] for r in received] != want:
                    raise ValueError(f"all_to_all_single: received blocks of "
                                     f"{[r.shape[0] for r in received]} rows, "
                                     f"output_split_sizes says {want}")
                output.copy_(torch.cat(received).view(output.shape))
        return self._work([output])

    alltoall_base = all_to_all_single

    @_c10d
    def gather(self, output_tensors: list[list[torch.Tensor]],
               input_tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = (opts or dist.GatherOptions()).rootRank
        tensor = input_tensors[0]
        with interop.caller_stream(tensor):
            got = self.comm.gather(readable(tensor), root=root)
            if got is not None:
                gathered = from_array(got, tensor.dtype)
                for q, output in enumerate(output_tensors[0]):
                    output.copy_(gathered[q].view(output.shape))
        return self._work([t for outputs in output_tensors for t in outputs])

    @_c10d
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
            into = Staged(output)
            self.comm.scatter(readable(blocks), root=root, out=into.array)
            into.done()
        return self._work(output_tensors)

    @_c10d
    def barrier(self, opts: Any = None) -> Any:
        self.comm.barrier()
        return self._work([])

    def monitored_barrier(self, timeout: datetime.timedelta | None = None,
                          wait_all_ranks: bool = False) -> None:
        """As gloo's, through the group's c10d store (`_torch_monitored`); `timeout`: the
        group's by default."""
        if self._store is None:
            raise RuntimeError("monitored_barrier needs the group's c10d store")
        self._monitored_barriers += 1
        monitored_barrier(self._store, self.comm.rank, self.comm.size, self._monitored_barriers,
                          datetime.timedelta(seconds=self.comm.config.timeout)
                          if timeout is None else timeout,
                          wait_all_ranks)

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
        """From destroy_process_group(): close the communicator. Group rank 0 started the
        group's control-plane server: it serves the others until they leave too (rank 0
        does not wait for them)."""
        server, self._server = self._server, None
        try:
            self.comm.close()
        finally:
            if server is not None:
                server.release()

    def abort(self) -> None:
        self.comm.abort("aborted through torch.distributed")

