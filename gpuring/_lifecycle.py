"""A communicator's lifecycle: one state, its transitions, and the errors they imply.

    OPEN ──fail()──▶ FAILED ──raised()──▶ BROKEN
      │                                     ▲
      └────────────────raised()─────────────┘
    any state ──close()──▶ CLOSED

FAILED: a failure came from outside any call (a peer died or gave up, the watchdog fired,
`abort()`); the next call raises it, naming itself. BROKEN: a call raised a failure; later
calls raise CommunicatorClosedError. Either way the communicator cannot run collectives again,
and closing it is no longer orderly (GPU buffers a peer may still read are kept).
"""

from __future__ import annotations

import enum
import threading
import weakref
from collections.abc import Callable
from typing import Any

from ._errors import CollectiveTimeoutError, CommunicatorClosedError, GpuringError, PeerFailureError

__all__ = ["State", "Lifecycle", "Outcome", "in_context", "weakly"]


class State(enum.Enum):
    OPEN = "open"  #: runs collectives
    FAILED = "failed"  #: a failure came between calls; the next call raises it
    BROKEN = "broken"  #: a call raised a failure; later calls raise CommunicatorClosedError
    CLOSED = "closed"  #: closed (after any of the above)


def in_context(failure: GpuringError, name: str, seq: int, rank: int) -> GpuringError:
    """The same kind of error as `failure`, saying which call on which rank it ended."""
    where = f"{name} #{seq} on rank {rank}: {failure}"
    if isinstance(failure, PeerFailureError):
        return PeerFailureError(where, peer=failure.peer, collective=name, seq=seq,
                                job_peer=failure.job_peer)
    if isinstance(failure, CollectiveTimeoutError):
        return CollectiveTimeoutError(where, collective=name, seq=seq, peer=failure.peer)
    return type(failure)(where)


class Outcome:
    """Whether the communicator closes orderly: no failure so far, so every buffer may be
    freed (after a failure, GPU buffers a peer may still read are kept)."""

    __slots__ = ("orderly",)

    def __init__(self) -> None:
        self.orderly = True


class Lifecycle:
    """The state of one communicator. `cause` is the first failure that came from outside a
    call, `error` the failure a call raised; `fail` may be called from any thread."""

    def __init__(self, rank: int):
        self.rank = rank
        self.state = State.OPEN
        self.cause: GpuringError | None = None
        self.error: BaseException | None = None
        self.by_user = False  #: abort() was called: close() need not report the failure
        #: the newest collective that was in flight when the failure came (None: none was)
        self.lost_through: int | None = None
        #: every collective up to this one is known to have completed without error
        self.completed_through = 0
        #: what closing needs to know, apart from the rest (no error or traceback in it, so
        #: the communicator's finalizer can hold it without holding the communicator)
        self.outcome = Outcome()
        self._lock = threading.Lock()

    @property
    def orderly(self) -> bool:
        return self.outcome.orderly

    def fail(self, cause: GpuringError, *, in_flight: int | None,
             by_user: bool = False) -> bool:
        """Record a failure from outside a call, which came while collectives up to
        `in_flight` may not have completed (None: all had); True for the first one (the
        caller then unblocks every wait of this rank), False when one was recorded already."""
        with self._lock:
            self.by_user = self.by_user or by_user
            if self.cause is not None:
                return False
            self.cause = cause
            self.lost_through = in_flight
            self.outcome.orderly = False
            if self.state is State.OPEN:
                self.state = State.FAILED
            return True

    def completed(self, seq: int) -> None:
        """Every collective up to `seq` completed without error: a failure that came while
        one of them was in flight lost nothing after all (its call was about to return)."""
        with self._lock:
            self.completed_through = max(self.completed_through, seq)

    def raised(self, error: BaseException) -> None:
        """A call raised `error`: the communicator cannot run collectives any more."""
        with self._lock:
            self.error = error
            self.outcome.orderly = False
            if self.state is not State.CLOSED:
                self.state = State.BROKEN

    def explain(self, error: GpuringError, name: str, seq: int) -> GpuringError:
        """`error` as this call's error, or the recorded cause if there is one (a peer that
        died reads better than the abort it caused)."""
        return in_context(self.cause if self.cause is not None else error, name, seq,
                          self.rank)

    def check(self, name: str, seq: int) -> None:
        """Raise if no collective may run: closed, or failed (a failure that came between
        calls is raised once as itself, as call `name` #`seq`; later calls get
        CommunicatorClosedError)."""
        state = self.state
        if state is State.OPEN:
            return
        if state is State.CLOSED:
            raise CommunicatorClosedError("the communicator is closed; call gpuring.init() "
                                          "for a new one")
        if state is State.FAILED and name:
            assert self.cause is not None
            error = in_context(self.cause, name, seq, self.rank)
            self.raised(error)
            raise error
        broken = self.error or self.cause
        raise CommunicatorClosedError(
            f"the communicator failed earlier and can no longer be used "
            f"({str(broken) or repr(broken)}); close it and call gpuring.init() again"
        ) from broken

    def unraised(self, seq: int) -> GpuringError | None:
        """At close: a failure no call has raised, that hit work in flight which did not
        complete after all (and was not the user's own abort), as close's error."""
        lost = self.lost_through is not None and self.lost_through > self.completed_through
        if self.state is State.FAILED and not self.by_user and lost:
            assert self.cause is not None
            return in_context(self.cause, "close", seq, self.rank)
        return None

    def close(self) -> None:
        with self._lock:
            self.state = State.CLOSED


def weakly(method: Callable[..., None]) -> Callable[..., None]:
    """A callback that calls `method` while its object lives. What the control plane and the
    watchdog hold must not keep a communicator alive (its finalizer closes it when the user
    drops it), and a failure the call path keeps holds frames of the communicator's calls."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, **kwargs)

    return call
