"""The Communicator: the verbs users call, and the one path every call takes.

Each verb checks its arguments into a `Call` (`_argcheck`) and hands it to `_call`: the
lifecycle says whether a collective may run; the prepared call for the call's key is made once
(the ranks agree on its `Signature`, a `Route` is picked, the engine plans it) and then runs
from the route table. Barrier is a call without arrays; the `*_async` verbs are the same verbs
run by a background thread.
"""

from __future__ import annotations

import functools
import inspect
import os
import threading
import warnings
import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec

from . import _argcheck, _arrays, interop
from ._call import Call, PreparedCall, Route, Signature
from ._config import Config
from ._errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    GpuringError,
    PeerFailureError,
)
from ._health import Health
from ._lifecycle import Lifecycle, Outcome, State, in_context
from ._ops import ReduceOp
from ._status import signature_hash
from ._work import Executor, Work, public_verb
from .algorithms.collectives import plan_collective
from .devices import device_class
from .devices.base import FlagWaitAborted, FlagWaitTimeout, Memory
from .devices.host import SHM_PREFIX, HostDevice
from .rendezvous.base import ControlPlane
from .scheduler import Engine, Launch
from .timeline import Timeline, write_trace

if TYPE_CHECKING:
    from .transports.mpi import MpiCollectives

__all__ = ["Communicator"]

#: collectives whose result GPURING_VERIFY compares across ranks (the same on every rank)
_VERIFIED = ("all_reduce", "all_gather", "broadcast")
_P = ParamSpec("_P")


def _release(engines: dict[str, Engine], watch: list[Any], control: ControlPlane,
             outcome: Outcome) -> None:
    """Close in order: tell the peers this rank is leaving, the engines (the watchdog still
    watching, so a peer that fails meanwhile ends the close's wait at once), the watchdog, the
    status board's memory, the control plane. Runs once, from close() or when the
    communicator is garbage collected."""
    for item in watch:
        if isinstance(item, Health):
            item.leaving()
    for engine in engines.values():
        engine.close(control, orderly=outcome.orderly)
    for item in watch:  # Health first, then the HostDevice that holds the board
        item.close()
    watch.clear()
    control.close()


