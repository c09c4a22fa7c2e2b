"""NCCL as gpuring reaches it: loading it through CuPy (an optional dependency), its unique id
across CuPy versions, its types and ops, which ranks share a GPU as NCCL sees them, and a bounded
wait for its calls that block the host without a limit."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._errors import CollectiveTimeoutError, GpuringError, PeerFailureError
from .._ops import ReduceOp

__all__ = ["TYPES", "OPS", "WIDER", "bounded", "load_nccl", "nccl_id_argument",
           "nccl_id_bytes", "reduces", "shared_gpus"]

#: gpuring's dtype names -> NCCL's type names
TYPES = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
         "uint32": "NCCL_UINT32", "int64": "NCCL_INT64", "uint64": "NCCL_UINT64",
         "float16": "NCCL_FLOAT16", "bfloat16": "NCCL_BFLOAT16", "float32": "NCCL_FLOAT32",
         "float64": "NCCL_FLOAT64"}
#: gpuring's ops -> NCCL's (avg: a sum, divided afterwards)
OPS = {ReduceOp.SUM: "NCCL_SUM", ReduceOp.AVG: "NCCL_SUM", ReduceOp.PROD: "NCCL_PROD",
       ReduceOp.MIN: "NCCL_MIN", ReduceOp.MAX: "NCCL_MAX"}
#: where NCCL lacks a type: the one reduced instead
WIDER = {"int16": "int32", "uint16": "uint32", "bfloat16": "float32", "bool": "uint8"}
#: ncclRemoteError: a peer's process failed
_REMOTE_ERROR = 6
_TICK = 0.05


def reduces(dtype: Any, op: ReduceOp) -> bool:
    """Whether NCCL reduces `dtype` (a NumPy dtype) with `op` (complex: only sums)."""
    return dtype.kind != "c" or op in (ReduceOp.SUM, ReduceOp.AVG)


def load_nccl() -> Any:
    """cupy.cuda.nccl, loaded; GpuringError saying what to install where it is not."""
    try:
        from cupy.cuda import nccl
    except Exception as exc:  # ImportError, or a library that fails to load
        raise GpuringError(f"CuPy collectives across nodes need NCCL, which CuPy could not "
                           f"load ({type(exc).__name__}: {exc}): pip install "
                           "nvidia-nccl-cu13 (or -cu12, as your CuPy)") from None
    if not getattr(nccl, "available", True) or not hasattr(nccl, "get_unique_id"):
        raise GpuringError("CuPy collectives across nodes need NCCL, which CuPy could not "
                           "load: pip install nvidia-nccl-cu13 (or -cu12, as your CuPy)")
    return nccl


def nccl_id_argument(nccl_id: bytes, cupy_version: str, char_signed: bool = True) -> Any:
    """CuPy >= 14 takes the 128-byte ncclUniqueId as bytes, older CuPy as a tuple of C chars
    (signed on x86-64, unsigned on ARM)."""
    if int(cupy_version.split(".")[0]) >= 14:
        return nccl_id
    return tuple(int(v) for v in np.frombuffer(nccl_id, dtype=np.int8 if char_signed
                                                else np.uint8))


def nccl_id_bytes(value: Any) -> bytes:
    """ncclGetUniqueId's result as 128 bytes (bytes in CuPy >= 14, a tuple of chars before)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    return np.asarray(value, dtype=np.int64).astype(np.int8).tobytes()


def shared_gpus(gpus: list[str]) -> list[int]:
    """The ranks whose GPU (node|bus, one per rank) another rank uses too."""
    return [r for r, g in enumerate(gpus) if g and gpus.count(g) > 1]


def bounded(work: Callable[[], Any], timeout: float, rank: int,
        stop: Callable[[], GpuringError | None], what: str, label: str, *,
        abort_late: bool = False,
        on_timeout: Callable[[GpuringError], None] | None = None) -> Any:
    """`work()` (an NCCL call that blocks the host, unbounded) on a thread of its own, waited
    for within `timeout` seconds or until `stop()` says why to end (that error is raised);
    its exception as a GpuringError (`label`: what failed; ncclRemoteError as
    PeerFailureError). `abort_late`: what `work` returns after that is an NCCL communicator
    to abort. `on_timeout(error)`: called before raising `error`, while `work` may still
    run. `rank` and `what` say who and what timed out."""
    done: list[Any] = []
    lock = threading.Lock()
    gave_up = False

    def run() -> None:
        try:
            result: Any = work()
        except BaseException as exc:
            result = _Failed(exc)
        with lock:
            done.append(result)
            late = gave_up
        if late and abort_late and not isinstance(result, _Failed):
            result.abort()  # (it must not stay connected)

    thread = threading.Thread(target=run, name=f"gpuring-nccl-{what}", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    notice = None
    while thread.is_alive() and time.monotonic() < deadline:
        thread.join(min(_TICK, max(0.0, deadline - time.monotonic())))
        notice = stop()
        if notice is not None:
            break
    with lock:
        if not done:
            gave_up = True
    if gave_up:
        error = notice or CollectiveTimeoutError(
            f"the {label} of rank {rank} was not {what} within {timeout} s: some rank "
            "did not take part")
        if on_timeout is not None:
            on_timeout(error)
        raise error
    if isinstance(done[0], _Failed):
        failed = done[0].error
        kind = PeerFailureError if getattr(failed, "status", None) == _REMOTE_ERROR \
            else GpuringError
        raise kind(f"{label}: {failed!r}") from failed
    return done[0]


@dataclass
class _Failed:
    """What a bounded piece of work raised."""

    error: BaseException
