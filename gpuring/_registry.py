"""Registered memory: arrays every rank's peers have mapped (`Communicator.empty`/`zeros`),
and where a call's arrays lie in it.

A registration is made by every rank at once, so it has the same number on every rank: the
number of registrations the communicator made before it. A call on arrays that lie in
registered memory says so with a `Placement` (which registration, how far into it), which
every rank's call must have alike (the ranks agree on it before the call first runs, and the
call is prepared once per placement, so what a rank knows of its peers' arrays is what they
pass); the collective then reads its peers' arrays where they lie (`algorithms.registered`).
Rank r's array lies at `base + r * stride`: the same offset on every rank (stride 0), or, for
an all_gather in place (`x=out[rank]`), each rank's own block of the output.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import _arrays
from ._engine import PeerArrays
from .devices.base import Memory, Span

__all__ = ["Registration", "Where", "Placement", "Registry"]


class Registration(NamedTuple):
    """Registered memory of one device kind: every rank's allocation, mapped here (this
    rank's own at its index), and where this rank's lies in its address space."""

    ident: int
    kind: str
    mems: tuple[Memory, ...]
    address: int
    nbytes: int


class Where(NamedTuple):
    """An array in registration `ident`: rank r's lies `base + r * stride` bytes into it."""

    ident: int
    base: int
    stride: int = 0

    def offset(self, rank: int) -> int:
        return self.base + rank * self.stride


class Placement(NamedTuple):
    """Where a call's input and output lie in registered memory (None: a plain array), the
    same on every rank. Only an all_reduce's output counts (it is the only collective whose
    peers read or write outputs)."""

    inp: Where | None
    out: Where | None


class Registry:
    """A communicator's registrations, by number and by device kind."""

    __slots__ = ("_by_id", "_by_kind")

    def __init__(self) -> None:
        self._by_id: list[Registration] = []
        self._by_kind: dict[str, list[Registration]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def add(self, kind: str, mems: tuple[Memory, ...], address: int,
            nbytes: int) -> Registration:
        """The next registration (numbered in the order made, the same on every rank)."""
        registration = Registration(len(self._by_id), kind, mems, address, nbytes)
        self._by_id.append(registration)
        self._by_kind.setdefault(kind, []).append(registration)
        return registration

    def find(self, kind: str, x: Any) -> tuple[int, int] | None:
        """(registration, byte offset) of the array `x` (C-contiguous, of device `kind`)
        when all of it lies in one registration, else None."""
        registrations = self._by_kind.get(kind)
        if not registrations or x.nbytes == 0:
            return None
        address = _arrays.address(x)
        for reg in registrations:
            offset = address - reg.address
            if 0 <= offset and offset + x.nbytes <= reg.nbytes:
                return reg.ident, offset
        return None

    def memory(self, ident: int, rank: int) -> Memory:
        """Rank `rank`'s allocation of registration `ident`, mapped here."""
        return self._by_id[ident].mems[rank]

    def placement(self, collective: str, x: Any, out: Any, rank: int) -> Placement | None:
        """Where the call's arrays lie (None: nowhere registered), seen from `rank`."""
        kind = _arrays.device_kind(x)
        found = self.find(kind, x)
        inp = None
        if found is not None:
            ident, offset = found
            stride = x.nbytes if collective == "all_gather" and out is not None and \
                _arrays.may_overlap(x, out) else 0  # in place: x is out's block of this rank
            inp = Where(ident, offset - rank * stride, stride)
        mine = self.find(kind, out) if collective == "all_reduce" and out is not None else None
        if inp is None and mine is None:
            return None
        return Placement(inp, None if mine is None else Where(*mine))

    def peer_arrays(self, placement: Placement, n: int, nbytes: int) -> tuple[PeerArrays, ...]:
        """Every rank's input and output of `nbytes` at `placement`, mapped here."""
        def span(where: Where | None, rank: int) -> Span | None:
            if where is None:
                return None
            return Span(self._by_id[where.ident].mems[rank], where.offset(rank), nbytes)

        return tuple(PeerArrays(span(placement.inp, r), span(placement.out, r))
                     for r in range(n))
