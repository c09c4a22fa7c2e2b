"""Watching over a communicator: a status board plus one watchdog thread.

The watchdog wakes every few tens of milliseconds and, through the status board, notices a
peer that died or gave up (and fails this rank's communicator with an error naming it), warns
about ranks missing from a collective that others have waited in for `stall_warning_s`, and,
for devices that do not block the host (GPU), fails a collective whose completion event has not
fired within the timeout.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

from ._errors import CollectiveMismatchError, CollectiveTimeoutError, GpuringError, PeerFailureError
from ._status import GAVE_UP, LEFT, MISMATCH, TIMED_OUT, StatusBoard, outside
from ._wording import compare_calls, ranks_text
from .devices.base import Event, FlagWaitAborted
from .devices.host import HostDevice
from .rendezvous.base import ControlPlane

__all__ = ["Watchdog"]

log = logging.getLogger("gpuring")

_TICK = 0.05
#: seconds a peer whose connection closed after its last collective has to end its process
#: (its connections close while it exits, a moment before it has ended)
_DEPARTING = 1.0


class Watchdog:
    """Created collectively; `on_failure(error)` is called at most once, from any thread."""

    def __init__(self, control: ControlPlane, host: HostDevice, *, timeout: float,
                 stall_warning_s: float, on_failure: Callable[[GpuringError], None]):
        self.rank = control.rank
        self.board = StatusBoard(control, host, timeout)
        self._timeout = timeout
        self._stall_warning_s = stall_warning_s
        self._on_failure = on_failure
        self._failed = False
        self._failure: tuple[str, int] | None = None  # why this rank failed, whom it
        # blames, when known
        self._current: tuple[int, str, float] | None = None
        #: a collective whose work failed on the GPU (its event may have completed)
        self._failed_seq: int | None = None
        #: (seq, name, what) of the call this rank agrees on with its peers, if it does
        self._expecting: tuple[int, str, str] | None = None
        self._warned_seq = 0
        self._pending: collections.deque[
            tuple[Event, float, str, int, Callable[[], None] | None]] = collections.deque()
        self._pending_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gpuring-watchdog", daemon=True)
        self._thread.start()

    # -- called by the communicator -----------------------------------------------------------
    def enter(self, seq: int, name: str, text: str, digest: int) -> None:
        """Publish entry into collective `seq`; raise if a peer entered it differently. (Peers
        that left are the watchdog's business: it checks every tick.)"""
        self._current = (seq, name, time.monotonic())
        clash = self.board.enter(seq, text, digest)
        if clash is not None:
            peer, theirs = clash
            said, differences = compare_calls({self.rank: text, peer: theirs})
            message = f"{name} #{seq} on rank {self.rank}: {said}"
            self._failed = True
            self.board.give_up(MISMATCH, message)
            raise CollectiveMismatchError(message, differences=differences)

    def leave(self) -> None:
        self._current = None

    def expect(self, seq: int | None, name: str = "", what: str = "") -> None:
        """This rank is agreeing on collective `seq` (`name`, described by `what`) with its
        peers over the control plane (None: done), so a peer that closed before `seq` fails
        it too, and so does a peer that entered `seq` without agreeing on it (its status
        board says whether it did): a rank agrees anew only on a call none of them agreed on
        before (they all made the same calls so far), so that peer runs another collective,
        one agreed before, and will never come."""
        if seq is not None:
            self.board.agreeing(seq)
        self._expecting = None if seq is None else (seq, name, what)

    def check(self) -> None:
        """Run the watchdog's check now, from the caller's thread: a failure the status board
        shows reaches `on_failure` before the caller goes on."""
        self._check()

    def busy(self) -> bool:
        """Whether this rank has a collective in flight: on the host, or queued on the GPU."""
        return self.in_flight() is not None

    def in_flight(self) -> int | None:
        """The newest of this rank's collectives that may not have completed (the one its
        host is in, one queued on the GPU, or one whose work failed), or None when every
        one has. (A held event stands for the ones it replaced, which complete before it.)"""
        current, failed = self._current, self._failed_seq
        newest = -1 if current is None else current[0]
        if failed is not None:
            newest = max(newest, failed)
        for event, _deadline, _name, seq, _check in list(self._pending):
            try:
                done = event.query()
            except Exception:  # a failed kernel: its results are lost
                done = False
            if not done:
                newest = max(newest, seq)
        return None if newest < 0 else newest

    def track(self, event: Event, name: str, seq: int,
              check: Callable[[], None] | None = None) -> None:
        """Fail the communicator if `event` has not completed within the timeout, or if
        `check` raises once it has (a device whose work gives up by itself: a kernel whose
        wait timed out completes, and says so in the device's status).

        At most two collectives are held: the one watched and the latest. A collective's
        event completes after every earlier one's (each is ordered after the one before), so
        a newer one stands for those it replaces, its deadline a little later; and holding
        few events lets the device reuse them (making one is a driver call)."""
        entry = (event, time.monotonic() + self._timeout, name, seq, check)
        pending = self._pending
        with self._pending_lock:  # (the watchdog's thread takes completed ones meanwhile)
            if len(pending) >= 2:
                pending.pop()  # the latest so far: this one completes after it
            pending.append(entry)

    def blame(self, error: CollectiveTimeoutError, name: str,
              seq: int) -> CollectiveTimeoutError:
        """A timeout names the rank this one waited for; if some ranks never entered the
        collective, name the first of those instead (the ring only shows the neighbour)."""
        missing = [r for r, entered in enumerate(self.board.entered()) if entered < seq]
        if not missing or missing[0] == error.peer:
            return error
        return CollectiveTimeoutError(
            f"{error}; but {ranks_text(missing)} {'has' if len(missing) == 1 else 'have'} "
            f"not entered {name} #{seq}: {'that' if len(missing) == 1 else 'those'} "
            f"stalled", collective=name, seq=seq, peer=missing[0])

    def give_up(self, reason: str, *, timed_out_on: int | None = None,
                because: BaseException | None = None, job_peer: int | None = None) -> None:
        """Tell peers this rank left: after a timeout waiting for `timed_out_on`, if given;
        else blaming the rank the error it gave up `because` of names (its `peer`, or its
        `job_peer`), or rank `job_peer` of the job."""
        self._failed = True
        if timed_out_on is not None:
            self.board.give_up(TIMED_OUT, reason, timed_out_on)
            return
        in_job = getattr(because, "job_peer", None)
        self.board.give_up(GAVE_UP, reason, self.board.culprit(
            getattr(because, "peer", None), job_peer if in_job is None else in_job))

    def note_failure(self, error: GpuringError) -> None:
        """The communicator failed (seen here or elsewhere): at close, tell the peers so and
        name the rank `error` blames. Only its text and culprit are kept: the error's
        traceback holds the frames of the call that raised it, and this object lives as long
        as its thread."""
        if self._failure is None:
            self._failure = (str(error), self.board.culprit(getattr(error, "peer", None),
                                                            getattr(error, "job_peer", None)))
        self._failed = True

    def completed(self, seq: int) -> None:
        """Every collective of this rank up to `seq` completed: say so on the board (a peer
        then takes this process ending for a departure, not a death)."""
        self.board.completed(seq)

    def departed(self, peer: int | None) -> bool:
        """Whether `peer` left after its last collective (its process ended without closing
        its communicator, every collective it entered completed): a notice of its end fails
        nothing by itself, only a collective after its last one (`_check`). The notice may
        come while that process is still exiting: it has a second to end."""
        return peer is not None and self.board.departed(peer, grace=_DEPARTING)

    def leaving(self) -> None:
        """Tell peers this rank closed its communicator (or, if it failed and has not said
        so yet, that it gave up, blaming the rank its failure names); keep watching them
        until `close`."""
        if not self._failed:
            self.board.give_up(LEFT, "closed")
        elif self.board.state() == 0:
            failure, culprit = self._failure or ("", -1)
            self.board.give_up(GAVE_UP, f"closed its communicator after a failure ({failure})",
                               culprit)

    def close(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=2)
        self.leaving()
        self.board.close()

    # -- the watchdog thread ------------------------------------------------------------------
    def _fail(self, error: GpuringError) -> None:
        with self._pending_lock:  # (two checks may fail at once: report one)
            if self._failed:
                return
            self._failed = True
        self._on_failure(error)

    def _watch(self) -> None:
        while not self._stop.wait(_TICK):
            try:
                self._check()
            except Exception:
                log.exception("gpuring watchdog check failed")

    def _check(self) -> None:
        if self._failed:
            return
        trouble = self.board.troubled_peer()
        if trouble is not None:
            peer, state, reason, culprit = trouble
            blamed = culprit if culprit >= 0 else None  # -1 on the board: it blames nobody
            in_job = outside(culprit)  # (a rank of the job this group has none for)
            error: GpuringError
            if state == MISMATCH:
                error = CollectiveMismatchError(f"{reason} (found by rank {peer})")
            elif state == TIMED_OUT:
                waited = "" if blamed is None or blamed == peer else \
                    f" waiting for rank {blamed}"
                error = CollectiveTimeoutError(f"rank {peer} timed out{waited}: {reason}",
                                               peer=blamed)
            elif in_job is not None:
                error = PeerFailureError(f"rank {in_job} of the job failed (rank {peer} here "
                                         f"gave up because of it: {reason})", job_peer=in_job)
            elif blamed is None or blamed == peer:  # it failed on its own account
                error = PeerFailureError(f"rank {peer} failed: {reason}", peer=peer,
                                         job_peer=self.board.job_ranks[peer])
            else:  # it gave up because of another: that one is the one to name
                error = PeerFailureError(f"rank {blamed} failed (rank {peer} gave up because "
                                         f"of it: {reason})", peer=blamed,
                                         job_peer=self.board.job_ranks[blamed])
            # say so on the board at once, naming the cause: a rank that looks later may find
            # this one gone too (a launcher ends the whole job once a rank died), and must
            # not blame it (unless this rank said something first: that stands)
            named = self.board.culprit(getattr(error, "peer", None), in_job)
            self.board.give_up(GAVE_UP, str(error), peer if named == -1 else named)
            self._fail(error)
            return
        # the collective this rank waits for: the one its host is in or agrees on, else the
        # oldest one still running on the GPU
        current, expecting = self._current, self._expecting
        waiting = current[:2] if current is not None else (
            expecting[:2] if expecting is not None else None)
        first = self._first() if waiting is None else None
        if first is not None:
            _event, _deadline, name, seq, _check = first
            waiting = (seq, name)
        if waiting is not None:
            gone = self.board.left_before(waiting[0])
            if gone:
                self._fail(PeerFailureError(
                    f"rank {gone[0]} closed its communicator without entering {waiting[1]} "
                    f"#{waiting[0]}", peer=gone[0], job_peer=self.board.job_ranks[gone[0]]))
                return
            departed = self.board.departed_before(waiting[0])
            if departed:
                peer, last, pid = departed[0]
                message = (f"rank {peer} (pid {pid}) is gone: its process ended after "
                           f"collective #{last}, without entering {waiting[1]} #{waiting[0]}")
                self.board.give_up(GAVE_UP, message, peer)
                self._fail(PeerFailureError(message, peer=peer))
                return
        if current is None and expecting is not None:
            ahead = self.board.ran_ahead(expecting[0])
            if ahead is not None:
                seq, name, what = expecting
                message = (f"rank {self.rank} called {what} as {name} #{seq}, which the "
                           f"ranks had not agreed on before, but rank {ahead[0]} went ahead "
                           f"with {ahead[1]}, agreed before")
                self.board.give_up(MISMATCH, message)
                self._fail(CollectiveMismatchError(message))
                return
        self._check_pending()
        self._check_stall()

    def _check_pending(self) -> None:
        while (entry := self._first()) is not None:
            event, deadline, name, seq, check = entry
            try:
                done = event.query()
            except Exception as exc:  # the GPU reported an error: the collective is lost
                self._failed_seq = seq
                message = f"{name} #{seq} failed on rank {self.rank}: {exc}"
                self.board.give_up(GAVE_UP, message)
                self._fail(GpuringError(message))
                self._forget(entry)
                return
            if done:
                self._forget(entry)
                if check is not None and self._failed_by_itself(check, name, seq):
                    return
                self.board.completed(seq)  # (and every earlier one: they complete in order)
            elif time.monotonic() > deadline:
                message = (f"{name} #{seq} did not complete on rank {self.rank} within "
                           f"{self._timeout} s")
                self.board.give_up(TIMED_OUT, message)  # peers learn before any release
                self._fail(CollectiveTimeoutError(message, collective=name, seq=seq))
                return
            else:
                return

    # The held collectives change under `_pending_lock`: `track` (the caller's thread) replaces
    # the latest where there are two, or adds one; the checks (the watchdog's thread, and the
    # caller's through `check`, possibly at once) remove the first once they dealt with it.
    def _first(self) -> tuple[Event, float, str, int, Callable[[], None] | None] | None:
        """The watched collective: the first held, if any."""
        with self._pending_lock:
            return self._pending[0] if self._pending else None

    def _forget(self, entry: tuple[Event, float, str, int, Callable[[], None] | None]
                ) -> None:
        """Stop holding `entry`, the watched collective, unless another check did already."""
        with self._pending_lock:
            if self._pending and self._pending[0] is entry:
                self._pending.popleft()

    def _failed_by_itself(self, check: Callable[[], None], name: str, seq: int) -> bool:
        """Run a completed collective's `check`; fail the communicator if it raises (an
        abort it raises for is already known)."""
        try:
            check()
        except FlagWaitAborted:
            return False
        except Exception as exc:
            self._failed_seq = seq
            message = f"{name} #{seq} failed on rank {self.rank}: {exc}"
            self.board.give_up(TIMED_OUT, message)
            self._fail(CollectiveTimeoutError(message, collective=name, seq=seq))
            return True
        return False

    def _check_stall(self) -> None:
        current = self._current
        if current is None:
            return
        seq, name, since = current
        waited = time.monotonic() - since
        if waited < self._stall_warning_s or self._warned_seq == seq:
            return
        missing = [r for r, entered in enumerate(self.board.entered()) if entered < seq]
        if missing:
            self._warned_seq = seq
            log.warning("gpuring: rank %d has waited %.0f s in %s #%d; ranks %s have not "
                        "entered it", self.rank, waited, name, seq, missing)
