"""The launcher's control plane: a small server in `gpuring run`, one connection per rank
(the ranks' side is `store_client`), and the messages between them.

Connections are `multiprocessing.connection` objects on loopback, authenticated with a per-job
key (HMAC challenge in both directions); a connection without the key is refused and logged.
The server answers allgathers once every rank has posted, and tells every rank at once when
one of them disconnects without saying goodbye or is reported dead by the launcher.
"""

from __future__ import annotations

import builtins
import enum
import importlib
import io
import logging
import os
import pickle
import socket
import threading
import time
from multiprocessing.connection import (  # type: ignore[attr-defined]
    Connection,
    Listener,
    answer_challenge,
    deliver_challenge,
)
from typing import Any, NamedTuple

__all__ = ["StoreServer", "ENV_ADDR", "ENV_KEY", "ENV_JOB"]

log = logging.getLogger("gpuring.rendezvous")

#: the built-in callables a message may name (plain data; no function that acts)
_PLAIN = frozenset({"complex", "frozenset", "set", "slice", "range", "bytearray", "int",
                    "float", "bool", "str", "bytes", "tuple", "list", "dict"})
#: NumPy's names in a pickled array or scalar
_NUMPY = frozenset({"ndarray", "dtype", "_reconstruct", "scalar"})


class _DataOnly(pickle.Unpickler):
    """An unpickler that makes data only: plain built-in types, NumPy arrays and scalars,
    and gpuring's own named tuples and enums (its messages, signatures, handles). Anything
    else a connection sends (a function to call, say) is refused: a process that reaches
    the control plane without the job's key set (see `gpuring.rendezvous.launchers`) can
    disturb the job, but cannot run code in it."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _PLAIN:
            return getattr(builtins, name)
        if module in ("numpy", "numpy.core.multiarray", "numpy._core.multiarray") and \
                name in _NUMPY:
            return super().find_class(module, name)
        if module in ("numpy.core.numeric", "numpy._core.numeric") and name == "_frombuffer":
            return super().find_class(module, name)  # (arrays pickled with protocol 5)
        if module == "gpuring" or module.startswith("gpuring."):
            try:  # gpuring's own modules only (the process may not use that one yet)
                found = getattr(importlib.import_module(module), name, None)
            except ImportError:
                found = None
            if isinstance(found, type) and issubclass(found, (tuple, enum.Enum)):
                return found
        raise pickle.UnpicklingError(f"the control plane takes plain data only, not "
                                     f"{module}.{name}")


def receive(conn: Connection) -> Any:
    """The next message of `conn`, made by `_DataOnly`."""
    return _DataOnly(io.BytesIO(conn.recv_bytes())).load()

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
    """The rank failed in `group`: tell the group's other ranks (`blamed`: the rank of the
    job it blames, where it knows one)."""

    reason: str
    group: str = ""
    members: tuple[int, ...] = ()
    blamed: int | None = None


class Waiting(NamedTuple):
    """The rank's wait in exchange `step` of `group` timed out: which members never posted?"""

    step: int
    group: str = ""


# ... and server to rank (`Lost` is the client's own note that the connection ended):
class Gathered(NamedTuple):
    """Every member's value of exchange `step` of `group`, in the group's order."""

    step: int
    values: list[Any]
    group: str = ""


class Failure(NamedTuple):
    """Rank `rank` (of the job) failed in `group`; None: it died (every group with it).
    `blamed`: the rank of the job it blames, where it knows one."""

    rank: int
    reason: str
    group: str | None = None
    blamed: int | None = None


class Left(NamedTuple):
    """Exchange `step` of `group` cannot complete: rank `rank` (of the job) closed without
    joining it."""

    step: int
    rank: int
    reason: str
    group: str = ""


class Absent(NamedTuple):
    """The members of `group` (ranks of the job) that had not posted exchange `step` when a
    rank asked (`Waiting`; empty: the exchange was not waiting for anyone any more)."""

    step: int
    ranks: tuple[int, ...]
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
        # every rank connects at once: a short accept queue (multiprocessing's default is 1)
        # drops their SYNs when the accept thread is late, and the kernel retries only after
        # 1, 3, 7, 15, 31 s, which can outlast the timeout
        self._listener = Listener((host, port), family="AF_INET", backlog=max(128, size))
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
        self._listening = True
        threading.Thread(target=self._accept_loop, name="gpuring-store", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn = self._listener.accept()
            except OSError:
                return
            if not self._listening:
                conn.close()
                self._listener.close()
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: Connection) -> None:
        try:
            deliver_challenge(conn, self._key)
            answer_challenge(conn, self._key)
            hello = receive(conn)
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
                message = receive(conn)
            except (EOFError, OSError, TypeError):  # TypeError: closed under our feet by close()
                self._disconnected(rank, generation, conn)
                return
            except pickle.UnpicklingError as exc:
                log.warning("gpuring: rank %d sent what the control plane refuses (%s)",
                            rank, exc)
                conn.close()
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
            elif isinstance(message, Waiting):
                self._answer_waiting(rank, generation, message)

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

    def _answer_waiting(self, rank: int, generation: int, asked: Waiting) -> None:
        with self._lock:
            entry = self._posted.get((generation, asked.group, asked.step))
            missing = () if entry is None else tuple(r for r in entry[1] if r not in entry[0])
            self._send(rank, Absent(asked.step, missing, asked.group), generation)

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
                    self._send(r, Failure(rank, abort.reason, abort.group, abort.blamed),
                               generation)

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

    def stop_listening(self) -> None:
        """Accept no new connection (those made go on). A connection that comes meanwhile is
        closed at once (a client retries: `store_client`)."""
        self._listening = False
        try:  # wake the accept loop, which then closes the listener (a close from here
            with socket.create_connection(self.address, timeout=1.0):  # would not wake it)
                pass
        except OSError:
            pass

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


