"""The control plane: who is in the job, and a few small collective messages between ranks."""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

__all__ = ["ControlPlane"]


class ControlPlane(abc.ABC):
    """Rank identity plus allgather of small picklable objects. Every call is collective."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    #: a name shared by every rank of the job, unique per job
    job_id: str
    #: True when every rank runs on this node (peers can map each other's memory)
    single_node: bool = True

    def __init__(self) -> None:
        self._failure_callbacks: list[Callable[[int, str], None]] = []

    @abc.abstractmethod
    def allgather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        """Every rank's `obj`, in rank order."""

    def barrier(self, timeout: float | None = None) -> None:
        self.allgather(None, timeout)

    def on_peer_failure(self, callback: Callable[[int, str], None]) -> None:
        """Call `callback(rank, reason)` (from any thread) when a peer is known to have died."""
        self._failure_callbacks.append(callback)

    def _peer_failed(self, rank: int, reason: str) -> None:
        for callback in list(self._failure_callbacks):
            callback(rank, reason)

    def report_failure(self, reason: str) -> None:
        """Tell the peers this rank gave up, where the control plane can (best effort)."""

    def interrupt(self, reason: str) -> None:
        """Make a pending or later exchange of this rank fail with PeerFailureError(reason)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Leave the job. Idempotent."""
