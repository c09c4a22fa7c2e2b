"""Failures: how a communicator keeps its promise to never hang and never lie, in one place.

The lifecycle (one state and its transitions):

    OPEN ──fail()──▶ FAILED ──raised()──▶ BROKEN
      │                                     ▲
      └────────────────raised()─────────────┘
    any state ──close()──▶ CLOSED

FAILED: a failure came from outside any call (a peer died or gave up, the watchdog fired,
`abort()`); the next call raises it, naming itself. BROKEN: a call raised a failure; later
calls raise CommunicatorClosedError. Either way the communicator cannot run collectives again,
and closing it is no longer orderly (GPU buffers a peer may still read are kept).

What happens when something fails, all of it here:

- `fail`: a failure from outside a call (any thread): record it, then release every wait of
  this rank (each engine's device, NCCL, the levels across nodes, the control plane).
- `give_up`: a call of this rank cannot go on: the communicator is broken, the status board
  says so (naming the rank blamed, where one is), the peers are told, and this rank's work
  is aborted. A peer that gave up only because of another rank's failure is not blamed: the
  watchdog's `blame` names the rank that failed first.
- the translations: engines, devices and transports raise plain errors (a flag wait that timed
  out or was aborted, an MPI or NCCL error); the context managers below (`on_run`,
  `on_exchange`, `on_transport`, `on_nodes`, `giving_up`) turn them into the user's error,
  which says which collective, which sequence number, which rank (`in_context`), or into
  the failure that caused them where one is known (a peer that died reads better than the
  abort it caused).
- `trace`: every failure this rank learns of, or raises, is written down by the flight
  recorder (`_recorder`: the communicators' last collectives), once per error.
"""

from __future__ import annotations

import enum
import logging
import threading
import weakref
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from ._errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    GpuringError,
    PeerFailureError,
)
from .devices.base import Device, FlagWaitAborted, FlagWaitTimeout

if TYPE_CHECKING:
    from ._config import Config
    from ._watchdog import Watchdog
    from .rendezvous.base import ControlPlane

__all__ = ["State", "Lifecycle", "Outcome", "in_context", "weakly", "Path", "fail",
           "give_up", "giving_up", "on_run", "on_exchange", "on_transport", "on_nodes",
           "on_streams", "job_peer", "tell_peers", "trace", "Unraised"]

log = logging.getLogger("gpuring")


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
        #: told every `completed` sequence number (the watchdog publishes it)
        self.on_completed: Callable[[int], None] | None = None
        #: the last failure the flight recorder wrote down (`trace`)
        self.traced: BaseException | None = None
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
        one of them was in flight lost nothing after all (its call was about to return).
        Told to `on_completed` (the status board, once there is one)."""
        with self._lock:
            self.completed_through = max(self.completed_through, seq)
        if self.on_completed is not None:
            self.on_completed(seq)

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



class NcclWork(Protocol):
    """What failure handling needs of the collectives on NCCL."""

    def abort(self, reason: str) -> None: ...


class NodeLevels(Protocol):
    """What failure handling needs of the two levels across nodes."""

    def abort(self, reason: str, job_peer: int | None = None) -> None: ...

    def node_failure(self) -> PeerFailureError | None: ...


class Engines(Protocol):
    """What failure handling needs of an engine: its device, to abort."""

    @property
    def device(self) -> Device: ...


class Path(Protocol):
    """What failure handling reads of a communicator's call path (`CallPath`)."""

    rank: int
    seq: int
    last_collective: str
    control: ControlPlane
    config: Config
    life: Lifecycle
    watchdog: Watchdog | None
    #: devices besides the engines' (the GPU of CuPy messages)
    devices: list[Device]

    @property
    def engines(self) -> Mapping[str, Engines]: ...

    @property
    def nccl(self) -> NcclWork | None: ...

    @property
    def levels(self) -> NodeLevels | None: ...

    def dump_trace(self, reason: str) -> str | None: ...


