"""The routes of a call path that leave gpuring's own engines: flat MPI (NumPy arrays), flat
NCCL (CuPy arrays), and two levels across nodes (`_hierarchy`); and which of them a call
takes: whether the ranks map each other's memory, whether NumPy collectives go through MPI.
Functions of the `CallPath` they serve.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NoReturn

from ._call import Call, PreparedCall
from ._errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    CommunicatorClosedError,
    GpuringError,
    PeerFailureError,
)
from ._hierarchy import HIERARCHICAL, Levels
from ._lifecycle import weakly
from .devices import device_class

if TYPE_CHECKING:
    from ._callpath import CallPath

__all__ = ["run_via_mpi", "run_nodes", "sync_levels", "run_via_nccl", "nodes_route",
           "asks_reach", "peers_reachable", "via_mpi"]

log = logging.getLogger("gpuring")


def run_via_mpi(path: CallPath, prepared: PreparedCall, call: Call) -> Any:
    name = call.collective
    if path.mpi is None:
        from .rendezvous.mpi import MpiControl
        from .transports.mpi import MpiCollectives

        assert isinstance(path.control, MpiControl)
        path.mpi = MpiCollectives(path.control, path.config.timeout)
    try:
        if call.x is None:
            path.mpi.barrier()
        else:
            path.mpi.run(name, call.x, call.out, call.op, call.root)
    except BaseException as exc:
        error: BaseException = exc
        known = first_failure(path) if isinstance(
            exc, (PeerFailureError, CollectiveTimeoutError)) else None
        if known is not None:
            error = path.life.explain(known, name, path.seq)
        elif isinstance(exc, GpuringError):  # which call, like the engine's errors
            error = path.life.explain(exc, name, path.seq)
        path.give_up(error, name)  # the other nodes learn it from this rank's notice
        if error is exc:
            raise
        raise error from None
    return call.out


def run_nodes(path: CallPath, prepared: PreparedCall, call: Call) -> Any:
    """In two levels (`_hierarchy`), after the ranks agree on the call (at every call: a
    rank that calls something else is a mismatch on every rank, not a wait for data that
    never comes); a failure of either level breaks this communicator and both levels,
    and is told to the peers of all three."""
    assert prepared.signature is not None
    try:
        path._agree(prepared.signature, remember=False)
    except CollectiveMismatchError:
        raise  # found alike on every rank, before anything moved
    except BaseException as exc:
        nodes_failed(path, exc, call.collective)
    if call.x is None:  # a barrier: the agreement was one
        return None
    try:
        if path.levels is None:
            assert path.layout is not None and path.make_communicator is not None
            path.levels = Levels(path.control, path.layout, path.config.deterministic,
                                 path.make_communicator)
        return path.levels.run(call, path.size)
    except BaseException as exc:
        nodes_failed(path, exc, call.collective)


def sync_levels(path: CallPath, name: str) -> None:
    """Across nodes, wait for both levels' collectives; their failure is this
    communicator's (`name`: the call that waits)."""
    if path.levels is not None:
        try:
            path.levels.synchronize()
        except BaseException as exc:
            nodes_failed(path, exc, name)


def nodes_failed(path: CallPath, exc: BaseException, name: str) -> NoReturn:
    """Raise the error of a failed call in two levels, after breaking this communicator
    and both levels and telling every peer (a mismatch of a level is found by every rank
    of that level: it only breaks them)."""
    error: BaseException = exc
    known = first_failure(path) if isinstance(
        exc, (PeerFailureError, CommunicatorClosedError)) else None
    if known is not None:
        error = path.life.explain(known, name, path.seq)
    elif isinstance(exc, CommunicatorClosedError) and path.life.cause is not None:
        error = path.life.explain(path.life.cause, name, path.seq)
    elif isinstance(exc, GpuringError):
        error = path.life.explain(exc, name, path.seq)
    if not isinstance(error, CollectiveMismatchError):
        path.give_up(error, name)
    else:
        path.life.raised(error)
    if path.levels is not None:
        path.levels.abort(f"rank {path.rank}: {error!r}", path.job_peer(error))
    if error is exc:
        raise exc
    raise error from None


def first_failure(path: CallPath) -> GpuringError | None:
    """Across nodes, the failure that came first, where it is known: a rank's report to
    the job (naming the rank it blames, where it knows one), else a rank of this node
    that died or gave up (a failure one level raised may only be a peer's giving up
    because of it)."""
    notice = path.control.failure_notice()
    if notice is not None:
        return notice
    return None if path.levels is None else path.levels.node_failure()


def run_via_nccl(path: CallPath, prepared: PreparedCall, call: Call) -> Any:
    name = call.collective
    try:
        if path.nccl is None:
            from .transports.nccl import NcclCollectives

            path.nccl = NcclCollectives(path.control, int(call.x.device.id),
                                        path.config.timeout, weakly(path.nccl_failed))
        path.nccl.run(name, call.x, call.out, call.op, call.root, path.size)
    except BaseException as exc:
        error: BaseException = exc
        if isinstance(exc, GpuringError):
            error = path.life.explain(exc, name, path.seq)
        path.give_up(error, name)
        if error is exc:
            raise
        raise error from None
    return call.out


def nodes_route(path: CallPath, name: str) -> bool:
    """Whether collective `name` runs in two levels across nodes (NumPy arrays: between
    nodes on MPI, which the ranks must then come from; CuPy arrays: on NCCL)."""
    return (path.layout is not None and path.config.transport == "auto"
            and path.make_communicator is not None and name in HIERARCHICAL)


def asks_reach(path: CallPath, kind: str) -> bool:
    """Whether the ranks have yet to find out whether they map each other's memory of
    `kind` (once, on one node, where gpuring picks the route)."""
    return (kind not in path.mappable and path.control.single_node
            and path.config.transport == "auto" and device_class(kind).may_be_unreachable)


def peers_reachable(path: CallPath, kind: str, name: str) -> bool:
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


def via_mpi(path: CallPath) -> bool:
    """Whether NumPy collectives go through MPI: across nodes, or when asked to."""
    if path.control.single_node and path.config.transport != "mpi":
        return False
    from .rendezvous.mpi import MpiControl

    if not isinstance(path.control, MpiControl):
        raise GpuringError("NumPy collectives across nodes (or GPURING_TRANSPORT=mpi) "
                           "need MPI between the nodes: start the ranks with mpiexec "
                           "(mpi4py installed: pip install gpuring[mpi])")
    return True
