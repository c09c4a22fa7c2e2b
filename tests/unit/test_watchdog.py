"""The watchdog's view of work queued on a device that does not block the host (GPU)."""

from __future__ import annotations

import threading
import time

import pytest

from gpuring import GpuringError, PeerFailureError
from gpuring._watchdog import Watchdog
from gpuring.devices.base import Event
from gpuring.devices.host import HostDevice
from gpuring.rendezvous.local import SingleProcess


class _Event(Event):
    """Work on a device that does not block the host: done, running or failed. `seen` is set
    once the watchdog thread (not the test's) has queried it."""

    def __init__(self, outcome: str, seen: threading.Event | None = None):
        self.outcome = outcome
        self.seen = seen or threading.Event()

    def query(self) -> bool:
        if threading.current_thread().name == "gpuring-watchdog":
            self.seen.set()
        if self.outcome == "error":
            raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access")
        return self.outcome == "done"


def _watchdog(timeout: float) -> tuple[Watchdog, list[GpuringError], threading.Event]:
    """A watchdog over SingleProcess, the failures it reports, and an event set at the
    first."""
    failures: list[GpuringError] = []
    failed = threading.Event()

    def on_failure(error: GpuringError) -> None:
        failures.append(error)
        failed.set()

    host = HostDevice(timeout=timeout, for_collectives=False)
    watchdog = Watchdog(SingleProcess(), host, timeout=timeout, stall_warning_s=1e9,
                    on_failure=on_failure)
    return watchdog, failures, failed


def test_a_gpu_error_fails_the_communicator_at_once() -> None:
    watchdog, failures, failed = _watchdog(timeout=600)
    try:
        assert not watchdog.busy()
        watchdog.track(_Event("error"), "all_reduce", 3)
        assert watchdog.busy()  # lost work counts as in flight
        assert failed.wait(10)
        assert len(failures) == 1 and "all_reduce #3 failed" in str(failures[0])
        assert "illegal memory access" in str(failures[0])
    finally:
        watchdog.close()


def test_work_that_never_completes_times_out() -> None:
    watchdog, failures, failed = _watchdog(timeout=0.3)
    try:
        start = time.monotonic()
        watchdog.track(_Event("running"), "broadcast", 1)
        assert failed.wait(10) and time.monotonic() - start >= 0.3
        assert "broadcast #1 did not complete" in str(failures[0])
    finally:
        watchdog.close()


def test_completed_work_is_not_busy() -> None:
    watchdog, failures, news = _watchdog(timeout=600)
    try:
        done = _Event("done")
        watchdog.track(done, "all_gather", 1)
        assert not watchdog.busy()
        # the watchdog checks tracked work in order: once it queries this later work it has
        # dealt with the completed one (so a failure it wrongly raised is already recorded)
        later = _Event("running", seen=news)
        watchdog.track(later, "all_gather", 2)
        assert news.wait(60), "the watchdog never checked the work"
        assert failures == [], failures
        assert done.seen.is_set() and later.seen.is_set()
        assert watchdog.busy()  # the later work is still running
    finally:
        watchdog.close()


def test_a_rank_that_learns_of_a_failure_says_whom_it_blames() -> None:
    """Rank 1 gives up; rank 0's watchdog fails its communicator within a tick and says on the
    board, at once, that it gave up because of rank 1 (a rank that looks later may find rank
    0 dead too, when a launcher ends the whole job)."""
    from gpuring._status import _CULPRIT, GAVE_UP

    from .test_status import _Threads

    size, shared, meet = 2, {}, threading.Barrier(2)
    failures: list[GpuringError] = []
    dogs: list[Watchdog | None] = [None] * size

    def make(rank: int) -> None:
        dogs[rank] = Watchdog(_Threads(rank, size, shared, meet),
                              HostDevice(timeout=30, for_collectives=False), timeout=30,
                              stall_warning_s=1e9, on_failure=failures.append)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    rank0, rank1 = dogs
    assert rank0 is not None and rank1 is not None
    try:
        rank1.give_up("its GPU faulted")
        deadline = time.monotonic() + 30
        while rank0.board.state() == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert rank0.board.state() == GAVE_UP
        assert len(failures) == 1 and failures[0].peer == 1, failures
        words = rank0.board._mine.i64
        assert words is not None and int(words[_CULPRIT]) == 1  # the rank it blames
    finally:
        rank0.close()
        rank1.close()


def test_the_newest_collective_in_flight() -> None:
    """What a failure that comes now may have hit: every collective up to the newest one not
    known complete (a held event stands for those it replaced; completed ones stay held until
    the watchdog's next tick, here never)."""
    watchdog, failures, _ = _watchdog(timeout=600)
    watchdog._stop.set()  # no tick from now on
    watchdog._thread.join()
    try:
        for seq in (3, 4, 5):
            watchdog.track(_Event("done"), "all_reduce", seq)
        assert watchdog.in_flight() is None
        watchdog.track(_Event("running"), "all_reduce", 6)  # replaces 5: held are 3 and 6
        assert watchdog.in_flight() == 6
        assert failures == []
    finally:
        watchdog.close()