def job_peer(path: Path, error: BaseException) -> int | None:
    """The rank of the job `error` blames, where it names one."""
    return path.control.in_job(getattr(error, "peer", None), getattr(error, "job_peer", None))


def tell_peers(path: Path, error: BaseException) -> None:
    """Report to the peers that this rank gave up because of `error` (best effort)."""
    path.control.report_failure(f"rank {path.rank}: {error!r}", getattr(error, "peer", None),
                                isinstance(error, CollectiveTimeoutError),
                                getattr(error, "job_peer", None))


def trace(path: Path, error: BaseException) -> None:
    """Have the flight recorder write this rank's dump, because of `error` (once per error:
    a failure that comes from outside a call, then the error a call raises of it, are two).
    A dump that cannot be written is logged, never raised."""
    life = path.life
    if life.traced is error:
        return
    life.traced = error
    reason = ("abort" if life.by_user else "timeout" if isinstance(error, CollectiveTimeoutError)
              else "mismatch" if isinstance(error, CollectiveMismatchError) else "failure")
    try:
        written = path.dump_trace(reason)
    except Exception as exc:
        log.warning("gpuring: rank %d could not write its flight recorder: %s", path.rank, exc)
        return
    if written is not None:
        log.info("gpuring: rank %d wrote its flight recorder to %s", path.rank, written)


def fail(path: Path, error: GpuringError, *, by_user: bool = False) -> None:
    """Record a failure that came from outside a call (a peer, the watchdog, abort()) and
    unblock every wait of this rank. Any thread."""
    watchdog = path.watchdog
    # a failure that reached no collective of this rank (all had completed) lost nothing
    in_flight = None if watchdog is None else watchdog.in_flight()
    if not path.life.fail(error, in_flight=in_flight, by_user=by_user):
        return
    if watchdog is not None:
        watchdog.note_failure(error)
    for engine in list(path.engines.values()):
        engine.device.abort(str(error))
    for device in list(path.devices):
        device.abort(str(error))
    levels = path.levels
    if levels is not None:
        levels.abort(str(error), job_peer(path, error))
    nccl = path.nccl
    if nccl is not None:
        nccl.abort(str(error))
    path.control.interrupt(str(error))
    trace(path, error)


def give_up(path: Path, error: BaseException, name: str, culprit: int | None = None,
            seq: int | None = None) -> None:
    """A call of this rank cannot go on: the communicator is broken; tell the peers
    (`culprit`: the rank a timeout blames, which the status board names instead)."""
    path.life.raised(error)
    if path.watchdog is not None:
        where = f"{name} #{path.seq if seq is None else seq}"
        path.watchdog.give_up(f"{where}: {error!r}", timed_out_on=culprit, because=error)
    if culprit is None:
        tell_peers(path, error)
    for engine in list(path.engines.values()):
        engine.device.abort(f"rank {path.rank} gave up: {error!r}")
    for device in list(path.devices):
        device.abort(f"rank {path.rank} gave up: {error!r}")
    nccl = path.nccl
    if nccl is not None:
        nccl.abort(f"rank {path.rank} gave up: {error!r}")
    trace(path, error)


class Unraised:
    """The failures of steps that must all run (closing a communicator: its channels, its
    levels, its engines), kept instead of raised: `with unraised.step(): ...` runs one
    step, and `error` is the first failure of any (a step run with `latest=True` replaces
    the ones before, as a failure that says it comes from close does)."""

    __slots__ = ("_latest", "error")

    def __init__(self, error: BaseException | None = None):
        self.error = error
        self._latest = False

    def step(self, *, latest: bool = False) -> Unraised:
        self._latest = latest
        return self

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if exc is not None and (self.error is None or self._latest):
            self.error = exc
        return exc is not None


class _Translating:
    """A context manager that hands a failure inside it to `translate`, which breaks what
    must break and returns the error to raise (the same one: raised as it is, unless
    `always_anew`: then without the context it came in)."""

    __slots__ = ()
    always_anew = False

    def __enter__(self) -> None:
        return None

    def translate(self, exc: BaseException) -> BaseException:
        raise NotImplementedError

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc is None:
            return
        error = self.translate(exc)
        if error is not exc or self.always_anew:  # (else the same one goes on as it is)
            raise error from None


