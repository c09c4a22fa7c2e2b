"""The launcher's control plane: a small server in `gpuring run`, one connection per rank.

Connections are `multiprocessing.connection` objects on loopback, authenticated with a per-job
key (HMAC challenge in both directions); a connection without the key is refused and logged.
The server answers allgathers once every rank has posted, and tells every rank at once when
one of them disconnects without saying goodbye or is reported dead by the launcher.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import (  # type: ignore[attr-defined]
    Client,
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
)
from typing import Any, NamedTuple

from .._errors import CollectiveTimeoutError, PeerFailureError
from .base import ControlPlane

__all__ = ["StoreServer", "StoreClient", "leave_and_stop", "ENV_ADDR", "ENV_KEY", "ENV_JOB"]

log = logging.getLogger("gpuring.rendezvous")

ENV_ADDR = "GPURING_STORE"
ENV_KEY = "GPURING_JOB_KEY"
ENV_JOB = "GPURING_JOB_ID"


# The messages, rank to server. `group` names the exchange's group of ranks: "" is the job,
# another name a sub-group (`ControlPlane.subgroup`) whose `members` (ranks of the job, in
# the group's order) its posts carry:
class Hello(NamedTuple):
    """The first message of a connection: which rank, which client generation."""

    rank: int
    generation: int


class Post(NamedTuple):
    """This rank's value for exchange `step` of `group`."""

    step: int
    value: Any
    group: str = ""
    members: tuple[int, ...] = ()


class Bye(NamedTuple):
    """The rank closed its client of `group` (orderly); None: its connection closes."""

    group: str | None = ""


class Abort(NamedTuple):
    """The rank failed in `group`: tell the group's other ranks."""

    reason: str
    group: str = ""
    members: tuple[int, ...] = ()


# ... and server to rank (`Lost` is the client's own note that the connection ended):
class Gathered(NamedTuple):
    """Every member's value of exchange `step` of `group`, in the group's order."""

    step: int
    values: list[Any]
    group: str = ""


class Failure(NamedTuple):
    """Rank `rank` (of the job) failed in `group`; None: it died (every group with it)."""

    rank: int
    reason: str
    group: str | None = None


class Left(NamedTuple):
    """Exchange `step` of `group` cannot complete: rank `rank` (of the job) closed without
    joining it."""

    step: int
    rank: int
    reason: str
    group: str = ""


class Lost(NamedTuple):
    """No exchange can complete any more (the connection ended, or the rank interrupted)."""

    reason: str


