"""The watchdog's view of work queued on a device that does not block the host (GPU)."""

from __future__ import annotations

import threading
import time

from gpuring import GpuringError
from gpuring._health import Health
from gpuring.devices.base import Event
from gpuring.devices.host import HostDevice
from gpuring.rendezvous.local import SingleProcess


class _Event(Event):
    def __init__(self, outcome: str):
        self.outcome = outcome

    def query(self) -> bool:
        if self.outcome == "error":
            raise RuntimeError("cudaErrorIllegalAddress: an illegal memory access")
        return self.outcome == "done"


def _health(timeout: float) -> tuple[Health, list[GpuringError], threading.Event]:
    failures: list[GpuringError] = []
    failed = threading.Event()

    def on_failure(error: GpuringError) -> None:
        failures.append(error)
        failed.set()

    host = HostDevice(timeout=timeout, for_collectives=False)
    health = Health(SingleProcess(), host, timeout=timeout, stall_warning_s=1e9,
                    on_failure=on_failure)
    return health, failures, failed


def test_a_gpu_error_fails_the_communicator_at_once() -> None:
    health, failures, failed = _health(timeout=600)
    try:
        assert not health.busy()
        health.track(_Event("error"), "all_reduce", 3)
        assert health.busy()  # lost work counts as in flight
        assert failed.wait(10)
        assert len(failures) == 1 and "all_reduce #3 failed" in str(failures[0])
        assert "illegal memory access" in str(failures[0])
    finally:
        health.close()


def test_work_that_never_completes_times_out() -> None:
    health, failures, failed = _health(timeout=0.3)
    try:
        start = time.monotonic()
        health.track(_Event("running"), "broadcast", 1)
        assert failed.wait(10) and time.monotonic() - start >= 0.3
        assert "broadcast #1 did not complete" in str(failures[0])
    finally:
        health.close()


def test_completed_work_is_not_busy() -> None:
    health, failures, _ = _health(timeout=600)
    try:
        health.track(_Event("done"), "all_gather", 1)
        assert not health.busy()
        time.sleep(0.2)
        assert failures == []
    finally:
        health.close()