class giving_up(_Translating):
    """Any failure inside: this rank gives up on call `name` (`give_up`), after which its
    peers, which go on, learn it (a failure after agreement, or after `seq` moved on)."""

    __slots__ = ("name", "passes", "path")

    def __init__(self, path: Path, name: str,
                 passes: tuple[type[BaseException], ...] = ()):
        self.path, self.name, self.passes = path, name, passes

    def translate(self, exc: BaseException) -> BaseException:
        if not isinstance(exc, self.passes):  # (errors every rank raises alike)
            give_up(self.path, exc, self.name)
        return exc


class on_run(_Translating):
    """A collective's run on an engine (`seq`: its number): whatever fails, its round
    counters are unusable; the error is the known cause, a mismatch (the status board told
    the peers), or this rank's own, blamed on the rank that failed first."""

    __slots__ = ("name", "path", "seq")

    def __init__(self, path: Path, name: str, seq: int):
        self.path, self.name, self.seq = path, name, seq

    def translate(self, exc: BaseException) -> BaseException:
        path, name, seq, life = self.path, self.name, self.seq, self.path.life
        error: BaseException = exc
        if life.cause is not None:
            error = life.explain(life.cause, name, seq)
            life.raised(error)
            trace(path, error)
        elif isinstance(error, CollectiveMismatchError):
            life.raised(error)
            trace(path, error)
        else:
            culprit = None
            if isinstance(error, CollectiveTimeoutError) and path.watchdog is not None:
                error = path.watchdog.blame(error, name, seq)
                culprit = error.peer
            give_up(path, error, name, culprit)
        return error


class on_exchange(_Translating):
    """An exchange of the control plane for call `name` #`seq` (an agreement, say): a peer
    that failed or a timeout breaks the communicator, as a collective's failure does."""

    __slots__ = ("name", "path", "seq")

    def __init__(self, path: Path, name: str, seq: int):
        self.path, self.name, self.seq = path, name, seq

    def translate(self, exc: BaseException) -> BaseException:
        if not isinstance(exc, (PeerFailureError, CollectiveTimeoutError)):
            return exc
        path, name, seq, life, watchdog = self.path, self.name, self.seq, self.path.life, \
            self.path.watchdog
        if life.cause is None and watchdog is not None and isinstance(exc, PeerFailureError):
            # the status board may know better: a peer that left the exchange after a
            # failure published whom it blames before the control plane said it left
            watchdog.check()
        error = life.explain(exc, name, seq)
        if life.cause is None and isinstance(exc, CollectiveTimeoutError):
            # say so on the status board, blaming the rank that did not take part where the
            # control plane knows it: a late peer then fails at once, instead of completing
            # the exchange this rank left and waiting its own timeout in a collective nobody
            # else will run; where there is no board yet (the first call sets it up), the
            # control plane tells the peers
            missing = getattr(error, "peer", None)
            give_up(path, error, name, culprit=-1 if missing is None else missing, seq=seq)
            if watchdog is None and missing is not None:
                tell_peers(path, error)
        elif watchdog is not None:  # at close, tell the peers this rank failed (and why),
            watchdog.note_failure(error)  # not that it left without entering the call
        life.raised(error)
        trace(path, error)
        return error


def _first_failure(path: Path) -> GpuringError | None:
    """Across nodes, the failure that came first, where it is known: a rank's report to
    the job (naming the rank it blames, where it knows one), else a rank of this node
    that died or gave up (a failure one level raised may only be a peer's giving up
    because of it)."""
    notice = path.control.failure_notice()
    if notice is not None:
        return notice
    levels = path.levels
    return None if levels is None else levels.node_failure()


