"""Cross-memory attach: one copy from a peer process's memory into this one's, with Linux's
`process_vm_readv` (what MPICH's and Open MPI's CMA paths use for large messages on one
node), and one copy into it with `process_vm_writev`, where the kernel allows it: the same
user, and ptrace permission (Yama's ptrace_scope, a container's seccomp profile or gVisor may
refuse it). Each rank probes once whether it may read and write each peer (`Probe`,
`refusal`); where it may not, large messages and collectives are staged instead."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import secrets
from typing import Any, NamedTuple

import numpy as np

__all__ = ["Probe", "probe", "refusal", "read", "write"]


class Probe(NamedTuple):
    """What a peer reads to find out whether it may read this process: `token` lies at
    `address` in process `pid`."""

    pid: int
    address: int
    token: bytes


class _Iovec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_calls: dict[str, Any] = {}
_mine: Any = None  #: this process's probe bytes (alive for the process's life)
_MINE_PID = -1


def _call(name: str = "process_vm_readv") -> Any:
    function = _calls.get(name)
    if function is None:
        lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        function = getattr(lib, name, None)
        if function is None:
            raise OSError(errno.ENOSYS, f"this C library has no {name}")
        function.restype = ctypes.c_ssize_t
        function.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_ulong,
                             ctypes.POINTER(_Iovec), ctypes.c_ulong, ctypes.c_ulong]
        _calls[name] = function
    return function


def probe() -> Probe:
    """This process's probe (made once per process)."""
    global _mine, _MINE_PID
    if _mine is None or _MINE_PID != os.getpid():
        _mine = ctypes.create_string_buffer(secrets.token_bytes(16), 16)
        _MINE_PID = os.getpid()
    return Probe(os.getpid(), ctypes.addressof(_mine), bytes(_mine.raw))


def refusal(peer: Probe, *, writes: bool = False) -> str | None:
    """Why this process may not read `peer`'s memory (None: it may); with `writes`, nor
    write it (the probe's own bytes are written back: the peer's probe stays as it is)."""
    got = np.zeros(len(peer.token), np.uint8)
    try:
        read(peer.pid, peer.address, got, got.nbytes)
    except OSError as exc:
        return f"process_vm_readv refused ({os.strerror(exc.errno or 0)})"
    if got.tobytes() != peer.token:
        return "process_vm_readv read something else than the peer's probe"
    if writes:
        try:
            write(peer.pid, peer.address, got, got.nbytes)
        except OSError as exc:
            return f"process_vm_writev refused ({os.strerror(exc.errno or 0)})"
    return None


def read(pid: int, address: int, into: Any, nbytes: int) -> None:
    """Copy `nbytes` at `address` of process `pid` into the start of the C-contiguous array
    `into` (OSError where the kernel refuses, or the process is gone: ESRCH)."""
    _move(_call(), pid, address, int(into.ctypes.data), nbytes)


def write(pid: int, address: int, data: Any, nbytes: int) -> None:
    """Copy the first `nbytes` of the C-contiguous array `data` to `address` of process
    `pid` (OSError as `read`)."""
    _move(_call("process_vm_writev"), pid, address, int(data.ctypes.data), nbytes)


def _move(function: Any, pid: int, address: int, base: int, nbytes: int) -> None:
    """`nbytes` between `base` here and `address` in `pid`, by `function` (a partial copy
    goes on where it stopped)."""
    done = 0
    while done < nbytes:
        local = _Iovec(base + done, nbytes - done)
        remote = _Iovec(address + done, nbytes - done)
        n = function(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
        if n < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        if n == 0:
            raise OSError(errno.EFAULT, "cross-memory attach moved nothing")
        done += n
