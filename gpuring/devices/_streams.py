"""What a schedule's work on a device is made of: memory and spans of it, 64-bit flags,
events, and streams that copy, reduce, wait on flags and write them; and the errors of a flag
wait. `gpuring.devices.base` says how a device provides them."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, NamedTuple

from .._ops import ReduceOp

__all__ = ["Memory", "Span", "Arg", "Flag", "Event", "Stream", "FlagWaitTimeout",
           "FlagWaitAborted"]


class Memory(abc.ABC):
    """A device allocation: local, opened from a peer, or a borrowed user array."""

    nbytes: int


class Span(NamedTuple):
    """`nbytes` bytes of `mem` starting at byte `offset`."""

    mem: Memory
    offset: int
    nbytes: int


class Arg(NamedTuple):
    """`nbytes` bytes at `offset` of a memory given at each run of a program: the collective's
    input (which = 0) or output (which = 1)."""

    which: int
    offset: int
    nbytes: int


class Flag(NamedTuple):
    """The 64-bit word at byte `offset` of `mem` (8-byte aligned)."""

    mem: Memory
    offset: int



class FlagWaitTimeout(Exception):
    """A flag wait ran past its deadline. Carries what was waited for."""

    def __init__(self, flag: Flag, value: int, observed: int, tag: Any):
        super().__init__(f"flag wait timed out: wanted >= {value}, saw {observed} ({tag})")
        self.flag = flag
        self.value = value
        self.observed = observed
        self.tag = tag


class FlagWaitAborted(Exception):
    """A flag wait was interrupted because the device was aborted."""

    def __init__(self, reason: str, tag: Any):
        super().__init__(reason)
        self.reason = reason
        self.tag = tag


class Event(abc.ABC):
    """A point in a stream that other streams (or the host) can wait for."""

    @abc.abstractmethod
    def query(self) -> bool:
        """True once every operation before the event has completed."""


class Stream(abc.ABC):
    """An ordered queue of operations. Enqueueing never blocks on the operations themselves."""

    @abc.abstractmethod
    def copy(self, dst: Span, src: Span) -> None:
        """dst[:] = src[:] (same byte count)."""

    @abc.abstractmethod
    def reduce(self, dst: Span, a: Span, b: Span, dtype: str, op: ReduceOp,
               divisor: int = 1) -> None:
        """dst = op(a, b) element-wise, then dst /= divisor when divisor != 1 (avg)."""

    @abc.abstractmethod
    def reduce_n(self, dst: Span, srcs: Sequence[Span], dtype: str, op: ReduceOp,
                 divisor: int = 1) -> None:
        """dst = srcs[0] op srcs[1] op ... op srcs[-1] element-wise (two or more sources, same
        byte count), folded in that order with every step rounded to the dtype, then dst /=
        divisor at the last step when divisor != 1: the same bits as `reduce(dst, srcs[0],
        srcs[1])` followed by `reduce(dst, dst, srcs[k])` for k = 2, 3, ..., the divisor
        passed to the last. dst may be the same memory as one source, at the same positions
        (an in-place fold: each element is read from every source before it is written; a
        device that cannot for some folds raises ValueError), and overlap none otherwise."""

    @abc.abstractmethod
    def wait_flag(self, flag: Flag, value: int, tag: Any = None) -> None:
        """Hold later operations until the flag is >= value. `tag` names the wait in errors.
        The flag must live in memory this device allocated (never a peer's): a stream waits
        only on words its own device can write, so `Device.abort` can release every wait."""

    @abc.abstractmethod
    def write_flag(self, flag: Flag, value: int) -> None:
        """Set the flag to value once every earlier operation is complete and visible to peers.
        The flag may be a peer's (a producer writes into its reader's memory). Once the device
        is aborted, writes to peers' memory are dropped: nothing computed after a failure
        reaches a peer."""

    def write_flags(self, flags: Sequence[Flag], value: int) -> None:
        """`write_flag` of each of `flags`, all to `value` (a device may do it in one
        operation)."""
        for flag in flags:
            self.write_flag(flag, value)

    def capturing(self) -> bool:
        """Whether the stream records work into a graph instead of running it (CUDA graph
        capture). Default: never."""
        return False

    @abc.abstractmethod
    def record(self) -> Event:
        """An event that completes when everything enqueued so far has."""

    @abc.abstractmethod
    def wait_event(self, event: Event) -> None:
        """Hold later operations until `event` completes."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Block the host until the stream is idle; raise the first error an operation hit."""
