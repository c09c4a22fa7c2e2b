"""Cross-memory attach on the host device: the copies between this process and a peer's
array (`AttachedMemory`) that a collective's steps make, with `process_vm_readv` and
`process_vm_writev` (`gpuring._cma`); a copy the kernel refuses (the peer died: ESRCH) is the
peer's failure."""

from __future__ import annotations

import errno

import numpy as np

from .. import _cma
from .._errors import PeerFailureError
from ._host_memory import AttachedMemory
from ._streams import Span

__all__ = ["attached", "read", "write"]


def attached(span: object) -> bool:
    """Whether `span` is a span of a peer's array that only cross-memory attach reaches."""
    return isinstance(span, Span) and isinstance(span.mem, AttachedMemory)


def read(span: Span, into: np.ndarray) -> None:
    """Copy the peer's bytes of `span` into the start of the C-contiguous array `into`."""
    mem = span.mem
    assert isinstance(mem, AttachedMemory)
    try:
        _cma.read(mem.pid, mem.address + span.offset, into, span.nbytes)
    except OSError as exc:
        raise _failed(mem, "read", exc) from None


def write(span: Span, data: np.ndarray) -> None:
    """Copy the first bytes of the C-contiguous array `data` into the peer's `span`."""
    mem = span.mem
    assert isinstance(mem, AttachedMemory)
    try:
        _cma.write(mem.pid, mem.address + span.offset, data, span.nbytes)
    except OSError as exc:
        raise _failed(mem, "written", exc) from None


def _failed(mem: AttachedMemory, what: str, exc: OSError) -> PeerFailureError:
    if exc.errno == errno.ESRCH:
        text = f"rank {mem.peer} (pid {mem.pid}) is gone: its array could not be {what} directly"
    else:
        text = (f"rank {mem.peer}'s array could not be {what} directly (the kernel refused: "
                f"{exc.strerror or exc})")
    return PeerFailureError(text, peer=mem.peer)
