"""The status board: a page of shared memory per rank that every rank on the node can read.

Each rank publishes its pid, the collective it has entered (sequence number, signature hash and
text), and whether it gave up and why. Peers use it to

- catch mismatched collectives even when agreement is cached (the later of two mismatched ranks
  sees the earlier one's signature; a memory fence between publishing and reading guarantees one
  of them does),
- notice a dead peer (its pid is gone) or one that gave up, within a watchdog tick,
- tell a peer that died from one that left: a process may end without closing its
  communicator once its last collective completed (a `multiprocessing` child exits without
  `atexit`); each rank publishes the newest collective it completed, so a peer whose process
  is gone after completing every collective it entered (and agreeing on no newer one) has
  left, as one that closed has: it fails only the collectives after its last,
- report which ranks have not entered a collective that others wait in (stall warnings).

It lives in host shared memory whatever device the collectives use.
"""

from __future__ import annotations

import os
import threading
import time
import zlib

from .devices.base import open_peer
from .devices.host import HostDevice, HostMemory
from .rendezvous.base import ControlPlane

__all__ = ["StatusBoard", "signature_hash", "outside", "process_alive", "GAVE_UP", "MISMATCH",
           "LEFT", "TIMED_OUT"]

_PAGE = 8192
_PID, _STATE, _SEQ, _SIG_LEN, _REASON_LEN, _CULPRIT, _AGREEING, _DONE = 0, 1, 2, 3, 4, 5, 6, 7
_HISTORY = 16  # words 16.. hold (seq, hash) for the last 8 collectives
_DEPTH = 8
_SIG_AT, _SIG_MAX = 1024, 2048
_REASON_AT, _REASON_MAX = 4096, 2048

GAVE_UP = 1  #: state: the rank failed and left its collective
MISMATCH = 2  #: state: the rank found a mismatched collective
LEFT = 3  #: state: the rank closed its communicator
TIMED_OUT = 4  #: state: the rank gave up waiting for another rank (the culprit)

_ROOT_CAUSE_ORDER = {MISMATCH: 0, TIMED_OUT: 1, GAVE_UP: 2}


def signature_hash(text: str) -> int:
    return zlib.crc32(text.encode()) + 1  # never 0, so an unwritten slot never matches


def outside(culprit: int) -> int | None:
    """The rank of the job a board's culprit word names outside the board's group (a word of
    -2 - that rank: a level across nodes gives up because of a rank of another node), or
    None where the word names a rank of the group (>= 0) or nobody (-1)."""
    return -2 - culprit if culprit <= -2 else None


