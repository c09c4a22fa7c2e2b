"""The operations of point-to-point messages: a send or a receive as the message engine
(`_messages`) tracks it, the `Work` a verb returns for it, and the checks of the verbs'
arguments."""

from __future__ import annotations

import operator
from typing import Any, Protocol

import numpy as np

from . import _arrays, interop
from ._mailbox import byte_view
from ._work import Work

__all__ = ["Send", "Recv", "MessageWork", "Waiter", "peer_rank", "source_rank", "tag_of",
           "sendable", "receivable", "dtype_bytes", "dtype_names", "TAGS"]

#: a send's states: queued (nothing written yet), awaiting the receiver (its announcement is
#: written, the data waits for the receiver's word), streaming (the receiver asked for the data)
QUEUED, AWAITING, STREAMING = 0, 1, 2
#: how a send's data travels: whole in its first record (eagerly), in pieces once the
#: receiver asks (staged), or read by the receiver where it lies: in registered memory, or
#: in the sender's own memory (cross-memory attach)
EAGERLY, STAGED, REGISTERED, ATTACHED = 0, 1, 2, 3

_DTYPES: dict[Any, bytes] = {}
#: tags lie in [-TAGS, TAGS)
TAGS = 1 << 62


def dtype_names() -> dict[Any, bytes]:
    """The dtypes messages were checked with so far (`dtype_bytes`), by dtype: a fast path
    takes the name of an array's dtype from here, or the general path."""
    return _DTYPES


def dtype_bytes(x: Any) -> bytes:
    """The name of `x`'s dtype as a record carries it (at most 16 bytes)."""
    dtype = x.dtype
    found = _DTYPES.get(dtype)
    if found is None:
        name = _arrays.dtype_name(x).encode()
        if len(name) > 16:
            raise TypeError(f"messages carry arrays of dtypes whose name has at most 16 "
                            f"characters, not {name.decode()!r}")
        found = _DTYPES[dtype] = name
    return found


class Send:
    """One message this rank sends: `data` (the bytes of the C-contiguous `array`, kept
    alive until the message no longer needs them) to rank `peer` with `tag`."""

    __slots__ = ("array", "begin", "count", "cuda", "data", "dtype", "error", "finished",
                 "mode", "msg", "name", "nbytes", "peer", "sent", "state", "tag", "where")

    def __init__(self, name: str, peer: int, tag: int, array: Any):
        self.name = name
        self.peer = peer
        self.tag = tag
        self.array = array
        #: a CuPy array: its data travels on the GPU (`_cuda_messages`)
        self.cuda = _arrays.is_cupy(array)
        self.data = memoryview(b"") if self.cuda else byte_view(array)
        self.nbytes = int(array.nbytes)
        self.count = int(array.size)
        self.dtype = dtype_bytes(array)
        self.state = QUEUED
        self.mode = EAGERLY
        self.where: bytes | None = None  #: a registered array's place, for the receiver
        self.msg = -1  #: its number among this rank's messages to `peer` (set when posted)
        self.sent = 0  #: bytes handed to the lane so far
        self.error: BaseException | None = None
        self.finished = False
        self.begin: float | None = None  #: when it was posted (a timeline's clock)

    @property
    def result(self) -> None:
        return None


class Recv:
    """One message this rank receives into `out` (the caller's `given`, as a native array),
    from rank `src` (None: any rank) with `tag`. Once matched: `source`, `count` (elements)
    and `nbytes` of the message; `got` counts the bytes arrived."""

    __slots__ = ("begin", "capacity", "count", "cuda", "data", "dtype", "error", "finished",
                 "given", "got", "name", "nbytes", "out", "source", "src", "tag")

    def __init__(self, name: str, src: int | None, tag: int, out: Any, given: Any):
        self.name = name
        self.src = src
        self.tag = tag
        self.out = out
        self.given = given
        self.cuda = _arrays.is_cupy(out)
        self.data = memoryview(b"") if self.cuda else byte_view(out)
        self.capacity = int(out.size)
        self.dtype = dtype_bytes(out)
        self.source: int | None = None
        self.count: int | None = None
        self.nbytes = 0
        self.got = 0
        self.error: BaseException | None = None
        self.finished = False
        self.begin: float | None = None

    @property
    def result(self) -> Any:
        return self.given


