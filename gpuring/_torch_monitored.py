"""`monitored_barrier` of the torch backend's process groups, through the group's c10d store,
as torch documents gloo's: every other rank tells rank 0 it arrived and waits (at most the
timeout) for rank 0 to let it go; rank 0 waits for each of them in rank order, within the
timeout in all, and raises naming the first rank that did not arrive (every such rank with
`wait_all_ranks`), or itself where its time ran out before it could wait. (torch's
`dist.monitored_barrier` serves gloo's groups only; `group.monitored_barrier(...)` reaches
this.)"""

from __future__ import annotations

import datetime
import time
from typing import Any

from torch.distributed import DistBackendError

__all__ = ["monitored_barrier"]


def _arrived(call: int, rank: int) -> str:
    return f"gpuring/monitored-barrier/{call}/arrived/{rank}"


def _released(call: int) -> str:
    return f"gpuring/monitored-barrier/{call}/released"


def _there(store: Any, key: str, seconds: float) -> bool:
    """Whether `key` is in `store` within `seconds` (none left: whether it is there now).
    Polled: a c10d store's own timed wait writes a warning to stderr when it times out."""
    deadline = time.monotonic() + seconds
    pause = 0.001
    while not store.check([key]):
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.05)
    return True


def monitored_barrier(store: Any, rank: int, size: int, call: int,
                      timeout: datetime.timedelta, wait_all_ranks: bool) -> None:
    """The `call`-th monitored barrier of a group (counted alike on every rank) of `size`
    ranks whose c10d store is `store`."""
    seconds = timeout.total_seconds()
    ms = round(seconds * 1000)
    if rank != 0:
        store.set(_arrived(call, rank), "1")
        if not _there(store, _released(call), seconds):
            raise DistBackendError(f"Rank {rank} timed out in monitoredBarrier after {ms} ms")
        return
    deadline = time.monotonic() + seconds
    missing: list[int] = []
    for peer in range(1, size):
        left = deadline - time.monotonic()
        if left <= 0 and not wait_all_ranks and not store.check([_arrived(call, peer)]):
            raise DistBackendError(f"Rank 0 timed out in monitoredBarrier after {ms} ms, "
                                   f"ranks 1 to {peer - 1} arrived" if peer > 1 else
                                   f"Rank 0 timed out in monitoredBarrier after {ms} ms, "
                                   "before any rank arrived")
        if not _there(store, _arrived(call, peer), left):
            if not wait_all_ranks:
                raise DistBackendError(f"[Rank 0]: Rank {peer} failed to pass monitoredBarrier "
                                       f"in {ms} ms")
            missing.append(peer)
    if missing:
        raise DistBackendError(f"[Rank 0]: Ranks {', '.join(map(str, missing))} failed to pass "
                               f"monitoredBarrier in {ms} ms")
    store.set(_released(call), "1")
