"""The Communicator: the verbs users call, its lifetime, async work and the timeline.

Each verb checks its arguments into a `Call` (`_argcheck`) and hands it to the communicator's
`CallPath` (`_callpath`), which prepares it once per kind (the ranks agree on its `Signature`,
a `Route` is picked, the engine plans it) and runs it. Barrier is a call without arrays; the
`*_async` verbs are the same verbs run by a background thread.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Concatenate, ParamSpec

import numpy as np

from . import _argcheck, _arrays, _p2p, _persistent, interop
from ._call import Call
from ._callpath import CallPath
from ._config import Config
from ._engine import Engine
from ._errors import (
    GpuringError,
)
from ._failures import Outcome, weakly
from ._groups import (
    Channel,
    Pairs,
    abort_channels,
    close_channels,
    split,
    synchronize_channels,
)
from ._hierarchy import LevelParts
from ._lastcalls import LastCalls
from ._messages import Messages
from ._ops import ReduceOp, check_op_dtype
from ._persistent import PersistentCollective
from ._timeline import write_trace
from ._watchdog import Watchdog
from ._work import Executor, Work, public_verb
from .rendezvous.base import ControlPlane

__all__ = ["Communicator"]

_P = ParamSpec("_P")


def _release(engines: dict[str, Engine], watchdog_parts: list[Any], control: ControlPlane,
             outcome: Outcome) -> None:
    """Close in order: tell the peers this rank is leaving, the engines (the watchdog still
    watching, so a peer that fails meanwhile ends the close's wait at once), the watchdog, the
    status board's memory, the control plane. Runs once, from close() or when the
    communicator is garbage collected."""
    for item in watchdog_parts:
        if isinstance(item, Watchdog):
            item.leaving()
    for engine in engines.values():
        engine.close(control, orderly=outcome.orderly)
    for item in watchdog_parts:  # Watchdog first, then the HostDevice that holds the board
        item.close()
    watchdog_parts.clear()
    control.close()


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
                 on_close: Callable[[Communicator], None] | None = None,
                 messages: bool = True):
        """`on_close(comm)` runs once the communicator closed (gpuring.init uses it to forget
        the job's communicator). `messages=False`: no point-to-point messages of NumPy
        arrays, and no setup for them (a pair's channel, made by one rank at a time)."""
        self._control = control
        self.config = config or Config.from_env()
        self._on_close = on_close
        cls, config = type(self), self.config  # (the path must not hold the communicator)
        self._path = CallPath(control, config, lambda group: _level(cls(group, config)))
        self._executor: Executor | None = None  # the async thread, made by the first *_async
        self._executor_lock = threading.Lock()
        self._last_calls = LastCalls()
        self._splits = 0  #: split() calls so far (the same on every rank)
        self._shrinks = 0  #: shrink() calls so far (the same on every survivor)
        #: point-to-point messages: a channel per peer
        self._pairs = Pairs(self._path, control, self.config,
                            lambda group, config: _channel(cls(group, config, messages=False)))
        path = self._path
        self._finalizer = weakref.finalize(self, _release, *path.held())
        control.on_peer_failure(weakly(path.on_peer_failure))
        #: point-to-point messages of NumPy arrays (set up with every rank now)
        self._messages = Messages(path, control, self.config.transport, self.config.timeout,
                                  setup=messages)
        path.watchdog_parts.append(self._messages.parts())  # (closed with the communicator)

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
        return self._path.closed

    def __repr__(self) -> str:
        return (f"<gpuring.Communicator rank {self.rank} of {self.size}, "
                f"{self._path.state}>")

    # -- collectives --------------------------------------------------------------------
    @public_verb
    def all_reduce(self, x: Any, *, op: ReduceOp | str = "sum", out: Any = None,
                   chunk_bytes: int | None = None, channels: int | None = None,
                   compression: str | None = None, algorithm: str | None = None) -> Any:
        """Element-wise reduction of `x` over all ranks; every rank gets the result.

        `out=x` reduces in place. Returns `out` (a new array when `out` is None).
        `compression="fp16"|"bf16"` sends float32/float64 through the ring in that format.
        `algorithm="ring"|"two_shot"|"one_shot"` picks the schedule (GPURING_ALGORITHM).
        """
        if compression is not None:
            return self._all_reduce_compressed(x, op, out, chunk_bytes, channels, compression,
                                               algorithm)
        return self._run("all_reduce", x, out, (op, chunk_bytes, channels, algorithm), lambda: (
            _argcheck.all_reduce(x, op, out, chunk_bytes, channels, algorithm)))

    @public_verb
    def reduce_scatter(self, x: Any, *, op: ReduceOp | str = "sum", out: Any = None,
                       chunk_bytes: int | None = None, channels: int | None = None,
                       algorithm: str | None = None) -> Any:
        """Reduce `x` over all ranks and keep this rank's block: block `rank` of the flattened
        result split into `size` equal blocks. `x.size` must be divisible by `size`. In place:
        `out=x.reshape(size, -1)[rank]`. `algorithm="ring"|"two_shot"` picks the schedule."""
        return self._run("reduce_scatter", x, out, (op, chunk_bytes, channels, algorithm),
                         lambda: _argcheck.reduce_scatter(x, op, out, chunk_bytes, channels,
                                                          self.size, self.rank, algorithm))

    @public_verb
    def all_gather(self, x: Any, *, out: Any = None, chunk_bytes: int | None = None,
                   channels: int | None = None) -> Any:
        """Every rank's `x` stacked in rank order: shape `(size, *x.shape)`. In place: pass
        `x=out[rank]` with `out`."""
        return self._run("all_gather", x, out, (chunk_bytes, channels), lambda: (
            _argcheck.all_gather(x, out, chunk_bytes, channels, self.size, self.rank)))

    @public_verb
    def broadcast(self, x: Any, *, root: int = 0, out: Any = None,
                  chunk_bytes: int | None = None, channels: int | None = None) -> Any:
        """Copy root's `x` into `x` on every rank (in place) and return it; with `out`, into
        `out` instead (`x` is then read on root only, and must match `out` everywhere)."""
        return self._run("broadcast", x, out, (root, chunk_bytes, channels), lambda: (
            _argcheck.broadcast(x, root, out, chunk_bytes, channels, self.size)))

    @public_verb
    def reduce(self, x: Any, *, op: ReduceOp | str = "sum", root: int = 0, out: Any = None,
               chunk_bytes: int | None = None, channels: int | None = None,
               algorithm: str | None = None) -> Any:
        """Element-wise reduction of `x` over all ranks, delivered to `root` only: returns the
        result on root and None on the other ranks (`out` is only used on root).
        `algorithm="ring"|"two_shot"` picks the schedule (ring: a chain)."""
        result = self._run("reduce", x, out, (op, root, chunk_bytes, channels, algorithm),
                           lambda: _argcheck.reduce(x, op, root, out, chunk_bytes, channels,
                                                    self.size, self.rank, algorithm))
        return result if self.rank == root else None

    @public_verb
    def gather(self, x: Any, *, root: int = 0, out: Any = None,
               chunk_bytes: int | None = None, channels: int | None = None) -> Any:
        """Every rank's `x` stacked in rank order on `root`: shape `(size, *x.shape)` there
        (`out`, used on root only), None on the other ranks."""
        result = self._run("gather", x, out, (root, chunk_bytes, channels), lambda: (
            _argcheck.gather(x, root, out, chunk_bytes, channels, self.size, self.rank)))
        return result if self.rank == root else None

    @public_verb
    def scatter(self, x: Any, *, root: int = 0, out: Any = None,
                chunk_bytes: int | None = None, channels: int | None = None) -> Any:
        """Block `rank` of root's `x`: every rank passes `x` of shape `(size, *block)` (only
        root's content is read) and gets `x[rank]` of root's, in `out` if given."""
        return self._run("scatter", x, out, (root, chunk_bytes, channels), lambda: (
            _argcheck.scatter(x, root, out, chunk_bytes, channels, self.size)))

    @public_verb
    def all_to_all(self, x: Any, *, out: Any = None, chunk_bytes: int | None = None,
                   channels: int | None = None) -> Any:
        """Every rank sends block j of `x` (shape `(size, *block)`) to rank j: `out[j]` is
        rank j's `x[rank]`. `out` must not overlap `x`."""
        return self._run("all_to_all", x, out, (chunk_bytes, channels), lambda: (
            _argcheck.all_to_all(x, out, chunk_bytes, channels, self.size)))

    def all_gather_v(self, x: Any) -> list[Any]:
        """Every rank's `x` in rank order, as a list: first dimensions may differ between
        ranks, the other dimensions and the dtype may not. (Two collectives: the shapes, then
        the data padded to the largest; see docs/api.md.)"""
        from ._uneven import all_gather_v

        return all_gather_v(self, x)

    def all_to_all_v(self, blocks: Sequence[Any]) -> list[Any]:
        """`blocks[j]` (a sequence of `size` arrays of one dtype, any shapes, empty ones
        too) goes to rank j; returns the list of what every rank sent this one, `result[j]`
        from rank j with the shape rank j gave it."""
        from ._uneven import all_to_all_v

        return all_to_all_v(self, blocks)

    def reduce_scatter_v(self, x: Any, counts: Sequence[int], *,
                         op: ReduceOp | str = "sum") -> Any:
        """This rank's share of the flattened reduction of `x`: elements
        `[sum(counts[:rank]), sum(counts[:rank + 1]))`; `counts` (non-negative, summing to
        `x.size`) the same on every rank, else CollectiveMismatchError on every rank."""
        from ._uneven import reduce_scatter_v

        return reduce_scatter_v(self, x, counts, op)

    # -- point to point, sub-communicators ----------------------------------------------
    def isend(self, x: Any, dst: int, tag: int = 0) -> Work:
        """Start sending `x` (NumPy) to rank `dst` with `tag`; returns a Work at once, whose
        `wait()` returns once `x` may be changed again. Only the two ranks of a message take
        part; messages of one pair and tag are received in the order sent. See docs/api.md,
        "Point to point"."""
        return _p2p.isend(self._messages, x, dst, tag)

    def irecv(self, out: Any, src: int | None = None, tag: int = 0) -> Work:
        """Start receiving into `out` (NumPy, C-contiguous, writable) the next message with
        `tag` from rank `src` (None: any rank); returns a Work at once, whose `wait()`
        returns `out` and whose `source`, `tag` and `count` (elements) then say what came.
        The message must have `out`'s dtype and at most `out.size` elements (else
        CollectiveMismatchError, on both ranks)."""
        return _p2p.irecv(self._messages, out, src, tag)

    def send(self, x: Any, dst: int, tag: int = 0) -> None:
        """`isend(x, dst, tag).wait()`: returns once `x` may be changed again (a small message
        once it lies in the receiver's inbox). CuPy arrays: queued on the stream, tag 0."""
        _p2p.send(self._messages, self._pairs, x, dst, tag)

    def recv(self, out: Any, src: int | None = None, tag: int = 0) -> Any:
        """`irecv(out, src, tag).wait()`: the next message with `tag` from `src` (None: any
        rank) in `out`, which it returns. CuPy arrays: from a rank `src`, with its shape."""
        return _p2p.recv(self._messages, self._pairs, out, src, tag)

    def sendrecv(self, x: Any, dst: int, out: Any, src: int, tag: int = 0) -> Any:
        """Send `x` to `dst` and receive from `src` into `out` at once, and return `out`;
        neither half waits for the other, so every rank calling
        `sendrecv(x, (rank + 1) % size, out, (rank - 1) % size)` shifts a ring without
        deadlock. `dst == src` exchanges with one peer; `dst == src == rank` copies. `out`
        must not overlap `x`."""
        return _p2p.sendrecv(self._messages, self._pairs, x, dst, out, src, tag)

    def group(self) -> contextlib.AbstractContextManager[None]:
        """`with comm.group(): ...`: the `isend`s and `irecv`s inside start together at its
        end (NCCL's ncclGroupStart/End), so their order on each rank never matters; wait
        for their works after it."""
        return self._messages.group()

    def batch(self, ops: Sequence[Any]) -> list[Work]:
        """torch's `batch_isend_irecv`: `ops` (each `("isend", x, dst)` or `("irecv", out,
        src)`, a tag after it optional) posted as one group; their works, in order."""
        return list(_p2p.batch(self._messages, ops))

    def split(self, color: int | None, key: int = 0) -> Communicator | None:
        """A new communicator of the ranks that pass the same `color` (an int >= 0), ranked
        by `(key, rank)`; `color=None` takes part but joins none and returns None (MPI's
        MPI_UNDEFINED). A collective of this communicator: every rank calls it in the same
        order as its other collectives. The new communicator has its own sequence numbers
        and buffers: collectives on it and on this one (or on its siblings) may interleave
        in any order that each communicator's ranks share, and it stays usable after this
        one closes. Close it on all its ranks, sub-communicators in the same order on every
        rank (a close waits for the peers' closes)."""
        cls, config = type(self), self.config
        return split(self._path, self._control, self._count_split, color, key,
                     lambda group: cls(group, config), self._drain_async)

    def _count_split(self) -> int:
        self._splits += 1
        return self._splits

    def shrink(self) -> Communicator:
        """A new communicator of the ranks still alive, renumbered in rank order, with its
        own buffers and sequence numbers: after a peer died (`PeerFailureError`), the
        survivors go on there (MPI ULFM's `MPIX_Comm_shrink`). Every survivor calls it; they
        agree on who is alive (a rank that dies meanwhile is left out by every survivor
        alike), bounded by the timeout. Needs ranks that outlive a death: `gpuring run
        --keep-going`, torchrun, or ranks started by hand (mpiexec ends the job; see
        docs/faults.md, "Shrink and carry on"). This communicator stays as it is: close it."""
        from ._shrink import shrink

        cls, config = type(self), self.config
        self._shrinks += 1
        number = self._shrinks
        return shrink(self._control, lambda: number, lambda group: cls(group, config),
                      config.timeout)

    def _run(self, verb: str, x: Any, out: Any, args: tuple[Any, ...],
             check: Callable[[], Call]) -> Any:
        """Run `verb`'s call: the last one's again where the same arrays and `args` (every
        other argument) come again, else the call `check()` makes of them."""
        last_calls = self._last_calls
        call = last_calls.find(verb, x, out, args)
        if call is not None:
            generation = call.generation
            result = self._path.run(call)
            if call.generation != generation:  # prepared anew: keep what it worked out
                last_calls.remember(verb, x, out, args, call)
            return result
        call = check()
        result = self._path.run(call)
        last_calls.remember(verb, x, out, args, call)
        return result

    # -- registered memory ----------------------------------------------------------------
    def empty(self, shape: int | Sequence[int], dtype: Any = "float64", *,
              device: str = "cpu") -> Any:
        """A new array (NumPy for `device="cpu"`, CuPy for `"cuda"`) in memory every peer
        maps: collectives on such arrays read the peers' arrays where they lie instead of
        staging them through the communication buffers (see docs/design.md,
        "Registered memory"). Every rank calls it alike, as a collective (the same shape, dtype and
        device, in the same order as its other collectives), and a call on such arrays must
        pass them alike on every rank: the same offsets into them (`x=out[rank]` for an
        all_gather in place). The memory is zero-filled. It stays valid for as long as the
        array (or a view of it) lives; once the communicator is closed, it is an ordinary
        array. The communicator keeps it (and its peers' mappings of it) until it closes:
        allocate registered arrays once and reuse them. Where there is no peer to map it (a
        world of one, NumPy collectives through MPI, CuPy collectives through NCCL) it is an
        ordinary array from the start."""
        return self._registered("empty", shape, dtype, device)

    def zeros(self, shape: int | Sequence[int], dtype: Any = "float64", *,
              device: str = "cpu") -> Any:
        """`empty` (whose memory is zero-filled): a registered array of zeros."""
        return self._registered("zeros", shape, dtype, device)

    def _registered(self, name: str, shape: int | Sequence[int], dtype: Any,
                    device: str) -> Any:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"{name}: device must be 'cpu' or 'cuda', got {device!r}")
        dims = (shape,) if isinstance(shape, int) else tuple(shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in dims):
            raise ValueError(f"{name}: shape must be non-negative ints, got {shape!r}")
        xp = _arrays.module_for(device)
        dtype = np.dtype(dtype)
        check_op_dtype(ReduceOp.SUM, dtype.name)  # what no collective takes is refused first
        self._drain_async()
        array = self._path.register(device, dims, dtype)
        if array is None:  # nobody to map it: an ordinary array
            array = xp.zeros(dims, dtype=dtype)
        return array

    @public_verb
    def barrier(self) -> None:
        """Return once every rank has entered the barrier."""
        if self.size == 1:  # nothing to wait for, and no collective to count
            self._path.check("barrier")
            return
        self._path.run(Call("barrier"))

    # -- persistent collectives (MPI_Allreduce_init and its twins) -----------------------
    def all_reduce_init(self, x: Any, *, op: ReduceOp | str = "sum", out: Any = None,
                        chunk_bytes: int | None = None, channels: int | None = None,
                        algorithm: str | None = None) -> PersistentCollective:
        """`all_reduce` as a persistent collective: arguments checked and agreed on now (a
        collective call), then `op.start()` / `op.wait()` (or `op()`) any number of times
        on these arrays. See `PersistentCollective`; the twins below are alike."""
        return self._init("all_reduce", x, out, lambda x, out: _argcheck.all_reduce(
            x, op, out, chunk_bytes, channels, algorithm))

    def reduce_scatter_init(self, x: Any, *, op: ReduceOp | str = "sum", out: Any = None,
                            chunk_bytes: int | None = None, channels: int | None = None,
                            algorithm: str | None = None) -> PersistentCollective:
        """`reduce_scatter` as a persistent collective (see `all_reduce_init`)."""
        return self._init("reduce_scatter", x, out, lambda x, out: _argcheck.reduce_scatter(
            x, op, out, chunk_bytes, channels, self.size, self.rank, algorithm))

    def all_gather_init(self, x: Any, *, out: Any = None, chunk_bytes: int | None = None,
                        channels: int | None = None) -> PersistentCollective:
        """`all_gather` as a persistent collective (see `all_reduce_init`)."""
        return self._init("all_gather", x, out, lambda x, out: _argcheck.all_gather(
            x, out, chunk_bytes, channels, self.size, self.rank))

    def broadcast_init(self, x: Any, *, root: int = 0, out: Any = None,
                       chunk_bytes: int | None = None,
                       channels: int | None = None) -> PersistentCollective:
        """`broadcast` as a persistent collective (see `all_reduce_init`)."""
        return self._init("broadcast", x, out, lambda x, out: _argcheck.broadcast(
            x, root, out, chunk_bytes, channels, self.size))

    def reduce_init(self, x: Any, *, op: ReduceOp | str = "sum", root: int = 0,
                    out: Any = None, chunk_bytes: int | None = None,
                    channels: int | None = None,
                    algorithm: str | None = None) -> PersistentCollective:
        """`reduce` as a persistent collective (see `all_reduce_init`); `wait()` gives None
        off the root."""
        return self._init("reduce", x, out, lambda x, out: _argcheck.reduce(
            x, op, root, out, chunk_bytes, channels, self.size, self.rank, algorithm),
            returns=self.rank == root)

    def gather_init(self, x: Any, *, root: int = 0, out: Any = None,
                    chunk_bytes: int | None = None,
                    channels: int | None = None) -> PersistentCollective:
        """`gather` as a persistent collective (see `all_reduce_init`); `wait()` gives None
        off the root."""
        return self._init("gather", x, out, lambda x, out: _argcheck.gather(
            x, root, out, chunk_bytes, channels, self.size, self.rank),
            returns=self.rank == root)

    def scatter_init(self, x: Any, *, root: int = 0, out: Any = None,
                     chunk_bytes: int | None = None,
                     channels: int | None = None) -> PersistentCollective:
        """`scatter` as a persistent collective (see `all_reduce_init`)."""
        return self._init("scatter", x, out, lambda x, out: _argcheck.scatter(
            x, root, out, chunk_bytes, channels, self.size))

    def all_to_all_init(self, x: Any, *, out: Any = None, chunk_bytes: int | None = None,
                        channels: int | None = None) -> PersistentCollective:
        """`all_to_all` as a persistent collective (see `all_reduce_init`)."""
        return self._init("all_to_all", x, out, lambda x, out: _argcheck.all_to_all(
            x, out, chunk_bytes, channels, self.size))

    def barrier_init(self) -> PersistentCollective:
        """`barrier` as a persistent collective (MPI_Barrier_init; see `all_reduce_init`)."""
        return self._init("barrier", None, None, lambda x, out: Call("barrier"))

    def _init(self, name: str, x: Any, out: Any, check: Callable[[Any, Any], Call],
              returns: bool = True) -> PersistentCollective:
        return _persistent.init(self._path, self._drain_async, name, x, out, check, returns)

    all_reduce_async = _in_background(all_reduce)
    reduce_scatter_async = _in_background(reduce_scatter)
    all_gather_async = _in_background(all_gather)
    broadcast_async = _in_background(broadcast)
    reduce_async = _in_background(reduce)
    gather_async = _in_background(gather)
    scatter_async = _in_background(scatter)
    all_to_all_async = _in_background(all_to_all)

    def all_reduce_many(self, arrays: Sequence[Any], *, op: ReduceOp | str = "sum",
                        fusion_bytes: int | None = None) -> list[Any]:
        """`all_reduce` of each array, packed per dtype into buffers of at most
        `fusion_bytes` (GPURING_FUSION_BYTES, 64 MiB): results in input order."""
        from ._fusion import all_reduce_many

        return all_reduce_many(self, arrays, op=op, fusion_bytes=fusion_bytes)

    def _all_reduce_compressed(self, x: Any, op: ReduceOp | str, out: Any,
                               chunk_bytes: int | None, channels: int | None,
                               compression: str, algorithm: str | None) -> Any:
        from ._compression import all_reduce_compressed, wire_dtype

        if self.config.deterministic:
            raise GpuringError("all_reduce: deterministic mode has no compressed all_reduce: "
                               "compression rounds each rank's values to 16 bits before they "
                               "are reduced, so its result is not the fold of the values")
        _argcheck.check_algorithm("all_reduce", algorithm)
        rop = ReduceOp.parse(op)
        x = _argcheck.input_array(x)
        wire_dtype(compression)  # a bad name is the first thing to hear of
        if _arrays.dtype_name(x) in ("float32", "float64"):
            out = _argcheck.output_array(out, x, x.shape, "all_reduce",
                                         in_place=lambda out: _arrays.same_memory(out, x),
                                         hint="out=x")
        return all_reduce_compressed(self, x, op=rop, out=out, compression=compression,
                                     chunk_bytes=chunk_bytes, channels=channels,
                                     algorithm=algorithm)

    @property
    def last_schedule(self) -> str:
        """What this rank's last collective ran, in words: "ring", "chain", "two_shot",
        "one_shot", "registered two_shot" (and the other registered forms), "fused"
        (a GPU collective as one kernel or stream operations), "kernels" (one kernel per
        piece, recorded into a CUDA graph), "exchange" (gather, scatter, all_to_all), "mpi",
        "alone", "barrier".
        `gpuring bench` reports it per size."""
        return self._path.last_schedule

    def chunk_bytes_for(self, device: str) -> int:
        """The piece size collectives on `device` arrays ("cpu", "cuda") use where a call
        sets none: GPURING_CHUNK_BYTES (`init(chunk_bytes=)`), else the device's default for
        this job (on ranks that share a GPU a whole buffer region, once the first
        collective on it made its engine)."""
        return self._path.default_chunk_bytes(device)

    @property
    def device_operations(self) -> int:
        """Driver calls this rank's collectives have made so far to enqueue work or make
        events (kernel launches, copies, stream memory operations, event creations, records
        and waits; setup, abort and close not counted): on a GPU, the host cost of the
        collectives in calls. 0 on the host device, which calls no driver. `gpuring bench`
        reports it per collective."""
        return self._path.device_operations()

    # -- failures -----------------------------------------------------------------------
    def dump_trace(self) -> str | None:
        """Write this rank's flight recorder now: the last collectives of every communicator
        of this process (GPURING_TRACE_ENTRIES of each), as JSON, to GPURING_TRACE_DIR (see
        docs/faults.md); returns the file's path (None where the recorder is off). Not a
        collective: any rank, any thread, any time. `gpuring doctor DIR` reads the files."""
        return self._path.dump_trace("dump_trace()")

    def abort(self, reason: str = "aborted by the user") -> None:
        """Fail this communicator now, from any thread: pending waits raise at once, peers
        are told, and later calls raise CommunicatorClosedError. Close it afterwards."""
        self._abort(reason)

    def _abort(self, reason: str, job_peer: int | None = None) -> None:
        """`abort`, telling the peers which rank of the job it is because of (`job_peer`,
        where the communicator is a part of another that failed: a level across nodes)."""
        pairs = self._pairs
        self._path.abort(reason, job_peer, lambda: abort_channels(pairs, reason, job_peer))

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
        self._messages.leave()
        unraised = self._path.close(close_channels(self._pairs) if self._pairs else None)
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
        pairs, messages = self._pairs, self._messages

        def also() -> None:
            messages.progress_now()
            if pairs:
                synchronize_channels(pairs)

        self._path.synchronize("synchronize", also)

    # -- training features: async, timeline --------------------------------------------
    def start_timeline(self, path: str | os.PathLike[str]) -> None:
        """Record every collective and ring round until `stop_timeline()`; every rank calls
        it. Rank 0 writes the merged Chrome trace to `path` at the stop."""
        self._path.check("")
        self._drain_async()
        self._path.start_timeline(os.fspath(path))

    def stop_timeline(self) -> str | None:
        """Stop recording; every rank calls it. Rank 0 writes the trace of all ranks and
        returns its path; the other ranks return None."""
        self._drain_async()
        timeline = self._path.stop_timeline()
        if timeline is None:
            return None
        per_rank = self._control.exchange("stop_timeline()", timeline.events,
                                          self.config.timeout)
        if self.rank != 0:
            return None
        write_trace(timeline.path, per_rank)
        return timeline.path

    def _submit(self, name: str, verb: Callable[..., Any], *args: Any, **kwargs: Any) -> Work:
        self._path.check(name)
        x = args[0]
        with self._executor_lock:
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
        timeline = self._path.timeline
        if timeline is None:
            return
        try:
            self.stop_timeline()
        except Exception as exc:
            path = f"{timeline.path}.rank{self.rank}.json"
            write_trace(path, [[] for _ in range(self.rank)] + [timeline.events])
            warnings.warn(f"timeline: could not merge the ranks' events ({exc}); wrote this "
                          f"rank's to {path}", RuntimeWarning, stacklevel=3)


def _level(comm: Communicator) -> LevelParts:
    """`comm` as a level of a communicator across nodes (`_hierarchy.Levels`) sees it."""
    path = comm._path
    return LevelParts(comm, comm._abort, path.current_watchdog)


def _channel(comm: Communicator) -> Channel:
    """`comm` as a pair's channel of point-to-point messages (`_groups.Pairs`) sees it."""
    path = comm._path
    return Channel(comm, comm._submit, path.current_watchdog,
                   functools.partial(comm._close, report=True), comm._abort)
