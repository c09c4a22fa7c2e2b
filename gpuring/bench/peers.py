"""Other libraries measured on the same arrays in the same run: MPI (mpi4py), NCCL
(cupy.cuda.nccl) and Gloo (torch.distributed). One that is absent or cannot run here is
skipped with a message, never an error."""

from __future__ import annotations

import datetime
import socket
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from ..transports.nccl import nccl_id_argument, nccl_id_bytes
from .metrics import IN_PLACE, MESSAGES, OUT_OF_PLACE
from .systems import Buffers, System, Unsupported, message_call

__all__ = ["PEERS", "parse_peers", "select_peers", "PeerUnavailable", "MpiPeer", "NcclPeer",
           "GlooPeer", "all_ranks_ok"]

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
        from mpi4py.util.dtlib import from_numpy_dtype

        self.MPI = MPI
        self.datatype = from_numpy_dtype
        self.comm = MPI.COMM_WORLD
        self.ops = {"sum": MPI.SUM, "prod": MPI.PROD, "min": MPI.MIN, "max": MPI.MAX}

    def placements(self, kind: str) -> tuple[str, ...]:
        """MPI's in-place forms where they lay data out as nccl-tests does (MPI's in-place
        reduce_scatter keeps the whole input in the output; broadcast is in place only)."""
        if kind == "broadcast":
            return (IN_PLACE,)
        if kind in ("reduce_scatter", "barrier") or kind in MESSAGES:
            return (OUT_OF_PLACE,)
        return (OUT_OF_PLACE, IN_PLACE)

    def call(self, kind: str, b: Buffers, op: str, root: int) -> Callable[[], object]:
        return self._verb(kind, b, op, root, blocking=True)

    def overlap(self, kind: str, b: Buffers, op: str,
                root: int) -> Callable[[], Callable[[], object]]:
        start = self._verb(kind, b, op, root, blocking=False)
        return lambda: start().Wait  # type: ignore[attr-defined]

    def _verb(self, kind: str, b: Buffers, op: str, root: int, *,
              blocking: bool) -> Callable[[], Any]:
        c, MPI = self.comm, self.MPI
        if kind in MESSAGES:
            if not blocking:
                raise Unsupported("messages are measured without --overlap")
            return message_call(
                kind, b, c.Get_rank(), c.Get_size(), lambda x, dst: c.Send(x, dest=dst),
                lambda out, src: c.Recv(out, source=src),
                lambda x, dst, out, src: c.Sendrecv(x, dest=dst, recvbuf=out, source=src))
        if kind == "barrier":
            return c.Barrier if blocking else c.Ibarrier
        if kind not in ("all_gather", "broadcast") and op not in self.ops:
            raise Unsupported(f"MPI has no {op} reduction")
        try:
            self.datatype(b.x.dtype)
        except (ValueError, KeyError, TypeError):
            raise Unsupported(f"mpi4py has no MPI datatype for {b.x.dtype}") from None
        mop = self.ops.get(op, MPI.SUM)
        in_place = b.placement == IN_PLACE
        send = MPI.IN_PLACE if in_place else b.x
        verb = {name: getattr(c, name if blocking else "I" + name[0].lower() + name[1:])
                for name in ("Allreduce", "Reduce_scatter_block", "Allgather", "Bcast",
                             "Reduce")}
        if kind == "all_reduce":
            return lambda: verb["Allreduce"](send, b.x if in_place else b.out, op=mop)
        if kind == "reduce_scatter":
            return lambda: verb["Reduce_scatter_block"](b.x, b.out, op=mop)
        if kind == "all_gather":
            return lambda: verb["Allgather"](send, b.out)
        if kind == "broadcast":
            return lambda: verb["Bcast"](b.x, root=root)
        if b.out is None:  # not the root
            return lambda: verb["Reduce"](b.x, None, op=mop, root=root)
        return lambda: verb["Reduce"](send, b.out, op=mop, root=root)

    def sync(self) -> None:
        self.comm.Barrier()


class PeerUnavailable(Exception):
    """A peer cannot run in this job; the message says why (printed as "skipped (...)")."""


def all_ranks_ok(comm: Any, ok: bool) -> bool:
    """True when `ok` holds on every rank (a collective: every rank must call it)."""
    flag = np.array([1 if ok else 0], dtype=np.int32)
    return bool(comm.all_reduce(flag, op="min")[0])


