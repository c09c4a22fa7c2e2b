"""A stand-in for `cupy.cuda.nccl` in the CUDA simulator: NCCL between processes, with NCCL's
semantics where gpuring depends on them.

- `NcclCommunicator(ndev, id, rank)` blocks until all `ndev` ranks have made theirs (as
  ncclCommInitRank does), without a timeout.
- A collective is queued on the stream given and returns at once. On the stream it publishes
  this rank's input, then waits until every rank of the communicator has published its own
  for the same call, with no timeout either: a rank that never comes (dead, or calling
  something else) holds the stream, as NCCL's kernels do, until `abort()`.
- `abort()` (ncclCommAbort) releases the waits of every queued call, which then write
  nothing; `check_async_error()` raises NcclError afterwards.
- Two ranks of one host (NCCL_HOSTID, else the host name) on one GPU are refused at init
  ("Duplicate GPU detected") unless NCCL_MULTI_RANK_GPU_ENABLE=1; buffers that overlap other
  than in NCCL's in-place forms are refused at the call (NCCL leaves them undefined).

- Point-to-point calls (`send`, `recv`) run only between `groupStart()` and `groupEnd()`:
  the group is one call of every rank of the communicator (gpuring groups them only in
  collectives where every rank takes part), each rank publishing what it sends to each peer.
  As in NCCL, the first group that reaches a peer connects to it: that `groupEnd` waits on
  the host, without a timeout, until the peer's `groupEnd` connects back. A call that fails
  inside a group makes `groupEnd` raise, and none of the group's calls runs.

Ranks meet through files under the system's temporary directory, named after the unique id.
Reductions fold in rank order, each step rounded to the dtype.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np

available = True
#: not NCCL: what measures NCCL (gpuring bench's peer) says so and skips it
STAND_IN = True

NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN, NCCL_AVG = 0, 1, 2, 3, 4

_DTYPES: dict[int, Any] = {NCCL_INT8: np.int8, NCCL_UINT8: np.uint8, NCCL_INT32: np.int32,
                           NCCL_UINT32: np.uint32, NCCL_INT64: np.int64,
                           NCCL_UINT64: np.uint64, NCCL_FLOAT16: np.float16,
                           NCCL_FLOAT32: np.float32, NCCL_FLOAT64: np.float64}


def _dtype(datatype: int) -> np.dtype[Any]:
    """The NumPy dtype of an NCCL data type; bfloat16's comes from ml_dtypes, imported only
    when asked for (its import costs a simulated process about a second)."""
    if datatype == NCCL_BFLOAT16 and datatype not in _DTYPES:
        import ml_dtypes

        _DTYPES[NCCL_BFLOAT16] = ml_dtypes.bfloat16
    return np.dtype(_DTYPES[datatype])


_POLL = 0.0005


class NcclError(RuntimeError):
    def __init__(self, status: int, text: str = ""):
        self.status = status
        super().__init__(f"NCCL_ERROR {status}: {text}")


def get_version() -> int:
    return 22805


def get_unique_id() -> tuple[int, ...]:
    """128 signed chars, as CuPy before 14 returns them."""
    return tuple(int(v) for v in np.frombuffer(secrets.token_bytes(128), np.int8))


def _folder(commId: Any) -> str:
    raw = bytes(commId) if isinstance(commId, (bytes, bytearray)) else \
        np.asarray(commId, np.int64).astype(np.int8).tobytes()
    return os.path.join(tempfile.gettempdir(), f"gpuring-cudasim-nccl-{raw[:12].hex()}")


def _publish(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


_groups = threading.local()  # the point-to-point calls of this thread's open group


def groupStart() -> None:
    depth = getattr(_groups, "depth", 0)
    if depth == 0:
        _groups.calls = []
        _groups.error = None
    _groups.depth = depth + 1


def groupEnd() -> None:
    depth = getattr(_groups, "depth", 0)
    if depth == 0:
        raise NcclError(5, "groupEnd without groupStart")
    _groups.depth = depth - 1
    if depth == 1:
        calls, _groups.calls = _groups.calls, []
        if _groups.error is not None:
            raise _groups.error
        comms: dict[int, NcclCommunicator] = {}
        for call in calls:
            comms.setdefault(id(call[0]), call[0])
        for comm in comms.values():
            comm._group([call[1:] for call in calls if call[0] is comm])


class NcclCommunicator:
    def __init__(self, ndev: int, commId: Any, rank: int):
        if not 0 <= rank < ndev:
            raise NcclError(4, "invalid rank")
        self._ndev, self._rank = ndev, rank
        self._dir = _folder(commId)
        os.makedirs(self._dir, exist_ok=True)
        self._seq = 0
        self._aborted = threading.Event()
        self._error: str | None = None
        self._comm = 1
        self._connected: set[int] = set()  # the peers point-to-point calls reached
        sim = sys.modules["cupy"]
        self._device = sim.cuda.runtime.getDevice()
        where = f"{os.environ.get('NCCL_HOSTID') or socket.gethostname()}|" \
                f"{sim.cuda.Device(self._device).pci_bus_id}"
        _publish(os.path.join(self._dir, f"join-{rank}"), where.encode())
        joins = [os.path.join(self._dir, f"join-{r}") for r in range(ndev)]
        while not all(os.path.exists(p) for p in joins):
            time.sleep(_POLL)
        for other, path in enumerate(joins):  # as ncclCommInitRank: one GPU per rank of a
            with open(path, "rb") as f:  # host, unless NCCL_MULTI_RANK_GPU_ENABLE=1
                theirs = f.read().decode()
            if other != rank and theirs == where and \
                    os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
                raise NcclError(5, f"Duplicate GPU detected : rank {rank} and rank {other} "
                                   f"both on CUDA device {where.split('|')[1]}")

    @property
    def comm(self) -> int:
        return self._comm

    def rank_id(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._ndev

    # -- the calls -----------------------------------------------------------------------
    def _queue(self, stream: int, sendbuf: int, nbytes: int, finish: Any, recvbuf: int = 0,
               recvbytes: int = 0, in_place: int = -1, payload: Any = None) -> None:
        """Queue one call: publish `nbytes` at `sendbuf` (or what `payload()` returns), wait
        for every rank's, then `finish(inputs)` (each rank's bytes, in rank order). The
        output (`recvbytes` at `recvbuf`) may only overlap the input as NCCL's in-place form
        has it: the input at `in_place` (an address; -1: the output's own)."""
        sim = sys.modules["cupy"]  # the simulator
        if recvbytes and nbytes and sendbuf < recvbuf + recvbytes and recvbuf < \
                sendbuf + nbytes and sendbuf != (recvbuf if in_place < 0 else in_place):
            raise NcclError(5, "invalid usage: the buffers overlap, but not in place")
        if not self._comm:
            raise NcclError(5, "communicator aborted or destroyed")
        seq, self._seq = self._seq, self._seq + 1
        me = os.path.join(self._dir, f"s{seq}-r{self._rank}")

        def run() -> None:
            try:
                call()
            except OSError:  # the files of a communicator every rank left
                if not self._aborted.is_set():
                    raise  # (an aborted call ends without error, as NCCL's kernels do)

        def call() -> None:
            if self._aborted.is_set():
                return
            _publish(me, payload() if payload is not None else
                     ctypes.string_at(sendbuf, nbytes) if nbytes else b"")
            paths = [os.path.join(self._dir, f"s{seq}-r{r}") for r in range(self._ndev)]
            while not all(os.path.exists(p) for p in paths):
                if self._aborted.wait(_POLL):
                    return
            inputs = []
            for p in paths:
                with open(p, "rb") as f:
                    inputs.append(f.read())
            if self._aborted.is_set():
                return
            finish(inputs)
            old = os.path.join(self._dir, f"s{seq - 2}-r{self._rank}")
            if seq >= 2 and os.path.exists(old):
                os.unlink(old)  # every rank read it: each has finished the call after it

        sim._stream(stream)._put(run)

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
                  stream: int) -> None:
        dtype = _dtype(datatype)
        self._queue(stream, sendbuf, count * dtype.itemsize, lambda inputs: _write(
            recvbuf, _fold([np.frombuffer(b, dtype) for b in inputs], op)),
            recvbuf, count * dtype.itemsize)

    def reduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,
               root: int, stream: int) -> None:
        dtype = _dtype(datatype)

        def finish(inputs: list[bytes]) -> None:
            if self._rank == root:
                _write(recvbuf, _fold([np.frombuffer(b, dtype) for b in inputs], op))
        self._queue(stream, sendbuf, count * dtype.itemsize, finish, recvbuf,
                    count * dtype.itemsize if self._rank == root else 0)

    def broadcast(self, sendbuff: int, recvbuff: int, count: int, datatype: int, root: int,
                  stream: int) -> None:
        nbytes = count * _dtype(datatype).itemsize
        self._queue(stream, sendbuff, nbytes if self._rank == root else 0,
                    lambda inputs: ctypes.memmove(recvbuff, inputs[root], nbytes),
                    recvbuff, nbytes)

    def bcast(self, buff: int, count: int, datatype: int, root: int, stream: int) -> None:
        self.broadcast(buff, buff, count, datatype, root, stream)

    def reduceScatter(self, sendbuf: int, recvbuf: int, recvcount: int, datatype: int,
                      op: int, stream: int) -> None:
        dtype = _dtype(datatype)
        rank = self._rank

        def finish(inputs: list[bytes]) -> None:
            blocks = [np.frombuffer(b, dtype)[rank * recvcount:(rank + 1) * recvcount]
                      for b in inputs]
            _write(recvbuf, _fold(blocks, op))
        block = recvcount * dtype.itemsize
        self._queue(stream, sendbuf, block * self._ndev, finish, recvbuf, block,
                    recvbuf - rank * block)

    def allGather(self, sendbuf: int, recvbuf: int, count: int, datatype: int,
                  stream: int) -> None:
        nbytes = count * _dtype(datatype).itemsize
        self._queue(stream, sendbuf, nbytes, lambda inputs: ctypes.memmove(
            recvbuf, b"".join(inputs), nbytes * len(inputs)), recvbuf,
            nbytes * self._ndev, recvbuf + self._rank * nbytes)

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._point("send", sendbuf, count, datatype, peer, stream)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._point("recv", recvbuf, count, datatype, peer, stream)

    def _point(self, kind: str, buf: int, count: int, datatype: int, peer: int,
               stream: int) -> None:
        if not getattr(_groups, "depth", 0):
            raise NcclError(5, "the stand-in runs send and recv only inside a group")
        if not 0 <= peer < self._ndev or not self._comm:
            _groups.error = NcclError(4, f"invalid peer {peer}" if self._comm else
                                      "communicator aborted or destroyed")
            raise _groups.error
        nbytes = count * _dtype(datatype).itemsize
        _groups.calls.append((self, kind, buf, nbytes, peer, stream))

    def _connect(self, peers: set[int]) -> None:
        """NCCL's connection to each peer not yet reached: on the host, until the peer's own
        first group reaches this rank (or this communicator is aborted)."""
        for peer in sorted(peers - self._connected - {self._rank}):
            _publish(os.path.join(self._dir, f"connect-{self._rank}-{peer}"), b"")
            theirs = os.path.join(self._dir, f"connect-{peer}-{self._rank}")
            while not os.path.exists(theirs):
                if self._aborted.wait(_POLL):
                    raise NcclError(3, "communicator aborted")
            self._connected.add(peer)

    def _group(self, calls: list[tuple[str, int, int, int, int]]) -> None:
        """One group's sends and receives: one call of every rank, on one stream."""
        streams = {call[4] for call in calls}
        if len(streams) != 1:
            raise NcclError(5, "a group's calls on one communicator use one stream")
        sends = [(buf, nbytes, peer) for kind, buf, nbytes, peer, _ in calls if kind == "send"]
        recvs = [(buf, nbytes, peer) for kind, buf, nbytes, peer, _ in calls if kind == "recv"]
        self._connect({peer for _, _, _, peer, _ in calls})
        for a, m, _ in sends:
            for b, k, _ in recvs:
                if m and k and a < b + k and b < a + m:
                    raise NcclError(5, "invalid usage: a send's buffer overlaps a recv's")
        rank = self._rank

        def payload() -> bytes:
            return pickle.dumps([(peer, ctypes.string_at(buf, nbytes) if nbytes else b"")
                                 for buf, nbytes, peer in sends])

        def finish(inputs: list[bytes]) -> None:
            sent = [[data for to, data in pickle.loads(raw) if to == rank] for raw in inputs]
            for buf, nbytes, peer in recvs:  # in the order each peer sent them
                if not sent[peer]:
                    raise NcclError(5, f"rank {rank} receives from rank {peer}, which sent "
                                       "it nothing in this group")
                data = sent[peer].pop(0)
                if len(data) != nbytes:
                    raise NcclError(5, f"rank {peer} sent {len(data)} bytes, rank {rank} "
                                       f"receives {nbytes}")
                ctypes.memmove(buf, data, nbytes)
        self._queue(streams.pop(), 0, 0, finish, payload=payload)

    # -- lifetime and errors -------------------------------------------------------------
    def check_async_error(self) -> None:
        if self._error is not None:
            raise NcclError(3, self._error)

    def abort(self) -> None:
        if self._comm:
            self._error = "communicator aborted"
            self._aborted.set()
            self._leave()

    def destroy(self) -> None:
        if self._comm:
            self._leave()

    def _leave(self) -> None:
        """The last rank to leave removes the files (a rank leaves once its streams are done
        with every call, or they gave up: no rank reads them any more then)."""
        self._comm = 0
        _publish(os.path.join(self._dir, f"leave-{self._rank}"), b"")
        if all(os.path.exists(os.path.join(self._dir, f"leave-{r}"))
               for r in range(self._ndev)):
            shutil.rmtree(self._dir, ignore_errors=True)


def _fold(arrays: list[np.ndarray], op: int) -> np.ndarray:
    dtype = arrays[0].dtype
    wide = np.float32 if dtype.name in ("float16", "bfloat16") else dtype
    acc = arrays[0].astype(wide)
    for a in arrays[1:]:
        b = a.astype(wide)
        acc = {NCCL_SUM: np.add, NCCL_AVG: np.add, NCCL_PROD: np.multiply,
               NCCL_MAX: np.maximum, NCCL_MIN: np.minimum}[op](acc, b)
        acc = acc.astype(dtype).astype(wide)
    if op == NCCL_AVG:
        acc = acc / len(arrays)
    return acc.astype(dtype)


def _write(address: int, array: np.ndarray) -> None:
    data = np.ascontiguousarray(array).tobytes()
    ctypes.memmove(address, data, len(data))
