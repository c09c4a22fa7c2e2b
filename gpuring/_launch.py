"""What the scheduler prepares for one collective (`Launch`: its rounds, or the one
operation it runs as, and the registered arrays it reaches) and what it raises where a rank
cannot register memory."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from ._errors import GpuringError
from ._ops import ReduceOp
from .algorithms.plan import RoundPlan, Wait
from .devices.base import FusedOp, Runner, Span

if TYPE_CHECKING:
    from ._scheduler import Engine

__all__ = ["Launch", "PeerArrays", "RegistrationError"]


class RegistrationError(GpuringError):
    """A rank could not allocate registered memory (every rank raises it; the communicator
    goes on)."""


class PeerArrays(NamedTuple):
    """A rank's input and output of a collective on registered memory, mapped here (None:
    not registered)."""

    inp: Span | None
    out: Span | None


class Launch:
    """A collective prepared for one engine: its rounds, the dtype and op, whether it runs on
    the inline stream, and (for that stream) its runners, compiled on the first run. Made by
    `Engine.prepare`, run by `Engine.run` as often as the collective is called."""

    __slots__ = ("_per_round", "collective", "divisor", "dtype", "engine", "fused", "fused_op",
                 "hears_all", "inline", "itemsize", "op", "peers", "root", "rounds", "runners")

    def __init__(self, engine: Engine, rounds: tuple[RoundPlan, ...], dtype: str,
                 itemsize: int, op: ReduceOp, inline: bool, fused: bool = False,
                 collective: str = "all_reduce", root: int = 0,
                 peers: tuple[PeerArrays, ...] = ()):
        self.engine = engine
        #: every rank's registered input and output, mapped here, which registered rounds
        #: read (`RoundPlan.registered`); empty for collectives on plain arrays
        self.peers = peers
        #: the collective runs as one operation on the caller's stream, not in rounds: `fused_op`
        #: (set by `Engine.prepare`)
        self.fused = fused
        self.fused_op: FusedOp | None = None
        self.collective = collective
        self.root = root
        self.rounds = rounds
        self.dtype = dtype
        self.itemsize = itemsize
        self.op = op
        self.divisor = engine.size if op is ReduceOp.AVG else 1
        self.inline = inline
        #: inline runners, per channel, of (round, buffer half (seq parity), credits known
        #: (see `Engine.run`)), each compiled on its first use
        self.runners: dict[tuple[int, int, bool], tuple[Runner, ...]] = {}
        #: per round: whether its (one) channel waits for a piece of every other rank
        self.hears_all = tuple(
            len(plan.channels) == 1 and {o.peer for o in plan.channels[0]
                                         if isinstance(o, Wait)} == set(range(engine.size))
            - {engine.rank} for plan in rounds)
        self._per_round: tuple[Launch, ...] | None = None

    def per_round(self) -> tuple[Launch, ...]:
        """One launch per round (the timeline runs and times them one by one); a fused launch
        is one step."""
        if self.fused:
            return (self,)
        if self._per_round is None:
            self._per_round = tuple(Launch(self.engine, (plan,), self.dtype, self.itemsize,
                                           self.op, self.inline, collective=self.collective,
                                           root=self.root, peers=self.peers)
                                    for plan in self.rounds)
        return self._per_round
