"""The control plane under mpiexec: rank, size and messages from MPI (mpi4py)."""

from __future__ import annotations

import os
import pickle
import secrets
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

from .._errors import CollectiveTimeoutError, GpuringError, PeerFailureError
from .base import ControlPlane, host_name

__all__ = ["MpiControl", "MpiGroup", "launched_by_mpi"]

_MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
            "SLURM_MPI_TYPE", "MV2_COMM_WORLD_SIZE", "I_MPI_HYDRA_TOPOLIB")


#: seconds between two polls of a wait's watches (`ControlPlane.watch`)
_WATCH_EVERY = 0.05

#: the tag of the messages that open an exchange (`MpiControl.allgather`: each rank's size to
#: each other rank); outside the tags a sub-group's meeting uses on the same communicator
_SIZE_TAG = 3


def launched_by_mpi() -> bool:
    """True when an MPI launcher started this process (without importing MPI)."""
    return any(name in os.environ for name in _MPI_ENV)


class Notice(NamedTuple):
    """A failure notice: rank `source` of the job gave up in group `group` (a control plane's
    `job_id`), blaming rank `peer` of the job (None: no rank in particular), for `reason`."""

    source: int
    group: str
    peer: int | None
    reason: str
    #: the rank gave up after waiting its whole timeout
    timed_out: bool = False


