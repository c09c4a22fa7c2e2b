"""The status board's view of a peer's process."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

from gpuring import GpuringError, PeerFailureError, _watchdog
from gpuring._status import GAVE_UP, LEFT, MISMATCH, TIMED_OUT, StatusBoard, _alive, outside
from gpuring._watchdog import Watchdog
from gpuring.devices.host import HostDevice
from gpuring.rendezvous.base import ControlPlane


def test_a_dead_process_is_dead_even_before_its_parent_reaps_it() -> None:
    """A rank killed under mpiexec stays a zombie until hydra's proxy reaps it (and a rank
    started through a wrapper until the wrapper does): signal 0 still reaches it, but it is
    dead, and its peers must see that at once."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # exited, not reaped: a zombie
            info = os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                break
            time.sleep(0.01)
        os.kill(child.pid, 0)  # still there for signals...
        assert not _alive(child.pid)  # ...yet dead
    finally:
        child.wait()
    assert not _alive(child.pid)  # and once reaped


def test_a_live_process_is_alive() -> None:
    assert _alive(os.getpid())
    assert _alive(os.getppid())
    assert _alive(0)  # not published yet


class _Threads(ControlPlane):
    """Rank `rank` of a job whose ranks are threads of this process."""

    local_size = 0
    job_id = "threads"

    def __init__(self, rank: int, size: int, shared: dict[int, Any], meet: threading.Barrier):
        super().__init__()
        self.rank = self.local_rank = rank
        self.size = self.local_size = size
        self._shared, self._meet = shared, meet

    def allgather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        self._meet.wait(timeout)
        self._shared[self.rank] = obj
        self._meet.wait(timeout)
        gathered = [self._shared[r] for r in range(self.size)]
        self._meet.wait(timeout)
        return gathered

    def close(self) -> None:
        pass


def _boards(size: int) -> list[StatusBoard]:
    shared: dict[int, Any] = {}
    meet = threading.Barrier(size)
    boards: list[StatusBoard | None] = [None] * size

    def make(rank: int) -> None:
        control = _Threads(rank, size, shared, meet)
        boards[rank] = StatusBoard(control, HostDevice(timeout=30, for_collectives=False), 30)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(b is not None for b in boards)
    return boards  # type: ignore[return-value]


def test_the_root_cause_is_reported_before_the_ranks_that_gave_up_because_of_it() -> None:
    """Rank 2 timed out waiting for rank 1; rank 0 learned of it and closed after the failure
    (GAVE_UP, blaming rank 1). Rank 1 must be told of the timeout, whichever rank it reads
    first."""
    boards = _boards(4)
    try:
        assert boards[1].troubled_peer() is None
        boards[2].give_up(TIMED_OUT, "waited for rank 1", 1)
        boards[0].give_up(GAVE_UP, "closed its communicator after a failure", 1)
        assert boards[1].troubled_peer() == (2, TIMED_OUT, "waited for rank 1", 1)
        boards[3].give_up(MISMATCH, "rank 3 called something else")
        assert boards[1].troubled_peer() == (3, MISMATCH, "rank 3 called something else", -1)
        assert boards[3].troubled_peer() == (2, TIMED_OUT, "waited for rank 1", 1)
    finally:
        for board in boards:
            board.close()


def test_the_first_word_stands() -> None:
    """A rank's later words (its calls failing once it failed, a close) do not replace what
    it said first: peers may have acted on that."""
    boards = _boards(2)
    try:
        assert boards[0].give_up(GAVE_UP, "rank 1 failed", 1)
        assert not boards[0].give_up(GAVE_UP, "a barrier failed")
        assert not boards[0].give_up(MISMATCH, "something else")
        assert boards[1].troubled_peer() == (0, GAVE_UP, "rank 1 failed", 1)
        assert boards[1].give_up(LEFT, "closed")
        assert not boards[1].give_up(GAVE_UP, "rank 0 failed", 0)
        assert boards[0].troubled_peer() is None  # a rank that left is no trouble
    finally:
        for board in boards:
            board.close()


def test_a_peer_that_entered_without_agreeing_ran_ahead() -> None:
    """While rank 1 agrees on collective 5, a peer that entered 5 having agreed on it too (it
    left the exchange first) is fine; one that entered 5 without agreeing ran a call agreed
    before: that peer and its collective are named."""
    boards = _boards(3)
    try:
        for board in boards:  # every rank agreed on and entered collective 4
            board.agreeing(4)
            board.enter(4, "all_reduce(op=sum)", 44)
        boards[1].agreeing(5)
        assert boards[1].ran_ahead(5) is None
        boards[0].agreeing(5)
        boards[0].enter(5, "all_reduce(op=max)", 55)  # agreed on 5, then entered it
        assert boards[1].ran_ahead(5) is None
        boards[2].enter(5, "all_reduce(op=sum)", 44)  # entered 5 on the agreement of 4
        assert boards[1].ran_ahead(5) == (2, "all_reduce(op=sum)")
        boards[2].enter(6, "barrier()", 66)  # and went further
        assert boards[1].ran_ahead(5) == (2, "#6, barrier()")
    finally:
        for board in boards:
            board.close()


