"""The point-to-point verbs on a communicator's message engine (`_messages.Messages`): checked
arguments in, a posted operation out.

`isend`/`irecv` return a `Work` at once; `send`/`recv` are the same and a wait; `sendrecv`
is a group of one send and one receive; `batch` a group of any (torch's
`batch_isend_irecv`). See docs/api.md, "Point to point".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _arrays, _groups, interop
from ._errors import GpuringError
from ._message_ops import (
    MessageWork,
    Recv,
    Send,
    peer_rank,
    receivable,
    sendable,
    source_rank,
    tag_of,
)
from ._messages import Messages

__all__ = ["isend", "irecv", "send", "recv", "sendrecv", "batch", "is_cuda"]


def is_cuda(x: Any) -> bool:
    """Whether `x` (any array) lives on a GPU."""
    return interop.device_kind(x) == "cuda"


def isend(m: Messages, x: Any, dst: Any, tag: Any = 0, name: str = "") -> MessageWork:
    verb = name or "isend"
    m.check(verb)
    dst = peer_rank(dst, m.size, "dst", verb)
    tag = tag_of(tag, verb)
    array = sendable(x, verb)
    if _arrays.is_cupy(array):
        _on_the_gpu_path(m, dst, verb)
    else:
        m.lane_for(dst)
    return m.post(Send(f"{name or 'send'} to rank {dst} (tag {tag})", dst, tag, array))


def irecv(m: Messages, out: Any, src: Any = None, tag: Any = 0, name: str = ""
          ) -> MessageWork:
    verb = name or "irecv"
    m.check(verb)
    source = source_rank(src, m.size, verb)
    tag = tag_of(tag, verb)
    array = receivable(out, verb)
    if _arrays.is_cupy(array):
        _on_the_gpu_path(m, source, verb)
    elif source is not None:
        m.lane_for(source)
    whom = "any rank" if source is None else f"rank {source}"
    return m.post(Recv(f"{name or 'recv'} from {whom} (tag {tag})", source, tag, array, out))


def send(m: Messages, pairs: _groups.Pairs, x: Any, dst: Any, tag: Any = 0) -> None:
    if type(x) is np.ndarray and m.send_small(x, dst, tag):
        return
    if is_cuda(x) and not _gpu_path(m, dst):  # on NCCL: the pair's channel
        _untagged(tag, "send")
        with interop.caller_stream(x):
            _groups.send(pairs, interop.to_native(x), dst)
        return
    _not_itself(m, dst, "dst", "send")
    with interop.caller_stream(x):
        isend(m, x, dst, tag).wait()


def recv(m: Messages, pairs: _groups.Pairs, out: Any, src: Any = None, tag: Any = 0) -> Any:
    if type(out) is np.ndarray and m.recv_small(out, src, tag) is not None:
        return out
    if is_cuda(out) and not _gpu_path(m, src):
        _untagged(tag, "recv")
        if src is None:
            raise ValueError("recv of a CuPy array from another node, or on NCCL, needs "
                             "src (a rank)")
        with interop.caller_stream(out):
            _groups.recv(pairs, interop.to_native(out), src)
        return out
    _not_itself(m, src, "src", "recv")
    with interop.caller_stream(out):
        return irecv(m, out, src, tag).wait()


def sendrecv(m: Messages, pairs: _groups.Pairs, x: Any, dst: Any, out: Any, src: Any,
             tag: Any = 0) -> Any:
    """Send `x` to `dst` and receive from `src` into `out` at once (a group of the two: a
    ring shift cannot deadlock); `out`."""
    verb = "sendrecv"
    cuda = is_cuda(x) or is_cuda(out)
    if cuda and not (_gpu_path(m, dst) and _gpu_path(m, src)) and \
            not (dst == src == m.rank):
        _untagged(tag, verb)
        with interop.caller_stream(x):
            _groups.sendrecv(pairs, interop.to_native(x), dst, out, src)
        return out
    dst = peer_rank(dst, m.size, "dst", verb)
    source = peer_rank(src, m.size, "src", verb)
    if (dst == m.rank) != (source == m.rank):
        raise ValueError(f"sendrecv: rank {m.rank} sends to itself only if it also receives "
                         f"from itself (dst={dst}, src={source})")
    native_x, native_out = sendable(x, verb), receivable(out, verb)
    if _arrays.device_kind(native_x) == _arrays.device_kind(native_out) and \
            _arrays.may_overlap(native_x, native_out):
        raise ValueError("sendrecv: out must not overlap x (x is read while out is written)")
    if cuda and dst == m.rank:  # to itself on the GPU: a copy on the stream
        _copy_into(native_out, native_x, verb)
        return out
    with interop.caller_stream(x):
        with m.group():
            sent = isend(m, native_x, dst, tag, name="sendrecv: send")
            received = irecv(m, out, source, tag, name="sendrecv: recv")
        m.wait([received.op, sent.op])  # (a failure raises from the first that failed)
        received.wait()
        sent.wait()
    return out


def _gpu_path(m: Messages, peer: Any) -> bool:
    """Whether CuPy messages with `peer` (None: any) take the GPU path (`_cuda_messages`),
    not the pair's channel (other nodes, NCCL)."""
    if peer is not None and (isinstance(peer, bool) or not isinstance(peer, int)):
        return True  # (the verb refuses it)
    return m.gpu_reaches(peer)