class _Alarm:
    """Failure notices between the ranks of an MPI job: a rank that gives up in a group
    tells every other rank with a small message on a communicator of its own, which each
    rank's waits poll (MPI itself tells nothing: a rank waiting for a dead peer's data would
    wait its whole timeout); a control plane heeds the notices of its own group and of the
    groups it follows (`MpiControl.follow`). A rank's node peers learn of its death from the
    status board in shared memory; the first of them to give up tells the rest of the job
    here. One per process and job (its sub-groups share it)."""

    _TAG = 7

    def __init__(self, comm: Any, MPI: Any, name: str):
        """`name`: the same on every rank, unique per job and generation (MPI may give a
        later communicator the context of a freed one, and a notice sent to the freed one
        could then reach it: notices of other names are dropped)."""
        import numpy as np

        self._MPI = MPI
        self.comm = comm.Dup()
        self.name = name
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self._inbox = np.zeros(4096, np.uint8)
        self._receive: Any = self._listen()
        self._sent: list[Any] = []  # the messages and their requests, until they complete
        self._told: set[str] = set()  # the groups this rank sent a notice of
        self._closed = False
        self._lock = threading.Lock()
        #: every notice heard so far
        self.heard: list[Notice] = []

    def _listen(self) -> Any:
        return self.comm.Irecv(self._inbox, source=self._MPI.ANY_SOURCE, tag=self._TAG)

    def check(self) -> list[Notice]:
        """The notices other ranks sent so far (any thread)."""
        with self._lock:
            while self._receive is not None:
                status = self._MPI.Status()
                if not self._receive.Test(status):
                    break
                text = self._inbox[:status.Get_count(self._MPI.BYTE)].tobytes()
                self._receive = self._listen()
                parts = text.decode(errors="replace").split("\n", 4)
                if len(parts) == 5 and parts[0] == self.name:  # (else an earlier job's)
                    self.heard.append(Notice(status.Get_source(), parts[1],
                                             int(parts[2]) if parts[2] else None, parts[4],
                                             parts[3] == "timeout"))
            return list(self.heard)

    def send(self, group: str, reason: str, peer: int | None, timed_out: bool) -> None:
        """Tell every other rank that this one gave up in `group`, once per group, without
        waiting for any of them; nothing where a notice of that group was heard already."""
        import numpy as np

        with self._lock:
            if self._closed or group in self._told or any(n.group == group
                                                         for n in self.heard):
                return
            self._told.add(group)
            kind = "timeout" if timed_out else "failure"
            text = f"{self.name}\n{group}\n{'' if peer is None else peer}\n{kind}\n{reason}"
            data = np.frombuffer(text.encode()[:4096], np.uint8).copy()
            self._sent = [(d, r) for d, r in self._sent if not r.Test()]
            self._sent += [(data, self.comm.Isend(data, dest=r, tag=self._TAG))
                           for r in range(self.size) if r != self.rank]

    def close(self) -> None:
        """Stop listening and free the communicator. Notices still on their way to a rank
        that is gone are left to MPI (a send to a dead rank may never complete)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._receive is not None:
                self._receive.Cancel()
                self._receive.Wait()
                self._receive = None
            self._sent = [(d, r) for d, r in self._sent if not r.Test()]
            if not self._sent:
                self.comm.Free()


class MpiControl(ControlPlane):
    """Every call is bounded: exchanges use non-blocking MPI and poll with backoff, and
    listen for a failure notice from any rank of the job (`report_failure`)."""

    over_mpi = True

    def __init__(self, comm: Any = None, alarm: _Alarm | None = None):
        super().__init__()
        try:
            from mpi4py import MPI
        except ImportError as exc:
            raise ImportError(
                "this process was started by an MPI launcher (mpiexec, srun), and gpuring "
                "meets its peers through MPI there, but mpi4py is not installed: "
                'pip install "gpuring[mpi]" (mpi4py with an MPI from PyPI), or run the ranks '
                "with gpuring run -n N") from exc

        self._MPI = MPI
        self.comm = (comm or MPI.COMM_WORLD).Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.job_id = self.comm.bcast(secrets.token_hex(8) if self.rank == 0 else None)
        self._own_alarm = alarm is None
        self._alarm = _Alarm(self.comm, MPI, self.job_id) if alarm is None else alarm
        #: the groups whose failure notices fail this control plane's waits
        self.lineage: set[str] = {self.job_id}
        self.locate(self.comm.allgather(host_name()))
        self._closed = False
        self._interrupted: str | None = None
        self._abandoned: list[Any] = []
        self._step = 0  #: exchanges started (`allgather`)
        #: the persistent requests that open an exchange (`_size_requests`), made on first use
        self._sizes: _Sizes | None = None

    def subgroup(self, members: tuple[int, ...], name: str) -> MpiGroup:
        return MpiGroup(self, members, name)

    def interrupt(self, reason: str) -> None:
        self._interrupted = reason

    def wait(self, request: Any, timeout: float | None, what: str,
             buffers: tuple[Any, ...] = ()) -> None:
        """Poll `request` until done; on a timeout or interrupt keep `buffers` alive for good,
        since MPI may still write them."""
        self._poll(request.Test, request, timeout, f"MPI {what}", buffers)

    def _poll(self, done: Callable[[], bool], request: Any, timeout: float | None, what: str,
              buffers: tuple[Any, ...], missing: Callable[[], list[int]] | None = None
              ) -> None:
        """Call `done()` until it says the `request` (or requests) completed; on a timeout or
        interrupt keep them and `buffers` alive for good, since MPI may still write them. A
        timeout names the ranks `missing()` lists, where it is given and lists some."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 1e-6
        watched = time.monotonic()
        while not done():
            if self._watches and time.monotonic() > watched + _WATCH_EVERY:
                watched = time.monotonic()
                for check in self._watches:
                    found = check()
                    if found is not None:
                        self._abandoned.append((request, buffers))
                        raise found
            if self._interrupted is not None:
                self._abandoned.append((request, buffers))
                raise PeerFailureError(self._interrupted)
            heard = self.failure_notice()
            if heard is not None:
                self._abandoned.append((request, buffers))
                raise heard
            if deadline is not None and time.monotonic() > deadline:
                absent = [] if missing is None else missing()
                self._abandoned.append((request, buffers))
                raise CollectiveTimeoutError(
                    f"{what} timed out after {timeout} s on rank {self.rank}: "
                    f"{_who(absent)} did not take part", peer=absent[0] if absent else None)
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)

    def allgather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        """Each rank first sends its data's size to each other rank (point to point, so
        that a rank that waits knows whose sizes came: a timeout names the ranks that did
        not take part), then the data goes in one MPI allgatherv."""
        import numpy as np

        MPI = self._MPI
        self._step += 1
        what = f"control-plane exchange #{self._step}"
        data = np.frombuffer(pickle.dumps(obj), np.uint8)
        sizes = self._sizes if self._sizes is not None else self._size_requests()
        sizes.mine[0] = data.size
        if sizes.requests:
            self._sizes = None  # (until they complete: a failed wait leaves them to MPI)
            MPI.Prequest.Startall(sizes.requests)
            self._poll(lambda: bool(MPI.Request.Testall(sizes.requests)), sizes.requests,
                       timeout, what, (sizes.mine, sizes.heard), sizes.missing)
            self._sizes = sizes
        sizes.heard[self.rank] = data.size
        heard = sizes.heard.copy()
        gathered = np.empty(int(heard.sum()), np.uint8)
        displs = np.concatenate(([0], np.cumsum(heard)[:-1]))
        request = self.comm.Iallgatherv(data, [gathered, heard, displs, MPI.BYTE])
        self._poll(request.Test, request, timeout, what, (data, gathered, heard, displs))
        return [pickle.loads(gathered[displs[r]:displs[r] + heard[r]].tobytes())
                for r in range(self.size)]

    def _size_requests(self) -> _Sizes:
        """The persistent requests that send this rank's size to each other rank and
        receive theirs (made once, and anew after a wait that did not complete them)."""
        import numpy as np

        mine, heard = np.zeros(1, np.int64), np.zeros(self.size, np.int64)
        peers = [r for r in range(self.size) if r != self.rank]
        receives = [self.comm.Recv_init(heard[r:r + 1], source=r, tag=_SIZE_TAG)
                    for r in peers]
        sends = [self.comm.Send_init(mine, dest=r, tag=_SIZE_TAG) for r in peers]
        return _Sizes(mine, heard, peers, receives, receives + sends)

    def _notice_error(self, notice: Notice) -> GpuringError:
        """The error of a failure notice, naming ranks of this group where they are in it:
        a timeout where the rank that gave up timed out, else a peer's failure."""
        ranks = self.job_ranks  # (a rank that gave up blaming nobody is the one to name,
        blame = notice.peer if notice.peer is not None or notice.timed_out else notice.source
        # unless it timed out: then who is late is unknown)
        peer = ranks.index(blame) if blame in ranks else None
        if notice.timed_out:
            return CollectiveTimeoutError(f"rank {notice.source} of the job timed out "
                                          f"({notice.reason})", peer=peer)
        blamed = "" if notice.peer is None else f": rank {notice.peer} of the job failed"
        return PeerFailureError(f"rank {notice.source} of the job gave up{blamed} "
                                f"({notice.reason})", peer=peer, job_peer=blame)

    def failure_notice(self) -> GpuringError | None:
        for notice in self._alarm.check():
            if notice.group in self.lineage:
                return self._notice_error(notice)
        return None

    def follow(self, other: ControlPlane) -> None:
        if isinstance(other, MpiControl):
            self.lineage |= other.lineage

    def report_failure(self, reason: str, peer: int | None = None,
                       timed_out: bool = False, job_peer: int | None = None) -> None:
        """Tell every rank of the job (`peer`: a rank of this group)."""
        self._alarm.send(self.job_id, reason, self.in_job(peer, job_peer), timed_out)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._own_alarm:
                self._alarm.close()
            if self._sizes is not None:  # (inactive: the last exchange completed them)
                for request in self._sizes.requests:
                    request.Free()
            self.comm.Free()


