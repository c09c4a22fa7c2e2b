"""A drop-in for `cupyx.distributed`: change the import, keep the calls.

    import gpuring.distributed as dist          # was: import cupyx.distributed as dist
    comm = dist.init_process_group(n_devices, rank)
    comm.all_reduce(x, y, op="sum")             # y holds the sum; returns None
    comm.stop()

`init_process_group` meets the other processes as cupyx does: rank 0 serves a rendezvous on
`host:port` (the arguments, else $CUPYX_DISTRIBUTED_HOST and $CUPYX_DISTRIBUTED_PORT, else
127.0.0.1:13333) and the others connect to it; the processes may come from any launcher or
be started by hand. With `use_mpi=True` they meet through MPI instead (under mpiexec).
Processes that report the same node name (`GPURING_HOSTNAME`, else the host's) are one node:
that gives each its local rank and local size.

Who may join: rank 0 listens on `host` only (loopback by default, so only processes of this
machine can connect), and admits only connections that prove the job's key: the hex string
in $GPURING_JOB_KEY, which every process of the job must be given alike. Without it, the key
is derived from the port, which keeps two jobs on different ports apart but admits any
process that can reach the port: set $GPURING_JOB_KEY whenever `host` is not loopback (a
warning says so).

The backend has cupyx's methods and signatures; results go into the arrays given and every
method returns None. Beyond cupyx: NumPy arrays too (then on the CPU), `op="avg"`, bfloat16,
a bounded wait for every call (`timeout=`, $GPURING_TIMEOUT) and errors naming a dead or
diverging peer (`gpuring.PeerFailureError`, `gpuring.CollectiveMismatchError`).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
from typing import Any

from . import _arrays
from ._communicator import Communicator
from ._config import Config
from ._errors import GpuringError
from .rendezvous.base import ControlPlane
from .rendezvous.launchers import job_key, meet

__all__ = ["init_process_group", "GpuringBackend", "DEFAULT_HOST", "DEFAULT_PORT"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 13333
ENV_HOST = "CUPYX_DISTRIBUTED_HOST"
ENV_PORT = "CUPYX_DISTRIBUTED_PORT"


def init_process_group(n_devices: int, rank: int, *, backend: str = "gpuring",
                       host: str | None = None, port: int | None = None,
                       use_mpi: bool = False, timeout: float | None = None
                       ) -> GpuringBackend:
    """Join the job of `n_devices` processes as `rank` and return its backend. Every process
    calls it; rank 0 first serves the rendezvous (see the module's doc). `backend` is
    "gpuring" ("nccl", cupyx's default, is taken too and also means gpuring). CuPy arrays
    use the current CuPy device at this call, as with cupyx. `timeout` bounds every wait
    in seconds (default $GPURING_TIMEOUT)."""
    if not isinstance(n_devices, int) or n_devices <= 0:
        raise ValueError(f"Invalid number of devices {n_devices}")
    if not isinstance(rank, int) or not 0 <= rank < n_devices:
        raise ValueError(f"Invalid rank {rank} for {n_devices} devices")
    if backend not in ("gpuring", "nccl"):
        raise ValueError(f"{backend} is not supported: use backend='gpuring'")
    config = Config.from_env(timeout=timeout)
    control: ControlPlane
    if use_mpi:
        from .rendezvous.mpi import MpiControl

        control = MpiControl()
        if (control.size, control.rank) != (n_devices, rank):
            control.close()
            raise ValueError(f"use_mpi: MPI says rank {control.rank} of {control.size}, the "
                             f"call says rank {rank} of {n_devices}")
    else:
        host = host or os.environ.get(ENV_HOST) or DEFAULT_HOST
        port = int(port if port is not None else os.environ.get(ENV_PORT) or DEFAULT_PORT)
        who = "gpuring.distributed.init_process_group"
        try:
            control = meet(rank, n_devices, host, port, job_key(host, port, who),
                           config.timeout, who)
        except OSError as exc:
            if rank == 0 and "cannot serve" in str(exc):
                raise GpuringError(f"{exc}; pass another port") from None
            raise
    cupy = sys.modules.get("cupy")
    if cupy is not None:  # CuPy arrays live on the device current now, as with cupyx
        control.device_slot = int(cupy.cuda.runtime.getDevice())
    return GpuringBackend(Communicator(control, config))


class GpuringBackend:
    """cupyx.distributed's backend interface over a gpuring Communicator (`.comm`, for the
    rest of gpuring's verbs). Arrays are CuPy (queued on `stream` or the current stream,
    as with cupyx) or NumPy (on the CPU; `stream` is then ignored)."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        self.rank = comm.rank
        self._n_devices = comm.size

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, in_array: Any, out_array: Any, op: str = "sum",
                   stream: Any = None) -> None:
        with _on(stream, in_array):
            self.comm.all_reduce(in_array, op=op,
                                 out=_as(out_array, in_array.shape, "out_array"))

    def reduce(self, in_array: Any, out_array: Any, root: int = 0, op: str = "sum",
               stream: Any = None) -> None:
        out = _as(out_array, in_array.shape, "out_array") if self.rank == root else None
        with _on(stream, in_array):
            self.comm.reduce(in_array, op=op, root=root, out=out)

    def broadcast(self, in_out_array: Any, root: int = 0, stream: Any = None) -> None:
        with _on(stream, in_out_array):
            self.comm.broadcast(in_out_array, root=root)

    def reduce_scatter(self, in_array: Any, out_array: Any, count: int, op: str = "sum",
                       stream: Any = None) -> None:
        if in_array.size != count * self._n_devices:
            raise ValueError(f"reduce_scatter: in_array has {in_array.size} elements, "
                             f"count x ranks is {count * self._n_devices}")
        with _on(stream, in_array):
            self.comm.reduce_scatter(in_array.reshape(-1), op=op,
                                     out=_as(out_array, (count,), "out_array"))

    def all_gather(self, in_array: Any, out_array: Any, count: int,
                   stream: Any = None) -> None:
        with _on(stream, in_array):
            self.comm.all_gather(_as(in_array, (count,), "in_array"),
                                 out=_as(out_array, (self._n_devices, count), "out_array"))

    def scatter(self, in_array: Any, out_array: Any, root: int = 0,
                stream: Any = None) -> None:
        with _on(stream, in_array):
            self.comm.scatter(in_array, root=root,
                              out=_as(out_array, in_array.shape[1:], "out_array"))

    def gather(self, in_array: Any, out_array: Any, root: int = 0,
               stream: Any = None) -> None:
        out = _as(out_array, (self._n_devices, *in_array.shape), "out_array") \
            if self.rank == root else None
        with _on(stream, in_array):
            self.comm.gather(in_array, root=root, out=out)

    def all_to_all(self, in_array: Any, out_array: Any, stream: Any = None) -> None:
        with _on(stream, in_array):
            self.comm.all_to_all(in_array, out=_as(out_array, in_array.shape, "out_array"))

    def barrier(self) -> None:
        """Return once every process entered the barrier (the host waits, as with cupyx)."""
        self.comm.barrier()

    # -- point to point --------------------------------------------------------------------
    def send(self, array: Any, peer: int, stream: Any = None) -> None:
        """Send `array` (its elements, whatever its shape) to `peer`."""
        with _on(stream, array):
            self.comm.send(_flat(array), peer)

    def recv(self, out_array: Any, peer: int, stream: Any = None) -> None:
        """Receive from `peer` into `out_array`, whose shape may differ from the sender's:
        the same element count (NumPy arrays: at least as many elements)."""
        with _on(stream, out_array):
            self.comm.recv(_flat(out_array), peer)

    def send_recv(self, in_array: Any, out_array: Any, peer: int, stream: Any = None) -> None:
        with _on(stream, in_array):
            self.comm.sendrecv(_flat(in_array), peer, _flat(out_array), peer)

    # -- lifetime --------------------------------------------------------------------------
    def stop(self) -> None:
        """Leave the job (waits for this process's queued work). Rank 0's process serves the
        rendezvous until it exits, when it waits (at most the timeout) for the others to
        leave."""
        self.comm.close()


def _as(array: Any, shape: tuple[int, ...], name: str) -> Any:
    """`array` seen with `shape` (a view: cupyx reads arrays by their element count)."""
    if not hasattr(array, "reshape") or not hasattr(array, "flags"):
        raise TypeError(f"{name} must be a CuPy or NumPy array, got {type(array).__name__}")
    if not array.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    size = math.prod(shape)
    if array.size != size:
        raise ValueError(f"{name} has {array.size} elements, the call needs {size}")
    return array if array.shape == tuple(shape) else array.reshape(shape)


def _flat(array: Any) -> Any:
    """A C-contiguous array seen flat (a view; any other array as it is, for the verb to
    refuse or copy): messages go by element count, as cupyx's do."""
    flags = getattr(array, "flags", None)
    if flags is None or not flags.c_contiguous or array.ndim == 1:
        return array
    return array.reshape(-1)


def _on(stream: Any, array: Any) -> Any:
    """`with` it: CuPy work queued on `stream` where one is given."""
    if stream is None or not _arrays.is_cupy(array):
        return contextlib.nullcontext()
    return stream