class Waiter(Protocol):
    """What a message's Work asks of the engine that runs it."""

    def poll(self, op: Send | Recv | None = None) -> None: ...

    def wait(self, ops: list[Send | Recv], timeout: float | None = None) -> None: ...


class MessageWork(Work):
    """The Work of a message (`isend`, `irecv`): `wait()` completes it (the engine makes
    progress with every message of the communicator meanwhile: no thread runs them) and
    returns the receive buffer (None for a send), or raises what the message failed with;
    `done()` makes progress once and says whether it completed or failed. A receive's
    `source`, `tag` and `count` (elements) say which message it matched, once it did (None
    before); a send's are its destination, tag and element count."""

    def __init__(self, engine: Waiter, op: Send | Recv):
        # (no Work.__init__: the engine, not a thread, completes it)
        self.name = op.name
        self._engine = engine
        self.op = op  #: the operation the engine tracks

    def __repr__(self) -> str:
        state = "done" if self.op.finished else "pending"
        return f"<gpuring.Work {self.name} {state}>"

    def done(self) -> bool:
        op = self.op
        if not op.finished:
            self._engine.poll(op)
        return op.finished

    def wait(self, timeout: float | None = None) -> Any:
        op = self.op
        if not op.finished:
            self._engine.wait([op], timeout)
        if op.error is not None:
            raise op.error
        return op.result

    @property
    def source(self) -> int | None:
        op = self.op
        return op.source if isinstance(op, Recv) else op.peer

    @property
    def tag(self) -> int:
        return self.op.tag

    @property
    def count(self) -> int | None:
        return self.op.count


def _index(value: Any, name: str, verb: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{verb}: {name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{verb}: {name} must be an int, got {type(value).__name__}") from None


def peer_rank(value: Any, size: int, name: str, verb: str) -> int:
    rank = _index(value, name, verb)
    if not 0 <= rank < size:
        raise ValueError(f"{verb}: {name}={rank} is not a rank of this communicator "
                         f"(size {size})")
    return rank


def source_rank(value: Any, size: int, verb: str) -> int | None:
    return None if value is None else peer_rank(value, size, "src", verb)


def tag_of(value: Any, verb: str) -> int:
    tag = _index(value, "tag", verb)
    if not -TAGS <= tag < TAGS:
        raise ValueError(f"{verb}: tag must be within +-2^62, got {tag}")
    return tag


def sendable(x: Any, verb: str) -> Any:
    """`x` as a C-contiguous NumPy or CuPy array (a view of other libraries' arrays, a
    contiguous copy of a strided one)."""
    native = interop.to_native(x)
    _arrays.device_kind(native)  # NumPy or CuPy, else TypeError
    if native.dtype.hasobject or native.dtype.fields is not None:
        raise TypeError(f"{verb}: messages carry arrays of plain numbers, not {native.dtype}")
    return _arrays.contiguous(native)


def receivable(out: Any, verb: str) -> Any:
    """`out` as a NumPy or CuPy array that a message can be written into: C-contiguous and
    writable (TypeError otherwise)."""
    native = interop.to_native(out)
    _arrays.device_kind(native)
    if not native.flags.c_contiguous or not getattr(native.flags, "writeable", True):
        raise TypeError(f"{verb} fills its buffer in place: it must be C-contiguous and "
                        "writable")
    if isinstance(native, np.ndarray) and (native.dtype.hasobject
                                           or native.dtype.fields is not None):
        raise TypeError(f"{verb}: messages carry arrays of plain numbers, not {native.dtype}")
    return native
