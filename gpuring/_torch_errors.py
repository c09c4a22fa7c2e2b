"""gpuring's errors as torch.distributed raises them: each is also a c10d
`torch.distributed.DistBackendError`, worded as c10d's backends word theirs.

torch users (and torch's own tests) catch a failed collective as `DistBackendError` (a
`RuntimeError`) and tell a timeout by "Timed out" in its message, a dead peer by "closed". The
process group raises, for every gpuring error of a call, an error of a class below: an instance
of the gpuring class it came from (its fields kept: `collective`, `seq`, `peer`,
`differences`...) and of `DistBackendError`, whose message leads with c10d's words and goes on
with gpuring's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed import DistBackendError

from ._errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    GpuringError,
    PeerFailureError,
    RegistrationError,
)

__all__ = ["C10dCollectiveMismatchError", "C10dCollectiveTimeoutError",
           "C10dCommunicatorClosedError", "C10dGpuringError", "C10dPeerFailureError",
           "C10dRegistrationError", "FailedWork", "as_c10d", "c10d_errors"]


class C10dGpuringError(GpuringError, DistBackendError):
    """A gpuring error of a torch.distributed call: also a c10d DistBackendError."""


class C10dCollectiveTimeoutError(CollectiveTimeoutError, DistBackendError):
    """CollectiveTimeoutError, also a DistBackendError: "Timed out waiting <ms>ms for ..."."""


class C10dPeerFailureError(PeerFailureError, DistBackendError):
    """PeerFailureError, also a DistBackendError: "Connection closed by peer ..."."""


class C10dCollectiveMismatchError(CollectiveMismatchError, DistBackendError):
    """CollectiveMismatchError, also a DistBackendError."""


class C10dCommunicatorClosedError(CommunicatorClosedError, DistBackendError):
    """CommunicatorClosedError, also a DistBackendError: "... closed ..."."""


class C10dRegistrationError(RegistrationError, DistBackendError):
    """RegistrationError, also a DistBackendError."""


#: gpuring's class -> its c10d twin (a subclass not listed maps to its nearest listed base)
_TWINS: dict[type[GpuringError], type[GpuringError]] = {
    CollectiveTimeoutError: C10dCollectiveTimeoutError,
    PeerFailureError: C10dPeerFailureError,
    CollectiveMismatchError: C10dCollectiveMismatchError,
    CommunicatorClosedError: C10dCommunicatorClosedError,
    RegistrationError: C10dRegistrationError,
    GpuringError: C10dGpuringError,
}


def _lead(exc: GpuringError, timeout: float, call: str) -> str:
    """c10d's words for what happened, before gpuring's message."""
    what = getattr(exc, "collective", None)
    seq = getattr(exc, "seq", None)
    what = call if what is None else what if seq is None else f"{what} #{seq}"
    if isinstance(exc, CollectiveTimeoutError):
        return f"Timed out waiting {round(timeout * 1000)}ms for {what} to complete"
    if isinstance(exc, PeerFailureError):
        peer = getattr(exc, "peer", None)
        return "Connection closed by peer" + ("" if peer is None else f" rank {peer}")
    if isinstance(exc, CommunicatorClosedError):
        return f"{what}: the process group's communicator is closed"
    if isinstance(exc, CollectiveMismatchError):
        return f"Detected mismatch between collectives on ranks in {what}"
    return f"{what} failed"


def as_c10d(exc: GpuringError, timeout: float, call: str = "the collective") -> GpuringError:
    """`exc` as its c10d twin: the same fields, the message led by c10d's words. `timeout`:
    the group's timeout in seconds (what a timeout's message says it waited); `call`: what
    was called, where `exc` does not name its collective."""
    if isinstance(exc, DistBackendError):
        return exc
    twin = next(_TWINS[cls] for cls in type(exc).__mro__ if cls in _TWINS)
    error = twin.__new__(twin)
    error.__dict__.update(exc.__dict__)
    error.args = (f"gpuring: {_lead(exc, timeout, call)}: {exc}",)
    return error


_F = TypeVar("_F", bound=Callable[..., Any])


class FailedWork(dist.Work):
    """The work of an async_op=True call that failed: as gloo's, it raises the call's error at
    `wait()`."""

    def __init__(self, error: BaseException):
        super().__init__()
        self.error = error

    def wait(self, timeout: Any = None) -> bool:
        raise self.error

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return False

    def exception(self) -> BaseException:
        return self.error


def c10d_errors(timeout: Callable[[Any], float]) -> Callable[[_F], _F]:
    """A decorator of a process group's methods: a GpuringError they raise is raised as its
    c10d twin (`as_c10d`), chained to it; where the call was made with async_op=True (an
    option of `asyncOp` True among its arguments: torch sets it to the caller's async_op, and
    options made in C++ have it True), it returns a FailedWork that raises it at wait(), as
    gloo's works do. `timeout(self)`: the group's timeout in seconds."""

    def decorate(method: _F) -> _F:
        @functools.wraps(method)
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return method(self, *args, **kwargs)
            except GpuringError as exc:
                twin = as_c10d(exc, timeout(self), method.__name__)
                if any(getattr(a, "asyncOp", False) is True for a in (*args, *kwargs.values())):
                    if twin is not exc:
                        twin.__cause__ = exc
                    return FailedWork(twin)
                if twin is exc:
                    raise
                raise twin from exc

        return wrapped  # type: ignore[return-value]

    return decorate
