"""The routes of a call path that leave gpuring's own engines: flat MPI (NumPy arrays), flat
NCCL (CuPy arrays), and two levels across nodes (`_hierarchy`); and which of them a call
takes: whether the ranks map each other's memory, whether NumPy collectives go through MPI.
Functions of the `CallPath` they serve.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from . import _failures
from ._call import Call, PreparedCall
from ._failures import Path, weakly
from ._hierarchy import Levels
from ._route import Facts, numpy_via_mpi
from .devices import device_class

if TYPE_CHECKING:
    from ._call import Signature
    from ._choices import Choices
    from ._engine import Engine
    from ._hierarchy import Layout, LevelParts
    from ._registry import Registry
    from .rendezvous.base import ControlPlane
    from .transports.mpi import MpiCollectives
    from .transports.nccl import NcclCollectives

__all__ = ["RoutePath", "run_via_mpi", "run_nodes", "sync_levels", "run_via_nccl", "asks_reach",
           "peers_reachable", "via_mpi"]

class RoutePath(Path, Protocol):
    """The call path as preparing a call (`_prepare`) and the routes that leave gpuring's
    engines (`_transport_routes`) see it: its facts, its agreement, its engines."""

    size: int
    facts: Facts
    choices: Choices
    registry: Registry
    mappable: dict[str, bool]
    layout: Layout | None
    make_communicator: Callable[[ControlPlane], LevelParts] | None
    mpi: MpiCollectives | None
    nccl: NcclCollectives | None  # type: ignore[assignment]
    levels: Levels | None  # type: ignore[assignment]

    @property
    def engines(self) -> dict[str, Engine]: ...

    def agree(self, signature: Signature, *, remember: bool = True) -> None: ...

    def exchange(self, what: str, obj: Any, name: str, described: str) -> list[Any]: ...

    def ensure_watchdog(self, name: str = ...) -> None: ...

    def capacity(self, kind: str) -> int: ...

    def engine(self, kind: str, capacity: int) -> Engine: ...

    def nccl_failed(self, error: Any) -> None: ...


log = logging.getLogger("gpuring")


def run_via_mpi(path: RoutePath, prepared: PreparedCall, call: Call) -> Any:
    name = call.collective
    if path.mpi is None:
        from .rendezvous.mpi import MpiControl
        from .transports.mpi import MpiCollectives

        assert isinstance(path.control, MpiControl)
        path.mpi = MpiCollectives(path.control, path.config.timeout)
    with _failures.on_transport(path, name, mpi=True):
        if call.x is None:
            path.mpi.barrier()
        else:
            path.mpi.run(name, call.x, call.out, call.op, call.root)
    return call.out


def run_nodes(path: RoutePath, prepared: PreparedCall, call: Call) -> Any:
    """In two levels (`_hierarchy`), after the ranks agree on the call (at every call: a
    rank that calls something else is a mismatch on every rank, not a wait for data that
    never comes); a failure of either level breaks this communicator and both levels,
    and is told to the peers of all three."""
    assert prepared.signature is not None
    with _failures.on_nodes(path, call.collective, agreeing=True):
        path.agree(prepared.signature, remember=False)
    if call.x is None:  # a barrier: the agreement was one
        return None
    with _failures.on_nodes(path, call.collective):
        if path.levels is None:
            assert path.layout is not None and path.make_communicator is not None
            path.levels = Levels(path.control, path.layout, path.config.deterministic,
                                 path.make_communicator)
        return path.levels.run(call, path.size)


def sync_levels(path: RoutePath, name: str) -> None:
    """Across nodes, wait for both levels' collectives; their failure is this
    communicator's (`name`: the call that waits)."""
    if path.levels is not None:
        with _failures.on_nodes(path, name):
            path.levels.synchronize()


def run_via_nccl(path: RoutePath, prepared: PreparedCall, call: Call) -> Any:
    name = call.collective
    with _failures.on_transport(path, name, mpi=False):
        if path.nccl is None:
            from .transports.nccl import NcclCollectives

            path.nccl = NcclCollectives(path.control, int(call.x.device.id),
                                        path.config.timeout, weakly(path.nccl_failed))
        path.nccl.run(name, call.x, call.out, call.op, call.root, path.size)
    return call.out


def asks_reach(path: RoutePath, kind: str) -> bool:
    """Whether the ranks have yet to find out whether they map each other's memory of
    `kind` (once, on one node, where gpuring picks the route)."""
    return (kind not in path.mappable and path.control.single_node
            and path.config.transport == "auto" and device_class(kind).may_be_unreachable)


def peers_reachable(path: RoutePath, kind: str, name: str) -> bool:
    """Whether every rank of this node can map every other's memory of `kind` (CUDA IPC
    needs peer access between different GPUs), decided by all ranks at once with call
    `name`; where one cannot, their collectives of `kind` run on NCCL."""
    devices = device_class(kind)
    try:
        place = devices.place(path.control)
    except Exception:  # the device says why once made
        place = ""
    places = path.exchange("where each rank's memory lies", place, name, name)
    try:
        why = devices.unreachable(path.control, places)
    except Exception as exc:
        why = f"peer access unknown ({exc!r})"
    whys = path.exchange("peer access", why, name, name)
    refused = [f"rank {r}: {w}" for r, w in enumerate(whys) if w]
    if refused:
        log.info("%s arrays: no peer access between these ranks' memory (%s); their "
                 "collectives run on NCCL", devices.arrays, "; ".join(refused))
    return not refused


def via_mpi(path: RoutePath) -> bool:
    """Whether NumPy collectives go through MPI (`_route.numpy_via_mpi`)."""
    return numpy_via_mpi(path.facts)