class StatusBoard:
    """Created collectively (every rank calls the constructor at the same point)."""

    def __init__(self, control: ControlPlane, host: HostDevice, timeout: float):
        self.rank = control.rank
        self.size = control.size
        self.job_ranks = control.job_ranks  #: the group's ranks in the job's
        self._host = host
        local = host.alloc(_PAGE)
        handles = control.exchange("setup (status pages)", host.export(local), timeout)
        self._pages: list[HostMemory] = [
            local if r == self.rank else open_peer(host, h, r)  # type: ignore[misc]
            for r, h in enumerate(handles)]
        #: every peer's rank, page and words (what `enter` reads on every call)
        self._peer_words = [(r, page, _words(page)) for r, page in enumerate(self._pages)
                            if r != self.rank]
        control.barrier(timeout, "setup (status pages mapped)")
        host.seal(local)
        self._mine = local
        self._fence = threading.Lock()
        self._said = threading.Lock()  # (`give_up` from the caller's and the watchdog's thread)
        self._last_text: str | None = None
        local.i64[_PID] = os.getpid()  # type: ignore[index]

    # -- this rank --------------------------------------------------------------------------
    def enter(self, seq: int, text: str, digest: int) -> tuple[int, str] | None:
        """Publish that this rank entered collective `seq`; return (peer, peer's signature
        text) for a peer that entered `seq` with a different signature, if any."""
        words = self._mine.i64
        assert words is not None
        slot = _HISTORY + 2 * (seq % _DEPTH)
        words[slot + 1] = digest
        words[slot] = seq
        if text is not self._last_text:  # the text only changes with the signature
            self._last_text = text
            raw = text.encode()[:_SIG_MAX]
            words[_SIG_LEN] = 0
            self._mine.u8[_SIG_AT:_SIG_AT + len(raw)] = memoryview(raw)
            words[_SIG_LEN] = len(raw)
        words[_SEQ] = seq
        with self._fence:  # a locked instruction: our stores are visible before we read
            pass
        for peer, page, theirs in self._peer_words:
            if theirs[slot] == seq and theirs[slot + 1] != digest:
                return peer, self._text(page, _SIG_AT, _SIG_LEN) if theirs[_SEQ] == seq else "?"
        return None

    def culprit(self, peer: int | None, job_peer: int | None = None) -> int:
        """The culprit word that blames rank `job_peer` of the job (in the group or,
        `outside`, not), or else rank `peer` of the group; -1 for neither. (An error names
        both where the group's rank it names only reported the job's rank that failed.)"""
        if job_peer is not None:
            return self.job_ranks.index(job_peer) if job_peer in self.job_ranks \
                else -2 - job_peer
        return peer if peer is not None and 0 <= peer < self.size else -1

    def give_up(self, state: int, reason: str, culprit: int = -1) -> bool:
        """Tell peers this rank left its collective (GAVE_UP, MISMATCH, TIMED_OUT, LEFT),
        why, and which rank it blames, if any (`culprit`: -1 none, it failed on its own
        account; a rank of the group; or `outside` it).
        Only the first word stands (False: one was said already): peers may have acted on
        it, and a later one is a consequence (this rank's calls failing once it failed)."""
        words = self._mine.i64
        assert words is not None
        with self._said:
            if words[_STATE] != 0:
                return False
            raw = reason.encode()[:_REASON_MAX]
            self._mine.u8[_REASON_AT:_REASON_AT + len(raw)] = memoryview(raw)
            words[_REASON_LEN] = len(raw)
            words[_CULPRIT] = culprit
            words[_STATE] = state
        return True

    def completed(self, seq: int) -> None:
        """Publish that every collective of this rank up to `seq` completed (its peers may
        then take its process ending for a departure, not a death)."""
        words = self._mine.i64
        assert words is not None
        if seq > words[_DONE]:
            words[_DONE] = seq

    def state(self) -> int:
        """This rank's published state (0 while it runs normally)."""
        return int(self._mine.i64[_STATE])  # type: ignore[index]

    # -- peers ------------------------------------------------------------------------------
    @staticmethod
    def _text(page: HostMemory, at: int, length_word: int) -> str:
        words = page.i64
        assert words is not None
        n = int(words[length_word])
        return bytes(page.u8[at:at + n]).decode(errors="replace")

    def troubled_peer(self, departures: bool = False) -> tuple[int, int, str, int] | None:
        """(peer, state, reason, culprit) of a peer that died or gave up, if any. When several
        did, the root cause wins: a mismatch, then a timeout, then a rank that failed or died
        on its own account (a rank that gives up because of another's report says GAVE_UP
        and blames that one: it may die too before this rank looks, when a launcher ends
        the whole job), then a rank that blames another. A peer whose process ended after
        its last collective (`departed`) is no trouble, unless `departures` (a level of a
        collective across nodes, between whose parts a rank may end)."""
        found: list[tuple[int, bool, tuple[int, int, str, int]]] = []  # (order, own, report)
        for peer, page in enumerate(self._pages):
            if peer == self.rank:
                continue
            words = page.i64
            assert words is not None
            state = int(words[_STATE])
            if state in (GAVE_UP, MISMATCH, TIMED_OUT):
                culprit = int(words[_CULPRIT])  # (-1 or itself: on its own account)
                found.append((_ROOT_CAUSE_ORDER[state], culprit in (-1, peer), (
                    peer, state, self._text(page, _REASON_AT, _REASON_LEN), culprit)))
            elif state != LEFT and not _alive(int(words[_PID])) and \
                    (departures or self._finished(words) is None):
                found.append((_ROOT_CAUSE_ORDER[GAVE_UP], True, (
                    peer, GAVE_UP, f"rank {peer} (pid {int(words[_PID])}) is gone", peer)))
        if not found:
            return None
        return min(found, key=lambda f: (f[0], not f[1], f[2][0]))[2]

    def entered(self) -> list[int]:
        """The collective sequence number each rank has entered last."""
        return [int(page.i64[_SEQ]) for page in self._pages]  # type: ignore[index]

    def agreeing(self, seq: int) -> None:
        """Publish that this rank agrees with its peers on collective `seq` (before it may
        enter it)."""
        self._mine.i64[_AGREEING] = seq  # type: ignore[index]

    def ran_ahead(self, seq: int) -> tuple[int, str] | None:
        """A peer that has entered collective `seq` or a later one without agreeing on `seq`,
        and the collective it entered last (its signature text), if any."""
        for peer, page in enumerate(self._pages):
            if peer == self.rank:
                continue
            words = page.i64
            assert words is not None
            entered = int(words[_SEQ])  # before the agreement's word: a peer writes it first
            with self._fence:  # and the two reads stay in that order on any CPU
                pass
            if entered >= seq and int(words[_AGREEING]) < seq:
                text = self._text(page, _SIG_AT, _SIG_LEN)
                return peer, text if entered == seq else f"#{entered}, {text}"
        return None

    def left_before(self, seq: int) -> list[int]:
        """Peers that closed their communicator before entering collective `seq`."""
        return [peer for peer, page in enumerate(self._pages)
                if peer != self.rank and page.i64[_STATE] == LEFT  # type: ignore[index]
                and page.i64[_SEQ] < seq]  # type: ignore[index]

    def departed_before(self, seq: int) -> list[tuple[int, int, int]]:
        """(peer, its last collective, its pid) of the peers whose process ended, without
        closing their communicator, after completing every collective they entered, the last
        one before `seq` (those are gone for collective `seq`)."""
        found = []
        for peer, page in enumerate(self._pages):
            if peer == self.rank:
                continue
            words = page.i64
            assert words is not None
            if words[_STATE] == 0 and words[_SEQ] < seq and not _alive(int(words[_PID])):
                last = self._finished(words)
                if last is not None:
                    found.append((peer, last, int(words[_PID])))
        return found

    def departed(self, peer: int, grace: float = 0.0) -> bool:
        """Whether `peer`'s process ended after completing every collective it entered (and
        agreeing on no newer one), without giving up: it left, it did not die mid-call.
        `grace`: how long to wait for such a process to end (its connections close while it
        exits, a moment before it has ended)."""
        if not 0 <= peer < len(self._pages) or peer == self.rank:
            return False
        words = self._pages[peer].i64
        assert words is not None
        if words[_STATE] != 0 or self._finished(words) is None:
            return False
        deadline = time.monotonic() + grace
        while _alive(int(words[_PID])):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    @staticmethod
    def _finished(words: memoryview) -> int | None:
        """The last collective of a rank whose words say it completed every collective it
        entered and agrees on no newer one; None where it may be inside one."""
        entered, done = int(words[_SEQ]), int(words[_DONE])
        return entered if done >= entered and int(words[_AGREEING]) <= done else None

    def close(self) -> None:
        self._pages, self._peer_words = [], []


def _words(page: HostMemory) -> memoryview:
    words = page.i64
    assert words is not None
    return words


def process_alive(pid: int) -> bool:
    """Whether process `pid` (of this node) still runs (see `_alive`)."""
    return _alive(pid)


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs. A zombie does not: it died and its parent has not
    reaped it yet, which can last (mpiexec's proxy under -disable-auto-cleanup leaves a
    SIGKILLed rank so until the job ends), and signal 0 still reaches a zombie."""
    if pid <= 0:
        return True  # not published yet
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:  # no procfs here, or it just went away (the next tick tells)
        return True
    # the state follows the command name in parentheses, which may itself hold ") "
    return stat[stat.rfind(b")") + 2:][:1] not in (b"Z", b"X")



