"""What flows down the one call path: a call as a verb describes it, the signature ranks agree
on, and the prepared call (its route, and for the engine its plan) that runs it again."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from ._errors import CollectiveMismatchError
from ._ops import ReduceOp
from ._wording import call_words, differences_text

if TYPE_CHECKING:
    from ._engine import Launch
    from ._registry import Placement

__all__ = ["Call", "Signature", "check_alike", "Route", "PreparedCall"]


@dataclass(slots=True)
class Call:
    """One collective, its arguments already checked: `x` the input (None for a barrier),
    `out` the output (allocated when the user gave none; None off the root of a reduce), and
    the per-call tuning (None: the communicator's settings)."""

    collective: str
    x: Any = None
    out: Any = None
    op: ReduceOp = ReduceOp.SUM
    root: int = 0
    chunk_bytes: int | None = None
    channels: int | None = None
    #: the output already holds the input where the plan would copy it (broadcast into x
    #: itself; all_gather with x as out's block of this rank), so that copy is left out
    in_place: bool = False
    #: the schedule asked for ("ring", "two_shot", "one_shot"; None: the communicator's)
    algorithm: str | None = None
    #: `key()`, once worked out
    known_key: tuple[Any, ...] | None = None
    #: a one-operation collective's operands (`Engine.bind`), once bound: they hold no
    #: array, so the same call coming again (`LastCalls`) runs them as they are
    bound: Any = None
    #: where the arrays lie in registered memory (None: plain arrays), worked out with the key
    placement: Placement | None = None
    #: the prepared call of `key()`, once looked up, and the generation of the call path's
    #: prepared calls it belongs to (`CallPath.generation`: a stale one is looked up anew)
    prepared: PreparedCall | None = None
    generation: int = -1

    def with_arrays(self, x: Any, out: Any) -> Call:
        """This call on other arrays of the same layout and placement (what it worked out
        kept)."""
        return Call(self.collective, x, out, self.op, self.root, self.chunk_bytes,
                    self.channels, self.in_place, self.algorithm, self.known_key, self.bound,
                    self.placement, self.prepared, self.generation)

    def key(self) -> tuple[Any, ...]:
        """What picks the prepared call: everything that shapes its plan."""
        key = self.known_key
        if key is None:
            x = self.x
            key = self.known_key = (self.collective,) if x is None else (
                self.collective, x.shape, x.dtype, type(x), self.op, self.root,
                self.chunk_bytes, self.channels, self.in_place, self.algorithm, self.placement)
        return key


class Signature(NamedTuple):
    """What every rank must call alike, compared across ranks before a call first runs. The
    tuning fields are None where the route has no plan (a world of one, MPI)."""

    collective: str
    device: str | None
    shape: tuple[int, ...]
    dtype: str | None
    op: str | None
    root: int
    chunk_bytes: int | None = None
    channels: int | None = None
    one_shot_bytes: int | None = None
    #: the largest collective run fused (GPURING_FUSED_BYTES)
    fused_bytes: int | None = None
    #: the smallest input of a collective on plain arrays that reaches the peers' arrays by
    #: cross-memory attach (GPURING_ATTACH_BYTES)
    attach_bytes: int | None = None
    buffer_bytes: int | None = None
    verify: bool | None = None
    #: the schedule (`plan_collective`'s `algorithm`, as the communicator resolved it)
    algorithm: str | None = None
    #: deterministic mode (every reduction a fold in rank order)
    deterministic: bool = False
    #: the device's settings that shape its capabilities (`Device.capability_settings`)
    device_settings: tuple[tuple[str, str], ...] | None = None
    #: where the input and the output lie in registered memory (None: plain arrays)
    registered: Placement | None = None
    #: the digest of the tuning table in force (`Tuning.digest`; None: none)
    tuning: str | None = None
    #: GPURING_TRANSPORT (which route runs a call across nodes)
    transport: str | None = None


def check_alike(signatures: list[Signature], name: str, rank: int,
                seq: int | None = None) -> None:
    """Raise CollectiveMismatchError where the ranks' signatures differ (`name`, `rank` and
    `seq`: this rank's call): its message says what differs in the words of the call (only
    what the user set: `_wording.differences_text`), its `differences` every field in which
    they differ, and each rank's value."""
    differences: dict[str, dict[int, object]] = {}
    for i, field in enumerate(Signature._fields):
        values: dict[int, object] = {r: s[i] for r, s in enumerate(signatures)}
        if len(set(map(repr, values.values()))) > 1:
            differences[field] = values
    if differences:
        where = name if seq is None else f"{name} #{seq}"
        calls = {r: call_words(s.collective, s.shape, s.dtype, s.op, s.root)
                 for r, s in enumerate(signatures)}
        raise CollectiveMismatchError(
            f"{where} on rank {rank}: {differences_text(differences, calls)}",
            differences=differences)


class Route(enum.Enum):
    """Who runs an agreed collective."""

    ALONE = "alone"  #: a world of one: nothing moves
    MPI = "mpi"  #: MPI's own collectives (NumPy arrays across nodes, or GPURING_TRANSPORT=mpi)
    NODES = "nodes"  #: in two levels across nodes (`_hierarchy`): in each node, then between
    NCCL = "nccl"  #: NCCL's own collectives (CuPy arrays across nodes, flat)
    ENGINE = "engine"  #: a device engine of this communicator


@dataclass(frozen=True)
class PreparedCall:
    """A collective every rank agreed on, ready to run again: its route and, for the engine,
    the engine's launch and the signature text and digest the status board compares."""

    route: Route
    launch: Launch | None = None
    text: str = ""
    digest: int = 0
    #: what a CUDA graph capture records of the call (`launch` itself where that runs as
    #: one kernel; else, for the engine, one kernel, or one per piece); None: refused under
    #: capture
    captured: Launch | None = None
    #: what runs, in words (`RoundPlan.schedule`, "fused", "mpi", "nodes", "alone")
    schedule: str = ""
    #: what the ranks agree on at every call (the route in two levels across nodes, which
    #: has no status board to compare a call that comes again), else None
    signature: Signature | None = None
    #: what the flight recorder shows of each call it runs (`_recorder.What`'s fields, as a
    #: plain tuple): the call it was prepared for, described then (its site included)
    what: tuple[Any, ...] | None = None