class NcclPeer(System):  # pragma: no cover - needs GPUs
    """NCCL through cupy.cuda.nccl, on the current CuPy stream. Constructing it is collective."""

    name = "nccl"
    _TYPES: ClassVar[dict[str, str]] = {
        "int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
        "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64",
        "float16": "NCCL_FLOAT16", "bfloat16": "NCCL_BFLOAT16", "float32": "NCCL_FLOAT32",
        "float64": "NCCL_FLOAT64"}
    _OPS: ClassVar[dict[str, str]] = {
        "sum": "NCCL_SUM", "prod": "NCCL_PROD", "min": "NCCL_MIN", "max": "NCCL_MAX",
        "avg": "NCCL_AVG"}

    def __init__(self, comm: Any):
        why = None
        try:
            import cupy
            from cupy.cuda import nccl
        except Exception as exc:  # ImportError, or a library that fails to load
            why = f"cupy.cuda.nccl is not importable ({type(exc).__name__}: {exc})"
        else:
            if not getattr(nccl, "available", True) or not hasattr(nccl, "get_unique_id"):
                why = "CuPy could not load libnccl (pip install nvidia-nccl-cu13)"
            elif getattr(nccl, "STAND_IN", False):
                why = "cupy.cuda.nccl is the CUDA simulator's stand-in: no NCCL to measure"
        if not all_ranks_ok(comm, why is None):
            raise PeerUnavailable(why or "NCCL is unavailable on another rank")
        self.cupy, self.nccl, self.gcomm = cupy, nccl, comm
        message = np.zeros(129, dtype=np.uint8)  # [ok, the 128-byte ncclUniqueId]
        if comm.rank == 0:
            try:
                message[1:] = np.frombuffer(nccl_id_bytes(nccl.get_unique_id()), np.uint8)
                message[0] = 1
            except Exception as exc:  # NcclError: reported below on every rank
                why = f"ncclGetUniqueId failed: {exc}"
        comm.broadcast(message, root=0)
        if not message[0]:
            raise PeerUnavailable(why or "ncclGetUniqueId failed on rank 0")
        nccl_id = message[1:].tobytes()
        try:
            self.comm = nccl.NcclCommunicator(
                comm.size, nccl_id_argument(nccl_id, cupy.__version__), comm.rank)
        except OverflowError:  # an old CuPy where C char is unsigned
            self.comm = nccl.NcclCommunicator(
                comm.size, nccl_id_argument(nccl_id, cupy.__version__, False), comm.rank)

    def call(self, kind: str, b: Buffers, op: str, root: int) -> Callable[[], object]:
        """Both placements, as nccl-tests: in place, the pointers alias (all_gather's input
        is out's slot, reduce_scatter's output x's block)."""
        nccl, c = self.nccl, self.comm
        if kind in MESSAGES:
            raise Unsupported("messages are not measured on NCCL here")
        if kind == "barrier":
            raise Unsupported("NCCL has no barrier")
        dtype = str(b.x.dtype)
        t = getattr(nccl, self._TYPES.get(dtype, ""), None)
        if t is None:
            raise Unsupported(f"NCCL has no {dtype}")
        nop = getattr(nccl, self._OPS.get(op, ""), None)
        if nop is None and kind not in ("all_gather", "broadcast"):
            raise Unsupported(f"this cupy.cuda.nccl has no {op}")
        x, n = b.x, b.x.size
        out = b.out.data.ptr if b.out is not None else 0
        count = n // self.gcomm.size

        def stream() -> int:
            return int(self.cupy.cuda.get_current_stream().ptr)

        if kind == "all_reduce":
            return lambda: c.allReduce(x.data.ptr, out, n, t, nop, stream())
        if kind == "reduce_scatter":
            return lambda: c.reduceScatter(x.data.ptr, out, count, t, nop, stream())
        if kind == "all_gather":
            return lambda: c.allGather(x.data.ptr, out, n, t, stream())
        if kind == "broadcast":
            return lambda: c.broadcast(x.data.ptr, out, n, t, root, stream())
        return lambda: c.reduce(x.data.ptr, out, n, t, nop, root, stream())

    def sync(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()
        self.gcomm.barrier()

    def close(self) -> None:
        self.comm.destroy()


class GlooPeer(System):
    """torch.distributed with the gloo backend, on tensors that share the benchmark's arrays
    (CPU tensors for NumPy, CUDA tensors through DLPack for CuPy). Gloo's all_reduce, broadcast
    and reduce work in place. On CUDA tensors only all_reduce and broadcast are measured (what
    gloo supports on CUDA in every torch version). Constructing it is collective."""

    name = "gloo"
    #: what gloo reduces and moves (no int16, no unsigned wider than 8 bits; NumPy's bfloat16 is
    #: not torch's)
    _DTYPES: ClassVar[frozenset[str]] = frozenset((
        "int8", "uint8", "int32", "int64", "float16", "float32", "float64",
        "complex64", "complex128"))

    def __init__(self, comm: Any, device: str = "cpu"):
        why = None
        try:
            import torch
            import torch.distributed as dist
        except ImportError as exc:
            why = f"{(exc.name or 'torch').split('.')[0]} is not importable"
        except Exception as exc:  # a torch that fails to load its libraries
            why = f"torch is not importable ({type(exc).__name__}: {exc})"
        else:
            if not dist.is_available() or not dist.is_gloo_available():
                why = "this torch has no gloo backend"
            elif device == "cuda" and not torch.cuda.is_available():
                why = "this torch has no CUDA"
        if not all_ranks_ok(comm, why is None):
            raise PeerUnavailable(why or "gloo is unavailable on another rank")
        self.torch, self.dist, self.device = torch, dist, device
        if device == "cuda":  # the GPU gpuring uses on this rank
            torch.cuda.set_device(comm.local_rank % torch.cuda.device_count())
        port = np.zeros(1, dtype=np.int64)
        if comm.rank == 0:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port[0] = s.getsockname()[1]
        comm.broadcast(port, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port[0])}",
                                rank=comm.rank, world_size=comm.size,
                                timeout=datetime.timedelta(seconds=120))
        r = dist.ReduceOp
        self.ops = {"sum": r.SUM, "prod": r.PRODUCT, "min": r.MIN, "max": r.MAX}

    def placements(self, kind: str) -> tuple[str, ...]:
        """Gloo's forms: all_gather out of place, the others in place."""
        return (OUT_OF_PLACE,) if kind in ("reduce_scatter", "all_gather", "barrier") else (
            IN_PLACE,)

    def _tensor(self, array: Any) -> Any:
        if self.device == "cuda":
            return self.torch.from_dlpack(array)
        return self.torch.from_numpy(array)

    def call(self, kind: str, b: Buffers, op: str, root: int) -> Callable[[], object]:
        dist = self.dist
        if kind in MESSAGES:
            raise Unsupported("messages are not measured on Gloo here")
        if kind == "barrier":
            return dist.barrier
        if str(b.x.dtype) not in self._DTYPES:
            raise Unsupported(f"gloo has no {b.x.dtype}")
        if kind == "reduce_scatter":
            raise Unsupported("gloo has no reduce_scatter")
        if self.device == "cuda" and kind not in ("all_reduce", "broadcast"):
            raise Unsupported(f"gloo has no {kind} on CUDA tensors")
        if kind not in ("all_gather", "broadcast") and op not in self.ops:
            raise Unsupported(f"gloo has no {op} reduction")
        x = self._tensor(b.x)
        top = self.ops.get(op)
        if kind == "all_reduce":
            return lambda: dist.all_reduce(x, op=top)
        if kind == "all_gather":
            outs = list(self._tensor(b.out).unbind(0))
            return lambda: dist.all_gather(outs, x)
        if kind == "broadcast":
            return lambda: dist.broadcast(x, src=root)
        return lambda: dist.reduce(x, dst=root, op=top)

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()
        self.dist.barrier()

    def close(self) -> None:
        self.dist.destroy_process_group()


