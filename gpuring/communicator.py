"""The Communicator: argument checks, cross-rank agreement, and dispatch to an engine."""

from __future__ import annotations

import enum
import os
import threading
import warnings
import weakref
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from . import _arrays, interop
from ._config import Config
from ._errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    GpuringError,
    PeerFailureError,
)
from ._health import Health
from ._ops import ReduceOp, check_op_dtype
from ._status import signature_hash
from ._work import Executor, Work, public_verb
from .algorithms.collectives import plan_collective
from .algorithms.plan import RoundPlan
from .devices.base import Device, FlagWaitAborted, FlagWaitTimeout
from .devices.host import SHM_PREFIX, HostDevice
from .rendezvous.base import ControlPlane
from .scheduler import Engine
from .timeline import Timeline, write_trace

__all__ = ["Communicator"]

_SIGNATURE_FIELDS = ("collective", "device", "shape", "dtype", "op", "root", "chunk_bytes",
                     "channels", "one_shot_bytes", "buffer_bytes", "verify")
class Route(enum.Enum):
    """Who runs an agreed collective."""

    ALONE = "alone"  #: a world of one: nothing moves
    MPI = "mpi"  #: MPI's own collectives (NumPy arrays across nodes)
    ENGINE = "engine"  #: a device engine of this communicator


@dataclass(frozen=True)
class PreparedCall:
    """A collective every rank agreed on, ready to run again: its route and, for the engine,
    the engine, its rounds, the dtype, whether it runs inline, and its signature text and
    digest (what the status board compares)."""

    route: Route
    engine: Engine | None = None
    rounds: tuple[RoundPlan, ...] = ()
    dtype: str = ""
    inline: bool = False
    text: str = ""
    digest: int = 0


_ALONE = PreparedCall(Route.ALONE)
_VIA_MPI = PreparedCall(Route.MPI)


def _device_class(kind: str) -> type[Device]:
    if kind == "cpu":
        return HostDevice
    from .devices.cuda import CudaDevice

    return CudaDevice


def _make_device(kind: str, control: ControlPlane, config: Config) -> Device:
    if kind == "cpu":
        if not control.single_node:
            raise GpuringError(
                "NumPy collectives across nodes are not supported yet: every rank of the "
                "job must run on one node (the host device maps peers' shared memory)")
        return HostDevice(name_prefix=f"{SHM_PREFIX}{control.job_id}-r{control.rank}-",
                          timeout=config.timeout)
    if not control.single_node:
        raise GpuringError(
            "CuPy collectives across nodes are not supported yet: every rank of the job must "
            "run on one node (the CUDA device maps peers' memory through CUDA IPC)")
    from .devices.cuda import CudaDevice

    return CudaDevice(local_rank=control.local_rank, timeout=config.timeout)


def _release(engines: dict[str, Engine], watch: list[Any], control: ControlPlane,
             state: dict[str, bool]) -> None:
    """Close in order: tell the peers this rank is leaving, the engines (the watchdog still
    watching, so a peer that fails meanwhile ends the close's wait at once), the watchdog, the
    status board's memory, the control plane. Runs once, from close() or when the
    communicator is garbage collected."""
    for item in watch:
        if isinstance(item, Health):
            item.leaving()
    for engine in engines.values():
        engine.close(control, orderly=state["orderly"])
    for item in watch:  # Health first, then the HostDevice that holds the board
        item.close()
    watch.clear()
    control.close()


