"""Message records between nodes, carried by MPI: the lanes of the message engine
(`gpuring._messages`) to the peers whose memory this rank cannot map.

A record (`gpuring._mailbox`'s header and its payload) is one MPI message of its own tag on
the control plane's communicator (whose collectives never match point-to-point messages, and
whose other point-to-point tags are below 32000); a message's data, once the receiver asked
for it, is one MPI message of another tag from the sender's array straight into the receive
buffer. MPI keeps messages of one tag between two ranks in order, so the data of the
messages of one pair meet the receives in the order the receiver asked for them. Every
request is tested, never waited for: the engine's waits stay bounded.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any

from .._mailbox import HEADER_BYTES, Header

__all__ = ["MpiLink", "MpiLane"]

_RECORD_TAG = 32100
_DATA_TAG = 32101
_HEADER = struct.Struct("<iiqqqqq16s")


class MpiLink:
    """The records of every peer on another node: sent with `MpiLane.put`, received by
    `poll`."""

    def __init__(self, comm: Any, MPI: Any):
        self._comm = comm
        self._MPI = MPI
        self._status = MPI.Status()
        #: requests in flight, with what they keep alive and what to call once complete
        self._requests: list[tuple[Any, Any, Callable[[], None] | None]] = []

    def lane(self, peer: int) -> MpiLane:
        return MpiLane(self, peer)

    def start(self, request: Any, keep: Any, then: Callable[[], None] | None = None) -> None:
        self._requests.append((request, keep, then))

    def poll(self, on_record: Callable[[int, Header, memoryview], None]) -> bool:
        """Complete the requests that are done (calling their callbacks) and hand every
        record that arrived to `on_record(source, header, payload)`; whether anything
        happened."""
        did = False
        if self._requests:
            pending = []
            for entry in self._requests:
                if entry[0].Test():
                    did = True
                    if entry[2] is not None:
                        entry[2]()
                else:
                    pending.append(entry)
            self._requests = pending
        MPI, status = self._MPI, self._status
        while True:
            message = self._comm.Improbe(source=MPI.ANY_SOURCE, tag=_RECORD_TAG, status=status)
            if message is None:
                return did
            buffer = bytearray(status.Get_count(MPI.BYTE))
            message.Recv([buffer, MPI.BYTE])
            header = Header._make(_HEADER.unpack_from(buffer, 0))
            on_record(status.Get_source(), header, memoryview(buffer)[HEADER_BYTES:])
            did = True

    def abandon(self) -> None:
        """Forget every request (the communicator failed or closed): what they keep alive
        stays so for good, since MPI may still use it."""
        _ABANDONED.extend(self._requests)
        self._requests = []


#: requests no one waits for any more, and their buffers (MPI may still write them)
_ABANDONED: list[Any] = []


class MpiLane:
    """The records to and from one peer on another node. Records never wait for room: MPI
    buffers them."""

    __slots__ = ("_link", "peer")
    #: data comes by a message of its own (`expect`), not in DATA records
    records_data = False

    def __init__(self, link: MpiLink, peer: int):
        self._link = link
        self.peer = peer

    def put(self, kind: int, msg: int, a: int = 0, b: int = 0, c: int = 0,
            dtype: bytes = b"", payload: memoryview | bytes | None = None,
            aux: int = 0) -> bool:
        size = 0 if payload is None else len(payload)
        record = bytearray(HEADER_BYTES + size)
        _HEADER.pack_into(record, 0, kind, aux, HEADER_BYTES + size, msg, a, b, c, dtype)
        if payload is not None and size:
            record[HEADER_BYTES:] = payload
        link = self._link
        request = link._comm.Isend([record, link._MPI.BYTE], dest=self.peer, tag=_RECORD_TAG)
        link.start(request, record)
        return True

    def stream(self, data: memoryview, finish: Callable[[], None]) -> bool:
        """Send a message's `data` (asked for by the receiver); `finish()` once it may be
        reused. All of it is handed over at once."""
        link = self._link
        request = link._comm.Isend([data, link._MPI.BYTE], dest=self.peer, tag=_DATA_TAG)
        link.start(request, data, finish)
        return True

    def expect(self, data: memoryview, finish: Callable[[], None]) -> None:
        """Receive the data of the message this rank just asked the peer for into `data`;
        `finish()` once it is there."""
        link = self._link
        request = link._comm.Irecv([data, link._MPI.BYTE], source=self.peer, tag=_DATA_TAG)
        link.start(request, data, finish)