def test_a_rank_that_blames_another_is_not_the_root_cause() -> None:
    """Rank 1 failed on its own account; rank 0 learned of it and gave up blaming rank 1
    (then, under a launcher that ends the whole job, both may be dead before rank 2 looks):
    rank 2 is told of rank 1's failure, not of rank 0's."""
    boards = _boards(3)
    try:
        boards[0].give_up(GAVE_UP, "rank 1 failed: its GPU faulted", 1)
        assert boards[2].troubled_peer() == (0, GAVE_UP, "rank 1 failed: its GPU faulted", 1)
        boards[1].give_up(GAVE_UP, "its GPU faulted")
        assert boards[2].troubled_peer() == (1, GAVE_UP, "its GPU faulted", -1)
    finally:
        for board in boards:
            board.close()


def test_a_culprit_outside_the_group_is_the_jobs_rank() -> None:
    """A board of a group whose ranks are ranks 4 to 6 of the job: a rank blames a rank of
    the group by its index, and one of the job outside the group (a rank of another node,
    for a level across nodes) by a word that `outside` reads back; such a rank blames
    another, so a rank that failed on its own account is the root cause before it."""
    boards = _boards(3)
    try:
        for board in boards:
            board.job_ranks = (4, 5, 6)
        assert boards[0].culprit(2) == 2 and boards[0].culprit(None, 5) == 1
        word = boards[0].culprit(None, 9)
        assert word <= -2 and outside(word) == 9 and outside(-1) is None and outside(0) is None
        assert boards[0].culprit(None) == -1
        boards[0].give_up(GAVE_UP, "rank 9 of the job died", word)
        assert boards[2].troubled_peer() == (0, GAVE_UP, "rank 9 of the job died", word)
        boards[1].give_up(GAVE_UP, "its GPU faulted")
        assert boards[2].troubled_peer() == (1, GAVE_UP, "its GPU faulted", -1)
    finally:
        for board in boards:
            board.close()


def test_a_watchdog_names_whom_its_rank_gave_up_because_of(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks 4 to 6 of the job. Rank 0 gives up because of a PeerFailureError naming rank 1:
    its board blames rank 1 (not itself, on its own account). Rank 2 gave up first, because
    of rank 9 of the job, which the group has no rank for: rank 1's watchdog then failed
    with an error that names rank 9 of the job (`job_peer`) and no rank of the group, and
    said so on its board, blaming rank 9 too. (The watchdogs' threads check nothing by
    themselves here: each check is the test's.)"""
    monkeypatch.setattr(_watchdog, "_TICK", 3600.0)
    shared: dict[int, Any] = {}
    meet = threading.Barrier(3)
    dogs: list[Watchdog | None] = [None] * 3
    failures: dict[int, list[GpuringError]] = {r: [] for r in range(3)}

    def make(rank: int) -> None:
        control = _Threads(rank, 3, shared, meet)
        control.job_ranks = (4, 5, 6)
        dogs[rank] = Watchdog(control, HostDevice(timeout=30, for_collectives=False),
                              timeout=30, stall_warning_s=1e9,
                              on_failure=failures[rank].append)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    watchdogs = [d for d in dogs if d is not None]
    assert len(watchdogs) == 3
    try:
        watchdogs[2].give_up("aborted", job_peer=9)
        watchdogs[1].check()
        (error,) = failures[1]
        assert isinstance(error, PeerFailureError) and (error.peer, error.job_peer) == (None, 9)
        assert "rank 9 of the job failed" in str(error)
        trouble = watchdogs[0].board.troubled_peer()
        assert trouble is not None and outside(trouble[3]) == 9
        watchdogs[0].give_up("all_reduce #3: rank 1 failed",
                             because=PeerFailureError("rank 1 failed", peer=1))
        assert watchdogs[2].board.troubled_peer() == (0, GAVE_UP, "all_reduce #3: rank 1 failed",
                                                      1)
        assert watchdogs[2].board.culprit(2, 5) == 1  # the job's rank wins: 2 only reported
        assert watchdogs[2].board.culprit(None, 0) == -2  # (rank 0 of the job is not rank 4)
    finally:
        for dog in watchdogs:
            dog.close()
