"""The one call path of a communicator: prepare a checked call once (`_prepare`: agree on
its signature across ranks, pick its route, plan it), then run it by its route; and what
happens on the path when something fails (the lifecycle's transitions, telling the peers,
releasing waits).
"""

from __future__ import annotations

import math
import threading
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _arrays, _capture
from . import _transport_routes as _routes
from ._call import Call, PreparedCall, Route, Signature, check_alike
from ._choices import Choices
from ._config import Config
from ._engine import Engine, Launch
from ._errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    GpuringError,
    PeerFailureError,
    RegistrationError,
)
from ._hierarchy import Layout, Levels
from ._lifecycle import Lifecycle, State, in_context, weakly
from ._prepare import prepare
from ._registry import Registry
from ._timeline import Timeline
from ._watchdog import Watchdog
from .devices import device_class
from .devices.base import FlagWaitAborted, FlagWaitTimeout, Memory
from .devices.host import SHM_PREFIX, HostDevice
from .rendezvous.base import ControlPlane

if TYPE_CHECKING:
    from .transports.mpi import MpiCollectives
    from .transports.nccl import NcclCollectives

__all__ = ["CallPath"]

#: collectives whose result GPURING_VERIFY compares across ranks (the same on every rank)
_VERIFIED = ("all_reduce", "all_gather", "broadcast")


