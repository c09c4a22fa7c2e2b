"""Sub-communicators (`split`) and the point-to-point messages of CuPy arrays (`send`,
`recv`, `sendrecv`; NumPy arrays have a message engine of their own, `_messages`).

A sub-communicator is a Communicator of its own over a sub-group of the control plane
(`ControlPlane.subgroup`): its own sequence numbers, buffers, watchdog and lifetime. CuPy
messages ride on the same thing: the first message between two ranks makes the communicator
of that pair (its name is the pair's, so both ranks make the same one without meeting), and a
message is a broadcast from the sender in it. That gives every message what collectives
have: both sides agree on its shape and dtype (`CollectiveMismatchError` on both sides, not a
hang), bounded waits, dead-peer errors; and messages between different pairs never wait for
each other.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _arrays, interop
from ._errors import GpuringError, PeerFailureError, in_ranks
from ._failures import Unraised

if TYPE_CHECKING:
    from ._callpath import CallPath
    from ._config import Config
    from ._watchdog import Watchdog
    from ._work import Work
    from .rendezvous.base import ControlPlane

__all__ = ["split", "Channel", "Pairs"]

#: a buffer region of a pair's channel, where GPURING_BUFFER_BYTES does not say (an engine
#: has four): a rank has a channel per peer it messages, so far less than a collective's
#: default on a GPU (messages larger than this run in rounds)
PAIR_BUFFER_BYTES = 4 << 20


def split(path: CallPath, control: ControlPlane, count: Callable[[], int], color: int | None,
          key: int, make: Callable[[ControlPlane], Any], drain: Callable[[], None]) -> Any:
    """`Communicator.split` (`count()`: its number, counted alike on every rank, once the
    ranks exchanged their colors): every rank tells
    the others its (color, key); the ranks of one color make a communicator of their own
    (`make` of its control plane), in (key, rank) order, once `drain()` waited for the
    async verbs' work."""
    if color is not None:
        color = _index(color, "color")
        if color < 0:
            raise ValueError(f"split: color must be >= 0 or None, got {color}")
    key = _index(key, "key")
    drain()  # (the async verbs' work first, as every collective's)
    path.life.check("split", path.seq + 1)
    entries = path.exchange("split()", (color, key), "split",
                            f"split(color={color}, key={key})")
    number = count()
    if color is None:
        return None
    members = tuple(sorted((r for r, (c, _) in enumerate(entries) if c == color),
                           key=lambda r: (entries[r][1], r)))
    return make(control.subgroup(members, f"{control.job_id}-s{number}c{color}"))


class Channel(NamedTuple):
    """A pair's communicator, as the communicator that makes it hands it over: its verbs,
    how to run one on its own thread, its watchdog, how to close and abort it."""

    comm: Any
    submit: Callable[..., Work]
    watchdog: Callable[[], Watchdog | None]
    close: Callable[[], None]
    abort: Callable[[str, int | None], None]


class Pairs:
    """A communicator's point-to-point messages: one channel per peer it messages (made
    on first use by `make`, kept until the communicator closes)."""

    def __init__(self, path: CallPath, control: ControlPlane, config: Config,
                 make: Callable[[ControlPlane, Config], Channel]):
        self.path, self.control, self.config, self.make = path, control, config, make
        self.rank, self.size = control.rank, control.size
        self.channels: dict[int, Channel] = {}  #: peer -> the pair's channel

    def __bool__(self) -> bool:
        return bool(self.channels)

    def pair(self, peer: int) -> tuple[Channel, int, int]:
        """The channel of this rank and `peer`, with this rank's and the peer's rank in it."""
        path = self.path
        with path.lock:
            found = self.channels.get(peer)
            if found is None:
                path.life.check("a point-to-point message", path.seq + 1)
                low, high = sorted((self.rank, peer))
                control = self.control.subgroup((low, high),
                                                f"{self.control.job_id}-p{low}x{high}")
                config = self.config
                if config.buffer_bytes is None:
                    config = dataclasses.replace(config, buffer_bytes=PAIR_BUFFER_BYTES)
                found = self.channels[peer] = self.make(control, config)
        mine = int(self.rank > peer)
        return found, mine, 1 - mine

