"""Which route a collective takes: a pure function (`choose`) of the agreed call and the
communicator's facts (`Facts`), decided once per prepared call (`_prepare`) and testable
without processes.

The routes, in the order they are tried:

1. a world of one runs nothing (`Route.ALONE`);
2. ranks on several nodes (under GPURING_TRANSPORT=auto) run a barrier as an agreement of
   the whole job, and the reductions and gathers of `HIERARCHICAL` in two levels: inside
   each node, then between the nodes (`Route.NODES`; NumPy arrays need MPI between nodes);
3. what gpuring's engines cannot reach runs on MPI (NumPy arrays across nodes, or
   GPURING_TRANSPORT=mpi) or on NCCL (CuPy arrays across nodes, GPURING_TRANSPORT=nccl, or
   GPUs whose memory the ranks cannot map);
4. everything else runs on a device engine of this communicator (`Route.ENGINE`).

Deterministic mode folds every element in rank order: a route or schedule that cannot is
refused (`Choice.refusal`), on every rank alike once the ranks agreed on the call.
"""

from __future__ import annotations

from typing import NamedTuple

from ._call import Route
from ._choices import FOLDS
from ._errors import GpuringError
from ._hierarchy import HIERARCHICAL

__all__ = ["Facts", "Choice", "choose", "numpy_via_mpi"]


class Facts(NamedTuple):
    """What a call's route depends on besides the call: the same on every rank."""

    size: int
    #: every rank on one node
    single_node: bool
    #: GPURING_TRANSPORT: "auto", "mpi" or "nccl"
    transport: str = "auto"
    #: GPURING_DETERMINISTIC
    deterministic: bool = False
    #: the ranks meet through MPI (started by mpiexec): MPI reaches between them
    over_mpi: bool = False
    #: the communicator can make the communicators of two levels (inside a node, between
    #: nodes) for collectives across nodes
    two_levels: bool = False


class Choice(NamedTuple):
    """A call's route, what `last_schedule` says of it where the route decides that
    (else ""), and why every rank refuses it (None: it runs)."""

    route: Route
    schedule: str = ""
    refusal: str | None = None


def numpy_via_mpi(facts: Facts) -> bool:
    """Whether NumPy collectives go through MPI: across nodes, or when asked to
    (GPURING_TRANSPORT=mpi); a GpuringError where the ranks have no MPI to go through."""
    if facts.single_node and facts.transport != "mpi":
        return False
    if not facts.over_mpi:
        raise GpuringError("NumPy collectives across nodes (or GPURING_TRANSPORT=mpi) need "
                           "MPI between the nodes: start the ranks with mpiexec (mpi4py "
                           "installed: pip install gpuring[mpi])")
    return True


def choose(facts: Facts, name: str, kind: str | None, algorithm: str | None = None, *,
           mappable: bool = True) -> Choice:
    """The route of collective `name` on arrays of device `kind` ("cpu", "cuda"; None for
    a barrier) with schedule `algorithm` (as the communicator resolved it), where the ranks
    do (`mappable`) or do not map each other's memory of that kind."""
    if facts.size == 1:
        return Choice(Route.ALONE, "alone")
    ring_refused = _RING_REFUSED.format(name=name) \
        if facts.deterministic and algorithm == "ring" else None
    auto = facts.transport == "auto"
    if kind is None and not facts.single_node and auto:  # every barrier agrees first
        return Choice(Route.NODES, "agreement")
    if kind is not None and not facts.single_node and auto and facts.two_levels \
            and name in HIERARCHICAL and (kind != "cpu" or numpy_via_mpi(facts)):
        return Choice(Route.NODES, "nodes", ring_refused)
    if kind is None or kind == "cpu":
        if numpy_via_mpi(facts):
            return Choice(Route.MPI, "mpi", _flat_refused(facts, name, "mpi"))
    elif not facts.single_node or facts.transport == "nccl" or not mappable:
        return Choice(Route.NCCL, "nccl", _flat_refused(facts, name, "nccl"))
    return Choice(Route.ENGINE, "", ring_refused)


def _flat_refused(facts: Facts, name: str, flat: str) -> str | None:
    if not (facts.deterministic and name in FOLDS):
        return None
    reach = "across nodes" if flat == "mpi" else \
        "across nodes or between GPUs without peer access"
    return (f"{name}: deterministic mode has no {name} through {flat.upper()} "
            f"({'NumPy' if flat == 'mpi' else 'CuPy'} arrays {reach}, or "
            f"GPURING_TRANSPORT={flat}): its reduction order is its own")


#: a ring asked for in deterministic mode (refused on every rank once agreed)
_RING_REFUSED = ("{name}: deterministic mode folds every element in rank order, which the "
                 "ring does not (its order depends on the segment): ask for 'two_shot' or "
                 "'one_shot', or for none")
