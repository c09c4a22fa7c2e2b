"""The Communicator: argument checks, cross-rank agreement, and dispatch to an engine."""

from __future__ import annotations

import threading
import weakref
from typing import Any

from . import _arrays
from ._config import Config
from ._errors import (
    CollectiveMismatchError,
    CommunicatorClosedError,
    GpuringError,
    PeerFailureError,
)
from ._ops import ReduceOp, check_op_dtype
from .algorithms.collectives import plan_collective
from .devices.base import Device
from .rendezvous.base import ControlPlane
from .scheduler import Engine

__all__ = ["Communicator"]

_SIGNATURE_FIELDS = ("collective", "device", "shape", "dtype", "op", "root")
_ALONE = object()  # prepared call of a world of one: nothing to plan


def _make_device(kind: str, control: ControlPlane, config: Config) -> Device:
    if kind == "cpu":
        if not control.single_node:
            raise GpuringError(
                "NumPy collectives across nodes are not supported yet: every rank of the "
                "job must run on one node (the host device maps peers' shared memory)")
        from .devices.host import SHM_PREFIX, HostDevice

        return HostDevice(name_prefix=f"{SHM_PREFIX}{control.job_id}-r{control.rank}-",
                          timeout=config.timeout)
    from .devices.cuda import CudaDevice

    return CudaDevice(device_id=control.local_rank, timeout=config.timeout)


def _release(engines: dict[str, Engine], control: ControlPlane) -> None:
    for engine in engines.values():
        engine.close()
    engines.clear()
    control.close()


