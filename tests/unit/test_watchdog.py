"""The watchdog's view of work queued on a device that does not block the host (GPU)."""

from __future__ import annotations

import threading
import time

from gpuring import GpuringError
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
