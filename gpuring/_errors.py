"""Exceptions raised by gpuring."""

from __future__ import annotations

__all__ = [
    "GpuringError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "PeerFailureError",
    "CommunicatorClosedError",
]


class GpuringError(RuntimeError):
    """Base class of every error gpuring raises on its own account."""


class CollectiveMismatchError(GpuringError):
    """Ranks called collectives that do not match (kind, shape, dtype, op, root...)."""

    def __init__(self, message: str, *, differences: dict[str, dict[int, object]] | None = None):
        super().__init__(message)
        #: field name -> {rank: value} for every field on which the ranks disagree.
        self.differences = differences or {}


class CollectiveTimeoutError(GpuringError):
    """A collective did not complete within the communicator's timeout."""

    def __init__(self, message: str, *, collective: str | None = None, seq: int | None = None,
                 peer: int | None = None):
        super().__init__(message)
        self.collective = collective
        self.seq = seq
        self.peer = peer


class PeerFailureError(GpuringError):
    """A peer rank died or aborted while this rank depended on it."""

    def __init__(self, message: str, *, peer: int | None = None, collective: str | None = None,
                 seq: int | None = None):
        super().__init__(message)
        self.peer = peer
        self.collective = collective
        self.seq = seq


class CommunicatorClosedError(GpuringError):
    """The communicator was closed or aborted and can no longer be used."""
