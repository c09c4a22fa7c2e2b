"""Mailboxes: where the messages of NumPy arrays between the ranks of one node travel, and the
records they travel as.

Each rank's inbox is one shared-memory allocation that every peer of its node maps:

    [control: HEAD[q], FREED[q], GPU_READY[q], GPU_FREED[q] for every rank q, a cache line
     each | RING[q] for every other rank q, `ring_bytes` each]

(GPU_READY and GPU_FREED count the pieces of CuPy messages, whose data travels in GPU
memory: `_cuda_messages`; the GPU reads and writes them where the inbox is registered with
CUDA.)

RING[q] of rank r holds the records rank q sends rank r, a byte stream that only q writes
and only r reads. HEAD[q] counts the bytes q has published there, FREED[q] the bytes rank q
has consumed of the ring this rank writes in q's inbox: both are written by the peer and
read by their owner, so every word a rank waits on lies in its own memory (as the engine's
flags do). Counters only grow (2^63 bytes will not be reached), positions are counters modulo
`ring_bytes`. A writer publishes a record by writing it and then HEAD; a reader reads HEAD,
then the record, and hands the space back by writing FREED once it copied the record out.
Stores become visible in program order on x86-64 (the host device's premise), so a reader
never sees HEAD before the record.

A record is a 64-byte header (`Header`: its kind, the message it belongs to, three integers
whose meaning depends on the kind, the dtype's name) and a payload, padded to 64 bytes. A
record never wraps: one that does not fit before the end of the ring is preceded by a WRAP
record that fills the rest.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np

from .devices.host import HostDevice, HostMemory

__all__ = ["EAGER", "RTS", "CTS", "DATA", "NACK", "FIN", "GPU_RTS", "GPU_DETACHED", "Header",
           "Inbox",
           "ShmLane",
           "HEADER_BYTES", "byte_view", "ring_bytes_for"]

#: a whole message: header and data (a): tag, (b): element count, (c): bytes
EAGER = 1
#: a message's announcement, its data to follow once the receiver asks (a, b, c as EAGER;
#: the payload says where the data lies: `Where`)
RTS = 2
#: the receiver asks for message `msg`'s data (clear to send)
CTS = 3
#: a piece of message `msg`'s data: (a) its offset in bytes, (c) its length
DATA = 4
#: the receiver refused message `msg`: the payload is why (JSON)
NACK = 5
#: the receiver read message `msg`'s data where it lies (a registered array): done
FIN = 6
#: the rest of the ring is unused: the next record starts at its beginning
WRAP = 7
#: a CuPy message's header (a, b, c as EAGER; the payload: its pieces, JSON), its data on
#: the GPU (`_cuda_messages`)
GPU_RTS = 8
#: the sender of this record closed its mappings of this rank's GPU outbox (at close)
GPU_DETACHED = 9

_HEADER = struct.Struct("<iiqqqqq16s")
_new = tuple.__new__
HEADER_BYTES = _HEADER.size  # 64
_ALIGN = 64
_LINE = 64  # one counter per cache line: peers that write neighbouring counters never share one
_PAGE = 4096
#: bytes of rings per rank shared among its peers, where GPURING_MESSAGE_BYTES sets none
_BUDGET = 8 << 20
_SMALLEST, _LARGEST = 64 << 10, 4 << 20


class Header(NamedTuple):
    kind: int
    aux: int
    length: int  #: bytes of the record, header and padding included
    msg: int  #: the message it belongs to: the sender's count of messages to this peer
    a: int
    b: int
    c: int
    dtype: bytes


def ring_bytes_for(peers: int, setting: int | None) -> int:
    """Bytes of one ring: `setting` (GPURING_MESSAGE_BYTES) rounded up to 64 bytes, else a
    budget shared by the `peers` of a node, a power of two from 64 KiB to 4 MiB."""
    if setting:
        return max(16 << 10, -(-setting // _ALIGN) * _ALIGN)
    share = _BUDGET // max(peers, 1)
    size = _SMALLEST
    while size * 2 <= min(share, _LARGEST):
        size *= 2
    return size


def byte_view(x: Any) -> memoryview:
    """The bytes of the C-contiguous array `x` (writable where `x` is), without a copy."""
    try:
        return memoryview(x).cast("B")
    except (TypeError, ValueError):  # an empty array, or a dtype the buffer protocol lacks
        return memoryview(x.reshape(-1).view(np.uint8))


class Inbox:
    """This rank's inbox (allocated by `device`), and where anything lies in any rank's."""

    def __init__(self, device: HostDevice, rank: int, size: int, ring_bytes: int):
        self.rank, self.size, self.ring_bytes = rank, size, ring_bytes
        self.control_bytes = -(-4 * size * _LINE // _PAGE) * _PAGE
        self.mem = device.alloc(self.control_bytes + (size - 1) * ring_bytes)

    def head_word(self, sender: int) -> int:
        """The index of HEAD[sender] among an inbox's 64-bit words."""
        return sender * _LINE // 8

    def freed_word(self, reader: int) -> int:
        return (self.size + reader) * _LINE // 8

    def gpu_ready_offset(self, sender: int) -> int:
        """Where GPU_READY[sender] lies in an inbox (bytes)."""
        return (2 * self.size + sender) * _LINE

    def gpu_freed_offset(self, reader: int) -> int:
        return (3 * self.size + reader) * _LINE

    def ring_offset(self, owner: int, sender: int) -> int:
        """Where RING[sender] lies in rank `owner`'s inbox."""
        return self.control_bytes + (sender - (sender > owner)) * self.ring_bytes


