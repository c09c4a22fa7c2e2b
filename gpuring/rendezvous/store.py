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

__all__ = ["StoreServer", "StoreClient", "ENV_ADDR", "ENV_KEY", "ENV_JOB"]

log = logging.getLogger("gpuring.rendezvous")

ENV_ADDR = "GPURING_STORE"
ENV_KEY = "GPURING_JOB_KEY"
ENV_JOB = "GPURING_JOB_ID"


# The messages, rank to server:
class Hello(NamedTuple):
    """The first message of a connection: which rank, which client generation."""

    rank: int
    generation: int


class Post(NamedTuple):
    """This rank's value for exchange `step`."""

    step: int
    value: Any


class Bye(NamedTuple):
    """The rank closed its client (orderly)."""


class Abort(NamedTuple):
    """The rank failed: tell the others."""

    reason: str


# ... and server to rank (`Lost` is the client's own note that the connection ended):
class Gathered(NamedTuple):
    """Every rank's value of exchange `step`, in rank order."""

    step: int
    values: list[Any]


class Failure(NamedTuple):
    """Rank `rank` failed (or died)."""

    rank: int
    reason: str


class Left(NamedTuple):
    """Exchange `step` cannot complete: rank `rank` closed without joining it."""

    step: int
    rank: int
    reason: str


class Lost(NamedTuple):
    """No exchange can complete any more (the connection ended, or the rank interrupted)."""

    reason: str


class StoreServer:
    """Runs in the launcher. `failures` lists (rank, reason) in the order they were seen."""

    def __init__(self, size: int, key: bytes, host: str = "127.0.0.1"):
        self.size = size
        self._key = key
        self._listener = Listener((host, 0), family="AF_INET")
        self.address: tuple[str, int] = self._listener.address  # type: ignore[assignment]
        self._lock = threading.Lock()
        self._conns: dict[int, Connection] = {}
        self._posted: dict[tuple[int, int], dict[int, Any]] = {}
        self._left: set[int] = set()  # id() of connections that said goodbye
        self._gone: dict[int, set[int]] = {}  # generation -> ranks that closed their client
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
            self._conns[rank] = conn
            if self.deaths:  # a peer already died: tell the newcomer at once
                self._send(rank, Failure(*self.deaths[0]))
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError, TypeError):  # TypeError: closed under our feet by close()
                self._disconnected(rank, conn)
                return
            if isinstance(message, Post):
                self._post(rank, (generation, message.step), message.value)
            elif isinstance(message, Bye):
                with self._lock:
                    self._left.add(id(conn))
                    self._gone.setdefault(generation, set()).add(rank)
                    for step in [k for k in self._posted if k[0] == generation]:
                        self._release_if_stuck(step)
            elif isinstance(message, Abort):
                self._report_abort(rank, message.reason)

    def _send(self, rank: int, message: Any) -> None:
        conn = self._conns.get(rank)
        if conn is None:
            return
        try:
            conn.send(message)
        except (OSError, ValueError):
            pass

    def _post(self, rank: int, step: tuple[int, int], obj: Any) -> None:
        with self._lock:
            posted = self._posted.setdefault(step, {})
            posted[rank] = obj
            if len(posted) == self.size:
                del self._posted[step]
                values = [posted[r] for r in range(self.size)]
                for r in range(self.size):
                    self._send(r, Gathered(step[1], values))
            else:
                self._release_if_stuck(step)

    def _release_if_stuck(self, step: tuple[int, int]) -> None:
        """An exchange that a closed rank never joined cannot complete: tell the ranks that
        wait in it (at once, rather than at their timeout). Holds the lock."""
        posted = self._posted[step]
        missing = sorted(self._gone.get(step[0], set()) - set(posted))
        if missing:
            del self._posted[step]
            reason = f"rank {missing[0]} closed its communicator without joining this exchange"
            for r in posted:
                self._send(r, Left(step[1], missing[0], reason))

    def _disconnected(self, rank: int, conn: Connection) -> None:
        if self._closed:  # close() ended every connection
            return
        with self._lock:
            gone_cleanly = id(conn) in self._left
            self._left.discard(id(conn))
            if self._conns.get(rank) is conn:  # not a newer connection of the same rank
                del self._conns[rank]
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
            for r in list(self._conns):
                if r != rank:
                    self._send(r, Failure(rank, reason))

    def _report_abort(self, rank: int, reason: str) -> None:
        with self._lock:
            for r in list(self._conns):
                if r != rank:
                    self._send(r, Failure(rank, reason))

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


class StoreClient(ControlPlane):
    """A rank's side, configured from the environment `gpuring run` sets. Every rank's k-th
    client of a process forms the job's k-th generation (re-initialisation after a close)."""

    _generation = 0

    def __init__(self, rank: int, size: int, local_rank: int, local_size: int,
                 address: tuple[str, int], key: bytes, job_id: str, timeout: float = 60.0):
        super().__init__()
        self.rank, self.size = rank, size
        self.local_rank, self.local_size = local_rank, local_size
        self.job_id = job_id
        self._replies: queue.Queue[Any] = queue.Queue()
        self._step = 0
        self._closed = False
        self.failure: tuple[int, str] | None = None
        #: why the connection to the launcher is gone, once it is (no exchange can work then)
        self.lost: str | None = None
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._conn = Client(address, family="AF_INET", authkey=key)
                break
            except ConnectionRefusedError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self._send_lock = threading.Lock()
        StoreClient._generation += 1
        self._conn.send(Hello(rank, StoreClient._generation))
        self._reader = threading.Thread(target=self._read_loop, name="gpuring-control",
                                        daemon=True)
        self._reader.start()

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

    def _read_loop(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except Exception:
                if not self._closed:
                    self.lost = "the launcher's control connection closed"
                    self._replies.put(Lost(self.lost))
                return
            if isinstance(message, Failure):
                if self.failure is None:
                    self.failure = (message.rank, message.reason)
                self._replies.put(message)
                self._peer_failed(message.rank, message.reason)
            else:
                self._replies.put(message)

    def _send(self, message: Any) -> None:
        with self._send_lock:
            self._conn.send(message)

    def allgather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        if self.failure is not None:
            rank, reason = self.failure
            raise PeerFailureError(reason, peer=rank)
        if self.lost is not None:  # later exchanges too: the one "lost" notice is used up
            raise PeerFailureError(self.lost)
        self._step += 1
        try:
            self._send(Post(self._step, obj))
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
                raise PeerFailureError(message.reason, peer=message.rank)

    def interrupt(self, reason: str) -> None:
        self._replies.put(Lost(reason))

    def report_failure(self, reason: str) -> None:
        try:
            self._send(Abort(reason))
        except OSError:
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._send(Bye())
        except OSError:
            pass
        self._conn.close()
