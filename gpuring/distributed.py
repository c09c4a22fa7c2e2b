"""A drop-in for `cupyx.distributed`: change the import, keep the calls.

    import gpuring.distributed as dist          # was: import cupyx.distributed as dist
    comm = dist.init_process_group(n_devices, rank)     # or dist.NCCLBackend(n_devices, rank)
    comm.all_reduce(x, y, op="sum")             # y holds the sum; returns None
    comm.stop()

`init_process_group` and `NCCLBackend(n_devices, rank, host, port, use_mpi)` meet the other
processes as cupyx does: rank 0 serves a rendezvous on `host:port` (the arguments, else
$CUPYX_DISTRIBUTED_HOST and $CUPYX_DISTRIBUTED_PORT, else 127.0.0.1:13333) and the others
connect to it; the processes may come from any launcher or be started by hand. With
`use_mpi=True` they meet through MPI instead (under mpiexec; where mpi4py is missing, through
the rendezvous, as cupyx falls back). Processes that report the same node name
(`GPURING_HOSTNAME`, else the host's) are one node: that gives each its local rank and size.

Who may join: rank 0 listens on `host` only (loopback by default, so only processes of this
machine can connect), and admits only connections that prove the job's key: the hex string
in $GPURING_JOB_KEY, which every process of the job must be given alike. Without it, the key
is derived from the port, which keeps two jobs on different ports apart but admits any
process that can reach the port: set $GPURING_JOB_KEY whenever `host` is not loopback (a
warning says so).

The backend has cupyx's methods, signatures and semantics (docs/api.md, "cupyx.distributed",
lists what still differs): results go into the arrays given and every method returns None;
arrays are read by their memory, C or F order, so `count` takes the first elements
(`all_gather`, `reduce_scatter`) and an output may be larger than the result; sparse
matrices (CSR, CSC, COO) go where cupyx takes them; a bad op, layout or first dimension
raises `ArgumentError`, a RuntimeError as cupyx raises (and a ValueError). Beyond cupyx:
NumPy arrays too (then on the CPU), `op="avg"`, bfloat16 and int16, a bounded wait for every
call (`timeout=`, $GPURING_TIMEOUT) and errors naming a dead or diverging peer
(`gpuring.PeerFailureError`, `gpuring.CollectiveMismatchError`).
"""

from __future__ import annotations

import contextlib
import importlib.util
import operator
import os
import sys
from typing import Any

from . import _arrays, _sparse
from ._communicator import Communicator
from ._config import Config
from ._errors import ArgumentError, GpuringError
from .rendezvous.base import ControlPlane
from .rendezvous.launchers import job_key, meet