def select_peers(names: list[str], comm: Any, device: str) -> tuple[list[System], list[str]]:
    """The peers that can run here, and a line for each one named (what runs, what not).
    Collective: every rank calls it with the same names, and a peer runs only where it could
    start on every rank."""
    peers: list[System] = []
    notes: list[str] = []
    makers: dict[str, Callable[[], System]] = {
        "mpi": lambda: MpiPeer(), "nccl": lambda: NcclPeer(comm),
        "gloo": lambda: GlooPeer(comm, device)}
    for name in names:
        why: str | None = None
        if name == "mpi":
            why = _mpi_world_matches(comm)
            if why is None and device != "cpu":
                why = "skipped on cuda (a PyPI MPI is not CUDA-aware; it would stage via host)"
        elif name == "nccl" and device != "cuda":
            why = "skipped (NCCL needs --device cuda and GPUs)"
        if not all_ranks_ok(comm, why is None):  # every rank skips it, or none does
            notes.append(f"{name}: {why or 'skipped (it cannot run on another rank)'}")
            continue
        peer: System | None = None
        try:
            peer = makers[name]()
        except PeerUnavailable as exc:
            why = f"skipped ({exc})"
        except Exception as exc:  # a failed init (NcclError, RuntimeError from gloo, ...)
            why = f"skipped (it failed to start: {type(exc).__name__}: {exc})"
        if not all_ranks_ok(comm, peer is not None):
            if peer is not None:
                peer.close()
                peer = None
            why = why or "skipped (it failed to start on another rank)"
        if peer is None:
            notes.append(f"{name}: {why}")
        else:
            peers.append(peer)
            notes.append(f"{name}: measured")
    return peers, notes


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
