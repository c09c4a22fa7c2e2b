"""Registered memory: arrays every rank's peers have mapped (`Communicator.empty`/`zeros`),
and where a call's arrays lie in it.

A registration is made by every rank at once, so it has the same number on every rank: the
number of registrations the communicator made before it. A call on arrays that lie in
registered memory says so with a `Placement` (which registration, how far into it), which
the ranks agree on before the call first runs; the collective then reads its peers' arrays
where they lie (`algorithms.registered`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import _arrays
from ._call import Signature
from ._scheduler import PeerArrays
from .devices.base import Memory, Span

__all__ = ["Registration", "Placement", "Registry"]


class Registration(NamedTuple):
    """Registered memory of one device kind: every rank's allocation, mapped here (this
    rank's own at its index), and where this rank's lies in its address space."""

    ident: int
    kind: str
    mems: tuple[Memory, ...]
    address: int
    nbytes: int


class Placement(NamedTuple):
    """Where a call's input and output lie in registered memory: (registration, byte
    offset), or None for a plain array. Only an all_reduce's output counts (it is the only
    collective whose peers read outputs). `in_place`: the output overlaps the input."""

    inp: tuple[int, int] | None
    out: tuple[int, int] | None
    in_place: bool = False

    def ids(self) -> tuple[int | None, int | None, bool]:
        """The registrations (None: plain) and whether in place, which every rank's call
        must have alike."""
        return (None if self.inp is None else self.inp[0],
                None if self.out is None else self.out[0], self.in_place)

    def offsets(self) -> tuple[int | None, int | None]:
        """The byte offsets into them, which may differ from rank to rank."""
        return (None if self.inp is None else self.inp[1],
                None if self.out is None else self.out[1])


class Registry:
    """A communicator's registrations, by number and by device kind."""

    __slots__ = ("_by_id", "_by_kind")

    def __init__(self) -> None:
        self._by_id: list[Registration] = []
        self._by_kind: dict[str, list[Registration]] = {}

    def __bool__(self) -> bool:
        return bool(self._by_id)

    def next_ident(self) -> int:
        return len(self._by_id)

    def add(self, registration: Registration) -> None:
        assert registration.ident == len(self._by_id)
        self._by_id.append(registration)
        self._by_kind.setdefault(registration.kind, []).append(registration)

    def get(self, ident: int) -> Registration:
        return self._by_id[ident]

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

    def placement(self, collective: str, x: Any, out: Any) -> Placement | None:
        """Where the call's arrays lie (None: nowhere registered)."""
        kind = _arrays.device_kind(x)
        inp = self.find(kind, x)
        mine = self.find(kind, out) if collective == "all_reduce" and out is not None else None
        if inp is None and mine is None:
            return None
        return Placement(inp, mine, out is not None and _arrays.may_overlap(x, out))

    def peer_arrays(self, signatures: list[Signature], nbytes: int) -> tuple[PeerArrays, ...]:
        """Every rank's input and output of `nbytes`, mapped here, from the signatures of the
        ranks' call (registrations agreed, offsets each rank's own)."""
        return tuple(PeerArrays(*(
            None if ident is None or offset is None else
            Span(self._by_id[ident].mems[rank], offset, nbytes)
            for ident, offset in zip((sig.registered or (None, None))[:2],
                                     sig.offsets or (None, None), strict=True)))
            for rank, sig in enumerate(signatures))