class StoreServer:
    """Runs in the launcher. `failures` lists (rank, reason) in the order they were seen."""

    def __init__(self, size: int, key: bytes, host: str = "127.0.0.1", port: int = 0):
        """Listen on `host`:`port` (0: a free port; `address` says which)."""
        self.size = size
        self._key = key
        self._listener = Listener((host, port), family="AF_INET")
        self.address: tuple[str, int] = self._listener.address  # type: ignore[assignment]
        self._lock = threading.Lock()
        #: (rank, generation) -> the connection (a rank that made a new client after a close
        #: may keep the old one for sub-groups that outlived it)
        self._conns: dict[tuple[int, int], Connection] = {}
        # (generation, group, step) -> the values posted so far, by rank, and the members
        self._posted: dict[tuple[int, str, int], tuple[dict[int, Any], tuple[int, ...]]] = {}
        self._left: set[int] = set()  # id() of connections that said goodbye
        # (generation, group) -> ranks that closed their client of that group
        self._gone: dict[tuple[int, str], set[int]] = {}
        self.failures: list[tuple[int, str]] = []
        #: failures of ranks that are gone for good (exited or disconnected without goodbye)
        self.deaths: list[tuple[int, str]] = []
        self.refused = 0
        self._closed = False
        threading.Thread(target=self._accept_loop, name="gpuring-store", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        try:
            deliver_challenge(conn, self._key)
            answer_challenge(conn, self._key)
            hello = conn.recv()
            if not isinstance(hello, Hello) or not 0 <= hello.rank < self.size:
                raise ValueError(f"bad greeting {hello!r}")
            rank, generation = hello
        except Exception as exc:
            log.warning("gpuring: refused a control connection without the job key (%s)", exc)
            with self._lock:
                self.refused += 1
            conn.close()
            return
        with self._lock:
            self._conns[rank, generation] = conn
            if self.deaths:  # a peer already died: tell the newcomer at once
                self._send(rank, Failure(*self.deaths[0]), generation)
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError, TypeError):  # TypeError: closed under our feet by close()
                self._disconnected(rank, generation, conn)
                return
            if isinstance(message, Post):
                members = message.members or tuple(range(self.size))
                self._post(rank, (generation, message.group, message.step), members,
                           message.value)
            elif isinstance(message, Bye):
                with self._lock:
                    if message.group is None:
                        self._left.add(id(conn))
                        continue
                    group = (generation, message.group)
                    self._gone.setdefault(group, set()).add(rank)
                    for step in [k for k in self._posted if k[:2] == group]:
                        self._release_if_stuck(step)
            elif isinstance(message, Abort):
                self._report_abort(rank, generation, message)

    def _send(self, rank: int, message: Any, generation: int | None = None) -> None:
        """Send to `rank`'s connection of `generation`; None: to every one of the rank's."""
        conns = [conn for (r, g), conn in self._conns.items()
                 if r == rank and generation in (None, g)]
        for conn in conns:
            try:
                conn.send(message)
            except (OSError, ValueError):
                pass

    def _post(self, rank: int, step: tuple[int, str, int], members: tuple[int, ...],
              obj: Any) -> None:
        with self._lock:
            posted, _ = self._posted.setdefault(step, ({}, members))
            posted[rank] = obj
            if len(posted) == len(members):
                del self._posted[step]
                values = [posted[r] for r in members]
                for r in members:
                    self._send(r, Gathered(step[2], values, step[1]), step[0])
            else:
                self._release_if_stuck(step)

    def _release_if_stuck(self, step: tuple[int, str, int]) -> None:
        """An exchange that a closed rank never joined cannot complete: tell the ranks that
        wait in it (at once, rather than at their timeout). Holds the lock."""
        posted, members = self._posted[step]
        missing = sorted((self._gone.get(step[:2], set()) & set(members)) - set(posted))
        if missing:
            del self._posted[step]
            reason = f"rank {missing[0]} closed its communicator without joining this exchange"
            for r in posted:
                self._send(r, Left(step[2], missing[0], reason, step[1]), step[0])

    def _disconnected(self, rank: int, generation: int, conn: Connection) -> None:
        if self._closed:  # close() ended every connection
            return
        with self._lock:
            gone_cleanly = id(conn) in self._left
            self._left.discard(id(conn))
            if self._conns.get((rank, generation)) is conn:  # not a newer one of the same
                del self._conns[rank, generation]
        if not gone_cleanly:
            self.report_failure(rank, f"rank {rank} disconnected without closing (died?)",
                                dead=True)

    def report_failure(self, rank: int, reason: str, *, dead: bool = False) -> None:
        """Tell every connected rank that `rank` failed. `dead`: the rank is gone for good,
        so ranks that connect later are told too."""
        with self._lock:
            if dead and all(r != rank for r, _ in self.deaths):
                self.deaths.append((rank, reason))
            if any(r == rank for r, _ in self.failures):
                return
            self.failures.append((rank, reason))
            for r in {r for r, _ in self._conns}:
                if r != rank:
                    self._send(r, Failure(rank, reason))

    def _report_abort(self, rank: int, generation: int, abort: Abort) -> None:
        with self._lock:
            for r in abort.members or {r for r, _ in self._conns}:
                if r != rank:
                    self._send(r, Failure(rank, abort.reason, abort.group), generation)

    def wait_until_alone(self, timeout: float) -> bool:
        """Wait (at most `timeout` s) until no rank is connected; whether none is."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if not self._conns:
                    return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)

    def close(self) -> None:
        """Stop serving; connected ranks see their connection end at once. (Closing alone
        would not do: a thread blocked in recv() keeps the socket open, sending nothing.)"""
        self._closed = True
        self._listener.close()
        with self._lock:
            for conn in self._conns.values():
                try:
                    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
                        sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                conn.close()
            self._conns.clear()


def leave_and_stop(close: Callable[[], None], server: StoreServer | None,
                   timeout: float) -> None:
    """Close this rank's side (`close`); then, where this rank's process serves the control
    plane (`server`), wait (at most `timeout` s) for the other ranks to leave, and stop."""
    try:
        close()
    finally:
        if server is not None:
            server.wait_until_alone(timeout)
            server.close()


class _Link:
    """A rank's one connection to the launcher's store, shared by the job's control plane
    and the sub-groups made from it; closed once all of them are closed. Its reader routes
    each reply to its group's client."""

    def __init__(self, rank: int, address: tuple[str, int], key: bytes, generation: int,
                 timeout: float):
        self.rank = rank
        deadline = time.monotonic() + timeout
        while True:
            try:
                self.conn = Client(address, family="AF_INET", authkey=key)
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
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
            deaths = [(r, why) for r, why in self.deaths.items() if r in client.members]
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

    def _read_loop(self) -> None:
        while True:
            try:
                message = self.conn.recv()
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
                    if message.rank in client.members:
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
    client of a process forms the job's k-th generation (re-initialisation after a close).
    Sub-groups (`subgroup`) share its connection, each with its own exchanges."""

    _generation = 0

    def __init__(self, rank: int, size: int, local_rank: int, local_size: int,
                 address: tuple[str, int], key: bytes, job_id: str, timeout: float = 60.0):
        super().__init__()
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = local_rank, local_size
        self.job_id = job_id
        StoreClient._generation += 1
        self._link = _Link(rank, address, key, StoreClient._generation, timeout)
        self._setup("", tuple(range(size)))
        #: each rank's node (ranks of `gpuring run` share one; others by local size)
        self.nodes = tuple(f"node{r // max(local_size, 1)}" for r in range(size))

    def _setup(self, group: str, members: tuple[int, ...]) -> None:
        """Join the link as the client of `group`, whose `members` are ranks of the job."""
        self.group, self.members = group, members
        self._replies: queue.Queue[Any] = queue.Queue()
        self._step = 0
        self._closed = False
        self.failure: tuple[int, str] | None = None
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
        nodes = tuple(self.nodes[m] for m in members)
        self._join(group, members, name, nodes)
        group.nodes = nodes
        group._link = self._link
        group._setup(name, tuple(self.members[m] for m in members))
        return group

    def deliver(self, message: Any) -> None:
        """A message of this client's group, from the link's reader."""
        if isinstance(message, Failure):
            rank, reason = self.members.index(message.rank), message.reason
            if self.group:  # the server names ranks of the job
                reason = f"{reason} (rank {message.rank} of the job is rank {rank} here)"
            if self.failure is None:
                self.failure = (rank, reason)
            self._replies.put(Failure(rank, reason, message.group))
            self._peer_failed(rank, reason)
            return
        self._replies.put(message)

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
            rank, reason = self.failure
            raise PeerFailureError(reason, peer=rank)
        if self.lost is not None:  # later exchanges too: the one "lost" notice is used up
            raise PeerFailureError(self.lost)
        self._step += 1
        try:
            self._send(Post(self._step, obj, self.group, self.members if self.group else ()))
        except OSError as exc:  # before the reader saw the end of the connection
            raise PeerFailureError(f"the launcher's control connection failed ({exc!r})"
                                   ) from None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                message = self._replies.get(timeout=wait)
            except queue.Empty:
                raise CollectiveTimeoutError(
                    f"control-plane exchange #{self._step} timed out after {timeout} s on rank "
                    f"{self.rank}: some rank did not take part") from None
            if isinstance(message, Gathered) and message.step == self._step:
                return list(message.values)
            if isinstance(message, Failure):
                raise PeerFailureError(message.reason, peer=message.rank)
            if isinstance(message, Lost):
                raise PeerFailureError(message.reason)
            if isinstance(message, Left) and message.step == self._step:
                raise PeerFailureError(message.reason, peer=self.members.index(message.rank))

    def interrupt(self, reason: str) -> None:
        self._replies.put(Lost(reason))

    def report_failure(self, reason: str) -> None:
        try:
            self._send(Abort(reason, self.group, self.members if self.group else ()))
        except OSError:
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._link.leave(self)