class Communicator:
    """A group of ranks that run collectives together. Use `gpuring.init()` to get one.

    Every collective is called by every rank in the same order with matching arguments.
    NumPy arrays run on the host device and return when the result is complete.
    """

    def __init__(self, control: ControlPlane, config: Config | None = None):
        self._control = control
        self.config = config or Config.from_env()
        self._engines: dict[str, Engine] = {}
        self._agreed: set[tuple[Any, ...]] = set()
        self._prepared: dict[tuple[Any, ...], Any] = {}
        self._seq = 0
        self._lock = threading.RLock()
        self._broken: BaseException | None = None
        self._closed = False
        self._finalizer = weakref.finalize(self, _release, self._engines, control)
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

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Free buffers, unmap peers, leave the job. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._finalizer()
        from . import _world

        _world.forget(self)

    def _on_peer_failure(self, rank: int, reason: str) -> None:
        for engine in list(self._engines.values()):
            engine.device.abort(f"rank {rank} failed: {reason}")

    # -- collectives --------------------------------------------------------------------
    def all_reduce(self, x: Any, *, op: ReduceOp | str = "sum", out: Any = None,
                   chunk_bytes: int | None = None, channels: int | None = None) -> Any:
        """Element-wise reduction of `x` over all ranks; every rank gets the result.

        `out=x` reduces in place. Returns `out` (a new array when `out` is None).
        """
        rop = ReduceOp.parse(op)
        x = self._check_input(x, "all_reduce")
        check_op_dtype(rop, _arrays.dtype_name(x))
        out = self._check_out(out, x, x.shape, "all_reduce", may_alias=True)
        return self._run("all_reduce", x, out, x.size, rop, 0, chunk_bytes, channels)

    def reduce_scatter(self, x: Any, *, op: ReduceOp | str = "sum", out: Any = None,
                       chunk_bytes: int | None = None, channels: int | None = None) -> Any:
        """Reduce `x` over all ranks and keep this rank's block: block `rank` of the flattened
        result split into `size` equal blocks. `x.size` must be divisible by `size`."""
        rop = ReduceOp.parse(op)
        x = self._check_input(x, "reduce_scatter")
        check_op_dtype(rop, _arrays.dtype_name(x))
        if x.size % self.size:
            raise ValueError(f"reduce_scatter needs x.size divisible by the {self.size} ranks, "
                             f"got {x.size}; pad the array")
        out = self._check_out(out, x, (x.size // self.size,), "reduce_scatter")
        return self._run("reduce_scatter", x, out, x.size, rop, 0, chunk_bytes, channels)

    def all_gather(self, x: Any, *, out: Any = None, chunk_bytes: int | None = None,
                   channels: int | None = None) -> Any:
        """Every rank's `x` stacked in rank order: shape `(size, *x.shape)`."""
        x = self._check_input(x, "all_gather")
        check_op_dtype(ReduceOp.SUM, _arrays.dtype_name(x))
        out = self._check_out(out, x, (self.size, *x.shape), "all_gather")
        return self._run("all_gather", x, out, x.size, ReduceOp.SUM, 0, chunk_bytes, channels)

    def broadcast(self, x: Any, *, root: int = 0, chunk_bytes: int | None = None,
                  channels: int | None = None) -> Any:
        """Copy root's `x` into `x` on every rank (in place) and return it."""
        root = self._check_root(root)
        if not _arrays.device_kind(x) or not x.flags.c_contiguous:
            raise TypeError("broadcast works in place and needs a C-contiguous array; "
                            "pass numpy.ascontiguousarray(x) and use the returned array")
        check_op_dtype(ReduceOp.SUM, _arrays.dtype_name(x))
        return self._run("broadcast", x, x, x.size, ReduceOp.SUM, root, chunk_bytes, channels)

    def reduce(self, x: Any, *, op: ReduceOp | str = "sum", root: int = 0, out: Any = None,
               chunk_bytes: int | None = None, channels: int | None = None) -> Any:
        """Element-wise reduction of `x` over all ranks, delivered to `root` only: returns the
        result on root and None on the other ranks (`out` is only used on root)."""
        rop = ReduceOp.parse(op)
        root = self._check_root(root)
        x = self._check_input(x, "reduce")
        check_op_dtype(rop, _arrays.dtype_name(x))
        if self.rank == root:
            out = self._check_out(out, x, x.shape, "reduce", may_alias=True)
        else:
            out = None
        result = self._run("reduce", x, out, x.size, rop, root, chunk_bytes, channels)
        return result if self.rank == root else None

    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        self._ensure_open()
        if self.size == 1:
            return
        with self._lock:
            self._agree(("barrier", "-", (), "-", "-", 0))
            engine = next(iter(self._engines.values()), None) or self._engine("cpu")
            rounds = plan_collective("barrier", self.size, self.rank, 0, itemsize=1,
                                     capacity_bytes=self.config.buffer_bytes,
                                     chunk_bytes=1, channels=1)
            self._seq += 1
            self._execute(engine, rounds, "barrier", None, None, "uint8", 1, ReduceOp.SUM,
                          inline=True)

    # -- checks -------------------------------------------------------------------------
    def _ensure_open(self) -> None:
        if self._closed:
            raise CommunicatorClosedError("the communicator is closed; call gpuring.init() "
                                          "for a new one")
        if self._broken is not None:
            raise CommunicatorClosedError(
                f"the communicator failed earlier and can no longer be used "
                f"({self._broken}); close it and call gpuring.init() again") from self._broken

    def _check_input(self, x: Any, name: str) -> Any:
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
        signatures = self._control.allgather(signature, self.config.timeout)
        differences: dict[str, dict[int, object]] = {}
        for i, field in enumerate(_SIGNATURE_FIELDS):
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
        self._agreed.add(signature)

    def _engine(self, kind: str) -> Engine:
        engine = self._engines.get(kind)
        if engine is None:
            device = _make_device(kind, self._control, self.config)
            try:
                engine = Engine(device, self._control, capacity_bytes=self.config.buffer_bytes,
                                timeout=self.config.timeout)
            except BaseException:
                device.close()
                raise
            self._engines[kind] = engine
        return engine

    def _run(self, name: str, x: Any, out: Any, count: int, op: ReduceOp, root: int,
             chunk_bytes: int | None, channels: int | None) -> Any:
        self._ensure_open()
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
            engine, rounds, dtype, inline = prepared
            device = engine.device
            in_mem = device.wrap(x) if count else None
            out_mem = device.wrap(out) if out is not None and count else None
            self._execute(engine, rounds, name, in_mem, out_mem, dtype, x.dtype.itemsize, op,
                          inline=inline)
        return out

    def _prepare(self, name: str, x: Any, count: int, op: ReduceOp, root: int,
                 chunk_bytes: int | None, channels: int | None) -> Any:
        """Agree with the peers on this call's signature, then pick engine and plan."""
        kind = _arrays.device_kind(x)
        dtype = _arrays.dtype_name(x)
        self._agree((name, kind, tuple(x.shape), dtype, op.value, root))
        if self.size == 1:
            return _ALONE
        engine = self._engine(kind)
        device = engine.device
        chunk = chunk_bytes or self.config.chunk_bytes or device.default_chunk_bytes
        nchannels = channels or self.config.channels or device.default_channels
        Config(chunk_bytes=chunk, channels=nchannels).validate()
        rounds = plan_collective(
            name, self.size, self.rank, count, itemsize=x.dtype.itemsize,
            capacity_bytes=self.config.buffer_bytes, chunk_bytes=chunk, channels=nchannels,
            root=root, one_shot_bytes=self.config.one_shot_bytes)
        return engine, rounds, dtype, nchannels == 1

    def _execute(self, engine: Engine, rounds: Any, name: str, in_mem: Any, out_mem: Any,
                 dtype: str, itemsize: int, op: ReduceOp, *, inline: bool) -> None:
        device = engine.device
        try:
            finished = engine.run(rounds, name=name, collective_seq=self._seq, in_mem=in_mem,
                                  out_mem=out_mem, dtype=dtype, itemsize=itemsize, op=op,
                                  inline=inline, after=device.caller_event())
        except (GpuringError, OSError) as exc:
            self._broken = exc
            if not isinstance(exc, PeerFailureError):
                self._control.report_failure(f"rank {self.rank}: {exc}")
            raise
        if finished is not None:
            device.order_caller_after(finished)

    def _run_alone(self, name: str, x: Any, out: Any) -> Any:
        if name == "all_gather":
            out[0] = x
        elif name == "broadcast":
            return x
        elif out is not x:
            out[...] = x.reshape(out.shape)
        return out
