"""Other libraries measured on the same arrays in the same run: MPI (mpi4py), NCCL
(cupy.cuda.nccl) and Gloo (torch.distributed). One that is absent or cannot run here is
skipped with a message, never an error."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from .metrics import IN_PLACE, OUT_OF_PLACE
from .systems import Buffers, System, Unsupported

__all__ = ["PEERS", "parse_peers", "select_peers", "MpiPeer", "NcclPeer", "GlooPeer"]

PEERS = ("mpi", "nccl", "gloo")


def parse_peers(text: str) -> list[str]:
    """`mpi,nccl` -> ["mpi", "nccl"]; `all` -> every peer; empty -> none."""
    names = [p.strip().lower() for p in text.split(",") if p.strip()]
    if names == ["all"]:
        return list(PEERS)
    unknown = [p for p in names if p not in PEERS]
    if unknown:
        raise ValueError(f"unknown peer {', '.join(unknown)}; choose from {', '.join(PEERS)}")
    return list(dict.fromkeys(names))


class MpiPeer(System):
    """mpi4py's Allreduce, Reduce_scatter_block, Allgather, Bcast, Reduce on COMM_WORLD."""

    name = "mpi"

    def __init__(self) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = MPI.COMM_WORLD
        self.ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}

    def placement(self, kind: str) -> str:
        return IN_PLACE if kind == "broadcast" else OUT_OF_PLACE

    def call(self, kind: str, b: Buffers, op: str, root: int) -> Callable[[], object]:
        c = self.comm
        if kind not in ("all_gather", "broadcast") and op not in self.ops:
            raise Unsupported(f"MPI has no {op} reduction")
        mop = self.ops.get(op, self.MPI.SUM)
        if kind == "all_reduce":
            return lambda: c.Allreduce(b.x, b.out, op=mop)
        if kind == "reduce_scatter":
            return lambda: c.Reduce_scatter_block(b.x, b.out, op=mop)
        if kind == "all_gather":
            return lambda: c.Allgather(b.x, b.out)
        if kind == "broadcast":
            return lambda: c.Bcast(b.x, root=root)
        return lambda: c.Reduce(b.x, b.out, op=mop, root=root)

    def sync(self) -> None:
        self.comm.Barrier()