class ShmLane:
    """The two rings between this rank and one peer of its node: records written into the
    peer's inbox (`put`), records read from this rank's (`take`, `release`)."""

    __slots__ = ("_freed", "_freed_there", "_head", "_head_here", "_in_mv", "_in_off",
                 "_mine", "_out_mv", "_out_off", "_theirs", "inbox", "peer", "piece", "ring",
                 "sent", "taken", "their_inbox")
    #: a message's data travels in DATA records (pieces of at most `piece` bytes)
    records_data = True

    def __init__(self, inbox: Inbox, peer: int, theirs: HostMemory):
        rank = inbox.rank
        self.peer = peer
        self.inbox = inbox  #: this rank's inbox
        self.their_inbox = theirs  #: the peer's inbox, mapped here
        self.ring = inbox.ring_bytes
        mine = inbox.mem
        assert mine.i64 is not None and theirs.i64 is not None and mine.mapping is not None \
            and theirs.mapping is not None
        self._mine, self._theirs = mine.i64, theirs.i64
        self._out_mv = memoryview(theirs.mapping)
        self._out_off = inbox.ring_offset(peer, rank)
        self._head = inbox.head_word(rank)  # HEAD[rank] in the peer's inbox
        self._freed = inbox.freed_word(peer)  # FREED[peer] in this rank's
        self._in_mv = memoryview(mine.mapping)
        self._in_off = inbox.ring_offset(rank, peer)
        self._head_here = inbox.head_word(peer)  # HEAD[peer] in this rank's inbox
        self._freed_there = inbox.freed_word(rank)  # FREED[rank] in the peer's
        #: the largest piece of a message's data in one DATA record: a quarter of the ring
        self.piece = self.ring // 4 - HEADER_BYTES
        self.sent = 0  #: bytes this rank published in the peer's ring
        self.taken = 0  #: bytes this rank consumed of its own ring from the peer

    # -- writing into the peer's inbox ---------------------------------------------------
    def put(self, kind: int, msg: int, a: int = 0, b: int = 0, c: int = 0,
            dtype: bytes = b"", payload: memoryview | bytes | None = None,
            aux: int = 0) -> bool:
        """Write a record and publish it; False (nothing written) where it does not fit yet
        (the peer has not consumed enough). Records larger than half the ring never fit."""
        size = 0 if payload is None else len(payload)
        length = HEADER_BYTES + -(-size // _ALIGN) * _ALIGN
        ring, sent = self.ring, self.sent
        at = sent % ring
        tail = ring - at
        freed = self._mine[self._freed]
        # a WRAP first where the record does not fit before the end, and where the ring is
        # empty and at least half of it lies before `at` (start over at its beginning, whose
        # cache lines the last records warmed: a ping-pong keeps reusing them). The WRAP's
        # bytes stay in use until the peer takes it, so the room left is what lies before
        # `at`: at least half the ring keeps "an empty ring takes any record" true.
        wrap = tail if at and (length > tail or (freed == sent and at >= ring // 2)) else 0
        if sent + wrap + length - freed > ring:
            return False
        base = self._out_off
        if wrap:
            _HEADER.pack_into(self._out_mv, base + at, WRAP, 0, tail, 0, 0, 0, 0, b"")
            sent += tail
            at = 0
        start = base + at
        if payload is not None and size:
            self._out_mv[start + HEADER_BYTES:start + HEADER_BYTES + size] = payload
        _HEADER.pack_into(self._out_mv, start, kind, aux, length, msg, a, b, c, dtype)
        self.sent = sent + length
        self._theirs[self._head] = self.sent  # published
        return True

    # -- reading this rank's inbox -------------------------------------------------------
    def waiting(self) -> bool:
        """Whether the peer published records this rank has not taken."""
        return self._mine[self._head_here] != self.taken

    def take(self) -> tuple[Header, memoryview] | None:
        """The next record and a view of its payload (valid until `release`), else None."""
        taken = self.taken
        if self._mine[self._head_here] == taken:
            return None
        ring = self.ring
        at = taken % ring
        header = _new(Header, _HEADER.unpack_from(self._in_mv, self._in_off + at))
        if header.kind == WRAP:
            self.taken = taken + (ring - at)
            return self.take()
        start = self._in_off + at + HEADER_BYTES
        return header, self._in_mv[start:start + header.length - HEADER_BYTES]

    def take_eager(self, tag: int, dtype: bytes, capacity: int, data: memoryview) -> int:
        """The fast path of a receive: where the next record is an eager message with
        `tag`, of `dtype`, at most `capacity` elements, copy its data into `data`, consume it
        and hand the room back; its element count. -1: nothing came yet; -2: the next record
        is another (nothing consumed)."""
        taken = self.taken
        if self._mine[self._head_here] == taken:
            return -1
        at = taken % self.ring
        kind, _, length, _, a, count, nbytes, name = _HEADER.unpack_from(
            self._in_mv, self._in_off + at)
        if kind == WRAP:
            taken += length
            at = 0
            kind, _, length, _, a, count, nbytes, name = _HEADER.unpack_from(
                self._in_mv, self._in_off)
        if kind != EAGER or a != tag or count > capacity or name.rstrip(b"\0") != dtype:
            self.taken = taken
            return -2
        start = self._in_off + at + HEADER_BYTES
        data[:nbytes] = self._in_mv[start:start + nbytes]
        self.taken = taken = taken + length
        self._theirs[self._freed_there] = taken
        return int(count)

    def skip(self, header: Header) -> None:
        """Consume the record `take` gave last (its payload must be copied out by now)."""
        self.taken += header.length

    def release(self) -> None:
        """Hand the records consumed so far back to the peer (its ring's room)."""
        self._theirs[self._freed_there] = self.taken
