"""The one call path of a communicator: prepare a checked call once (`_prepare`: agree on
its signature across ranks, pick its route, plan it), then run it by its route. What happens
when something fails on the way is `_failures`'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _arrays, _capture, _failures, _recorder
from . import _transport_routes as _routes
from ._call import Call, PreparedCall, Route, Signature, check_alike
from ._choices import Choices
from ._config import Config
from ._engine import Engine, Launch
from ._errors import (
    CollectiveMismatchError,
    CommunicatorClosedError,
    GpuringError,
    PeerFailureError,
    RegistrationError,
)
from ._failures import Lifecycle, Outcome, State, Unraised, in_context, weakly
from ._hierarchy import Layout, Levels
from ._prepare import prepare
from ._recorder import BEFORE, END, FAILED, WHAT, Ring, Standing, clock, describe
from ._registry import Registry
from ._route import Facts
from ._timeline import Timeline
from ._watchdog import Watchdog
from .devices import device_class
from .devices.base import Memory
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
        #: devices besides the engines' that a failure aborts (the GPU of CuPy messages)
        self.devices: list[Any] = []
        #: the one prepared-call cache, by `Call.key()` (a call that comes again holds its
        #: entry: `Call.prepared`). Preparing every call anew cost 2,972 Python opcodes and
        #: 204 us per call instead of 878 and 10.2 (1 KiB CuPy all_reduce of 2 ranks on the
        #: CUDA simulator, best runs: `bench/host_cost.py --without prepared`)
        self.prepared: dict[tuple[Any, ...], PreparedCall] = {}
        #: counts the times `prepared` was forgotten (a call's own `prepared` is of one)
        self.generation = 0
        #: the signatures the ranks agreed on. Not for speed (agreement runs only while
        #: preparing): ranks whose keys differ where the signature does not (one calls in
        #: place, one not) prepare at different calls, and must agree on the signature once,
        #: alike, or one would wait in an exchange its peers never enter
        self.agreed: set[Signature] = set()
        self.registry = Registry()  #: registered memory (`register`)
        self.choices = Choices(config, control.size)  #: what calls that ask for nothing run
        self.seq = 0  #: collectives this rank started
        self.last_collective = "collective"  #: the name of the last one
        self._last_schedule = ""  #: what the last one ran (`PreparedCall.schedule`)
        self.lock = threading.RLock()
        self.watchdog: Watchdog | None = None  #: made on the first collective across ranks
        self.watchdog_parts: list[Any] = []  #: the watchdog and its board's memory, to close
        self._timeline: Timeline | None = None  #: the recording timeline; checked per call
        self.mpi: MpiCollectives | None = None  # made on first use
        self.make_communicator = make_communicator  #: (for the levels across nodes)
        #: where the ranks run, where collectives across nodes go in two levels (else None)
        self.layout = None if control.single_node else Layout.of(control.nodes, control.rank)
        #: what the routes of this communicator's calls depend on (`_route.choose`)
        self.facts = Facts(control.size, control.single_node, config.transport,
                           config.deterministic, control.over_mpi,
                           self.layout is not None and make_communicator is not None)
        self.levels: Levels | None = None  #: those two levels' communicators, made on first use
        self.nccl: NcclCollectives | None = None  #: CuPy collectives on NCCL, made on first use
        #: per kind of device that may lack it: whether the ranks map each other's memory
        #: (decided with the first collective of that kind; else the collectives run on NCCL)
        self.mappable: dict[str, bool] = {}
        #: the flight recorder's ring (GPURING_TRACE_ENTRIES; None: off)
        self.ring = Ring(config.trace_entries) if config.trace_entries > 0 else None
        if self.ring is not None:
            _recorder.register(self)

    def run(self, call: Call) -> Any:
        """Run a checked call: prepare it once per key, then run it by its route. A call
        that comes again (`LastCalls`), or a persistent collective's, holds its prepared
        call: it runs as it is while the prepared calls of this generation stand (forgetting
        them happens on every rank at once, so every rank prepares it anew alike). The
        flight recorder keeps it: an entry of the ring, its end time, whether it failed."""
        if self.life.state is not State.OPEN:
            self._refuse(call)
        if call.x is None:
            _capture.refuse_barrier()
        with self.lock:
            prepared = call.prepared
            if prepared is None or call.generation != self.generation:
                prepared = self._prepared(call)
            ring, entry = self.ring, None
            if ring is not None:  # (the prepared call holds the description)
                entry = [self.seq, prepared, clock(), 0.0, ""]
                ring.append(entry)
            try:  # (costs nothing where nothing fails)
                launch = prepared.launch
                if launch is not None and (prepared.captured is not launch or
                                           self._timeline is not None) \
                        and launch.engine.device.capturing():
                    captured = _capture.recorded(prepared, call.collective,
                                                 self._timeline is not None,
                                                 call.x is not None and call.x.size == 0)
                    self.seq += 1
                    if captured is None:  # an empty collective: nothing moves or is recorded
                        self._last_schedule = "nothing"
                        return call.out
                    self._last_schedule = "kernels" if captured is not launch \
                        else prepared.schedule
                    return self._run_engine(prepared, call, captured)
                if prepared.route is Route.ENGINE:  # the common route, decided first
                    self.seq += 1
                    self._last_schedule = prepared.schedule
                    return self._run_engine(prepared, call)
                _capture.refuse_route(prepared, call.collective, call.x)
                self.seq += 1
                self._last_schedule = prepared.schedule
                return _ROUTES[prepared.route](self, prepared, call)
            except BaseException:
                if entry is not None:  # (and where this one was called from, exactly)
                    entry[WHAT] = describe(call.key(), call.out, prepared.schedule)
                    entry[FAILED] = "failed"
                raise
            finally:
                if entry is not None:
                    entry[END] = clock()

    def _refuse(self, call: Call) -> None:
        """Raise the error of a call this communicator may no longer run (`Lifecycle.check`),
        after recording it as failed (once per sequence number: the call this rank would
        have run next, which a dump shows)."""
        ring, seq = self.ring, self.seq + 1
        if ring is None or self.life.state is State.CLOSED:
            self.life.check(call.collective, seq)
            return
        if ring and ring[-1][BEFORE] == self.seq:  # recorded (and written) already
            self.life.check(call.collective, seq)
            return
        ring.append([self.seq, describe(call.key(), call.out, ""), clock(), 0.0, "refused"])
        try:
            self.life.check(call.collective, seq)
        except GpuringError as exc:
            _failures.trace(self, exc)
            raise

    def start(self, call: Call) -> Any:
        """Run a persistent collective's call (`PersistentCollective.start`): `run` of a call
        that holds its prepared call, where that runs on an engine as it is (no timeline, no
        flight recorder, no verification, nothing else to record under a capture) without
        `run`'s look-ups;
        once its operands are bound (a fused launch's, bound on its first run), only the
        status board, the launch and the completion bookkeeping remain."""
        prepared = call.prepared
        if prepared is None:
            return self.run(call)
        launch = prepared.launch
        if launch is None or call.generation != self.generation or call.x is None \
                or self._timeline is not None or self.ring is not None or self.config.verify or (
                    prepared.captured is not launch and launch.engine.device.capturing()):
            return self.run(call)
        if self.life.state is not State.OPEN:
            self.life.check(call.collective, self.seq + 1)
        with self.lock:
            if call.generation != self.generation:  # forgotten meanwhile, by another thread
                return self.run(call)
            self.seq += 1
            self._last_schedule = prepared.schedule
            bound = call.bound
            if bound is not None:
                self._execute(prepared, launch, call.collective, None, None, bound)
                return call.out
            return self._run_engine(prepared, call)

    @property
    def last_schedule(self) -> str:
        """What the last collective ran (`PreparedCall.schedule`; "" before the first)."""
        return self._last_schedule

    @property
    def timeline(self) -> Timeline | None:
        """The timeline recording (`start_timeline`), else None."""
        return self._timeline

    def held(self) -> tuple[dict[str, Engine], list[Any], ControlPlane, Outcome]:
        """What a communicator's finalizer releases (`_communicator._release`): the engines,
        the watchdog's parts, the control plane, and the lifecycle's outcome."""
        return self.engines, self.watchdog_parts, self.control, self.life.outcome

    def current_watchdog(self) -> Watchdog | None:
        """The watchdog, once the first collective across ranks made it."""
        return self.watchdog

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
            prepared = self._prepare_recorded(call)
            if len(self.prepared) > 1024:  # bounded: forgetting costs a new preparation
                self._forget_prepared()
            self.prepared[key] = prepared
        if prepared is not call.prepared:  # (operands of another launch, maybe another
            call.prepared, call.bound = prepared, None  # schedule)
        call.generation = self.generation
        return prepared

    def _prepare_recorded(self, call: Call) -> PreparedCall:
        """`prepare(call)`, with the call's description for the flight recorder
        (`PreparedCall.what`: made now, recorder on or off, so that a ring turned on later
        has it). Where the recorder is on, the call shows meanwhile as collective `seq + 1`
        (its ranks agree on it: a rank that stalls there shows where), then as it was (the
        run that follows records the call), or as failed where preparing it failed."""
        ring = self.ring
        what = describe(call.key(), call.out, "")
        if ring is None:
            prepared = prepare(self, call)
        else:
            dropped = ring[0] if len(ring) == ring.capacity else None
            entry = [self.seq, what, clock(), 0.0, ""]
            ring.append(entry)
            try:
                prepared = prepare(self, call)
            except BaseException:
                entry[FAILED] = "failed"
                raise
            if ring and ring[-1] is entry:  # (under the lock: nothing was appended since)
                ring.pop()
                if dropped is not None:
                    ring.appendleft(dropped)
        return dataclasses.replace(prepared, what=(*what[:2], prepared.schedule, *what[3:]))

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
        _failures.tell_peers(self, error)
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
            try:  # (a try costs nothing where nothing fails: this runs at every host call)
                in_mem = device.wrap(x)
                out_mem = in_mem if out is x else device.wrap(out) if out is not None else None
                if launch.fused:
                    bound = engine.bind(launch, in_mem, out_mem)
                    if own:
                        call.bound = bound
            except BaseException as exc:  # this rank's seq moved on
                _failures.give_up(self, exc, name)
                raise
        timeline = self._timeline
        if timeline is None:
            self._execute(prepared, launch, name, in_mem, out_mem, bound)
        else:
            timeline.record(name, self.seq, x, call.op, launch.per_round(), lambda one: (
                self._execute(prepared, one, name, in_mem, out_mem, bound)))
        if x is None and not device.blocking:  # a barrier holds the host too
            with _failures.giving_up(self, name):
                engine.synchronize()
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
        try:  # (not a `with`: a try costs nothing where nothing fails, at every call)
            if self.life.cause is not None:
                raise self.life.cause
            watchdog.enter(seq, name, prepared.text, prepared.digest)
            finished = engine.run_fused(launch, bound, name, seq) if bound is not None \
                else engine.run(launch, in_mem, out_mem, name, seq)
        except BaseException as exc:
            error = _failures.on_run(self, name, seq).translate(exc)
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
    def agree(self, signature: Signature, *, remember: bool = True) -> None:
        """Check that every rank runs the same collective; cached per signature, unless not
        to `remember` it (a call refused once agreed: each attempt agrees anew, so a rank
        that tries it again while its peers call something else meets a mismatch)."""
        if signature in self.agreed:
            return
        name = signature.collective
        signatures = self.exchange("a collective", signature, name, _described(signature))
        try:
            check_alike(signatures, name, self.rank, self.seq + 1)
        except CollectiveMismatchError as exc:  # every rank raises it; the communicator
            self._entry_failed(self.seq + 1)  # goes on
            _failures.trace(self, exc)
            raise
        if len(self.agreed) >= 4096:  # bounded: forgetting only costs a fresh agreement
            self.agreed.clear()  # on every rank at once (the same calls agreed on);
            self._forget_prepared()  # a prepared call is only reused while still agreed
        if remember:
            self.agreed.add(signature)

    def exchange(self, what: str, obj: Any, name: str, described: str) -> list[Any]:
        """Every rank's `obj` for the step `what` of the call `name` (`described` in words),
        bounded by the timeout; a failure breaks the communicator, as a collective's does."""
        seq, watchdog = self.seq + 1, self.watchdog
        if watchdog is not None:  # a peer that closes meanwhile fails this exchange at once
            watchdog.expect(seq, name, described)
        try:
            with _failures.on_exchange(self, name, seq):
                return self.control.exchange(what, obj, self.config.timeout)
        finally:
            if watchdog is not None:
                watchdog.expect(None)

    def capacity(self, kind: str) -> int:
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
            self.ensure_watchdog(name)
            self.agree(Signature(name, kind, shape, dtype.name, None, 0), remember=False)
            if _routes.asks_reach(self, kind):
                self.mappable[kind] = _routes.peers_reachable(self, kind, name)
            if not self.mappable.get(kind, True):
                return None
            # after agreement the peers go on: tell them (a RegistrationError every rank
            # raises, and nothing was mapped)
            with _failures.giving_up(self, name, passes=(RegistrationError,)):
                engine = self.engine(kind, self.capacity(kind))
                nbytes = math.prod(shape) * dtype.itemsize
                mems = engine.register(self.control, nbytes)
                array = engine.device.array(mems[self.rank], shape, dtype)
            self.registry.add(kind, mems, _arrays.address(array), nbytes)
            return array

    def engine(self, kind: str, capacity: int) -> Engine:
        engine = self.engines.get(kind)
        if engine is None:
            device = device_class(kind).for_job(self.control, self.config.timeout)
            with contextlib.ExitStack() as undo:  # if it fails: peers may have mapped what
                undo.callback(device.close, peers_may_read=True)  # this rank exported by now
                engine = Engine(device, self.control, capacity_bytes=capacity,
                                timeout=self.config.timeout,
                                fused_limit=self.config.fused_bytes)
                undo.pop_all()
            self.engines[kind] = engine
        return engine

    def ensure_watchdog(self, name: str = "a collective") -> None:
        """Create the status board and watchdog (collectively, on first use: by the call
        `name`, whose error a failure to set them up is, as its agreement's would be)."""
        if self.watchdog is None:
            host = HostDevice(name_prefix=f"{SHM_PREFIX}{self.control.job_id}-"
                                          f"r{self.rank}-status-", timeout=self.config.timeout,
                              for_collectives=False)
            with contextlib.ExitStack() as undo, \
                    _failures.on_exchange(self, name, self.seq + 1):
                undo.callback(host.close)
                self.watchdog = Watchdog(self.control, host, timeout=self.config.timeout,
                                         stall_warning_s=self.config.stall_warning_s,
                                         on_failure=weakly(self.fail))
                undo.pop_all()
            self.watchdog_parts += [self.watchdog, host]
            self.life.on_completed = self.watchdog.completed

    def _verify(self, name: str, out: Any) -> None:
        """GPURING_VERIFY: compare a checksum of the result across ranks."""
        checksum = zlib.crc32(_arrays.to_host(out).tobytes())
        sums = self.control.exchange(f"{name} (result check)", checksum, self.config.timeout)
        if len(set(sums)) > 1:
            error = GpuringError(
                f"{name} #{self.seq}: results differ across ranks (checksums "
                + ", ".join(f"rank {r} {c:08x}" for r, c in enumerate(sums)) + ")")
            self.life.raised(error)
            _failures.trace(self, error)
            raise error

    # -- what the communicator asks of its path --------------------------------------------
    @property
    def closed(self) -> bool:
        return self.life.state is State.CLOSED

    @property
    def state(self) -> str:
        """The lifecycle's state, in a word ("open", "failed", "broken", "closed")."""
        return self.life.state.value

    def check(self, name: str) -> None:
        """Raise if call `name` (the next collective) may not run (`Lifecycle.check`)."""
        self.life.check(name, self.seq + 1)

    def synchronize(self, name: str, also: Callable[[], None]) -> None:
        """Wait for every collective this rank started (`name`: the call that waits), then
        `also()` (the messages' channels); raise the first failure."""
        seq = self.seq
        self.life.check(name, seq)
        self.wait_engines(name)
        _routes.sync_levels(self, name)
        also()
        self.life.completed(seq)

    def abort(self, reason: str, job_peer: int | None, first: Callable[[], None]) -> None:
        """`Communicator.abort` (`job_peer`: the rank of the job it is because of, where
        known): `first()` (the messages' channels abort), the levels across nodes abort, the
        status board and the control plane tell the peers, and this rank's waits end
        (`_failures.fail`)."""
        self.life.by_user = True  # before anything a failure arriving meanwhile could race
        first()
        if self.levels is not None:
            self.levels.abort(reason, job_peer)
        error = CommunicatorClosedError(f"communicator aborted on rank {self.rank}: {reason}")
        if self.watchdog is not None:
            self.watchdog.give_up(reason, job_peer=job_peer)
        self.control.report_failure(f"rank {self.rank} aborted: {reason}", job_peer=job_peer)
        self.fail(error, by_user=True)

    def close(self, unraised: BaseException | None) -> BaseException | None:
        """Close the levels across nodes, wait for the engines (where still open) and close
        NCCL's collectives; the first failure no call raised yet (after `unraised`, the
        channels'), or None. The engines themselves go with the communicator's finalizer."""
        if self.levels is not None:
            unraised = self.levels.close() or unraised
        kept = Unraised(unraised)
        if self.life.state is State.OPEN:
            with kept.step(latest=True):  # (its error already says it comes from close)
                self.wait_engines("close")
        else:
            kept.error = self.life.unraised(self.seq) or kept.error
        if self.nccl is not None:
            with kept.step():
                self.nccl.close()
        self.life.close()
        return kept.error

    def default_chunk_bytes(self, kind: str) -> int:
        """`Communicator.chunk_bytes_for`: the setting, else the engine's default (the
        device's for this job), else the device's default."""
        if self.config.chunk_bytes:
            return self.config.chunk_bytes
        engine = self.engines.get(kind)
        return engine.default_chunk_bytes if engine is not None else \
            device_class(kind).default_chunk_bytes

    def device_operations(self) -> int:
        """Driver calls the engines' devices made so far (`Communicator.device_operations`)."""
        return sum(engine.device.operations for engine in self.engines.values()) + \
            sum(device.operations for device in self.devices)

    def start_timeline(self, filename: str) -> None:
        """Record every collective from now on (every rank calls it: a common time origin)."""
        if self._timeline is not None:
            raise GpuringError("a timeline is already recording; call stop_timeline() first")
        self.control.barrier(self.config.timeout, "start_timeline()")
        self._timeline = Timeline(filename, self.rank)

    def stop_timeline(self) -> Timeline | None:
        """Stop recording; the timeline that recorded (None: none did)."""
        timeline, self._timeline = self._timeline, None
        return timeline

    # -- the flight recorder (`_recorder`) ------------------------------------------------
    def standing(self) -> Standing:
        """What a dump of the flight recorder says of this communicator besides its ring."""
        life, watchdog = self.life, self.watchdog
        broken = life.error or life.cause
        failure = broken or life.traced
        return Standing(self.control.job_id, tuple(self.control.job_ranks), self.rank,
                        self.seq, life.state.value, life.completed_through,
                        None if watchdog is None else watchdog.in_flight(),
                        life.lost_through, failure, broken is not None,
                        None if failure is None else _failures.job_peer(self, failure))

    def _entry_failed(self, seq: int) -> None:
        """The flight recorder's entry of collective `seq` (where it holds one) failed."""
        ring = self.ring
        entry = ring[-1] if ring else None  # (the newest: the call being prepared)
        if entry is not None and entry[BEFORE] == seq - 1:
            entry[FAILED] = "failed"

    def dump_trace(self, reason: str) -> str | None:
        """Write this rank's flight recorder (every communicator of the process) now; the
        file's path, or None where the recorder is off."""
        return None if self.ring is None else _recorder.dump(reason)

    # -- failures (`_failures`) ----------------------------------------------------------
    def on_peer_failure(self, error: PeerFailureError) -> None:
        if self.watchdog is not None and self.watchdog.departed(error.peer):
            return  # it left after its last collective: the watchdog fails any later one
        self.fail(error)

    def fail(self, error: GpuringError, *, by_user: bool = False) -> None:
        """`_failures.fail`, as a method: what the watchdog and the control plane call
        (weakly) when a failure comes from outside a call. Any thread."""
        _failures.fail(self, error, by_user=by_user)

    def wait_engines(self, name: str) -> None:
        """Wait for every collective this rank started (`name`: the call that waits)."""
        if self.nccl is not None:
            try:
                self.nccl.synchronize()
            except GpuringError as exc:
                failed = in_context(self.life.cause or exc, name, self.seq, self.rank)
                self.life.raised(failed)
                raise failed from None
        for engine in list(self.engines.values()):
            with _failures.on_streams(self, name):
                engine.synchronize()


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