class _Sizes(NamedTuple):
    """The persistent requests that open an exchange (`MpiControl._size_requests`)."""

    #: this rank's size, and every rank's as received (this rank's own set after)
    mine: Any
    heard: Any
    #: the other ranks, and the receive from each, in that order
    peers: list[int]
    receives: list[Any]
    #: the receives and the sends
    requests: list[Any]

    def missing(self) -> list[int]:
        """The ranks whose size has not come (after a wait for them timed out)."""
        return [peer for peer, receive in zip(self.peers, self.receives, strict=True)
                if not receive.Test()]


def _who(ranks: list[int]) -> str:
    """Ranks, in words, as a timeout names the ranks that did not take part."""
    return "some rank" if not ranks else f"rank {ranks[0]}" if len(ranks) == 1 else \
        f"ranks {ranks}"


class MpiGroup(MpiControl):
    """A sub-group's control plane under mpiexec: an MPI communicator of its members, made
    at its first use (so making the group waits for no peer). The members first meet with
    point-to-point messages, which are bounded; then `Comm.Create_group`, which only the
    members call, completes at once."""

    def __init__(self, parent: MpiControl, members: tuple[int, ...], name: str):
        parent.join_subgroup(self, members, name, tuple(parent.nodes[m] for m in members))
        self._MPI = parent._MPI
        self._alarm = parent._alarm
        self._own_alarm = False
        self.lineage = {name}
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
                inner = MpiControl(comm, parent._alarm)
                inner.job_ranks = self.job_ranks
                inner.lineage = self.lineage
                inner._watches = self._watches
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