class NcclPeer(System):  # pragma: no cover - needs GPUs
    """NCCL through cupy.cuda.nccl, on the current CuPy stream."""

    name = "nccl"
    _TYPES: ClassVar[dict[str, str]] = {
        "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
        "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64",
        "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32", "float64": "NCCL_FLOAT64"}
    _OPS: ClassVar[dict[str, str]] = {
        "sum": "NCCL_SUM", "prod": "NCCL_PROD", "min": "NCCL_MIN", "max": "NCCL_MAX",
        "avg": "NCCL_AVG"}

    def __init__(self, comm: Any):
        import cupy
        from cupy.cuda import nccl

        self.cupy, self.nccl, self.gcomm = cupy, nccl, comm
        uid = np.zeros(128, dtype=np.int64)  # ncclUniqueId: 128 bytes
        if comm.rank == 0:
            uid[:] = np.asarray(nccl.get_unique_id(), dtype=np.int64)
        comm.broadcast(uid, root=0)
        self.comm = nccl.NcclCommunicator(comm.size, tuple(int(v) for v in uid), comm.rank)

    def placement(self, kind: str) -> str:
        return IN_PLACE if kind == "broadcast" else OUT_OF_PLACE

    def call(self, kind: str, b: Buffers, op: str, root: int) -> Callable[[], object]:
        nccl, c = self.nccl, self.comm
        dtype = str(b.x.dtype)
        if dtype not in self._TYPES:
            raise Unsupported(f"NCCL has no {dtype}")
        t = getattr(nccl, self._TYPES[dtype])
        nop = getattr(nccl, self._OPS.get(op, ""), None)
        if nop is None and kind not in ("all_gather", "broadcast"):
            raise Unsupported(f"this cupy.cuda.nccl has no {op}")
        x, n = b.x, b.x.size
        out = b.out.data.ptr if b.out is not None else 0

        def stream() -> int:
            return int(self.cupy.cuda.get_current_stream().ptr)

        if kind == "all_reduce":
            return lambda: c.allReduce(x.data.ptr, out, n, t, nop, stream())
        if kind == "reduce_scatter":
            return lambda: c.reduceScatter(x.data.ptr, out, n // self.gcomm.size, t, nop,
                                           stream())
        if kind == "all_gather":
            return lambda: c.allGather(x.data.ptr, out, n, t, stream())
        if kind == "broadcast":
            return lambda: c.broadcast(x.data.ptr, x.data.ptr, n, t, root, stream())
        return lambda: c.reduce(x.data.ptr, out, n, t, nop, root, stream())

    def sync(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()
        self.gcomm.barrier()

    def close(self) -> None:
        self.comm.destroy()


class GlooPeer(System):
    """torch.distributed with the gloo backend on CPU tensors that share the NumPy arrays.
    Gloo's all_reduce, broadcast and reduce work in place."""

    name = "gloo"

    def __init__(self, comm: Any):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        port = np.zeros(1, dtype=np.int64)
        if comm.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port[0] = s.getsockname()[1]
        comm.broadcast(port, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port[0])}",
                                rank=comm.rank, world_size=comm.size)
        r = dist.ReduceOp
        self.ops = {"sum": r.SUM, "prod": r.PRODUCT, "min": r.MIN, "max": r.MAX}

    def placement(self, kind: str) -> str:
        return OUT_OF_PLACE if kind in ("reduce_scatter", "all_gather") else IN_PLACE

    def call(self, kind: str, b: Buffers, op: str, root: int) -> Callable[[], object]:
        dist, torch = self.dist, self.torch
        if kind == "reduce_scatter":
            raise Unsupported("gloo has no reduce_scatter")
        if kind not in ("all_gather", "broadcast") and op not in self.ops:
            raise Unsupported(f"gloo has no {op} reduction")
        x = torch.from_numpy(b.x)
        top = self.ops.get(op)
        if kind == "all_reduce":
            return lambda: dist.all_reduce(x, op=top)
        if kind == "all_gather":
            outs = list(torch.from_numpy(b.out).unbind(0))
            return lambda: dist.all_gather(outs, x)
        if kind == "broadcast":
            return lambda: dist.broadcast(x, src=root)
        return lambda: dist.reduce(x, dst=root, op=top)

    def sync(self) -> None:
        self.dist.barrier()

    def close(self) -> None:
        self.dist.destroy_process_group()


def _mpi_world_matches(comm: Any) -> str | None:
    from ..rendezvous.mpi import launched_by_mpi

    if not launched_by_mpi():
        return "skipped (run under mpiexec to compare with MPI)"
    try:
        from mpi4py import MPI
    except ImportError:
        return "skipped (mpi4py is not installed: pip install mpi4py mpich)"
    if MPI.COMM_WORLD.Get_size() != comm.size:
        return (f"skipped (MPI's world has {MPI.COMM_WORLD.Get_size()} ranks, this job "
                f"{comm.size})")
    return None


def select_peers(names: list[str], comm: Any, device: str) -> tuple[list[System], list[str]]:
    """The peers that can run here, and a line for each one named (what runs, what not)."""
    peers: list[System] = []
    notes: list[str] = []
    for name in names:
        why: str | None = None
        if name == "mpi":
            why = _mpi_world_matches(comm)
            if why is None and device != "cpu":
                why = "skipped on cuda (a PyPI MPI is not CUDA-aware; it would stage via host)"
        elif name == "nccl" and device != "cuda":
            why = "skipped (NCCL needs --device cuda and GPUs)"
        elif name == "gloo" and device != "cpu":
            why = "skipped on cuda (gloo stages GPU tensors through the host)"
        if why is None:
            try:
                peer: System = {"mpi": lambda: MpiPeer(), "nccl": lambda: NcclPeer(comm),
                                "gloo": lambda: GlooPeer(comm)}[name]()
            except ImportError as exc:
                module = (exc.name or str(exc)).split(".")[0]
                why = f"skipped ({module} is not importable)"
            else:
                peers.append(peer)
                notes.append(f"{name}: measured")
                continue
        notes.append(f"{name}: {why}")
    return peers, notes