def _weakly(method: Callable[..., None]) -> Callable[..., None]:
    """A callback that calls `method` while its object lives: what the control plane and the
    watchdog hold must not keep the communicator alive (its finalizer closes it when the user
    drops it)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, **kwargs)

    return call


def _in_background(verb: Callable[Concatenate[Communicator, _P], Any]
                   ) -> Callable[Concatenate[Communicator, _P], Work]:
    """The `*_async` twin of a verb: the same call, run by the communicator's background
    thread; returns a Work at once."""
    name = verb.__name__
    checked = inspect.signature(verb)

    @functools.wraps(verb)
    def submit(self: Communicator, *args: _P.args, **kwargs: _P.kwargs) -> Work:
        bound = checked.bind(self, *args, **kwargs)  # a wrong call fails here, not in wait()
        return self._submit(name, getattr(self, name), *bound.args[1:], **bound.kwargs)

    submit.__name__ = f"{name}_async"
    submit.__qualname__ = f"Communicator.{name}_async"
    submit.__signature__ = checked.replace(return_annotation="Work")  # type: ignore[attr-defined]
    submit.__doc__ = (f"`{name}` in the background: returns a Work at once, whose `wait()` "
                      f"gives what `{name}` returns (or raises what it raises).")
    return submit


class Communicator:
    """A group of ranks that run collectives together. Use `gpuring.init()` to get one.

    Every collective is called by every rank in the same order with matching arguments.
    NumPy arrays run on the host device and return when the result is complete.
    """

    def __init__(self, control: ControlPlane, config: Config | None = None, *,
                 on_close: Callable[[Communicator], None] | None = None):
        """`on_close(comm)` runs once the communicator closed (gpuring.init uses it to forget
        the job's communicator)."""
        self._control = control
        self.config = config or Config.from_env()
        self._on_close = on_close
        self._engines: dict[str, Engine] = {}
        self._agreed: set[Signature] = set()
        self._prepared: dict[tuple[Any, ...], PreparedCall] = {}
        self._seq = 0  # collectives this rank started
        self._last_collective = "collective"  # the name of the last one
        self._lock = threading.RLock()
        self._life = Lifecycle(control.rank)
        self._watch: list[Any] = []
        self._mpi: MpiCollectives | None = None  # made on first use
        self._health: Health | None = None  # status board and watchdog, made on first use
        self._executor: Executor | None = None  # the async thread, made by the first *_async
        self._timeline: Timeline | None = None  # recording timeline; checked once per call
        self._finalizer = weakref.finalize(self, _release, self._engines, self._watch, control,
                                           self._life.outcome)
        control.on_peer_failure(_weakly(self._on_peer_failure))

    # -- identity -----------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._control.rank

    @property
    def size(self) -> int:
        return self._control.size

    @property
    def local_rank(self) -> int:
        return self._control.local_rank

    @property
    def local_size(self) -> int:
        return self._control.local_size

    @property
    def closed(self) -> bool:
        return self._life.state is State.CLOSED

    def __repr__(self) -> str:
        return (f"<gpuring.Communicator rank {self.rank} of {self.size}, "
                f"{self._life.state.value}>")

    # -- collectives --------------------------------------------------------------------
    @public_verb
    def all_reduce(self, x: Any, *, op: ReduceOp | str = "sum", out: Any = None,
                   chunk_bytes: int | None = None, channels: int | None = None,
                   compression: str | None = None) -> Any:
        """Element-wise reduction of `x` over all ranks; every rank gets the result.

        `out=x` reduces in place. Returns `out` (a new array when `out` is None).
        `compression="fp16"|"bf16"` sends float32/float64 through the ring in that format.
        """
        if compression is not None:
            return self._all_reduce_compressed(x, op, out, chunk_bytes, channels, compression)
        return self._call(_argcheck.all_reduce(x, op, out, chunk_bytes, channels))

    @public_verb
    def reduce_scatter(self, x: Any, *, op: ReduceOp | str = "sum", out: Any = None,
                       chunk_bytes: int | None = None, channels: int | None = None) -> Any:
        """Reduce `x` over all ranks and keep this rank's block: block `rank` of the flattened
        result split into `size` equal blocks. `x.size` must be divisible by `size`."""
        return self._call(_argcheck.reduce_scatter(x, op, out, chunk_bytes, channels,
                                                   self.size))

    @public_verb
    def all_gather(self, x: Any, *, out: Any = None, chunk_bytes: int | None = None,
                   channels: int | None = None) -> Any:
        """Every rank's `x` stacked in rank order: shape `(size, *x.shape)`."""
        return self._call(_argcheck.all_gather(x, out, chunk_bytes, channels, self.size))

    @public_verb
    def broadcast(self, x: Any, *, root: int = 0, chunk_bytes: int | None = None,
                  channels: int | None = None) -> Any:
        """Copy root's `x` into `x` on every rank (in place) and return it."""
        return self._call(_argcheck.broadcast(x, root, chunk_bytes, channels, self.size))

    @public_verb
    def reduce(self, x: Any, *, op: ReduceOp | str = "sum", root: int = 0, out: Any = None,
               chunk_bytes: int | None = None, channels: int | None = None) -> Any:
        """Element-wise reduction of `x` over all ranks, delivered to `root` only: returns the
        result on root and None on the other ranks (`out` is only used on root)."""
        call = _argcheck.reduce(x, op, root, out, chunk_bytes, channels, self.size, self.rank)
        result = self._call(call)
        return result if self.rank == call.root else None

    @public_verb
    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        if self.size == 1:  # nothing to wait for, and no collective to count
            self._life.check("barrier", self._seq + 1)
            return
        self._call(Call("barrier"))

    all_reduce_async = _in_background(all_reduce)
    reduce_scatter_async = _in_background(reduce_scatter)
    all_gather_async = _in_background(all_gather)
    broadcast_async = _in_background(broadcast)
    reduce_async = _in_background(reduce)

    def all_reduce_many(self, arrays: Sequence[Any], *, op: ReduceOp | str = "sum",
                        fusion_bytes: int | None = None) -> list[Any]:
        """`all_reduce` of each array, packed per dtype into buffers of at most
        `fusion_bytes` (GPURING_FUSION_BYTES, 64 MiB): results in input order."""
        from .fusion import all_reduce_many

        return all_reduce_many(self, arrays, op=op, fusion_bytes=fusion_bytes)

    def _all_reduce_compressed(self, x: Any, op: ReduceOp | str, out: Any,
                               chunk_bytes: int | None, channels: int | None,
                               compression: str) -> Any:
        from .compression import all_reduce_compressed, wire_dtype

        rop = ReduceOp.parse(op)
        x = _argcheck.input_array(x)
        wire_dtype(compression)  # a bad name is the first thing to hear of
        if _arrays.dtype_name(x) in ("float32", "float64"):
            out = _argcheck.output_array(out, x, x.shape, "all_reduce", may_alias=True)
        return all_reduce_compressed(self, x, op=rop, out=out, compression=compression,
                                     chunk_bytes=chunk_bytes, channels=channels)

    # -- the call path ------------------------------------------------------------------
    def _call(self, call: Call) -> Any:
        """Run a checked call: prepare it once per key, then run it by its route."""
        self._life.check(call.collective, self._seq + 1)
        key = call.key()
        with self._lock:
            prepared = self._prepared.get(key)
            if prepared is None:
                prepared = self._prepare(call)
                if len(self._prepared) > 1024:  # bounded: forgetting costs a new preparation
                    self._prepared.clear()
                self._prepared[key] = prepared
            self._seq += 1
            return _ROUTES[prepared.route](self, prepared, call)

    def _prepare(self, call: Call) -> PreparedCall:
        """Agree with the peers on the call's signature (every setting that shapes the plan
        included), pick its route, and for the engine, the engine and the plan."""
        name, x, config = call.collective, call.x, self.config
        if x is None:  # a barrier: no array, on an engine this rank has (else the host's)
            kind = next(iter(self._engines), "cpu")
            plain = Signature(name, None, (), None, None, 0)
            dtype, shape, count, itemsize, chunk, nchannels = "uint8", (), 0, 1, 1, 1
        else:
            kind, dtype = _arrays.device_kind(x), _arrays.dtype_name(x)
            shape, count, itemsize = tuple(x.shape), x.size, x.dtype.itemsize
            plain = Signature(name, kind, shape, dtype, call.op.value, call.root)
        if self.size == 1 or ((x is None or kind == "cpu") and self._via_mpi()):
            self._agree(plain)
            return PreparedCall(Route.ALONE if self.size == 1 else Route.MPI)
        devices = device_class(kind)
        if x is not None:
            chunk = call.chunk_bytes or config.chunk_bytes or devices.default_chunk_bytes
            nchannels = call.channels or config.channels or devices.default_channels
            Config(chunk_bytes=chunk, channels=nchannels).validate()
        engine = self._engines.get(kind)
        capacity = engine.capacity if engine is not None else (
            config.buffer_bytes or devices.default_buffer_bytes)
        if x is None:
            signature = plain._replace(chunk_bytes=1, channels=1, verify=config.verify)
        else:
            signature = plain._replace(chunk_bytes=chunk, channels=nchannels,
                                       one_shot_bytes=config.one_shot_bytes,
                                       buffer_bytes=capacity, verify=config.verify)
        self._ensure_health()
        self._agree(signature)
        try:
            engine = self._engine(kind, capacity)
            rounds = plan_collective(
                name, self.size, self.rank, count, itemsize=itemsize,
                capacity_bytes=capacity, chunk_bytes=chunk, channels=nchannels,
                root=call.root, one_shot_bytes=config.one_shot_bytes)
        except BaseException as exc:  # after agreement the peers go on: tell them
            self._give_up(exc, name)
            raise
        text = "barrier()" if x is None else (
            f"{name}(shape={shape}, dtype={dtype}, op={call.op.value}, root={call.root}, "
            f"device={kind}, chunk_bytes={chunk}, channels={nchannels})")
        launch = engine.prepare(rounds, dtype=dtype, itemsize=itemsize, op=call.op,
                                inline=nchannels == 1)
        return PreparedCall(Route.ENGINE, launch, text, signature_hash(text))

    def _run_alone(self, prepared: PreparedCall, call: Call) -> Any:
        x, out = call.x, call.out
        if x is None:
            return None
        if call.collective == "all_gather":
            out[0] = x
        elif call.collective == "broadcast":
            return x
        elif out is not x:
            out[...] = x.reshape(out.shape)
        return out

    def _run_via_mpi(self, prepared: PreparedCall, call: Call) -> Any:
        name = call.collective
        if self._mpi is None:
            from .rendezvous.mpi import MpiControl
            from .transports.mpi import MpiCollectives

            assert isinstance(self._control, MpiControl)
            self._mpi = MpiCollectives(self._control, self.config.timeout)
        try:
            if call.x is None:
                self._mpi.barrier()
            else:
                self._mpi.run(name, call.x, call.out, call.op, call.root)
        except BaseException as exc:
            error: BaseException = exc
            if isinstance(exc, GpuringError):  # which call, like the engine's errors
                error = self._life.explain(exc, name, self._seq)
            self._life.raised(error)
            if error is exc:
                raise
            raise error from None
        return call.out

    def _run_engine(self, prepared: PreparedCall, call: Call) -> Any:
        launch = prepared.launch
        assert launch is not None
        engine = launch.engine
        device = engine.device
        name, x, out = call.collective, call.x, call.out
        in_mem = out_mem = None
        if x is not None and x.size:
            try:
                in_mem = device.wrap(x)
                out_mem = device.wrap(out) if out is not None else None
            except BaseException as exc:  # this rank's seq moved on: the peers must know
                self._give_up(exc, name)
                raise
        timeline = self._timeline
        if timeline is None:
            self._execute(prepared, launch, name, in_mem, out_mem)
        else:
            timeline.record(name, self._seq, x, call.op, launch.per_round(), lambda one: (
                self._execute(prepared, one, name, in_mem, out_mem)))
        if x is None and not device.blocking:  # a barrier holds the host too
            try:
                engine.synchronize()
            except BaseException as exc:
                self._give_up(exc, name)
                raise
        elif self.config.verify and name in _VERIFIED:
            self._verify(name, out)
        return out

    def _execute(self, prepared: PreparedCall, launch: Launch, name: str,
                 in_mem: Memory | None, out_mem: Memory | None) -> None:
        """Announce the collective on the status board, run `launch` (the prepared call's, or
        one round of it), and turn any failure into this call's error (the communicator is
        unusable afterwards)."""
        engine = launch.engine
        device = engine.device
        health = self._health
        assert health is not None
        seq = self._seq
        self._last_collective = name
        try:
            if self._life.cause is not None:
                raise self._life.cause
            health.enter(seq, name, prepared.text, prepared.digest)
            finished = engine.run(launch, in_mem, out_mem, name, seq, device.caller_event())
        except BaseException as exc:  # whatever it is, the round counters are now unusable
            error: BaseException = exc
            if self._life.cause is not None:
                error = self._life.explain(self._life.cause, name, seq)
                self._life.raised(error)
            elif isinstance(error, CollectiveMismatchError):
                self._life.raised(error)  # the status board already told the peers
            else:
                culprit = None
                if isinstance(error, CollectiveTimeoutError):
                    error = health.blame(error, name, seq)
                    culprit = error.peer
                self._give_up(error, name, culprit)
            if error is exc:
                raise
            raise error from None
        finally:
            health.leave()
        if finished is not None:
            health.track(finished, name, seq)
            device.order_caller_after(finished)

    # -- agreement, engines, the watchdog ------------------------------------------------
    def _agree(self, signature: Signature) -> None:
        """Check that every rank runs the same collective; cached per signature."""
        if signature in self._agreed:
            return
        name, seq, life, health = signature.collective, self._seq + 1, self._life, self._health
        if health is not None:  # a peer that closes meanwhile fails this exchange at once
            health.expect(seq, name)
        try:
            signatures = self._control.exchange("a collective", signature, self.config.timeout)
        except (PeerFailureError, CollectiveTimeoutError) as exc:
            if life.cause is None and health is not None and isinstance(exc, PeerFailureError):
                # the status board may know better: a peer that left the exchange after a
                # failure published whom it blames before the control plane said it left
                health.check()
            error = life.explain(exc, name, seq)
            if life.cause is None and isinstance(exc, CollectiveTimeoutError):
                # say so on the status board (which rank is missing is unknown here): a late
                # peer then fails at once, instead of completing the exchange this rank left
                # and waiting its own timeout in a collective nobody else will run
                self._give_up(error, name, culprit=-1, seq=seq)
            elif health is not None:  # at close, tell the peers this rank failed (and why),
                health.note_failure(error)  # not that it left without entering the call
            life.raised(error)
            raise error from None
        finally:
            if health is not None:
                health.expect(None)
        differences: dict[str, dict[int, object]] = {}
        for i, field in enumerate(Signature._fields):
            values = {r: s[i] for r, s in enumerate(signatures)}
            if len(set(map(repr, values.values()))) > 1:
                differences[field] = values
        if differences:
            detail = "; ".join(
                f"{field}: " + ", ".join(f"rank {r} {v}" for r, v in values.items())
                for field, values in differences.items())
            raise CollectiveMismatchError(
                f"ranks called different collectives ({name} on rank {self.rank}): {detail}",
                differences=differences)
        if len(self._agreed) >= 4096:  # bounded: forgetting only costs a fresh agreement
            self._agreed.clear()
        self._agreed.add(signature)

    def _via_mpi(self) -> bool:
        """Whether NumPy collectives go through MPI: across nodes, or when asked to."""
        if self._control.single_node and self.config.transport != "mpi":
            return False
        from .rendezvous.mpi import MpiControl

        if not isinstance(self._control, MpiControl):
            raise GpuringError("NumPy collectives across nodes (or GPURING_TRANSPORT=mpi) "
                               "need the ranks to come from mpiexec")
        return True

    def _engine(self, kind: str, capacity: int) -> Engine:
        engine = self._engines.get(kind)
        if engine is None:
            device = device_class(kind).for_job(self._control, self.config.timeout)
            try:
                engine = Engine(device, self._control, capacity_bytes=capacity,
                                timeout=self.config.timeout)
            except BaseException:  # peers may have mapped what this rank exported by now
                device.close(peers_may_read=True)
                raise
            self._engines[kind] = engine
        return engine

    def _ensure_health(self) -> None:
        """Create the status board and watchdog (collectively, on first use)."""
        if self._health is None:
            host = HostDevice(name_prefix=f"{SHM_PREFIX}{self._control.job_id}-"
                                          f"r{self.rank}-status-", timeout=self.config.timeout,
                              for_collectives=False)
            try:
                self._health = Health(self._control, host, timeout=self.config.timeout,
                                      stall_warning_s=self.config.stall_warning_s,
                                      on_failure=_weakly(self._fail))
            except BaseException:
                host.close()
                raise
            self._watch += [self._health, host]

    def _verify(self, name: str, out: Any) -> None:
        """GPURING_VERIFY: compare a checksum of the result across ranks."""
        checksum = zlib.crc32(_arrays.to_host(out).tobytes())
        sums = self._control.exchange(f"{name} (result check)", checksum, self.config.timeout)
        if len(set(sums)) > 1:
            error = GpuringError(
                f"{name} #{self._seq}: results differ across ranks (checksums "
                + ", ".join(f"rank {r} {c:08x}" for r, c in enumerate(sums)) + ")")
            self._life.raised(error)
            raise error

    # -- failures -----------------------------------------------------------------------
    def abort(self, reason: str = "aborted by the user") -> None:
        """Fail this communicator now, from any thread: pending waits raise at once, peers
        are told, and later calls raise CommunicatorClosedError. Close it afterwards."""
        self._life.by_user = True  # before anything a failure arriving meanwhile could race
        error = CommunicatorClosedError(f"communicator aborted on rank {self.rank}: {reason}")
        if self._health is not None:
            self._health.give_up(reason)
        self._control.report_failure(f"rank {self.rank} aborted: {reason}")
        self._fail(error, by_user=True)

    def _on_peer_failure(self, rank: int, reason: str) -> None:
        self._fail(PeerFailureError(f"rank {rank} failed: {reason}", peer=rank))

    def _fail(self, error: GpuringError, *, by_user: bool = False) -> None:
        """Record a failure that came from outside a call (a peer, the watchdog, abort()) and
        unblock every wait of this rank. Any thread."""
        health = self._health
        # a failure that reached no collective of this rank (all had completed) lost nothing
        busy = health is not None and health.busy()
        if not self._life.fail(error, busy=busy, by_user=by_user):
            return
        if health is not None:
            health.note_failure(error)
        for engine in list(self._engines.values()):
            engine.device.abort(str(error))
        self._control.interrupt(str(error))

    def _give_up(self, error: BaseException, name: str, culprit: int | None = None,
                 seq: int | None = None) -> None:
        """A call of this rank cannot go on: the communicator is broken; tell the peers."""
        self._life.raised(error)
        if self._health is not None:
            where = f"{name} #{self._seq if seq is None else seq}"
            self._health.give_up(f"{where}: {error!r}", timed_out_on=culprit)
        if culprit is None:
            self._control.report_failure(f"rank {self.rank}: {error!r}")
        for engine in list(self._engines.values()):
            engine.device.abort(f"rank {self.rank} gave up: {error!r}")

    # -- lifetime -----------------------------------------------------------------------
    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # an exception on its way out says more than a failure it caused: don't mask it
        self._close(report=exc_type is None)

    def close(self) -> None:
        """Wait for this rank's collectives, free buffers, unmap peers, leave the job.
        Idempotent. Raises the failure of a collective that no call has raised yet (GPU
        collectives return before they complete: see `synchronize`); a failure that came
        after all of this rank's collectives had completed is not raised."""
        self._close(report=True)

    def _close(self, report: bool) -> None:
        if self.closed:
            return
        self._close_training()
        unraised: BaseException | None = None
        if self._life.state is State.OPEN:
            try:
                self._wait_engines("close")
            except BaseException as exc:  # already says it comes from close
                unraised = exc
        else:
            unraised = self._life.unraised(self._seq)
        self._life.close()
        self._finalizer()
        if self._on_close is not None:
            self._on_close(self)
        if report and unraised is not None:
            raise unraised

    def synchronize(self) -> None:
        """Wait until every collective this rank started has completed; raise the first
        failure. CUDA collectives return once queued: their errors reach the host here, in the
        next call, or in `close()`; results read before then are not checked."""
        self._drain_async()
        self._life.check("synchronize", self._seq)
        self._wait_engines("synchronize")

    def _wait_engines(self, name: str) -> None:
        for engine in list(self._engines.values()):
            try:
                engine.synchronize()
            except BaseException as exc:
                cause = self._life.cause
                if cause is not None:  # the cause (a peer died, say) reads better
                    error: BaseException = in_context(cause, name, self._seq, self.rank)
                else:
                    error = self._streams_failure(exc, name)
                    culprit = (error.peer if isinstance(error, CollectiveTimeoutError)
                               and error.peer is not None else None)
                    self._give_up(error, name, culprit)
                self._life.raised(error)
                raise error from None

    def _streams_failure(self, cause: BaseException, name: str) -> BaseException:
        """The error of a failed `engine.synchronize()` (already the root cause among the
        streams' errors) as a gpuring error naming the call."""
        collective, seq = self._last_collective, self._seq
        error: BaseException = cause
        if isinstance(cause, FlagWaitTimeout):
            tag = cause.tag
            peer, what = tag if isinstance(tag, tuple) and len(tag) == 2 else (None, tag)
            error = CollectiveTimeoutError(
                f"collectives up to {collective} #{seq} did not complete on rank {self.rank}: "
                f"timed out after {self.config.timeout} s waiting for rank {peer} ({what}); "
                f"that rank is stalled, dead, or called a different collective",
                collective=collective, seq=seq, peer=peer)
            if self._health is not None:
                error = self._health.blame(error, collective, seq)
        elif isinstance(cause, FlagWaitAborted):
            error = PeerFailureError(f"collectives up to {collective} #{seq} aborted on rank "
                                     f"{self.rank}: {cause.reason}", collective=collective,
                                     seq=seq)
        if isinstance(error, GpuringError):
            return in_context(error, name, seq, self.rank)
        return error

    # -- training features: async, timeline --------------------------------------------
    def start_timeline(self, path: str | os.PathLike[str]) -> None:
        """Record every collective and ring round until `stop_timeline()`; every rank calls
        it. Rank 0 writes the merged Chrome trace to `path` at the stop."""
        self._life.check("", self._seq)
        self._drain_async()
        if self._timeline is not None:
            raise GpuringError("a timeline is already recording; call stop_timeline() first")
        # a common time origin on every rank
        self._control.barrier(self.config.timeout, "start_timeline()")
        self._timeline = Timeline(os.fspath(path), self.rank)

    def stop_timeline(self) -> str | None:
        """Stop recording; every rank calls it. Rank 0 writes the trace of all ranks and
        returns its path; the other ranks return None."""
        self._drain_async()
        timeline, self._timeline = self._timeline, None
        if timeline is None:
            return None
        per_rank = self._control.exchange("stop_timeline()", timeline.events,
                                          self.config.timeout)
        if self.rank != 0:
            return None
        write_trace(timeline.path, per_rank)
        return timeline.path

    def _submit(self, name: str, verb: Callable[..., Any], *args: Any, **kwargs: Any) -> Work:
        self._life.check(name, self._seq + 1)
        x = args[0]
        with self._lock:
            if self._executor is None:
                self._executor = Executor()
        # views made here, in the caller's thread and on the caller's stream (torch's for a
        # torch tensor): DLPack orders them there, and the collective starts after it
        with interop.caller_stream(x):
            args, kwargs, restore = interop.convert(args, kwargs)
            cuda = interop.device_kind(args[0]) == "cuda"

            def run() -> Any:
                return restore(verb(*args, **kwargs))

            device_id = int(args[0].device.id) if cuda else None  # the array's own GPU
            return self._executor.submit(run, name, cuda_device=device_id,
                                         caller_stream=lambda: interop.caller_stream(x))

    def _drain_async(self) -> None:
        executor = self._executor
        if executor is not None and executor.busy():
            executor.drain()

    def _close_training(self) -> None:
        """From close(): finish the async work, then stop the timeline. If the ranks can no
        longer gather the timeline, each writes its own events to PATH.rankN.json."""
        if self._executor is not None:
            self._executor.close()
        timeline = self._timeline
        if timeline is None:
            return
        try:
            self.stop_timeline()
        except Exception as exc:
            path = f"{timeline.path}.rank{self.rank}.json"
            write_trace(path, [[] for _ in range(self.rank)] + [timeline.events])
            warnings.warn(f"timeline: could not merge the ranks' events ({exc}); wrote this "
                          f"rank's to {path}", RuntimeWarning, stacklevel=3)


#: who runs a prepared call, by its route
_ROUTES: dict[Route, Callable[[Communicator, PreparedCall, Call], Any]] = {
    Route.ALONE: Communicator._run_alone,
    Route.MPI: Communicator._run_via_mpi,
    Route.ENGINE: Communicator._run_engine,
}
