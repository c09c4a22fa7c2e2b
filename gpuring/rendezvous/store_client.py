"""The ranks' side of the launcher's control plane (`store`): one connection per process,
shared by the job's control plane and the sub-groups made from it, each with its own
exchanges."""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Client, Connection  # type: ignore[attr-defined]
from typing import Any

from .._errors import CollectiveTimeoutError, PeerFailureError
from .base import ControlPlane
from .store import (
    ENV_ADDR,
    ENV_JOB,
    ENV_KEY,
    Abort,
    Absent,
    Bye,
    Failure,
    Gathered,
    Hello,
    Left,
    Lost,
    Post,
    Waiting,
    receive,
)

__all__ = ["StoreClient"]


@contextlib.contextmanager
def waiting_line(line: str, after: float = 5.0) -> Iterator[None]:
    """Print `line` on stderr if the block is still running `after` seconds in (a wait that
    may be long says so, instead of waiting silently)."""
    timer = threading.Timer(after, lambda: print(line, file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class _Link:
    """A rank's one connection to the launcher's store, shared by the job's control plane
    and the sub-groups made from it; closed once all of them are closed. Its reader routes
    each reply to its group's client."""

    def __init__(self, rank: int, address: tuple[str, int], key: bytes, generation: int,
                 timeout: float):
        self.rank = rank
        where = f"{address[0]}:{address[1]}"
        with waiting_line(f"gpuring: rank {rank} is waiting to reach the control server at "
                          f"{where} (up to {timeout:g} s)"):
            deadline = time.monotonic() + timeout
            while True:
                try:
                    self.conn = Client(address, family="AF_INET", authkey=key)
                    break
                except (ConnectionRefusedError, ConnectionResetError, EOFError) as exc:
                    # (reset, ended: a server that stopped listening closed it; try again)
                    if time.monotonic() > deadline:
                        raise ConnectionRefusedError(
                            f"rank {rank} could not reach the control server at {where} "
                            f"within {timeout:g} s: is rank 0 (which serves it) running, "
                            "with the same host and port?") from exc
                    time.sleep(0.05)
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._groups: dict[str, StoreClient] = {}
        self._closed = False
        #: why the connection is gone, once it is (no exchange can work then)
        self.lost: str | None = None
        #: ranks of the job known dead, with why (a sub-group made later must know too)
        self.deaths: dict[int, str] = {}
        self.conn.send(Hello(rank, generation))
        self._reader = threading.Thread(target=self._read_loop, name="gpuring-control",
                                        daemon=True)
        self._reader.start()

    def join(self, client: StoreClient) -> None:
        with self._lock:
            if client.group in self._groups:
                raise ValueError(f"control group {client.group!r} exists already")
            self._groups[client.group] = client
            deaths = [(r, why) for r, why in self.deaths.items() if r in client.job_ranks]
        for rank, reason in deaths[:1]:
            client.deliver(Failure(rank, reason))
        if self.lost is not None:
            client.deliver(Lost(self.lost))

    def leave(self, client: StoreClient) -> None:
        """`client` closed: say so; the last one closes the connection."""
        with self._lock:
            self._groups.pop(client.group, None)
            last = not self._groups
        try:
            self.send(Bye(client.group))
            if last:
                self.send(Bye(None))
        except OSError:
            pass
        if last:
            self._closed = True
            try:  # the reader blocked in recv() would keep the socket open: end it for both
                with socket.socket(fileno=os.dup(self.conn.fileno())) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.conn.close()

    def departed(self) -> frozenset[int]:
        """The ranks of the job known dead."""
        with self._lock:
            return frozenset(self.deaths)

    def _read_loop(self) -> None:
        while True:
            try:
                message = receive(self.conn)
            except Exception:
                if not self._closed:
                    self.lost = "the launcher's control connection closed"
                    for client in self._clients():
                        client.deliver(Lost(self.lost))
                return
            if isinstance(message, Failure) and message.group is None:  # a death
                with self._lock:
                    self.deaths.setdefault(message.rank, message.reason)
                for client in self._clients():
                    if message.rank in client.job_ranks:
                        client.deliver(message)
            else:
                target = self._groups.get(message.group)
                if target is not None:
                    target.deliver(message)

    def _clients(self) -> list[StoreClient]:
        with self._lock:
            return list(self._groups.values())

    def send(self, message: Any) -> None:
        with self._send_lock:
            self.conn.send(message)


class StoreClient(ControlPlane):
    """A rank's side, configured from the environment `gpuring run` sets. Every rank's k-th
    client of a process forms the job's k-th generation (re-initialisation after a close),
    unless `generation` names it: a server that serves one group of clients only (each
    process group of the torch backend has its own) is met at generation 1 by every rank,
    however many clients of other servers a process made before (ranks outside a group make
    none for it). Sub-groups (`subgroup`) share its connection, each with its own
    exchanges."""

    _generation = 0

    def __init__(self, rank: int, size: int, local_rank: int, local_size: int,
                 address: tuple[str, int], key: bytes, job_id: str, timeout: float = 60.0,
                 generation: int | None = None):
        super().__init__()
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = local_rank, local_size
        self.job_id = job_id
        if generation is None:
            StoreClient._generation += 1
            generation = StoreClient._generation
        self._link = _Link(rank, address, key, generation, timeout)
        self._setup("")
        #: each rank's node (ranks of `gpuring run` share one; `rendezvous.meet` asks)
        self.nodes = tuple(f"node{r // max(local_size, 1)}" for r in range(size))

    def _setup(self, group: str) -> None:
        """Join the link as the client of `group` (its ranks in the job: `job_ranks`)."""
        self.group = group
        self._replies: queue.Queue[Any] = queue.Queue()
        self._step = 0
        self._closed = False
        #: the first failure this group learned of (`_named`)
        self.failure: Failure | None = None
        self._link.join(self)

    @property
    def _conn(self) -> Connection:
        return self._link.conn

    @property
    def lost(self) -> str | None:
        """Why the connection to the launcher is gone, once it is."""
        return self._link.lost

    def subgroup(self, members: tuple[int, ...], name: str) -> StoreClient:
        group = StoreClient.__new__(StoreClient)
        self.join_subgroup(group, members, name, tuple(self.nodes[m] for m in members))
        group._link = self._link
        group._setup(name)
        return group

    def deliver(self, message: Any) -> None:
        """A message of this client's group, from the link's reader."""
        if isinstance(message, Failure):
            failure = self._named(message)
            if self.failure is None:
                self.failure = failure
            self._replies.put(failure)
            self._peer_failed(PeerFailureError(f"rank {failure.rank} failed: {failure.reason}",
                                               peer=failure.rank, job_peer=failure.blamed))
            return
        self._replies.put(message)

    def _named(self, message: Failure) -> Failure:
        """`message` (whose ranks are the job's) as this group names it: `rank` the rank of
        the group to blame (the one the failed rank blamed, where it is in the group), the
        reason saying who reports it; `blamed` the failed rank in the job's ranks."""
        rank, reason = self.job_ranks.index(message.rank), message.reason
        if self.group:  # the server names ranks of the job
            reason = f"{reason} (rank {message.rank} of the job is rank {rank} here)"
        blamed = message.rank if message.blamed is None else message.blamed
        if blamed != message.rank:
            reporter = rank
            if blamed in self.job_ranks:
                rank = self.job_ranks.index(blamed)  # the rank it gave up because of
                reason = f"rank {reporter} reports it: {reason}"
            else:  # a rank of the job outside this group
                reason = (f"rank {blamed} of the job failed, rank {reporter} here gave up "
                          f"because of it: {reason}")
        return Failure(rank, reason, message.group, blamed)

    @classmethod
    def from_env(cls) -> StoreClient:
        host, port = os.environ[ENV_ADDR].rsplit(":", 1)
        return cls(
            rank=int(os.environ["GPURING_RANK"]),
            size=int(os.environ["GPURING_WORLD_SIZE"]),
            local_rank=int(os.environ.get("GPURING_LOCAL_RANK", os.environ["GPURING_RANK"])),
            local_size=int(os.environ.get("GPURING_LOCAL_SIZE",
                                          os.environ["GPURING_WORLD_SIZE"])),
            address=(host, int(port)),
            key=bytes.fromhex(os.environ[ENV_KEY]),
            job_id=os.environ[ENV_JOB],
        )

    def _send(self, message: Any) -> None:
        self._link.send(message)

    def allgather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        if self.failure is not None:
            failure = self.failure
            raise PeerFailureError(failure.reason, peer=failure.rank, job_peer=failure.blamed)
        if self.lost is not None:  # later exchanges too: the one "lost" notice is used up
            raise PeerFailureError(self.lost)
        self._step += 1
        try:
            self._send(Post(self._step, obj, self.group, self.job_ranks if self.group else ()))
        except OSError as exc:  # before the reader saw the end of the connection
            raise PeerFailureError(f"the launcher's control connection failed ({exc!r})"
                                   ) from None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                message = self._replies.get(timeout=wait)
            except queue.Empty:
                missing = self._absent()
                who = "some rank" if not missing else \
                    f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
                raise CollectiveTimeoutError(
                    f"control-plane exchange #{self._step} timed out after {timeout} s on rank "
                    f"{self.rank}: {who} did not take part",
                    peer=missing[0] if missing else None) from None
            if isinstance(message, Absent):  # (an answer that came too late)
                continue
            if isinstance(message, Gathered) and message.step == self._step:
                return list(message.values)
            if isinstance(message, Failure):
                raise PeerFailureError(message.reason, peer=message.rank,
                                       job_peer=message.blamed)
            if isinstance(message, Lost):
                raise PeerFailureError(message.reason)
            if isinstance(message, Left) and message.step == self._step:
                raise PeerFailureError(message.reason, peer=self.job_ranks.index(message.rank))

    def _absent(self) -> list[int]:
        """After a wait in exchange `_step` timed out: the ranks of this group that never
        posted it, as the server says (asked, and waited for, a second at most; [] where it
        does not answer, or where the exchange completed meanwhile)."""
        try:
            self._send(Waiting(self._step, self.group))
        except OSError:
            return []
        deadline = time.monotonic() + 1.0
        held = []
        try:
            while (wait := deadline - time.monotonic()) > 0:
                try:
                    message = self._replies.get(timeout=wait)
                except queue.Empty:
                    break
                if isinstance(message, Absent) and message.step == self._step:
                    return [self.job_ranks.index(r) for r in message.ranks
                            if r in self.job_ranks]
                held.append(message)
        finally:
            for message in held:  # (whatever came meanwhile is for the next read)
                self._replies.put(message)
        return []

    def interrupt(self, reason: str) -> None:
        self._replies.put(Lost(reason))

    def departed(self) -> frozenset[int]:
        return self._link.departed()

    def report_failure(self, reason: str, peer: int | None = None,
                       timed_out: bool = False, job_peer: int | None = None) -> None:
        try:
            self._send(Abort(reason, self.group, self.job_ranks if self.group else (),
                             self.in_job(peer, job_peer)))
        except OSError:
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._link.leave(self)