def _in_context(failure: GpuringError, name: str, seq: int, rank: int) -> GpuringError:
    """The same kind of error as `failure`, saying which call on which rank it ended."""
    where = f"{name} #{seq} on rank {rank}: {failure}"
    if isinstance(failure, PeerFailureError):
        return PeerFailureError(where, peer=failure.peer, collective=name, seq=seq)
    if isinstance(failure, CollectiveTimeoutError):
        return CollectiveTimeoutError(where, collective=name, seq=seq, peer=failure.peer)
    return type(failure)(where)


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
        self._agreed: set[tuple[Any, ...]] = set()
        self._prepared: dict[tuple[Any, ...], PreparedCall] = {}
        self._seq = 0
        self._lock = threading.RLock()
        self._broken: BaseException | None = None
        self._failure: GpuringError | None = None
        self._user_aborted = False  # abort() was called: close() need not report the failure
        self._failure_hit_work = False  # the failure came while a collective was in flight
        self._closed = False
        self._watch: list[Any] = []
        self._mpi: Any = None  # MpiCollectives, made on first use
        self._health: Health | None = None
        self._state = {"orderly": True}  # False once failed: close then leaks GPU buffers
        self._finalizer = weakref.finalize(self, _release, self._engines, self._watch, control,
                                           self._state)
        control.on_peer_failure(self._on_peer_failure)

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
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<gpuring.Communicator rank {self.rank} of {self.size}, {state}>"

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
        if self._closed:
            return
        self._close_training()
        unraised: BaseException | None = None
        if self._failure is None and self._broken is None:
            try:
                self._wait_engines("close")
            except BaseException as exc:  # already says it comes from close
                unraised = exc
        elif self._broken is None and not self._user_aborted and self._failure_hit_work:
            assert self._failure is not None
            unraised = _in_context(self._failure, "close", self._seq, self.rank)
        self._closed = True
        self._state["orderly"] = self._failure is None and self._broken is None
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
        self._ensure_open("synchronize", starts=False)
        self._wait_engines("synchronize")

    def _wait_engines(self, name: str) -> None:
        for engine in list(self._engines.values()):
            try:
                engine.synchronize()
            except BaseException as exc:
                if self._failure is not None:  # the cause (a peer died, say) reads better
                    error: BaseException = _in_context(self._failure, name, self._seq,
                                                       self.rank)
                else:
                    error = self._streams_failure(exc, name)
                    culprit = (error.peer if isinstance(error, CollectiveTimeoutError)
                               and error.peer is not None else None)
                    self._give_up(error, name, culprit)
                self._broken = error
                raise error from None

    def _streams_failure(self, first: BaseException, name: str
                         ) -> BaseException:
        """The error of a failed `engine.synchronize()` (already the root cause among the
        streams' errors) as a gpuring error naming the call."""
        cause = first
        collective, seq = self._last_collective, self._seq
        error: BaseException = cause
        if isinstance(cause, FlagWaitTimeout):
            tag = cause.tag
            peer, what = tag if isinstance(tag, tuple) and len(tag) == 2 else (None, tag)
            timed_out = CollectiveTimeoutError(
                f"collectives up to {collective} #{seq} did not complete on rank {self.rank}: "
                f"timed out after {self.config.timeout} s waiting for rank {peer} ({what}); "
                f"that rank is stalled, dead, or called a different collective",
                collective=collective, seq=seq, peer=peer)
            if self._health is not None:
                timed_out, _ = self._blame(timed_out, self._health, collective, seq)
            error = timed_out
        elif isinstance(cause, FlagWaitAborted):
            error = PeerFailureError(f"collectives up to {collective} #{seq} aborted on rank "
                                     f"{self.rank}: {cause.reason}", collective=collective,
                                     seq=seq)
        if isinstance(error, GpuringError):
            return _in_context(error, name, seq, self.rank)
        return error

    def abort(self, reason: str = "aborted by the user") -> None:
        """Fail this communicator now, from any thread: pending waits raise at once, peers
        are told, and later calls raise CommunicatorClosedError. Close it afterwards."""
        self._user_aborted = True
        error = CommunicatorClosedError(f"communicator aborted on rank {self.rank}: {reason}")
        if self._health is not None:
            self._health.give_up(reason)
        self._control.report_failure(f"rank {self.rank} aborted: {reason}")
        self._fail(error)

    def _on_peer_failure(self, rank: int, reason: str) -> None:
        self._fail(PeerFailureError(f"rank {rank} failed: {reason}", peer=rank))

    def _fail(self, error: GpuringError) -> None:
        """Record the first failure and unblock every wait of this rank (any thread)."""
        if self._failure is not None:
            return
        # a failure that reached no collective of this rank (all had completed) lost nothing
        self._failure_hit_work = self._health is not None and self._health.busy()
        self._failure = error
        if self._health is not None:
            self._health.note_failure(error)
        self._state["orderly"] = False
        for engine in list(self._engines.values()):
            engine.device.abort(str(error))
        self._control.interrupt(str(error))

    # -- collectives --------------------------------------------------------------------
    @public_verb
    def all_reduce(self, x: Any, *, op: ReduceOp | str = "sum", out: Any = None,
                   chunk_bytes: int | None = None, channels: int | None = None,
                   compression: str | None = None) -> Any:
        """Element-wise reduction of `x` over all ranks; every rank gets the result.

        `out=x` reduces in place. Returns `out` (a new array when `out` is None).
        `compression="fp16"|"bf16"` sends float32/float64 through the ring in that format.
        """
        rop = ReduceOp.parse(op)
        x = self._check_input(x)
        if compression is not None:
            from .compression import all_reduce_compressed, wire_dtype

            wire_dtype(compression)  # a bad name is the first thing to hear of
            if _arrays.dtype_name(x) in ("float32", "float64"):
                out = self._check_out(out, x, x.shape, "all_reduce", may_alias=True)
            return all_reduce_compressed(self, x, op=rop, out=out, compression=compression,
                                         chunk_bytes=chunk_bytes, channels=channels)
        check_op_dtype(rop, _arrays.dtype_name(x))
        out = self._check_out(out, x, x.shape, "all_reduce", may_alias=True)
        return self._run("all_reduce", x, out, x.size, rop, 0, chunk_bytes, channels)

    @public_verb
    def reduce_scatter(self, x: Any, *, op: ReduceOp | str = "sum", out: Any = None,
                       chunk_bytes: int | None = None, channels: int | None = None) -> Any:
        """Reduce `x` over all ranks and keep this rank's block: block `rank` of the flattened
        result split into `size` equal blocks. `x.size` must be divisible by `size`."""
        rop = ReduceOp.parse(op)
        x = self._check_input(x)
        check_op_dtype(rop, _arrays.dtype_name(x))
        if x.size % self.size:
            raise ValueError(f"reduce_scatter needs x.size divisible by the {self.size} ranks, "
                             f"got {x.size}; pad the array")
        out = self._check_out(out, x, (x.size // self.size,), "reduce_scatter")
        return self._run("reduce_scatter", x, out, x.size, rop, 0, chunk_bytes, channels)

    @public_verb
    def all_gather(self, x: Any, *, out: Any = None, chunk_bytes: int | None = None,
                   channels: int | None = None) -> Any:
        """Every rank's `x` stacked in rank order: shape `(size, *x.shape)`."""
        x = self._check_input(x)
        check_op_dtype(ReduceOp.SUM, _arrays.dtype_name(x))
        out = self._check_out(out, x, (self.size, *x.shape), "all_gather")
        return self._run("all_gather", x, out, x.size, ReduceOp.SUM, 0, chunk_bytes, channels)

    @public_verb
    def broadcast(self, x: Any, *, root: int = 0, chunk_bytes: int | None = None,
                  channels: int | None = None) -> Any:
        """Copy root's `x` into `x` on every rank (in place) and return it."""
        root = self._check_root(root)
        if not _arrays.device_kind(x) or not x.flags.c_contiguous:
            raise TypeError("broadcast works in place and needs a C-contiguous array; "
                            "pass numpy.ascontiguousarray(x) and use the returned array")
        check_op_dtype(ReduceOp.SUM, _arrays.dtype_name(x))
        return self._run("broadcast", x, x, x.size, ReduceOp.SUM, root, chunk_bytes, channels)

    @public_verb
    def reduce(self, x: Any, *, op: ReduceOp | str = "sum", root: int = 0, out: Any = None,
               chunk_bytes: int | None = None, channels: int | None = None) -> Any:
        """Element-wise reduction of `x` over all ranks, delivered to `root` only: returns the
        result on root and None on the other ranks (`out` is only used on root)."""
        rop = ReduceOp.parse(op)
        root = self._check_root(root)
        x = self._check_input(x)
        check_op_dtype(rop, _arrays.dtype_name(x))
        if self.rank == root:
            out = self._check_out(out, x, x.shape, "reduce", may_alias=True)
        else:
            out = None
        result = self._run("reduce", x, out, x.size, rop, root, chunk_bytes, channels)
        return result if self.rank == root else None

    @public_verb
    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        self._ensure_open("barrier")
        if self.size == 1:
            return
        with self._lock:
            key = ("barrier",)
            prepared = self._prepared.get(key)
            if prepared is None and self._via_mpi():
                self._agree(("barrier", "-", (), "-", "-", 0))
                prepared = self._prepared[key] = _VIA_MPI
            if prepared is _VIA_MPI:
                self._seq += 1
                self._run_via_mpi("barrier", None, None, ReduceOp.SUM, 0)
                return
            if prepared is None:
                text = "barrier()"
                self._ensure_health()
                self._agree(("barrier", "-", (), "-", "-", 0, 1, 1, 0, 0, self.config.verify))
                engine = next(iter(self._engines.values()), None) or self._engine(
                    "cpu", self.config.buffer_bytes or HostDevice.default_buffer_bytes)
                rounds = plan_collective("barrier", self.size, self.rank, 0, itemsize=1,
                                         capacity_bytes=engine.capacity,
                                         chunk_bytes=1, channels=1)
                prepared = self._prepared[key] = PreparedCall(
                    Route.ENGINE, engine, rounds, "uint8", True, text, signature_hash(text))
            self._seq += 1
            self._execute(prepared, "barrier", None, None, 1, ReduceOp.SUM)
            assert prepared.engine is not None
            if not prepared.engine.device.blocking:  # a barrier holds the host too
                try:
                    prepared.engine.synchronize()
                except BaseException as exc:
                    self._give_up(exc, "barrier")
                    raise

    # -- checks -------------------------------------------------------------------------
    def _ensure_open(self, name: str = "", starts: bool = True) -> None:
        """Raise if the communicator cannot run collective `name`: closed, or failed. A failure
        that came in between calls (a peer died) is raised once as itself, naming this call
        (numbered as the next collective if it `starts` one, else as the last one);
        later calls get CommunicatorClosedError."""
        if self._closed:
            raise CommunicatorClosedError("the communicator is closed; call gpuring.init() "
                                          "for a new one")
        if self._broken is None and self._failure is not None and name:
            error = _in_context(self._failure, name, self._seq + (1 if starts else 0), self.rank)
            self._broken = error
            raise error
        broken = self._broken or self._failure
        if broken is not None:
            raise CommunicatorClosedError(
                f"the communicator failed earlier and can no longer be used "
                f"({str(broken) or repr(broken)}); close it and call gpuring.init() again"
            ) from broken

    def _check_input(self, x: Any) -> Any:
        _arrays.device_kind(x)
        return _arrays.contiguous(x)

    def _check_root(self, root: Any) -> int:
        if isinstance(root, bool) or not isinstance(root, int):
            raise TypeError(f"root must be an int rank, got {type(root).__name__}")
        if not 0 <= root < self.size:
            raise ValueError(f"root {root} is not a rank of this communicator "
                             f"(0..{self.size - 1})")
        return root

    def _check_out(self, out: Any, x: Any, shape: tuple[int, ...], name: str,
                   may_alias: bool = False) -> Any:
        if out is None:
            return _arrays.array_module(x).empty(shape, dtype=x.dtype)
        if _arrays.device_kind(out) != _arrays.device_kind(x):
            raise TypeError(f"{name}: out must live on the same device as x")
        if out.dtype != x.dtype:
            raise TypeError(f"{name}: out has dtype {out.dtype}, x has {x.dtype}; they must match")
        if tuple(out.shape) != tuple(shape):
            raise ValueError(f"{name}: out must have shape {tuple(shape)}, got {tuple(out.shape)}")
        if not out.flags.c_contiguous:
            raise ValueError(f"{name}: out must be C-contiguous")
        if out is not x and _arrays.array_module(x).may_share_memory(out, x):
            if not (may_alias and _arrays.same_memory(out, x)):
                raise ValueError(f"{name}: out overlaps x; pass out=x to work in place, or a "
                                 "separate array")
        return out

    # -- execution ----------------------------------------------------------------------
    def _agree(self, signature: tuple[Any, ...]) -> None:
        """Check that every rank runs the same collective; cached per signature."""
        if signature in self._agreed:
            return
        health = self._health
        if health is not None:  # a peer that closes meanwhile fails this exchange at once
            health.expect(self._seq + 1, signature[0])
        try:
            signatures = self._control.exchange("a collective", signature, self.config.timeout)
        except (PeerFailureError, CollectiveTimeoutError) as exc:
            if self._failure is None and health is not None and isinstance(
                    exc, PeerFailureError):
                # the status board may know better: a peer that left the exchange after a
                # failure published whom it blames before the control plane said it left
                health.check()
            cause = self._failure if self._failure is not None else exc
            error = _in_context(cause, signature[0], self._seq + 1, self.rank)
            if self._failure is None and isinstance(exc, CollectiveTimeoutError):
                # say so on the status board (which rank is missing is unknown here): a late
                # peer then fails at once, instead of completing the exchange this rank left
                # and waiting its own timeout in a collective nobody else will run
                self._give_up(error, signature[0], culprit=-1, seq=self._seq + 1)
            elif health is not None:  # at close, tell the peers this rank failed (and why),
                health.note_failure(error)  # not that it left without entering the call
            self._broken = error
            raise error from None
        finally:
            if health is not None:
                health.expect(None)
        differences: dict[str, dict[int, object]] = {}
        for i, field in enumerate(_SIGNATURE_FIELDS[:len(signature)]):
            values = {r: s[i] for r, s in enumerate(signatures)}
            if len(set(map(repr, values.values()))) > 1:
                differences[field] = values
        if differences:
            detail = "; ".join(
                f"{field}: " + ", ".join(f"rank {r} {v}" for r, v in values.items())
                for field, values in differences.items())
            raise CollectiveMismatchError(
                f"ranks called different collectives ({signature[0]} on rank {self.rank}): "
                f"{detail}", differences=differences)
        if len(self._agreed) >= 4096:  # bounded: forgetting only costs a fresh agreement
            self._agreed.clear()
        self._agreed.add(signature)

    def _engine(self, kind: str, capacity: int) -> Engine:
        engine = self._engines.get(kind)
        if engine is None:
            device = _make_device(kind, self._control, self.config)
            try:
                engine = Engine(device, self._control, capacity_bytes=capacity,
                                timeout=self.config.timeout)
            except BaseException:  # peers may have mapped what this rank exported by now
                device.close(peers_may_read=True)
                raise
            self._engines[kind] = engine
        return engine

    def _run(self, name: str, x: Any, out: Any, count: int, op: ReduceOp, root: int,
             chunk_bytes: int | None, channels: int | None) -> Any:
        self._ensure_open(name)
        key = (name, x.shape, x.dtype, type(x), op, root, chunk_bytes, channels)
        with self._lock:
            prepared = self._prepared.get(key)
            if prepared is None:
                prepared = self._prepare(name, x, count, op, root, chunk_bytes, channels)
                if len(self._prepared) > 1024:
                    self._prepared.clear()
                self._prepared[key] = prepared
            self._seq += 1
            if prepared is _ALONE:
                return self._run_alone(name, x, out)
            if prepared is _VIA_MPI:
                self._run_via_mpi(name, x, out, op, root)
                return out
            assert prepared.engine is not None
            device = prepared.engine.device
            try:
                in_mem = device.wrap(x) if count else None
                out_mem = device.wrap(out) if out is not None and count else None
            except BaseException as exc:  # this rank's seq moved on: the peers must know
                self._give_up(exc, name)
                raise
            if self._timeline is None:
                self._execute(prepared, name, in_mem, out_mem, x.dtype.itemsize, op)
            else:
                self._timeline.execute(self, prepared, name, in_mem, out_mem, x, op)
            if self.config.verify and name in ("all_reduce", "all_gather", "broadcast"):
                self._verify(name, out)
        return out

    def _prepare(self, name: str, x: Any, count: int, op: ReduceOp, root: int,
                 chunk_bytes: int | None, channels: int | None) -> PreparedCall:
        """Agree with the peers on this call's signature (including every setting that shapes
        the plan), then pick engine and plan."""
        kind = _arrays.device_kind(x)
        dtype = _arrays.dtype_name(x)
        if self.size == 1 or (kind == "cpu" and self._via_mpi()):
            self._agree((name, kind, tuple(x.shape), dtype, op.value, root))
            return _ALONE if self.size == 1 else _VIA_MPI
        device_class = _device_class(kind)
        chunk = chunk_bytes or self.config.chunk_bytes or device_class.default_chunk_bytes
        nchannels = channels or self.config.channels or device_class.default_channels
        Config(chunk_bytes=chunk, channels=nchannels).validate()
        engine = self._engines.get(kind)
        capacity = engine.capacity if engine is not None else (
            self.config.buffer_bytes or device_class.default_buffer_bytes)
        signature = (name, kind, tuple(x.shape), dtype, op.value, root, chunk, nchannels,
                     self.config.one_shot_bytes, capacity, self.config.verify)
        self._ensure_health()
        self._agree(signature)
        try:
            engine = self._engine(kind, capacity)
            rounds = plan_collective(
                name, self.size, self.rank, count, itemsize=x.dtype.itemsize,
                capacity_bytes=capacity, chunk_bytes=chunk, channels=nchannels, root=root,
                one_shot_bytes=self.config.one_shot_bytes)
        except BaseException as exc:  # after agreement the peers go on: tell them
            self._give_up(exc, name)
            raise
        text = (f"{name}(shape={tuple(x.shape)}, dtype={dtype}, op={op.value}, root={root}, "
                f"device={kind}, chunk_bytes={chunk}, channels={nchannels})")
        return PreparedCall(Route.ENGINE, engine, rounds, dtype, nchannels == 1, text,
                            signature_hash(text))

    def _via_mpi(self) -> bool:
        """Whether NumPy collectives go through MPI: across nodes, or when asked to."""
        if self._control.single_node and self.config.transport != "mpi":
            return False
        from .rendezvous.mpi import MpiControl

        if not isinstance(self._control, MpiControl):
            raise GpuringError("NumPy collectives across nodes (or GPURING_TRANSPORT=mpi) "
                               "need the ranks to come from mpiexec")
        return True

    def _run_via_mpi(self, name: str, x: Any, out: Any, op: ReduceOp, root: int) -> None:
        if self._mpi is None:
            from .rendezvous.mpi import MpiControl
            from .transports.mpi import MpiCollectives

            assert isinstance(self._control, MpiControl)
            self._mpi = MpiCollectives(self._control, self.config.timeout)
        try:
            if name == "barrier":
                self._mpi.barrier()
            else:
                self._mpi.run(name, x, out, op, root)
        except BaseException as exc:
            error: BaseException = exc
            if isinstance(exc, GpuringError):  # which call, like the ring's errors
                cause = self._failure if self._failure is not None else exc
                error = _in_context(cause, name, self._seq, self.rank)
            self._broken = error
            self._state["orderly"] = False
            if error is exc:
                raise
            raise error from None

    def _give_up(self, error: BaseException, name: str, culprit: int | None = None,
                 seq: int | None = None) -> None:
        """This rank cannot go on: mark the communicator broken and tell the peers."""
        self._broken = error
        self._state["orderly"] = False
        if self._health is not None:
            where = f"{name} #{self._seq if seq is None else seq}"
            self._health.give_up(f"{where}: {error!r}", timed_out_on=culprit)
        if culprit is None:
            self._control.report_failure(f"rank {self.rank}: {error!r}")
        for engine in list(self._engines.values()):
            engine.device.abort(f"rank {self.rank} gave up: {error!r}")

    def _ensure_health(self) -> None:
        """Create the status board and watchdog (collectively, on first use)."""
        if self._health is None:
            host = HostDevice(name_prefix=f"{SHM_PREFIX}{self._control.job_id}-"
                                          f"r{self.rank}-status-", timeout=self.config.timeout,
                              for_collectives=False)
            try:
                self._health = Health(self._control, host, timeout=self.config.timeout,
                                      stall_warning_s=self.config.stall_warning_s,
                                      on_failure=self._fail)
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
            self._broken = error
            raise error

    def _execute(self, prepared: PreparedCall, name: str, in_mem: Any, out_mem: Any,
                 itemsize: int, op: ReduceOp) -> None:
        """Announce the collective on the status board, run it, and turn any failure into
        this call's error (the communicator is unusable afterwards)."""
        engine = prepared.engine
        assert engine is not None
        rounds, dtype, inline = prepared.rounds, prepared.dtype, prepared.inline
        text, digest = prepared.text, prepared.digest
        device = engine.device
        health = self._health
        assert health is not None
        seq = self._seq
        self._last_collective = name
        try:
            if self._failure is not None:
                raise self._failure
            health.enter(seq, name, text, digest)
            finished = engine.run(rounds, name=name, collective_seq=seq, in_mem=in_mem,
                                  out_mem=out_mem, dtype=dtype, itemsize=itemsize, op=op,
                                  inline=inline, after=device.caller_event())
        except BaseException as exc:  # whatever it is, the round counters are now unusable
            error: BaseException = exc
            if self._failure is not None:
                error = _in_context(self._failure, name, seq, self.rank)
                self._broken = error
            elif isinstance(error, CollectiveMismatchError):
                self._broken = error  # the status board already told the peers
            else:
                culprit = None
                if isinstance(error, CollectiveTimeoutError):
                    error, culprit = self._blame(error, health, name, seq)
                self._give_up(error, name, culprit)
            if error is exc:
                raise
            raise error from None
        finally:
            health.leave()
        if finished is not None:
            health.track(finished, name, seq)
            device.order_caller_after(finished)

    def _blame(self, error: CollectiveTimeoutError, health: Health, name: str,
               seq: int) -> tuple[CollectiveTimeoutError, int | None]:
        """A timeout names the rank this one waited for; if some ranks never entered the
        collective, name the first of those instead (the ring only shows the neighbour)."""
        missing = [r for r, entered in enumerate(health.board.entered()) if entered < seq]
        if not missing or missing[0] == error.peer:
            return error, error.peer
        return CollectiveTimeoutError(
            f"{error}; ranks {missing} have not entered {name} #{seq}", collective=name,
            seq=seq, peer=missing[0]), missing[0]

    def _run_alone(self, name: str, x: Any, out: Any) -> Any:
        if name == "all_gather":
            out[0] = x
        elif name == "broadcast":
            return x
        elif out is not x:
            out[...] = x.reshape(out.shape)
        return out

    # -- training features (async, fusion, compression, timeline, interop) --
    _executor: Executor | None = None  # the async thread, made by the first async verb
    _last_collective = "collective"  # the name of the last collective this rank started
    _timeline: Timeline | None = None  # recording timeline; checked once per collective

    def all_reduce_async(self, x: Any, *, op: ReduceOp | str = "sum", out: Any = None,
                         chunk_bytes: int | None = None, channels: int | None = None,
                         compression: str | None = None) -> Work:
        """`all_reduce` in the background; `wait()` on the returned Work gives its result."""
        return self._submit("all_reduce", self.all_reduce, x, op=op, out=out,
                            chunk_bytes=chunk_bytes, channels=channels,
                            compression=compression)

    def reduce_scatter_async(self, x: Any, *, op: ReduceOp | str = "sum", out: Any = None,
                             chunk_bytes: int | None = None,
                             channels: int | None = None) -> Work:
        """`reduce_scatter` in the background; returns a Work."""
        return self._submit("reduce_scatter", self.reduce_scatter, x, op=op, out=out,
                            chunk_bytes=chunk_bytes, channels=channels)

    def all_gather_async(self, x: Any, *, out: Any = None, chunk_bytes: int | None = None,
                         channels: int | None = None) -> Work:
        """`all_gather` in the background; returns a Work."""
        return self._submit("all_gather", self.all_gather, x, out=out,
                            chunk_bytes=chunk_bytes, channels=channels)

    def broadcast_async(self, x: Any, *, root: int = 0, chunk_bytes: int | None = None,
                        channels: int | None = None) -> Work:
        """`broadcast` in the background; returns a Work."""
        return self._submit("broadcast", self.broadcast, x, root=root,
                            chunk_bytes=chunk_bytes, channels=channels)

    def reduce_async(self, x: Any, *, op: ReduceOp | str = "sum", root: int = 0,
                     out: Any = None, chunk_bytes: int | None = None,
                     channels: int | None = None) -> Work:
        """`reduce` in the background; returns a Work (its result is None off the root)."""
        return self._submit("reduce", self.reduce, x, op=op, root=root, out=out,
                            chunk_bytes=chunk_bytes, channels=channels)

    def all_reduce_many(self, arrays: Sequence[Any], *, op: ReduceOp | str = "sum",
                        fusion_bytes: int | None = None) -> list[Any]:
        """`all_reduce` of each array, packed per dtype into buffers of at most
        `fusion_bytes` (GPURING_FUSION_BYTES, 64 MiB): results in input order."""
        from .fusion import all_reduce_many

        return all_reduce_many(self, arrays, op=op, fusion_bytes=fusion_bytes)

    def start_timeline(self, path: str | os.PathLike[str]) -> None:
        """Record every collective and ring round until `stop_timeline()`; every rank calls
        it. Rank 0 writes the merged Chrome trace to `path` at the stop."""
        self._ensure_open()
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

    def _submit(self, name: str, verb: Any, x: Any, **kwargs: Any) -> Work:
        self._ensure_open(name)
        with self._lock:
            if self._executor is None:
                self._executor = Executor()
        # views made here, in the caller's thread and on the caller's stream (torch's for a
        # torch tensor): DLPack orders them there, and the collective starts after it
        with interop.caller_stream(x):
            args, kwargs, restore = interop.convert((x,), kwargs)
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
