"""CuPy collectives carried by NCCL (`cupy.cuda.nccl`): the path where CUDA IPC cannot map a
peer's memory (between nodes, between GPUs without peer access). Each call is queued on the
caller's stream and returns at once, as every CuPy collective of gpuring does.

Bounded, with NCCL's own means. ncclCommInitRank waits for every rank without a limit, so the
communicator is made on a thread and waited for within the timeout (a communicator that comes
after that is aborted). Connections are made within the timeout too: the collectives' at init
(NCCL_RUNTIME_CONNECT=0 unless set otherwise), the point-to-point channels' before the first
point-to-point verb, by a byte each way between every pair of ranks, bounded alike; so no
later call waits on the host for its peers. Every call records an event before and after it,
and a watcher thread (every 50 ms) fails the communicator when a call has not completed within
the timeout of the moment the stream reached it, when NCCL reports an asynchronous error
(ncclCommGetAsyncError), or when the control plane learns that a rank failed (a notice to the
job, a watch of the node's status board); failing aborts the NCCL communicator (ncclCommAbort),
which ends its calls still queued or running, so the caller's stream goes on. NCCL's calls on
one communicator never overlap (a lock): the caller's enqueue and the watcher's query and abort
take turns.

gather, scatter and all_to_all are NCCL's point-to-point calls, grouped.

Types: NCCL's own; bytes moved (all_gather, broadcast, the point-to-point verbs) as uint8
whatever the dtype; complex sums as pairs of reals, complex products as an all_gather and a
fold in rank order. avg is a sum divided afterwards (integers rounded toward zero, as
gpuring's own avg).
"""

from __future__ import annotations

import collections
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import settings
from .._errors import CollectiveTimeoutError, GpuringError, PeerFailureError
from .._ops import ReduceOp, divide_toward_zero, fold
from ..rendezvous.base import ControlPlane
from ._nccl_lib import (
    OPS,
    TYPES,
    WIDER,
    bounded,
    load_nccl,
    nccl_id_argument,
    nccl_id_bytes,
    reduces,
    shared_gpus,
)

__all__ = ["NcclCollectives", "load_nccl", "nccl_id_argument", "nccl_id_bytes", "reduces"]

_TICK = 0.05
#: the reductions
_FOLDS = ("all_reduce", "reduce_scatter", "reduce")
#: the verbs made of point-to-point calls
_EXCHANGES = ("gather", "scatter", "all_to_all")


