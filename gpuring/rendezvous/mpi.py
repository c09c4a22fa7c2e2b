"""The control plane under mpiexec: rank, size and messages from MPI (mpi4py)."""

from __future__ import annotations

import os
import pickle
import secrets
import threading
import time
import zlib
from typing import Any

from .._errors import CollectiveTimeoutError, PeerFailureError
from .base import ControlPlane

__all__ = ["MpiControl", "MpiGroup", "launched_by_mpi"]

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
        #: each rank's node (host name)
        self.nodes: tuple[str, ...] = tuple(self.comm.allgather(MPI.Get_processor_name()))
        self._closed = False
        self._interrupted: str | None = None
        self._abandoned: list[Any] = []

    def subgroup(self, members: tuple[int, ...], name: str) -> MpiGroup:
        return MpiGroup(self, members, name)

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


class MpiGroup(MpiControl):
    """A sub-group's control plane under mpiexec: an MPI communicator of its members, made
    at its first use (so making the group waits for no peer). The members first meet with
    point-to-point messages, which are bounded; then `Comm.Create_group`, which only the
    members call, completes at once."""

    def __init__(self, parent: MpiControl, members: tuple[int, ...], name: str):
        self.nodes = tuple(parent.nodes[m] for m in members)
        parent._join(self, members, name, self.nodes)
        self._MPI = parent._MPI
        self._parent = parent
        self._members = members
        self._inner: MpiControl | None = None
        self._connecting = threading.Lock()
        self._closed = False
        self._interrupted = None
        self._abandoned = []

    @property
    def comm(self) -> Any:  # type: ignore[override]
        return self._connect(None).comm

    def _connect(self, timeout: float | None) -> MpiControl:
        with self._connecting:
            if self._inner is None:
                self._inner = self._meet(timeout)
            return self._inner

    def _meet(self, timeout: float | None) -> MpiControl:
        """Meet the members (bounded), then make the group's communicator. `Create_group`
        blocks until every member calls it, and a member that gave up on the meeting never
        will: it runs on a thread of its own, waited for within what is left of `timeout`
        (a thread that never returns is left behind, and this rank's error says why)."""
        import numpy as np

        parent = self._parent
        deadline = None if timeout is None else time.monotonic() + timeout
        tag = 1000 + zlib.crc32(self.job_id.encode()) % 30000
        mine = np.array([zlib.crc32(self.job_id.encode())], np.int64)
        others = [m for m in self._members if m != parent.rank]
        heard = np.zeros(len(others), np.int64)
        requests = [parent.comm.Isend(mine, dest=m, tag=tag) for m in others]
        requests += [parent.comm.Irecv(heard[i:i + 1], source=m, tag=tag)
                     for i, m in enumerate(others)]
        for request in requests:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self.wait(request, left, f"meeting of group {self.job_id}", (mine, heard))
        if (heard != mine[0]).any():
            from .._errors import CollectiveMismatchError

            raise CollectiveMismatchError(f"rank {self.rank} of group {self.job_id}: a member "
                                          "set up another group at the same time")
        made: list[Any] = []

        def create() -> None:
            try:
                group = parent.comm.Get_group().Incl(list(self._members))
                comm = parent.comm.Create_group(group, tag)
                group.Free()
                inner = MpiControl(comm)
                comm.Free()
                inner.job_id = self.job_id
                made.append(inner)
            except BaseException as exc:
                made.append(exc)

        thread = threading.Thread(target=create, name="gpuring-mpi-group", daemon=True)
        thread.start()
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if not made:
            raise CollectiveTimeoutError(
                f"MPI group {self.job_id} was not made within {timeout} s on rank "
                f"{self.rank}: a member met the others but did not make it (it timed out "
                "in the meeting, or died)")
        if isinstance(made[0], BaseException):
            raise made[0]
        inner: MpiControl = made[0]
        return inner

    def interrupt(self, reason: str) -> None:
        self._interrupted = reason
        if self._inner is not None:
            self._inner.interrupt(reason)

    def allgather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        return self._connect(timeout).allgather(obj, timeout)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._inner is not None:
                self._inner.close()