class on_transport(_Translating):
    """A collective on MPI or NCCL (flat): its error names the call (or the first failure
    the job knows of, on MPI), and the peers learn it (the other nodes from this rank's
    notice)."""

    __slots__ = ("mpi", "name", "path")

    def __init__(self, path: Path, name: str, mpi: bool):
        self.path, self.name, self.mpi = path, name, mpi

    def translate(self, exc: BaseException) -> BaseException:
        path, name = self.path, self.name
        error: BaseException = exc
        known = _first_failure(path) if self.mpi and isinstance(
            exc, (PeerFailureError, CollectiveTimeoutError)) else None
        if known is not None:
            error = path.life.explain(known, name, path.seq)
        elif isinstance(exc, GpuringError):  # which call, like the engine's errors
            error = path.life.explain(exc, name, path.seq)
        give_up(path, error, name)
        return error


class on_nodes(_Translating):
    """A call in two levels across nodes: a failure of either level breaks this
    communicator and both levels, and is told to the peers of all three (a mismatch of a
    level is found by every rank of that level: it only breaks them; `agreeing`: the
    agreement before the call, whose mismatch every rank finds before anything moved)."""

    __slots__ = ("agreeing", "name", "path")

    def __init__(self, path: Path, name: str, agreeing: bool = False):
        self.path, self.name, self.agreeing = path, name, agreeing

    def translate(self, exc: BaseException) -> BaseException:
        if self.agreeing and isinstance(exc, CollectiveMismatchError):
            return exc
        path, name, life = self.path, self.name, self.path.life
        error: BaseException = exc
        known = _first_failure(path) if isinstance(
            exc, (PeerFailureError, CommunicatorClosedError)) else None
        if known is not None:
            error = life.explain(known, name, path.seq)
        elif isinstance(exc, CommunicatorClosedError) and life.cause is not None:
            error = life.explain(life.cause, name, path.seq)
        elif isinstance(exc, GpuringError):
            error = life.explain(exc, name, path.seq)
        if not isinstance(error, CollectiveMismatchError):
            give_up(path, error, name)
        else:
            life.raised(error)
            trace(path, error)
        levels = path.levels
        if levels is not None:
            levels.abort(f"rank {path.rank}: {error!r}", job_peer(path, error))
        return error


class on_streams(_Translating):
    """A wait for an engine's streams (`Engine.synchronize`, whose error is already the
    root cause among the streams') by call `name`: its error as the call's, blamed on the
    rank that failed first, and this rank gives up (unless a failure from outside caused
    it, which is the error then)."""

    __slots__ = ("name", "path")
    always_anew = True

    def __init__(self, path: Path, name: str):
        self.path, self.name = path, name

    def translate(self, exc: BaseException) -> BaseException:
        path, name, life = self.path, self.name, self.path.life
        if life.cause is not None:  # the cause (a peer died, say) reads better
            error: BaseException = in_context(life.cause, name, path.seq, path.rank)
            life.raised(error)
            trace(path, error)
            return error
        collective, seq = path.last_collective, path.seq
        error = exc
        if isinstance(exc, FlagWaitTimeout):
            tag = exc.tag
            peer, what = tag if isinstance(tag, tuple) and len(tag) == 2 else (None, tag)
            error = CollectiveTimeoutError(
                f"collectives up to {collective} #{seq} did not complete on rank {path.rank}: "
                f"timed out after {path.config.timeout} s waiting for rank {peer} ({what}); "
                f"that rank is stalled, dead, or called a different collective",
                collective=collective, seq=seq, peer=peer)
            if path.watchdog is not None:
                error = path.watchdog.blame(error, collective, seq)
        elif isinstance(exc, FlagWaitAborted):
            error = PeerFailureError(f"collectives up to {collective} #{seq} aborted on rank "
                                     f"{path.rank}: {exc.reason}", collective=collective,
                                     seq=seq)
        if isinstance(error, GpuringError):
            error = in_context(error, name, seq, path.rank)
        culprit = (error.peer if isinstance(error, CollectiveTimeoutError)
                   and error.peer is not None else None)
        give_up(path, error, name, culprit)
        return error