class NcclCollectives:
    """A communicator's collectives on one NCCL communicator of its ranks (made here,
    collectively: every rank calls it with its control plane). `on_failure(error)` is called
    once, from the watcher thread, when the communicator fails by itself."""

    def __init__(self, control: ControlPlane, device: int, timeout: float,
                 on_failure: Callable[[GpuringError], None]):
        import cupy

        self._cupy, self._control, self._timeout = cupy, control, timeout
        self._device = device
        self._on_failure = on_failure
        #: an abort asked for (any thread), seen without the lock by bounded waits
        self._aborting: GpuringError | None = None
        node = settings.get("GPURING_HOSTNAME")
        if node:  # NCCL's nodes are gpuring's: NCCL refuses two ranks on one GPU of one node
            os.environ.setdefault("NCCL_HOSTID", node)
        why, unique, gpu = None, None, ""
        shares = os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") == "1"
        try:
            nccl = load_nccl()
            if control.rank == 0:
                unique = nccl_id_bytes(nccl.get_unique_id())
            gpu = f"{os.environ.get('NCCL_HOSTID') or socket.gethostname()}|" \
                  f"{cupy.cuda.Device(device).pci_bus_id}"  # (as NCCL tells GPUs apart)
        except Exception as exc:
            why = str(exc)
        met = control.exchange("NCCL communicator", (why, unique, gpu, shares), timeout)
        missing = [f"rank {r}: {w}" for r, (w, _, _, _) in enumerate(met) if w]
        if missing:
            raise GpuringError("; ".join(missing))
        shared = shared_gpus([g for _, _, g, _ in met])
        if shared and not all(met[r][3] for r in shared):
            raise GpuringError(  # (NCCL would fail those ranks alone, the rest would wait)
                f"ranks {shared} of one node share a GPU, which NCCL takes only with "
                "NCCL_MULTI_RANK_GPU_ENABLE=1 on each of them")
        self._nccl = nccl
        os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")  # (read by NCCL at its first init)
        self.comm = self._make(met[0][1], device)
        #: the calls not known complete: (started, done, name, when the stream reached it)
        self._pending: collections.deque[_Pending] = collections.deque()
        self._lock = threading.Lock()  # the state below and every call of `comm`
        self.failure: GpuringError | None = None
        self._closed = False
        self._peers_connected = False  #: point-to-point channels made (`_connect_peers`)
        self._scratch: Any = None  #: their first bytes' memory
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="gpuring-nccl", daemon=True)
        self._watcher.start()

    def _make(self, unique: bytes, device: int) -> Any:
        """ncclCommInitRank on a thread of its own (it waits for every rank, unbounded),
        waited for within the timeout, or until the job learns that a rank failed; a
        communicator that comes after that is aborted."""
        control, cupy, nccl = self._control, self._cupy, self._nccl

        def make() -> Any:  # (this thread's device for good: restoring it makes a context)
            cupy.cuda.runtime.setDevice(device)
            try:
                return nccl.NcclCommunicator(
                    control.size, nccl_id_argument(unique, cupy.__version__), control.rank)
            except OverflowError:  # an old CuPy where C char is unsigned
                return nccl.NcclCommunicator(
                    control.size, nccl_id_argument(unique, cupy.__version__, False),
                    control.rank)

        return bounded(make, self._timeout, self._control.rank, self._stop_waiting, "made",
                       "NCCL communicator", abort_late=True)

    def _stop_waiting(self) -> GpuringError | None:
        """Why a bounded wait should end now: an abort asked for, or the job's failure."""
        return self._aborting or self._job_failure()

    def _job_failure(self) -> GpuringError | None:
        """A failure the control plane learned: a notice to the job, or a watch's (the
        node's status board)."""
        notice = self._control.failure_notice()
        if notice is not None:
            return notice
        return self._control.watched_failure()

    def _connect_peers(self, ptr: int) -> None:
        """(Under the lock, before the first point-to-point call, queued on stream `ptr`.)
        Connect NCCL's point-to-point channels to every peer, bounded: NCCL connects them at
        a peer's first send or recv, in a groupEnd that waits on the host for the peer
        (NCCL_RUNTIME_CONNECT covers the collectives only). One byte each way between every
        pair, in one group; its groupEnd (the host's part) is bounded here, its kernels as
        the call's that follows them on the stream. A connection that does not come within
        the timeout aborts the communicator (which ends the wait) and fails the transport.
        (NCCL's abort is meant to end a wait of another thread in it.)"""
        cupy, nccl, size, rank = self._cupy, self._nccl, self._control.size, self._control.rank
        if size < 2 or self._peers_connected:
            return
        self._scratch = scratch = cupy.zeros(2 * size, cupy.uint8)  # (kept: the kernels use it)

        def connect() -> None:
            cupy.cuda.runtime.setDevice(self._device)
            with contextlib.ExitStack() as undo:
                nccl.groupStart()
                undo.callback(_end_group_quietly, nccl)
                for peer in range(size):
                    if peer != rank:
                        self.comm.send(scratch.data.ptr + peer, 1, nccl.NCCL_UINT8, peer, ptr)
                        self.comm.recv(scratch.data.ptr + size + peer, 1, nccl.NCCL_UINT8,
                                       peer, ptr)
                undo.pop_all()
            nccl.groupEnd()

        def give_up(error: GpuringError) -> None:  # (the lock is held)
            self.failure = error
            self._pending.clear()
            self._stop.set()
            self.comm.abort()

        bounded(connect, self._timeout, rank, self._stop_waiting, "connected to its peers",
                "NCCL communicator", on_timeout=give_up)
        self._peers_connected = True

    # -- the collectives -------------------------------------------------------------------
    def run(self, name: str, x: Any, out: Any, op: ReduceOp, root: int, size: int) -> None:
        """Queue collective `name` of C-contiguous CuPy `x` into `out` on the current stream
        (`out` as the MPI transport takes it: x itself in place, all_gather's out holding x
        as this rank's slot, reduce_scatter's out x's block of this rank, None off a
        reduce's root)."""
        cupy = self._cupy
        stream = cupy.cuda.get_current_stream()
        started = cupy.cuda.Event(block=False, disable_timing=True)
        done = cupy.cuda.Event(block=False, disable_timing=True)
        with self._lock:
            self._check()
            started.record(stream)
            self._enqueue(name, x, out, op, root, size, int(stream.ptr))
            done.record(stream)
            self._pending.append(_Pending(started, done, name))

    def _enqueue(self, name: str, x: Any, out: Any, op: ReduceOp, root: int, size: int,
                 ptr: int) -> None:
        cupy, nccl, c = self._cupy, self._nccl, self.comm
        if name in _EXCHANGES:
            self._exchange(name, x, out, root, size, ptr)
            return
        if name in _FOLDS and not reduces(x.dtype, op):
            self._gathered_fold(name, x, out, op, root, size, ptr)
            return
        if name in ("all_gather", "broadcast"):  # bytes
            count, t = x.nbytes, nccl.NCCL_UINT8
            if name == "all_gather":
                c.allGather(x.data.ptr, out.data.ptr, count, t, ptr)
            else:
                c.broadcast(x.data.ptr, out.data.ptr, count, t, root, ptr)
        else:
            send, target, t, nop, widened = self._typed(x, out, op)
            if name == "all_reduce":
                c.allReduce(send.data.ptr, target.data.ptr, send.size, t, nop, ptr)
            elif name == "reduce_scatter":
                c.reduceScatter(send.data.ptr, target.data.ptr, target.size, t, nop, ptr)
            else:  # reduce: only root's out is written
                c.reduce(send.data.ptr, 0 if target is None else target.data.ptr, send.size,
                         t, nop, root, ptr)
            if widened and target is not None:  # back into out, rounded once
                out[...] = target.astype(out.dtype)
            if op is ReduceOp.AVG and out is not None:
                _divide(cupy, out, size)

    def _gathered_fold(self, name: str, x: Any, out: Any, op: ReduceOp, root: int, size: int,
                       ptr: int) -> None:
        """A reduction NCCL lacks (a complex product): every rank's input gathered, then
        folded in rank order (this rank's block of a reduce_scatter; on root of a reduce)."""
        rank = self._control.rank
        everyone = self._cupy.empty((size, x.size), x.dtype)
        self.comm.allGather(x.data.ptr, everyone.data.ptr, x.nbytes, self._nccl.NCCL_UINT8, ptr)
        if name == "reduce" and rank != root:
            return
        if name == "reduce_scatter":
            block = x.size // size
            everyone = everyone[:, rank * block:(rank + 1) * block]
        out[...] = fold(list(everyone), op).reshape(out.shape)

    def _exchange(self, name: str, x: Any, out: Any, root: int, size: int, ptr: int) -> None:
        """gather, scatter and all_to_all as NCCL's point-to-point calls in one group (as
        NCCL's own examples build them), bytes whatever the dtype; this rank's own block is a
        copy on the same stream."""
        nccl, c, rank = self._nccl, self.comm, self._control.rank
        t = nccl.NCCL_UINT8
        block = x.nbytes // size if name != "gather" else x.nbytes
        sends: list[tuple[int, int]] = []  # (address, peer)
        recvs: list[tuple[int, int]] = []
        if name == "gather":
            if rank == root:
                recvs = [(out.data.ptr + r * block, r) for r in range(size) if r != rank]
            else:
                sends = [(x.data.ptr, root)]
        elif name == "scatter":
            if rank == root:
                sends = [(x.data.ptr + r * block, r) for r in range(size) if r != rank]
            else:
                recvs = [(out.data.ptr, root)]
        else:
            sends = [(x.data.ptr + r * block, r) for r in range(size) if r != rank]
            recvs = [(out.data.ptr + r * block, r) for r in range(size) if r != rank]
        if block:  # (every rank agreed on the shape; NCCL's empty sends vary by version)
            self._connect_peers(ptr)
            with contextlib.ExitStack() as undo:
                nccl.groupStart()
                undo.callback(_end_group_quietly, nccl)
                for address, peer in sends:
                    c.send(address, block, t, peer, ptr)
                for address, peer in recvs:
                    c.recv(address, block, t, peer, ptr)
                undo.pop_all()
            nccl.groupEnd()
        if name == "gather" and rank == root:
            out[rank] = x
        elif name == "scatter" and rank == root:
            out[...] = x[rank]
        elif name == "all_to_all":
            out[rank] = x[rank]

    def _typed(self, x: Any, out: Any, op: ReduceOp) -> tuple[Any, Any, int, int, bool]:
        """(input, output, NCCL type, NCCL op, widened) of a reduction: complex as pairs of reals; a
        type NCCL lacks (int16, uint16; bfloat16 in an old NCCL) in a wider one, the output
        then a new array (reductions of integers wrap alike in the wider type)."""
        nccl = self._nccl
        if x.dtype.kind == "c":
            if op not in (ReduceOp.SUM, ReduceOp.AVG):
                raise GpuringError(f"NCCL has no {op.value} of {x.dtype}")
            real = np.dtype(np.float32 if x.dtype == np.complex64 else np.float64)
            x, out = x.view(real), None if out is None else out.view(real)
        t = getattr(nccl, TYPES.get(x.dtype.name, ""), None)
        widened = t is None
        if widened:
            wide = WIDER.get(x.dtype.name)
            t = None if wide is None else getattr(nccl, TYPES[wide], None)
            if t is None:
                raise GpuringError(f"NCCL has no {x.dtype.name}")
            x = x.astype(wide)
            out = None if out is None else self._cupy.empty(out.shape, wide)
        assert t is not None
        return x, out, int(t), getattr(nccl, OPS[op]), widened

    # -- completion and failure ------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until every queued call completed (bounded: the watcher fails a late one; a
        watcher that is gone is a failure too)."""
        delay = 1e-4
        while True:
            with self._lock:
                self._check()
                if not self._pending:
                    return
            if not self._watcher.is_alive():
                raise GpuringError(f"the NCCL watcher of rank {self._control.rank} stopped "
                                   "with calls pending")
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    def _check(self) -> None:
        if self.failure is not None:
            raise self.failure

    def _watch(self) -> None:
        try:
            # this thread's device for good (its first CUDA call would otherwise make a
            # context on GPU 0, and so would restoring the device it had)
            self._cupy.cuda.runtime.setDevice(self._device)
            while not self._stop.wait(_TICK):
                error = self._trouble()
                if error is not None:
                    self._fail(error)
                    return
        except BaseException as exc:  # never a silent end: synchronize() would spin
            self._fail(GpuringError(f"the NCCL watcher of rank {self._control.rank} "
                                    f"failed: {exc!r}"))

    def _trouble(self) -> GpuringError | None:
        now = time.monotonic()
        with self._lock:
            if self._closed or self.failure is not None:
                return None
            while self._pending and self._pending[0].done.done:
                self._pending.popleft()
            for call in self._pending:  # the clock starts when the stream reaches a call
                if call.reached is None and call.started.done:
                    call.reached = now
            late = next((c for c in self._pending if c.reached is not None
                         and now > c.reached + self._timeout), None)
            if late is not None:
                return CollectiveTimeoutError(
                    f"NCCL {late.name} did not complete on rank {self._control.rank} within "
                    f"{self._timeout} s: some rank did not take part", collective=late.name)
            try:
                self.comm.check_async_error()
            except Exception as exc:
                return PeerFailureError(f"NCCL reported an error on rank "
                                        f"{self._control.rank}: {exc}")
        return self._job_failure()

    def _fail(self, error: GpuringError) -> None:
        """The watcher's: abort, then tell the communicator (`on_failure`)."""
        if self._abort(error):
            self._on_failure(error)

    def abort(self, reason: str) -> None:
        """End every queued call (ncclCommAbort) and fail this transport. Any thread (a
        bounded wait that holds the lock sees the request and ends first)."""
        error = PeerFailureError(reason)
        if self._aborting is None:
            self._aborting = error
        self._abort(error)

    def _abort(self, error: GpuringError) -> bool:
        """Whether this call aborted (not an earlier one, nor after close)."""
        with self._lock:
            if self.failure is not None or self._closed:
                return False
            self.failure = error
            self._pending.clear()
            self._stop.set()
            self.comm.abort()
        return True

    def close(self) -> None:
        """Wait for the queued calls (bounded), then free the communicator."""
        try:
            if self.failure is None:
                self.synchronize()
        finally:
            self._stop.set()
            if threading.current_thread() is not self._watcher:
                self._watcher.join()  # (a tick is bounded: the watcher ends within one)
            with self._lock:
                if self.failure is None and not self._closed:
                    self.comm.destroy()
                self._closed = True


@dataclass
class _Pending:
    """A call not known complete: events before and after it on the caller's stream, and
    when the watcher saw the stream reach it (its timeout counts from then)."""

    started: Any
    done: Any
    name: str
    reached: float | None = None


def _divide(cupy: Any, out: Any, size: int) -> None:
    """out /= size on the device; integers rounded toward zero."""
    if out.dtype.kind in "fc":
        out /= size
    else:
        divide_toward_zero(out, size)


def _end_group_quietly(nccl: Any) -> None:
    """End an NCCL group whose calls failed (the first error is the one to tell)."""
    with contextlib.suppress(Exception):
        nccl.groupEnd()