@contextlib.contextmanager
def _in_ranks_of(pairs: Pairs, verb: str, peer: int, x: Any = None) -> Iterator[None]:
    """A message of `comm` (`x` its array): an event of `comm`'s timeline when one records;
    errors of the channel with `peer` in `comm`'s ranks (their `peer` and `differences` name
    ranks of `comm`, and the message says which message failed)."""
    timeline = pairs.path.timeline
    try:
        with contextlib.nullcontext() if timeline is None or x is None else \
                timeline.span(verb, x):
            yield
    except GpuringError as exc:
        low, high = sorted((pairs.rank, peer))
        raise in_ranks(exc, (low, high), f"{verb} (ranks {low} and {high}, which are ranks 0 "
                                         "and 1 of their channel)", pairs.control.job_ranks
                       ) from None


def _message(channel: Channel, array: Any, root: int) -> Any:
    """One message on a pair's channel: a broadcast from `root`; for NumPy arrays the two
    ranks then meet, so that a send returns once the receiver has the data (a send that
    returned early would leave a mismatch found later to the receiver alone)."""
    result = channel.comm.broadcast(array, root=root)
    if _arrays.device_kind(array) == "cpu":
        channel.comm.barrier()
    return result


def send(comm: Pairs, x: Any, dst: Any) -> None:
    peer = _peer(comm, dst, "dst", "send")
    _arrays.device_kind(x)  # a NumPy or CuPy array, else TypeError
    channel, mine, _ = comm.pair(peer)
    with _in_ranks_of(comm, f"send to rank {peer}", peer, x):
        _message(channel, _arrays.contiguous(x), mine)


def recv(comm: Pairs, x: Any, src: Any) -> Any:
    peer = _peer(comm, src, "src", "recv")
    _check_filled(x, "recv", "x")
    channel, _, theirs = comm.pair(peer)
    with _in_ranks_of(comm, f"recv from rank {peer}", peer, x):
        return _message(channel, x, theirs)


def sendrecv(comm: Pairs, x: Any, dst: Any, out: Any, src: Any) -> Any:
    """Send `x` to `dst` and receive `out` from `src` at once (neither waits for the
    other, so a ring shift cannot deadlock)."""
    dst, src = _rank(comm, dst, "dst", "sendrecv"), _rank(comm, src, "src", "sendrecv")
    _arrays.device_kind(x)  # a NumPy or CuPy array, else TypeError
    given, out = out, interop.to_native(out)  # the verb converted x only
    _check_filled(out, "sendrecv", "out")
    x = _arrays.contiguous(x)
    if dst == comm.rank or src == comm.rank:
        if dst != src:
            raise ValueError(f"sendrecv: rank {comm.rank} sends to itself only if it also "
                             f"receives from itself (dst={dst}, src={src})")
        if _arrays.device_kind(x) != _arrays.device_kind(out) or x.shape != out.shape \
                or x.dtype != out.dtype:
            raise ValueError("sendrecv to itself: out must match x (shape, dtype, device)")
        out[...] = x
        return given
    if _arrays.device_kind(x) == _arrays.device_kind(out) and _arrays.may_overlap(x, out):
        raise ValueError("sendrecv: out must not overlap x (x is read while out is written)")
    if dst == src:  # one pair, both ways: the lower rank's message first
        channel, mine, theirs = comm.pair(dst)
        with _in_ranks_of(comm, f"sendrecv with rank {dst}", dst, x):
            for root in (0, 1):
                _message(channel, x if root == mine else out, root)
        return given
    if _arrays.device_kind(x) == "cuda":
        _check_hardware_queues()
    sending, mine, _ = comm.pair(dst)
    receiving, _, theirs = comm.pair(src)
    # the send on the pair's own thread (made on the caller's stream, as its async verbs)
    work = sending.submit("sendrecv", lambda a: _message(sending, a, mine), x)
    with contextlib.ExitStack() as undo:
        # the send is bounded by its channel's timeout; when both halves fail, the receive's
        # error is the one raised (a peer that gave up because of it fails the send), but
        # the send is waited for whatever ends the receive
        undo.callback(_wait_quietly, work)
        _receive_beside(comm, work, receiving, sending, out, src, dst, theirs, x)
        undo.pop_all()
    with _in_ranks_of(comm, f"sendrecv: send to rank {dst}", dst, x):
        work.wait()
    return given


