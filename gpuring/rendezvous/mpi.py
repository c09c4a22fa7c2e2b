"""The control plane under mpiexec: rank, size and messages from MPI (mpi4py)."""

from __future__ import annotations

import os
import pickle
import secrets
import time
from typing import Any

from .._errors import CollectiveTimeoutError, PeerFailureError
from .base import ControlPlane

__all__ = ["MpiControl", "launched_by_mpi"]

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
            "SLURM_MPI_TYPE", "MV2_COMM_WORLD_SIZE", "I_MPI_HYDRA_TOPOLIB")


def launched_by_mpi() -> bool:
    """True when an MPI launcher started this process (without importing MPI)."""
    return any(name in os.environ for name in _MPI_ENV)


class MpiControl(ControlPlane):
    """Every call is bounded: exchanges use non-blocking MPI and poll with backoff."""

    def __init__(self, comm: Any = None):
        super().__init__()
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = (comm or MPI.COMM_WORLD).Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        local = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.local_rank = local.Get_rank()
        self.local_size = local.Get_size()
        local.Free()
        self.single_node = self.local_size == self.size
        self.job_id = self.comm.bcast(secrets.token_hex(8) if self.rank == 0 else None)
        self._closed = False
        self._interrupted: str | None = None
        self._abandoned: list[Any] = []

    def interrupt(self, reason: str) -> None:
        self._interrupted = reason

    def wait(self, request: Any, timeout: float | None, what: str,
             buffers: tuple[Any, ...] = ()) -> None:
        """Poll `request` until done; on a timeout or interrupt keep `buffers` alive for good,
        since MPI may still write them."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 1e-6
        while not request.Test():
            if self._interrupted is not None:
                self._abandoned.append((request, buffers))
                raise PeerFailureError(self._interrupted)
            if deadline is not None and time.monotonic() > deadline:
                self._abandoned.append((request, buffers))
                raise CollectiveTimeoutError(
                    f"MPI {what} timed out after {timeout} s on rank {self.rank}: "
                    f"some rank did not take part")
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def allgather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        import numpy as np

        MPI = self._MPI
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = np.zeros(self.size, np.int64)
        mine = np.array([data.size], np.int64)
        self.wait(self.comm.Iallgather(mine, sizes), timeout, "allgather", (mine, sizes))
        gathered = np.empty(int(sizes.sum()), np.uint8)
        displs = np.concatenate(([0], np.cumsum(sizes)[:-1]))
        request = self.comm.Iallgatherv(data, [gathered, sizes, displs, MPI.BYTE])
        self.wait(request, timeout, "allgather", (data, gathered, sizes, displs))
        return [pickle.loads(gathered[displs[r]:displs[r] + sizes[r]].tobytes())
                for r in range(self.size)]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.comm.Free()