class CallPath:
    """A communicator's calls and their shared state: the lifecycle, the collectives started
    (`seq`), the prepared calls, the engines, the watchdog. The communicator's verbs hand
    their checked calls to `run`; `fail` may be called from any thread."""

    def __init__(self, control: ControlPlane, config: Config,
                 make_communicator: Callable[[ControlPlane], Any] | None = None):
        """`make_communicator(control)`: a communicator over a sub-group's control plane (for
        the levels of collectives across nodes)."""
        self.control = control
        self.config = config
        self.rank, self.size = control.rank, control.size
        self.life = Lifecycle(control.rank)
        self.engines: dict[str, Engine] = {}
        self.prepared: dict[tuple[Any, ...], PreparedCall] = {}
        #: counts the times `prepared` was forgotten (a call's own `prepared` is of one)
        self.generation = 0
        self.agreed: set[Signature] = set()  #: the signatures the ranks agreed on
        self.registry = Registry()  #: registered memory (`register`)
        self.choices = Choices(config, control.size)  #: what calls that ask for nothing run
        self.seq = 0  #: collectives this rank started
        self.last_collective = "collective"  #: the name of the last one
        self.last_schedule = ""  #: what the last one ran (`PreparedCall.schedule`)
        self.lock = threading.RLock()
        self.watchdog: Watchdog | None = None  #: made on the first collective across ranks
        self.watchdog_parts: list[Any] = []  #: the watchdog and its board's memory, to close
        self.timeline: Timeline | None = None  #: recording timeline; checked once per call
        self.mpi: MpiCollectives | None = None  # made on first use
        self.make_communicator = make_communicator  #: (for the levels across nodes)
        #: where the ranks run, where collectives across nodes go in two levels (else None)
        self.layout = None if control.single_node else Layout.of(control.nodes, control.rank)
        self.levels: Levels | None = None  #: those two levels' communicators, made on first use
        self.nccl: NcclCollectives | None = None  #: CuPy collectives on NCCL, made on first use
        #: per kind of device that may lack it: whether the ranks map each other's memory
        #: (decided with the first collective of that kind; else the collectives run on NCCL)
        self.mappable: dict[str, bool] = {}

    def run(self, call: Call) -> Any:
        """Run a checked call: prepare it once per key, then run it by its route. A call
        that comes again (`LastCalls`), or a persistent collective's, holds its prepared
        call: it runs as it is while the prepared calls of this generation stand (forgetting
        them happens on every rank at once, so every rank prepares it anew alike)."""
        if self.life.state is not State.OPEN:
            self.life.check(call.collective, self.seq + 1)
        if call.x is None:
            _capture.refuse_barrier()
        with self.lock:
            prepared = call.prepared
            if prepared is None or call.generation != self.generation:
                prepared = self._prepared(call)
            launch = prepared.launch
            if launch is not None and (prepared.captured is not launch or
                                       self.timeline is not None) \
                    and launch.engine.device.capturing():
                captured = _capture.recorded(prepared, call.collective,
                                             self.timeline is not None,
                                             call.x is not None and call.x.size == 0)
                self.seq += 1
                if captured is None:  # an empty collective: nothing moves, nothing to record
                    self.last_schedule = "nothing"
                    return call.out
                self.last_schedule = "kernels" if captured is not launch \
                    else prepared.schedule
                return self._run_engine(prepared, call, captured)
            if prepared.route is Route.ENGINE:  # the common route, decided first
                self.seq += 1
                self.last_schedule = prepared.schedule
                return self._run_engine(prepared, call)
            _capture.refuse_route(prepared, call.collective, call.x)
            self.seq += 1
            self.last_schedule = prepared.schedule
            return _ROUTES[prepared.route](self, prepared, call)

    def prepare(self, call: Call) -> PreparedCall:
        """Prepare `call` now, as its first run would (the ranks agree on it unless they
        already did, so every rank calls this alike, as a collective), without running it,
        and keep it on the call: what a persistent collective holds."""
        if self.life.state is not State.OPEN:
            self.life.check(call.collective, self.seq + 1)
        if call.x is None:
            _capture.refuse_barrier()
        with self.lock:
            return self._prepared(call)

    def _prepared(self, call: Call) -> PreparedCall:
        """The prepared call of `call`'s key (prepared now if there is none), kept on the
        call with this generation (a call that comes again, `LastCalls`, finds it there).
        Under the lock."""
        key = call.known_key
        if key is None:
            if self.registry and call.x is not None:
                call.placement = self.registry.placement(call.collective, call.x, call.out,
                                                         self.rank)
            key = call.key()
        prepared = self.prepared.get(key)
        if prepared is None:
            if _arrays.capturing(call.x):  # (a barrier was refused before)
                raise _capture.first_call_refused(call.collective)
            prepared = prepare(self, call)
            if len(self.prepared) > 1024:  # bounded: forgetting costs a new preparation
                self._forget_prepared()
            self.prepared[key] = prepared
        if prepared is not call.prepared:
            call.prepared, call.bound = prepared, None  # (operands of another launch)
        call.generation = self.generation
        return prepared

    def _forget_prepared(self) -> None:
        """Drop every prepared call, and those calls keep (a new generation)."""
        self.prepared.clear()
        self.generation += 1

    def _run_alone(self, prepared: PreparedCall, call: Call) -> Any:
        x, out = call.x, call.out
        if x is None:
            return None
        if call.collective in ("all_gather", "gather"):
            out[0] = x
        elif call.collective == "scatter":
            out[...] = x[0]
        elif out is not x:
            out[...] = x.reshape(out.shape)
        return out

    def nccl_failed(self, error: GpuringError) -> None:
        """NCCL's watcher found a failure (after this rank's calls returned): the peers must
        know too (those of other nodes wait in NCCL until told)."""
        self.tell_peers(error)
        self.fail(error)

    def _run_engine(self, prepared: PreparedCall, call: Call,
                    launch: Launch | None = None) -> Any:
        """Run the prepared call's launch, or `launch` (what a capture records of it)."""
        own = launch is None
        launch = prepared.launch if launch is None else launch
        assert launch is not None
        engine = launch.engine
        device = engine.device
        name, x, out = call.collective, call.x, call.out
        bound = call.bound if own else None  # (the call's own launch's operands)
        in_mem = out_mem = None
        if bound is None and x is not None and x.size:
            try:
                in_mem = device.wrap(x)
                out_mem = in_mem if out is x else device.wrap(out) if out is not None else None
                if launch.fused:
                    bound = engine.bind(launch, in_mem, out_mem)
                    if own:
                        call.bound = bound
            except BaseException as exc:  # this rank's seq moved on: the peers must know
                self.give_up(exc, name)
                raise
        timeline = self.timeline
        if timeline is None:
            self._execute(prepared, launch, name, in_mem, out_mem, bound)
        else:
            timeline.record(name, self.seq, x, call.op, launch.per_round(), lambda one: (
                self._execute(prepared, one, name, in_mem, out_mem, bound)))
        if x is None and not device.blocking:  # a barrier holds the host too
            try:
                engine.synchronize()
            except BaseException as exc:
                self.give_up(exc, name)
                raise
            self._completed(self.seq, engine)
        elif self.config.verify and name in _VERIFIED:
            self._verify(name, out)
        return out

    def _execute(self, prepared: PreparedCall, launch: Launch, name: str,
                 in_mem: Memory | None, out_mem: Memory | None, bound: Any = None) -> None:
        """Announce the collective on the status board, run `launch` (the prepared call's, or
        one round of it; a fused one's operands `bound`), and turn any failure into this
        call's error (the communicator is unusable afterwards)."""
        engine = launch.engine
        watchdog = self.watchdog
        assert watchdog is not None
        seq = self.seq
        self.last_collective = name
        try:
            if self.life.cause is not None:
                raise self.life.cause
            watchdog.enter(seq, name, prepared.text, prepared.digest)
            finished = engine.run_fused(launch, bound, name, seq) if bound is not None \
                else engine.run(launch, in_mem, out_mem, name, seq)
        except BaseException as exc:  # whatever it is, the round counters are now unusable
            error: BaseException = exc
            if self.life.cause is not None:
                error = self.life.explain(self.life.cause, name, seq)
                self.life.raised(error)
            elif isinstance(error, CollectiveMismatchError):
                self.life.raised(error)  # the status board already told the peers
            else:
                culprit = None
                if isinstance(error, CollectiveTimeoutError):
                    error = watchdog.blame(error, name, seq)
                    culprit = error.peer
                self.give_up(error, name, culprit)
            if error is exc:
                raise
            raise error from None
        finally:
            watchdog.leave()
        if engine.device.blocking:  # its work (and all before) completed without error
            self._completed(seq, engine)
        if finished is not None:
            watchdog.track(finished, name, seq, engine.device.check)

    def _completed(self, seq: int, engine: Engine) -> None:
        """`engine`'s work up to collective `seq` completed without error: so did all of
        this rank's, unless another engine may still be running some (a GPU's)."""
        for other in self.engines.values():
            if other is not engine and not other.device.blocking:
                return
        self.life.completed(seq)

    # -- agreement, engines, the watchdog ------------------------------------------------
    def _agree(self, signature: Signature, *, remember: bool = True) -> None:
        """Check that every rank runs the same collective; cached per signature, unless not
        to `remember` it (a call refused once agreed: each attempt agrees anew, so a rank
        that tries it again while its peers call something else meets a mismatch)."""
        if signature in self.agreed:
            return
        name = signature.collective
        signatures = self.exchange("a collective", signature, name, _described(signature))
        check_alike(signatures, name, self.rank)
        if len(self.agreed) >= 4096:  # bounded: forgetting only costs a fresh agreement
            self.agreed.clear()  # on every rank at once (the same calls agreed on);
            self._forget_prepared()  # a prepared call is only reused while still agreed
        if remember:
            self.agreed.add(signature)

    def exchange(self, what: str, obj: Any, name: str, described: str) -> list[Any]:
        """Every rank's `obj` for the step `what` of the call `name` (`described` in words),
        bounded by the timeout; a failure breaks the communicator, as a collective's does."""
        seq, life, watchdog = self.seq + 1, self.life, self.watchdog
        if watchdog is not None:  # a peer that closes meanwhile fails this exchange at once
            watchdog.expect(seq, name, described)
        try:
            return self.control.exchange(what, obj, self.config.timeout)
        except (PeerFailureError, CollectiveTimeoutError) as exc:
            if life.cause is None and watchdog is not None and isinstance(exc, PeerFailureError):
                # the status board may know better: a peer that left the exchange after a
                # failure published whom it blames before the control plane said it left
                watchdog.check()
            error = life.explain(exc, name, seq)
            if life.cause is None and isinstance(exc, CollectiveTimeoutError):
                # say so on the status board (which rank is missing is unknown here): a late
                # peer then fails at once, instead of completing the exchange this rank left
                # and waiting its own timeout in a collective nobody else will run
                self.give_up(error, name, culprit=-1, seq=seq)
            elif watchdog is not None:  # at close, tell the peers this rank failed (and why),
                watchdog.note_failure(error)  # not that it left without entering the call
            life.raised(error)
            raise error from None
        finally:
            if watchdog is not None:
                watchdog.expect(None)

    def _capacity(self, kind: str) -> int:
        """The size of a buffer region of the engine for `kind` (the agreed setting, or the
        device's default, until the engine exists)."""
        engine = self.engines.get(kind)
        return engine.capacity if engine is not None else (
            self.config.buffer_bytes or device_class(kind).default_buffer_bytes)

    def register(self, kind: str, shape: tuple[int, ...], dtype: Any) -> Any:
        """An array of `kind` ("cpu", "cuda"), `shape` and `dtype` (a NumPy dtype) in
        registered memory, made by every rank at once (`Communicator.empty`); None where the
        ranks have no peer to map it (a world of one, NumPy collectives through MPI)."""
        name = "empty"
        with self.lock:
            if self.life.state is not State.OPEN:
                self.life.check(name, self.seq + 1)
            if self.size == 1 or (kind == "cpu" and _routes.via_mpi(self)) or (
                    kind != "cpu" and (not self.control.single_node
                                       or self.config.transport == "nccl")):
                return None
            self._ensure_watchdog()
            self._agree(Signature(name, kind, shape, dtype.name, None, 0), remember=False)
            if _routes.asks_reach(self, kind):
                self.mappable[kind] = _routes.peers_reachable(self, kind, name)
            if not self.mappable.get(kind, True):
                return None
            try:
                engine = self._engine(kind, self._capacity(kind))
                nbytes = math.prod(shape) * dtype.itemsize
                mems = engine.register(self.control, nbytes)
                array = engine.device.array(mems[self.rank], shape, dtype)
            except RegistrationError:  # every rank raises it, nothing was mapped
                raise
            except BaseException as exc:  # after agreement the peers go on: tell them
                self.give_up(exc, name)
                raise
            self.registry.add(kind, mems, _arrays.address(array), nbytes)
            return array

    def _engine(self, kind: str, capacity: int) -> Engine:
        engine = self.engines.get(kind)
        if engine is None:
            device = device_class(kind).for_job(self.control, self.config.timeout)
            try:
                engine = Engine(device, self.control, capacity_bytes=capacity,
                                timeout=self.config.timeout,
                                fused_limit=self.config.fused_bytes)
            except BaseException:  # peers may have mapped what this rank exported by now
                device.close(peers_may_read=True)
                raise
            self.engines[kind] = engine
        return engine

    def _ensure_watchdog(self) -> None:
        """Create the status board and watchdog (collectively, on first use)."""
        if self.watchdog is None:
            host = HostDevice(name_prefix=f"{SHM_PREFIX}{self.control.job_id}-"
                                          f"r{self.rank}-status-", timeout=self.config.timeout,
                              for_collectives=False)
            try:
                self.watchdog = Watchdog(self.control, host, timeout=self.config.timeout,
                                      stall_warning_s=self.config.stall_warning_s,
                                      on_failure=weakly(self.fail))
            except BaseException:
                host.close()
                raise
            self.watchdog_parts += [self.watchdog, host]

    def _verify(self, name: str, out: Any) -> None:
        """GPURING_VERIFY: compare a checksum of the result across ranks."""
        checksum = zlib.crc32(_arrays.to_host(out).tobytes())
        sums = self.control.exchange(f"{name} (result check)", checksum, self.config.timeout)
        if len(set(sums)) > 1:
            error = GpuringError(
                f"{name} #{self.seq}: results differ across ranks (checksums "
                + ", ".join(f"rank {r} {c:08x}" for r, c in enumerate(sums)) + ")")
            self.life.raised(error)
            raise error

    # -- failures -----------------------------------------------------------------------
    def on_peer_failure(self, error: PeerFailureError) -> None:
        self.fail(error)

    def job_peer(self, error: BaseException) -> int | None:
        """The rank of the job `error` blames, where it names one."""
        return self.control.in_job(getattr(error, "peer", None), getattr(error, "job_peer", None))

    def tell_peers(self, error: BaseException) -> None:
        """Report to the peers that this rank gave up because of `error` (best effort)."""
        self.control.report_failure(f"rank {self.rank}: {error!r}", getattr(error, "peer", None),
                                    isinstance(error, CollectiveTimeoutError),
                                    getattr(error, "job_peer", None))

    def fail(self, error: GpuringError, *, by_user: bool = False) -> None:
        """Record a failure that came from outside a call (a peer, the watchdog, abort()) and
        unblock every wait of this rank. Any thread."""
        watchdog = self.watchdog
        # a failure that reached no collective of this rank (all had completed) lost nothing
        in_flight = None if watchdog is None else watchdog.in_flight()
        if not self.life.fail(error, in_flight=in_flight, by_user=by_user):
            return
        if watchdog is not None:
            watchdog.note_failure(error)
        for engine in list(self.engines.values()):
            engine.device.abort(str(error))
        if self.levels is not None:
            self.levels.abort(str(error), self.job_peer(error))
        if self.nccl is not None:
            self.nccl.abort(str(error))
        self.control.interrupt(str(error))

    def give_up(self, error: BaseException, name: str, culprit: int | None = None,
                 seq: int | None = None) -> None:
        """A call of this rank cannot go on: the communicator is broken; tell the peers."""
        self.life.raised(error)
        if self.watchdog is not None:
            where = f"{name} #{self.seq if seq is None else seq}"
            self.watchdog.give_up(f"{where}: {error!r}", timed_out_on=culprit, because=error)
        if culprit is None:
            self.tell_peers(error)
        for engine in list(self.engines.values()):
            engine.device.abort(f"rank {self.rank} gave up: {error!r}")
        if self.nccl is not None:
            self.nccl.abort(f"rank {self.rank} gave up: {error!r}")

    def wait_engines(self, name: str) -> None:
        if self.nccl is not None:
            try:
                self.nccl.synchronize()
            except GpuringError as exc:
                failed = in_context(self.life.cause or exc, name, self.seq, self.rank)
                self.life.raised(failed)
                raise failed from None
        for engine in list(self.engines.values()):
            try:
                engine.synchronize()
            except BaseException as exc:
                cause = self.life.cause
                if cause is not None:  # the cause (a peer died, say) reads better
                    error: BaseException = in_context(cause, name, self.seq, self.rank)
                else:
                    error = self._streams_failure(exc, name)
                    culprit = (error.peer if isinstance(error, CollectiveTimeoutError)
                               and error.peer is not None else None)
                    self.give_up(error, name, culprit)
                self.life.raised(error)
                raise error from None

    def _streams_failure(self, cause: BaseException, name: str) -> BaseException:
        """The error of a failed `engine.synchronize()` (already the root cause among the
        streams' errors) as a gpuring error naming the call."""
        collective, seq = self.last_collective, self.seq
        error: BaseException = cause
        if isinstance(cause, FlagWaitTimeout):
            tag = cause.tag
            peer, what = tag if isinstance(tag, tuple) and len(tag) == 2 else (None, tag)
            error = CollectiveTimeoutError(
                f"collectives up to {collective} #{seq} did not complete on rank {self.rank}: "
                f"timed out after {self.config.timeout} s waiting for rank {peer} ({what}); "
                f"that rank is stalled, dead, or called a different collective",
                collective=collective, seq=seq, peer=peer)
            if self.watchdog is not None:
                error = self.watchdog.blame(error, collective, seq)
        elif isinstance(cause, FlagWaitAborted):
            error = PeerFailureError(f"collectives up to {collective} #{seq} aborted on rank "
                                     f"{self.rank}: {cause.reason}", collective=collective,
                                     seq=seq)
        if isinstance(error, GpuringError):
            return in_context(error, name, seq, self.rank)
        return error


def _described(signature: Signature) -> str:
    """What a signature asks for, in words of the call."""
    if signature.device is None and not signature.shape:
        return signature.collective + "()"
    return (f"{signature.collective}(shape={signature.shape}, dtype={signature.dtype}, "
            f"op={signature.op}, root={signature.root}, device={signature.device})")


#: who runs a prepared call, by its route
_ROUTES: dict[Route, Callable[[CallPath, PreparedCall, Call], Any]] = {
    Route.ALONE: CallPath._run_alone,
    Route.MPI: _routes.run_via_mpi,
    Route.ENGINE: CallPath._run_engine,
    Route.NODES: _routes.run_nodes,
    Route.NCCL: _routes.run_via_nccl,
}