def _on_the_gpu_path(m: Messages, peer: int | None, verb: str) -> None:
    if peer == m.rank:
        raise ValueError(f"{verb} of a CuPy array to or from itself: use sendrecv (a copy)")
    if not m.gpu_reaches(peer):
        raise GpuringError(f"{verb} of CuPy arrays reaches the ranks of this node whose GPUs "
                           f"map each other's memory; rank {peer} is not one (use send, recv "
                           "or sendrecv: they go on NCCL)")


def _copy_into(out: Any, x: Any, verb: str) -> None:
    """A message to itself: `x` into the first elements of `out` (same dtype, room)."""
    if x.dtype != out.dtype or x.size > out.size:
        raise ValueError(f"{verb} to itself: out must have x's dtype and room for it")
    out.reshape(-1)[:x.size] = x.reshape(-1)


def batch(m: Messages, ops: Sequence[Any]) -> list[MessageWork]:
    """Post `ops` (each `(verb, array, peer)` or `(verb, array, peer, tag)`, the verb
    "isend" or "irecv", or the communicator's `isend`/`irecv`) as one group; their works, in
    order."""
    parsed = []
    for op in ops:
        if not isinstance(op, (tuple, list)) or len(op) not in (3, 4):
            raise TypeError(f"batch: each operation is (verb, array, peer[, tag]), got {op!r}")
        verb = op[0] if isinstance(op[0], str) else getattr(op[0], "__name__", None)
        if verb not in ("isend", "irecv"):
            raise ValueError(f"batch: an operation's verb is 'isend' or 'irecv', got {op[0]!r}")
        parsed.append((verb, op[1], op[2], op[3] if len(op) == 4 else 0))
    works = []
    with m.group():
        for verb, array, peer, tag in parsed:
            works.append(isend(m, array, peer, tag) if verb == "isend"
                         else irecv(m, array, peer, tag))
    return works


def _not_itself(m: Messages, peer: Any, name: str, verb: str) -> None:
    if peer is not None and not isinstance(peer, bool) and peer == m.rank:
        raise ValueError(f"{verb}: {name} is this rank ({m.rank}); a rank does not wait for a "
                         "message to itself (isend/irecv, sendrecv and batch may have one)")


def _untagged(tag: Any, verb: str) -> None:
    if tag != 0:
        raise ValueError(f"{verb}: messages of CuPy arrays carry no tag (tag=0)")


