"""A world of ranks that are threads of this process: a control plane whose exchanges meet
at a barrier (`ThreadWorld`), and `run_ranks`, which runs one function per rank on its own
communicator and returns what each returned (or raises what one raised). The ranks map
each other's shared memory as processes do; the GIL runs one at a time."""

from __future__ import annotations

import secrets
import threading
from collections.abc import Callable
from typing import Any

from gpuring._communicator import Communicator
from gpuring._config import Config
from gpuring._errors import CollectiveTimeoutError
from gpuring.rendezvous.base import ControlPlane

__all__ = ["ThreadWorld", "run_ranks"]


class _Meeting:
    """What the ranks of one world share: the current step's values and the barrier."""

    def __init__(self, size: int):
        self.size = size
        self.barrier = threading.Barrier(size)
        self.values: list[Any] = [None] * size
        self.job_id = secrets.token_hex(8)


class ThreadWorld(ControlPlane):
    def __init__(self, meeting: _Meeting, rank: int):
        super().__init__()
        self._meeting = meeting
        self.rank, self.size = rank, meeting.size
        self.job_id = meeting.job_id
        self.locate(["here"] * meeting.size)

    def allgather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        meeting = self._meeting
        try:
            meeting.barrier.wait(timeout)
            meeting.values[self.rank] = obj
            meeting.barrier.wait(timeout)
            gathered = list(meeting.values)
            meeting.barrier.wait(timeout)
        except threading.BrokenBarrierError:
            raise CollectiveTimeoutError(f"rank {self.rank}: an exchange timed out") from None
        return gathered

    def close(self) -> None:
        pass


def run_ranks(size: int, body: Callable[[Communicator], Any], *, timeout: float = 60.0,
              config: Config | None = None) -> list[Any]:
    """`body(comm)` on `size` ranks (threads) at once, their communicators' timeout
    `timeout`; their results in rank order (each rank has a minute at most)."""
    meeting = _Meeting(size)
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def rank(r: int) -> None:
        try:
            with Communicator(ThreadWorld(meeting, r), config or Config(timeout=timeout)) as comm:
                results[r] = body(comm)
        except BaseException as exc:  # handed to the caller
            errors[r] = exc
            meeting.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60.0)
        assert not thread.is_alive(), "a rank did not finish"
    for error in errors:
        if error is not None:
            raise error
    return results