def _wait_quietly(work: Work) -> None:
    with contextlib.suppress(BaseException):
        work.wait()


def _receive_beside(comm: Pairs, work: Work, receiving: Channel, sending: Channel, out: Any,
                    src: int, dst: int, theirs: int, x: Any) -> None:
    """sendrecv's receive, while its send runs as `work`."""
    try:
        with _in_ranks_of(comm, f"sendrecv: recv from rank {src}", src, out):
            _message(receiving, out, theirs)
    except GpuringError as received:
        # the send is bounded by its channel's timeout; when both halves fail, the receive's
        # error is the one raised, unless its peer only closed its channel (after a failure
        # elsewhere) and the send has a failure of its own (closer to the cause: a peer that
        # died, say)
        only_left = isinstance(received, PeerFailureError) and _peer_only_left(receiving)
        try:
            with _in_ranks_of(comm, f"sendrecv: send to rank {dst}", dst, x):
                work.wait()
        except GpuringError as sent:
            if only_left and not _peer_only_left(sending):
                raise sent from None
        except Exception:
            pass
        raise


def _peer_only_left(channel: Channel) -> bool:
    """Whether the peer of a pair's channel closed it cleanly, neither dying nor giving up
    (as the channel's status board shows)."""
    watchdog = channel.watchdog()
    if watchdog is None:
        return False
    board = watchdog.board
    return board.troubled_peer() is None and bool(board.left_before(1 << 62))


#: fewest hardware queues per GPU with which the two halves of a CUDA sendrecv between two
#: peers cannot hold each other up (each half's stream waits on its own peer's flags)
_HALVES_NEED_QUEUES = 4
_warned_queues = False


def _check_hardware_queues() -> None:
    global _warned_queues
    queues = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")
    if _warned_queues or not queues or not queues.isdigit() or \
            int(queues) >= _HALVES_NEED_QUEUES:
        return
    _warned_queues = True
    warnings.warn(f"sendrecv between two peers on CuPy arrays with CUDA_DEVICE_MAX_CONNECTIONS="
                  f"{queues}: its two halves run on streams that may then share a hardware "
                  "queue, where a wait of one holds up the other, across ranks in a cycle "
                  f"until the timeout; use at least {_HALVES_NEED_QUEUES} (the default is 8)",
                  RuntimeWarning, stacklevel=5)


def synchronize_channels(comm: Pairs) -> None:
    """`comm.synchronize()` for its messages: wait for every pair's channel."""
    for peer, channel in sorted(comm.channels.items()):
        with _in_ranks_of(comm, f"synchronize (messages with rank {peer})", peer):
            channel.comm.synchronize()


def abort_channels(comm: Pairs, reason: str, job_peer: int | None) -> None:
    """Abort every pair's channel (`Communicator.abort`)."""
    for channel in list(comm.channels.values()):
        channel.abort(reason, job_peer)


def close_channels(comm: Pairs) -> BaseException | None:
    """Close `comm`'s pairs' channels, in the order of the pairs' ranks on every rank (a close
    waits for the peer's, and a common order cannot make a cycle of waits); the first error
    a channel had not raised yet, in `comm`'s ranks."""
    kept = Unraised()
    for peer, channel in sorted(comm.channels.items()):
        with kept.step(), _in_ranks_of(comm, f"close (messages with rank {peer})", peer):
            channel.close()
    return kept.error


def _index(value: Any, name: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _rank(comm: Pairs, value: Any, name: str, verb: str) -> int:
    rank = _index(value, name)
    if not 0 <= rank < comm.size:
        raise ValueError(f"{verb}: {name}={rank} is not a rank of this communicator "
                         f"(size {comm.size})")
    return rank


def _peer(comm: Pairs, value: Any, name: str, verb: str) -> int:
    rank = _rank(comm, value, name, verb)
    if rank == comm.rank:
        raise ValueError(f"{verb}: {name} is this rank ({rank}); a rank does not message "
                         "itself (sendrecv to itself copies)")
    return rank


def _check_filled(x: Any, verb: str, name: str) -> None:
    _arrays.device_kind(x)  # a NumPy or CuPy array, else TypeError
    if not x.flags.c_contiguous or not getattr(x.flags, "writeable", True):
        raise TypeError(f"{verb} fills {name} in place: it must be C-contiguous and writable")
