"""The communicator `gpuring.init()` makes, and the module-level verbs that act on it."""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from typing import Any

from . import settings
from ._communicator import Communicator
from ._config import Config
from ._errors import GpuringError
from ._ops import ReduceOp
from ._work import Work
from .rendezvous.base import ControlPlane

__all__ = ["init", "current", "all_reduce", "reduce_scatter", "all_gather", "broadcast",
           "gather", "scatter", "all_to_all", "all_gather_v", "all_to_all_v",
           "reduce_scatter_v", "send", "recv", "sendrecv", "isend", "irecv", "split",
           "reduce", "barrier", "synchronize", "all_reduce_async", "all_reduce_many"]

_lock = threading.Lock()
_current: Communicator | None = None


def _control_plane(timeout: float) -> ControlPlane:
    """The job's control plane, from the launcher that started this process."""
    from .rendezvous.launchers import from_environment, job_key, meet
    from .rendezvous.mpi import launched_by_mpi
    from .rendezvous.store import ENV_ADDR

    if os.environ.get(ENV_ADDR):
        from .rendezvous.store_client import StoreClient

        return StoreClient.from_env()
    if launched_by_mpi():
        from .rendezvous.mpi import MpiControl

        return MpiControl()
    job = from_environment()
    if job is not None:
        who = f"gpuring.init under {job.launcher}"
        try:
            control = meet(job.rank, job.size, job.host, job.port,
                           job_key(job.host, job.port, who, job.salt), timeout, who)
        except OSError as exc:
            if "cannot serve" not in str(exc):
                raise
            raise GpuringError(f"{exc}; set GPURING_PORT to a free port") from None
        if job.local_rank is not None:  # the GPU the launcher gave this rank
            control.device_slot = job.local_rank
        return control
    from .rendezvous.local import SingleProcess

    return SingleProcess()


def init(*, timeout: float | None = None, chunk_bytes: int | None = None,
         channels: int | None = None, buffer_bytes: int | None = None,
         algorithm: str | None = None, deterministic: bool | None = None,
         tuning: str | os.PathLike[str] | None = None) -> Communicator:
    """The job's communicator: ranks from `gpuring run`, from MPI under mpiexec, from
    torchrun's or Slurm's variables (`rendezvous.launchers`), or a world of one. Calling it
    again returns the same communicator until that one is closed.
    Arguments override the GPURING_* environment variables (`deterministic`:
    GPURING_DETERMINISTIC, `algorithm`: GPURING_ALGORITHM, `tuning`: GPURING_TUNING, a table
    from `gpuring tune`)."""
    global _current
    with _lock:
        if _current is not None and not _current.closed:
            return _current
        config = Config.from_env(timeout=timeout, chunk_bytes=chunk_bytes, channels=channels,
                                 buffer_bytes=buffer_bytes, algorithm=algorithm,
                                 deterministic=deterministic,
                                 tuning=None if tuning is None else os.fspath(tuning))
        _current = Communicator(_control_plane(config.timeout), config, on_close=forget)
        trace = settings.get("GPURING_TIMELINE")
        if trace:
            _current.start_timeline(trace)
        return _current


def forget(comm: Communicator) -> None:
    """Called by Communicator.close(): the next init() makes a new communicator."""
    global _current
    with _lock:
        if _current is comm:
            _current = None


def current() -> Communicator:
    """The communicator init() made; GpuringError if there is none."""
    comm = _current
    if comm is None or comm.closed:
        raise GpuringError("no communicator: call gpuring.init() first")
    return comm


def all_reduce(x: Any, *, op: ReduceOp | str = "sum", out: Any = None) -> Any:
    """`Communicator.all_reduce` on the communicator init() made."""
    return current().all_reduce(x, op=op, out=out)


def reduce_scatter(x: Any, *, op: ReduceOp | str = "sum", out: Any = None) -> Any:
    """`Communicator.reduce_scatter` on the communicator init() made."""
    return current().reduce_scatter(x, op=op, out=out)


def all_gather(x: Any, *, out: Any = None) -> Any:
    """`Communicator.all_gather` on the communicator init() made."""
    return current().all_gather(x, out=out)


def broadcast(x: Any, *, root: int = 0, out: Any = None) -> Any:
    """`Communicator.broadcast` on the communicator init() made."""
    return current().broadcast(x, root=root, out=out)


def reduce(x: Any, *, op: ReduceOp | str = "sum", root: int = 0, out: Any = None) -> Any:
    """`Communicator.reduce` on the communicator init() made."""
    return current().reduce(x, op=op, root=root, out=out)


def gather(x: Any, *, root: int = 0, out: Any = None) -> Any:
    """`Communicator.gather` on the communicator init() made."""
    return current().gather(x, root=root, out=out)


def scatter(x: Any, *, root: int = 0, out: Any = None) -> Any:
    """`Communicator.scatter` on the communicator init() made."""
    return current().scatter(x, root=root, out=out)


def all_to_all(x: Any, *, out: Any = None) -> Any:
    """`Communicator.all_to_all` on the communicator init() made."""
    return current().all_to_all(x, out=out)


def all_gather_v(x: Any) -> list[Any]:
    """`Communicator.all_gather_v` on the communicator init() made."""
    return current().all_gather_v(x)


def all_to_all_v(blocks: Sequence[Any]) -> list[Any]:
    """`Communicator.all_to_all_v` on the communicator init() made."""
    return current().all_to_all_v(blocks)


def reduce_scatter_v(x: Any, counts: Sequence[int], *, op: ReduceOp | str = "sum") -> Any:
    """`Communicator.reduce_scatter_v` on the communicator init() made."""
    return current().reduce_scatter_v(x, counts, op=op)


def send(x: Any, dst: int, tag: int = 0) -> None:
    """`Communicator.send` on the communicator init() made."""
    current().send(x, dst, tag)


def recv(out: Any, src: int | None = None, tag: int = 0) -> Any:
    """`Communicator.recv` on the communicator init() made."""
    return current().recv(out, src, tag)


def sendrecv(x: Any, dst: int, out: Any, src: int, tag: int = 0) -> Any:
    """`Communicator.sendrecv` on the communicator init() made."""
    return current().sendrecv(x, dst, out, src, tag)


def isend(x: Any, dst: int, tag: int = 0) -> Work:
    """`Communicator.isend` on the communicator init() made."""
    return current().isend(x, dst, tag)


def irecv(out: Any, src: int | None = None, tag: int = 0) -> Work:
    """`Communicator.irecv` on the communicator init() made."""
    return current().irecv(out, src, tag)


def split(color: int | None, key: int = 0) -> Communicator | None:
    """`Communicator.split` of the communicator init() made."""
    return current().split(color, key)


def barrier() -> None:
    """`Communicator.barrier` on the communicator init() made."""
    current().barrier()


def synchronize() -> None:
    """`Communicator.synchronize` on the communicator init() made."""
    current().synchronize()


def all_reduce_async(x: Any, *, op: ReduceOp | str = "sum", out: Any = None) -> Work:
    """`Communicator.all_reduce_async` on the communicator init() made."""
    return current().all_reduce_async(x, op=op, out=out)


def all_reduce_many(arrays: Sequence[Any], *, op: ReduceOp | str = "sum") -> list[Any]:
    """`Communicator.all_reduce_many` on the communicator init() made."""
    return current().all_reduce_many(arrays, op=op)
