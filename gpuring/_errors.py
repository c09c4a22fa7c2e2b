"""Exceptions raised by gpuring."""

from __future__ import annotations

import copy
from collections.abc import Sequence

__all__ = [
    "GpuringError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "PeerFailureError",
    "CommunicatorClosedError",
    "RegistrationError",
    "ArgumentError",
]


class GpuringError(RuntimeError):
    """Base class of every error gpuring raises on its own account."""

    __module__ = "gpuring"  # (how tracebacks name it: where users import it from)


class CollectiveMismatchError(GpuringError):
    """Ranks called collectives that do not match (kind, shape, dtype, op, root...)."""

    __module__ = "gpuring"  # (how tracebacks name it: where users import it from)

    def __init__(self, message: str, *, differences: dict[str, dict[int, object]] | None = None):
        super().__init__(message)
        #: field name -> {rank: value} for every field on which the ranks disagree.
        self.differences = differences or {}


class CollectiveTimeoutError(GpuringError):
    """A collective did not complete within the communicator's timeout."""

    __module__ = "gpuring"  # (how tracebacks name it: where users import it from)

    def __init__(self, message: str, *, collective: str | None = None, seq: int | None = None,
                 peer: int | None = None):
        super().__init__(message)
        self.collective = collective
        self.seq = seq
        self.peer = peer


class PeerFailureError(GpuringError):
    """A peer rank died or aborted while this rank depended on it."""

    __module__ = "gpuring"  # (how tracebacks name it: where users import it from)

    def __init__(self, message: str, *, peer: int | None = None, collective: str | None = None,
                 seq: int | None = None, job_peer: int | None = None):
        super().__init__(message)
        #: the failed rank, in the communicator's ranks (None: unknown, or not one of them)
        self.peer = peer
        self.collective = collective
        self.seq = seq
        #: the failed rank in the job's ranks (the launcher's), where known: it names a
        #: rank that a sub-communicator has no rank for (one that failed outside it)
        self.job_peer = job_peer


class CommunicatorClosedError(GpuringError):
    """The communicator was closed or aborted and can no longer be used."""

    __module__ = "gpuring"  # (how tracebacks name it: where users import it from)


def in_ranks(exc: GpuringError, members: Sequence[int], where: str,
             job_ranks: Sequence[int] = ()) -> GpuringError:
    """`exc`, raised by a communicator whose rank i is rank `members[i]` of another, in that
    other's ranks: the rank it blames (`peer`) and the ranks of its `differences` renamed,
    its message prefixed with `where`. `job_ranks`: the other's ranks in the job's, by which
    a failed rank that `exc` could only name in the job's ranks (`job_peer`) is named."""
    error = copy.copy(exc)
    error.args = (f"{where}: {exc}",)
    culprit = getattr(exc, "peer", None)
    in_job = getattr(exc, "job_peer", None)
    if in_job is not None and in_job in job_ranks:
        error.peer = list(job_ranks).index(in_job)  # type: ignore[attr-defined]
    elif isinstance(culprit, int) and 0 <= culprit < len(members):
        error.peer = members[culprit]  # type: ignore[attr-defined]
    if isinstance(exc, CollectiveMismatchError) and isinstance(error, CollectiveMismatchError):
        error.differences = {field: {members[r]: v for r, v in values.items()}
                             for field, values in exc.differences.items()}
    return error


class RegistrationError(GpuringError):
    """A rank could not allocate registered memory (every rank raises it; the communicator
    goes on)."""


class ArgumentError(RuntimeError, ValueError):
    """A call's arrays or op do not fit it, where cupyx.distributed raises RuntimeError (an
    unknown op, an array neither C- nor F-contiguous, a first dimension that is not the rank
    count); a ValueError too, as gpuring's other argument errors are."""