__all__ = ["init_process_group", "NCCLBackend", "GpuringBackend", "ArgumentError",
           "DEFAULT_HOST", "DEFAULT_PORT"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 13333
ENV_HOST = "CUPYX_DISTRIBUTED_HOST"
ENV_PORT = "CUPYX_DISTRIBUTED_PORT"
#: the ops cupyx takes, and gpuring's average
_OPS = ("sum", "prod", "min", "max", "avg")


def init_process_group(n_devices: int, rank: int, *, backend: str = "nccl",
                       host: str | None = None, port: int | None = None,
                       use_mpi: bool = False, timeout: float | None = None) -> NCCLBackend:
    """Join the job of `n_devices` processes as `rank` and return its backend. Every process
    calls it; rank 0 first serves the rendezvous (see the module's doc). `backend` is
    "nccl" (cupyx's name, the default) or "gpuring": both mean gpuring. CuPy arrays use the
    current CuPy device at this call, as with cupyx. `timeout` bounds every wait in seconds
    (default $GPURING_TIMEOUT)."""
    n_devices, rank = _job_size_and_rank(n_devices, rank)
    if backend not in ("gpuring", "nccl"):
        raise ValueError(f"{backend} is not supported: use backend='nccl' (gpuring)")
    host = host or os.environ.get(ENV_HOST) or DEFAULT_HOST
    port = int(port if port is not None else os.environ.get(ENV_PORT) or DEFAULT_PORT)
    return NCCLBackend(n_devices, rank, host, port, use_mpi, timeout=timeout)


def _job_size_and_rank(n_devices: Any, rank: Any) -> tuple[int, int]:
    """cupyx's checks (ValueError), on integers of any kind (a NumPy integer too)."""
    n_devices, rank = _integer(n_devices, "n_devices"), _integer(rank, "rank")
    if n_devices <= 0:
        raise ValueError(f"Invalid number of devices {n_devices}")
    if not 0 <= rank < n_devices:
        raise ValueError(f"Invalid rank {rank} for {n_devices} devices")
    return n_devices, rank


def _integer(value: Any, name: str) -> int:
    """`value` as an int: Python's or NumPy's integers (not bool); TypeError otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an integer, got a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}") from None


def _meet(n_devices: int, rank: int, host: str, port: int, use_mpi: bool,
          config: Config) -> ControlPlane:
    """The job's control plane: through MPI (`use_mpi`, where mpi4py is importable, as cupyx
    decides) or the rendezvous rank 0 serves on host:port."""
    if use_mpi and importlib.util.find_spec("mpi4py") is not None:
        from .rendezvous.mpi import MpiControl

        control = MpiControl()
        if (control.size, control.rank) != (n_devices, rank):
            control.close()
            raise ValueError(f"use_mpi: MPI says rank {control.rank} of {control.size}, the "
                             f"call says rank {rank} of {n_devices}")
        return control
    who = "gpuring.distributed"
    try:
        return meet(rank, n_devices, host, port, job_key(host, port, who), config.timeout, who)
    except OSError as exc:
        if rank == 0 and "cannot serve" in str(exc):
            raise GpuringError(f"{exc}; pass another port") from None
        raise


class NCCLBackend:
    """cupyx.distributed's backend, run by gpuring: `NCCLBackend(n_devices, rank, host, port,
    use_mpi)` joins the job as `init_process_group` does (`timeout=` bounds every wait).
    Arrays are CuPy (queued on `stream` or the current stream, as with cupyx) or NumPy (on
    the CPU; `stream` is then ignored). `comm` is the gpuring Communicator underneath, for
    the rest of gpuring's verbs; `NCCLBackend.over(comm)` wraps one made otherwise."""

    def __init__(self, n_devices: int, rank: int, host: str | None = DEFAULT_HOST,
                 port: int | None = DEFAULT_PORT, use_mpi: bool = False, *,
                 timeout: float | None = None):
        n_devices, rank = _job_size_and_rank(n_devices, rank)
        config = Config.from_env(timeout=timeout)
        control = _meet(n_devices, rank, host or DEFAULT_HOST,
                        DEFAULT_PORT if port is None else _integer(port, "port"), use_mpi, config)
        cupy = sys.modules.get("cupy")
        if cupy is not None:  # CuPy arrays live on the device current now, as with cupyx
            control.device_slot = int(cupy.cuda.runtime.getDevice())
        self._attach(Communicator(control, config))

    @classmethod
    def over(cls, comm: Communicator) -> NCCLBackend:
        """The backend of an open gpuring Communicator (closed by `stop`)."""
        backend = cls.__new__(cls)
        backend._attach(comm)
        return backend

    def _attach(self, comm: Communicator) -> None:
        self.comm = comm
        self.rank = comm.rank
        self._n_devices = comm.size

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, in_array: Any, out_array: Any, op: str = "sum",
                   stream: Any = None) -> None:
        """out_array's first in_array.size elements: the reduction of every rank's in_array
        (`op`: "sum", "prod", "min", "max", or gpuring's "avg")."""
        if _sparse.is_sparse(in_array):
            _sparse.all_reduce(self.comm, in_array, out_array, _op(op, None))
            return
        x = _flat(in_array, "in_array")
        rop = _op(op, x)
        y = _first(_flat(out_array, "out_array"), x.size, "out_array")
        with _on(stream, x):
            self.comm.all_reduce(x, op=rop, out=x if _same(x, y) else y)

    def reduce(self, in_array: Any, out_array: Any, root: int = 0, op: str = "sum",
               stream: Any = None) -> None:
        """The reduction of every rank's in_array into root's out_array (only root's is
        written; the others may pass any array or None)."""
        root = _integer(root, "root")
        if _sparse.is_sparse(in_array):
            _sparse.reduce(self.comm, in_array, out_array, root, _op(op, None))
            return
        x = _flat(in_array, "in_array")
        rop = _op(op, x)
        y = None
        if self.rank == root:
            y = _first(_flat(out_array, "out_array"), x.size, "out_array")
            y = x if _same(x, y) else y
        with _on(stream, x):
            self.comm.reduce(x, op=rop, root=root, out=y)

    def broadcast(self, in_out_array: Any, root: int = 0, stream: Any = None) -> None:
        """Root's in_out_array into every rank's (by its element count)."""
        root = _integer(root, "root")
        if _sparse.is_sparse(in_out_array):
            _sparse.broadcast(self.comm, in_out_array, root)
            return
        x = _flat(in_out_array, "in_out_array")
        with _on(stream, x):
            self.comm.broadcast(x, root=root)

    def reduce_scatter(self, in_array: Any, out_array: Any, count: int, op: str = "sum",
                       stream: Any = None) -> None:
        """Block `rank` (of `count` elements) of the reduction of the first
        `count x n_devices` elements of every rank's in_array, into out_array's first
        `count`. Sparse: in_array is a list of n_devices matrices, each reduced to rank 0,
        which scatters them (`count` is not used)."""
        if isinstance(in_array, (list, tuple)) and in_array and \
                _sparse.is_sparse(in_array[0]):
            _sparse.reduce_scatter(self.comm, in_array, out_array, _op(op, None))
            return
        count = _count(count)
        x = _first(_flat(in_array, "in_array"), count * self._n_devices, "in_array")
        rop = _op(op, x)
        y = _first(_flat(out_array, "out_array"), count, "out_array")
        with _on(stream, x):
            self.comm.reduce_scatter(x, op=rop, out=y)

    def all_gather(self, in_array: Any, out_array: Any, count: int,
                   stream: Any = None) -> None:
        """The first `count` elements of every rank's in_array, in rank order, into the first
        `count x n_devices` of out_array. Sparse: out_array is a list, to which every rank's
        matrix is appended (`count` is not used)."""
        if _sparse.is_sparse(in_array):
            _sparse.all_gather(self.comm, in_array, out_array)
            return
        count = _count(count)
        x = _first(_flat(in_array, "in_array"), count, "in_array")
        y = _first(_flat(out_array, "out_array"), count * self._n_devices, "out_array")
        with _on(stream, x):
            self.comm.all_gather(x, out=y.reshape(self._n_devices, count))

    def scatter(self, in_array: Any, out_array: Any, root: int = 0,
                stream: Any = None) -> None:
        """Block i of root's in_array (shape `(n_devices, ...)` on every rank) into rank i's
        out_array (the block's element count). Sparse: in_array is root's list of
        n_devices matrices."""
        root = _integer(root, "root")
        if (isinstance(in_array, (list, tuple)) and in_array and
                _sparse.is_sparse(in_array[0])) or _sparse.is_sparse(out_array):
            _sparse.scatter(self.comm, in_array, out_array, root)
            return
        x = _blocks(in_array, self._n_devices, "scatter", "in_array")
        y = _flat(out_array, "out_array")
        if y.size != x.shape[1]:
            raise ArgumentError(f"scatter: out_array has {y.size} elements, a block of "
                                f"in_array {x.shape[1]}")
        with _on(stream, x):
            self.comm.scatter(x, root=root, out=y)

    def gather(self, in_array: Any, out_array: Any, root: int = 0,
               stream: Any = None) -> None:
        """Every rank's in_array into block i of root's out_array (shape `(n_devices, ...)`;
        the other ranks may pass None, beyond cupyx). Sparse: out_array is root's list, to
        which every rank's matrix is appended."""
        root = _integer(root, "root")
        if _sparse.is_sparse(in_array):
            _sparse.gather(self.comm, in_array, out_array, root)
            return
        x = _flat(in_array, "in_array")
        y = None
        if out_array is not None or self.rank == root:
            y = _blocks(out_array, self._n_devices, "gather", "out_array")
            if y.shape[1] != x.size:
                raise ArgumentError(f"gather: a block of out_array has {y.shape[1]} elements, "
                                    f"in_array {x.size}")
        with _on(stream, x):
            self.comm.gather(x, root=root, out=y if self.rank == root else None)

    def all_to_all(self, in_array: Any, out_array: Any, stream: Any = None) -> None:
        """Block j of every rank's in_array into block i of rank j's out_array (both of shape
        `(n_devices, ...)`). Sparse: lists of n_devices matrices (out_array is appended
        to)."""
        if isinstance(in_array, (list, tuple)) and in_array and \
                _sparse.is_sparse(in_array[0]):
            _sparse.all_to_all(self.comm, in_array, out_array)
            return
        x = _blocks(in_array, self._n_devices, "all_to_all", "in_array")
        y = _blocks(out_array, self._n_devices, "all_to_all", "out_array")
        if x.shape != y.shape:
            raise ArgumentError(f"all_to_all: a block of in_array has {x.shape[1]} elements, "
                                f"of out_array {y.shape[1]}")
        with _on(stream, x):
            self.comm.all_to_all(x, out=y)

    def barrier(self) -> None:
        """Return once every process entered the barrier (the host waits, as with cupyx)."""
        self.comm.barrier()

    # -- point to point --------------------------------------------------------------------
    def send(self, array: Any, peer: int, stream: Any = None) -> None:
        """Send `array` (its elements) to `peer`, which receives them with `recv`."""
        peer = _integer(peer, "peer")
        if _sparse.is_sparse(array):
            _sparse.send(self.comm, array, peer)
            return
        x = _flat(array, "array")
        with _on(stream, x):
            self.comm.send(x, peer)

    def recv(self, out_array: Any, peer: int, stream: Any = None) -> None:
        """Receive what `peer` sends into out_array: the same element count (NumPy arrays:
        at least as many elements)."""
        peer = _integer(peer, "peer")
        if _sparse.is_sparse(out_array):
            _sparse.recv(self.comm, out_array, peer)
            return
        y = _flat(out_array, "out_array")
        with _on(stream, y):
            self.comm.recv(y, peer)

    def send_recv(self, in_array: Any, out_array: Any, peer: int, stream: Any = None) -> None:
        """Send in_array to `peer` and receive its into out_array, at once (`peer` may be
        this rank: a copy)."""
        peer = _integer(peer, "peer")
        if _sparse.is_sparse(in_array):
            _sparse.send_recv(self.comm, in_array, out_array, peer)
            return
        x, y = _flat(in_array, "in_array"), _flat(out_array, "out_array")
        with _on(stream, x):
            self.comm.sendrecv(x, peer, y, peer)

    # -- lifetime --------------------------------------------------------------------------
    def stop(self) -> None:
        """Leave the job (waits for this process's queued work). A process may also just
        exit after its last call: the peers finish the calls it took part in (see
        docs/faults.md). Rank 0's process serves the rendezvous until it
        exits."""
        self.comm.close()


#: the name this class had first
GpuringBackend = NCCLBackend


def _op(op: Any, x: Any) -> str:
    """`op` checked as cupyx does (an unknown op is a RuntimeError; complex arrays take no
    min or max), for array `x` (None: any)."""
    if not isinstance(op, str) or op not in _OPS:
        raise ArgumentError(f"Unknown op {op!r}: use one of {', '.join(_OPS)}")
    if x is not None and x.dtype.kind == "c" and op in ("min", "max"):
        raise ValueError(f"op {op!r} is not defined for complex arrays: use sum, prod or avg")
    return op


def _count(count: Any) -> int:
    count = _integer(count, "count")
    if count < 0:
        raise ValueError(f"count must not be negative, got {count}")
    return count


def _checked(array: Any, name: str) -> Any:
    """`array`, a NumPy or CuPy array laid out in C or F order (ArgumentError otherwise)."""
    if not hasattr(array, "flags") or not hasattr(array, "reshape"):
        raise TypeError(f"{name} must be a CuPy or NumPy array, got {type(array).__name__}")
    _arrays.device_kind(array)
    if not array.flags.c_contiguous and not array.flags.f_contiguous:
        raise ArgumentError(f"{name} must be C- or F-contiguous")
    return array


def _flat(array: Any, name: str) -> Any:
    """`array`'s elements in memory order, as a 1-D view (C or F order: the same bytes)."""
    array = _checked(array, name)
    if array.ndim == 1:
        return array
    return array.reshape(-1) if array.flags.c_contiguous else array.T.reshape(-1)


def _first(flat: Any, count: int, name: str) -> Any:
    """The first `count` elements of 1-D `flat` (ArgumentError where it has fewer)."""
    if flat.size < count:
        raise ArgumentError(f"{name} has {flat.size} elements, the call needs {count}")
    return flat if flat.size == count else flat[:count]


def _same(x: Any, y: Any) -> bool:
    """Whether 1-D views `x` and `y` are the same elements (an in-place call)."""
    return type(x) is type(y) and _arrays.same_memory(x, y)


def _blocks(array: Any, n: int, verb: str, name: str) -> Any:
    """`array` as (n, block elements): its first dimension must be the rank count (cupyx's
    RuntimeError), its blocks contiguous (C order, or one dimension)."""
    if array is None or not hasattr(array, "shape"):
        raise TypeError(f"{verb}: {name} must be a CuPy or NumPy array of shape "
                        f"({n}, ...), got {type(array).__name__}")
    array = _checked(array, name)
    if array.ndim == 0 or array.shape[0] != n:
        raise ArgumentError(f"{verb} requires {name} to have {n} elements in its first "
                            f"dimension, found {tuple(array.shape)}")
    if not array.flags.c_contiguous:
        raise ArgumentError(f"{verb}: {name} must be C-contiguous (its blocks are the rows "
                            "of its first dimension)")
    return array.reshape(n, -1)


def _on(stream: Any, array: Any) -> Any:
    """`with` it: CuPy work queued on `stream` where one is given."""
    if stream is None or not _arrays.is_cupy(array):
        return contextlib.nullcontext()
    return stream