def test_work_that_failed_by_itself_counts_as_in_flight() -> None:
    """A collective whose kernel gave up by itself completes, but its work is lost."""
    watchdog, failures, failed = _watchdog(timeout=600)

    def check() -> None:
        raise RuntimeError("a wait timed out in the kernel")

    try:
        watchdog.track(_Event("done"), "broadcast", 7, check)
        assert failed.wait(10) and "broadcast #7 failed" in str(failures[0])
        assert watchdog.in_flight() == 7
    finally:
        watchdog.close()


def test_a_failure_close_reports_only_for_work_it_lost() -> None:
    """A failure that came while collective 5 was in flight is close's error, unless every
    collective through 5 then completed without error (its call was about to return)."""
    from gpuring import PeerFailureError
    from gpuring._failures import Lifecycle

    def life(completed: int) -> Lifecycle:
        one = Lifecycle(rank=1)
        one.completed(4)
        assert one.fail(PeerFailureError("rank 0 failed: recovering", peer=0), in_flight=5)
        one.completed(completed)
        return one

    assert life(completed=5).unraised(seq=5) is None
    lost = life(completed=4).unraised(seq=5)
    assert isinstance(lost, PeerFailureError) and lost.peer == 0
    assert "close #5 on rank 1: rank 0 failed" in str(lost)
    idle = Lifecycle(rank=1)
    idle.fail(PeerFailureError("rank 0 failed", peer=0), in_flight=None)
    assert idle.unraised(seq=5) is None


def test_only_a_rank_whose_every_engine_is_done_vouches_for_its_work() -> None:
    """A blocking engine's call (or a barrier on one engine) that returns says that engine's
    work completed: all of the rank's only where no other engine may still be running some
    (a GPU's queued collectives)."""
    from types import SimpleNamespace

    from gpuring._callpath import CallPath
    from gpuring._failures import Lifecycle

    def engine(blocking: bool) -> SimpleNamespace:
        return SimpleNamespace(device=SimpleNamespace(blocking=blocking))

    host, gpu = engine(True), engine(False)
    for engines, vouched in (({"cpu": host}, 2), ({"cpu": host, "cuda": gpu}, 0)):
        path = SimpleNamespace(engines=engines, life=Lifecycle(rank=0))
        CallPath._completed(path, 2, host)  # type: ignore[arg-type]
        assert path.life.completed_through == vouched


@pytest.mark.parametrize("later", [True, False])
def test_two_checks_at_once_deal_with_each_collective_once(later: bool) -> None:
    """The caller's thread (`Watchdog.check`) and the watchdog's may check the held
    collectives at once, both finding the watched one complete: it is let go once, and a
    later one stays watched."""
    watchdog, failures, _ = _watchdog(timeout=600)
    watchdog._stop.set()  # the two checks below are the only ones
    watchdog._thread.join()
    both = threading.Barrier(2, timeout=30)

    class _SeenByBoth(_Event):
        def query(self) -> bool:
            both.wait()  # each check is inside this query when the other is
            return True

    errors: list[BaseException] = []

    def check() -> None:
        try:
            watchdog._check_pending()
        except BaseException as exc:
            errors.append(exc)

    try:
        watchdog.track(_SeenByBoth("done"), "all_reduce", 1)
        if later:
            watchdog.track(_Event("running"), "all_reduce", 2)
        threads = [threading.Thread(target=check) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert errors == [] and failures == []
        assert watchdog.in_flight() == (2 if later else None)
    finally:
        watchdog.close()


def test_the_text_blames_the_rank_the_error_names() -> None:
    """Rank 2 gives up because of rank 1 (which closed, say): rank 0's error names rank 1 in
    its text, as its `.peer` and `.job_peer` do, not rank 2, which only gave up."""
    from .test_status import _Threads

    size, shared, meet = 3, {}, threading.Barrier(3)
    failures: list[GpuringError] = []
    dogs: list[Watchdog | None] = [None] * size

    def make(rank: int) -> None:
        dogs[rank] = Watchdog(_Threads(rank, size, shared, meet),
                              HostDevice(timeout=30, for_collectives=False), timeout=30,
                              stall_warning_s=1e9,
                              on_failure=failures.append if rank == 0 else lambda e: None)

    threads = [threading.Thread(target=make, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(dogs)
    try:
        dogs[1].close()  # type: ignore[union-attr]
        dogs[2].give_up("closed its communicator after a failure",  # type: ignore[union-attr]
                        because=PeerFailureError("rank 1 closed", peer=1))
        deadline = time.monotonic() + 30
        while not failures and time.monotonic() < deadline:
            time.sleep(0.01)
        (error,) = failures
        assert isinstance(error, PeerFailureError)
        assert (error.peer, error.job_peer) == (1, 1)
        assert str(error).startswith("rank 1 failed (rank 2 gave up because of it: "), error
    finally:
        for dog in dogs:
            if dog is not None:
                dog.close()
