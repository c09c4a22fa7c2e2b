"""The lanes a communicator's point-to-point messages travel on (`Lanes`), set up when the
communicator is made, by every rank at once: each rank allocates its inbox (`_mailbox`), the
ranks exchange where their inboxes lie and what each reads to find out whether it may read
the others' memory directly (`_cma`), map the inboxes of their node's peers, meet, and drop
the inboxes' names; the peers of other nodes are reached through MPI
(`transports.mpi_messages`), where the ranks came from `mpiexec`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, NamedTuple

from . import _cma, settings
from ._errors import GpuringError
from ._mailbox import Inbox, ShmLane, ring_bytes_for
from .devices.base import open_peer
from .devices.host import SHM_PREFIX, HostDevice, HostMemory

if TYPE_CHECKING:
    from ._cuda_messages import CudaMessages
    from .rendezvous.base import ControlPlane
    from .transports.mpi_messages import MpiLane, MpiLink

__all__ = ["Lanes", "InboxHandle", "Parts", "set_up", "LARGEST_EAGER"]

log = logging.getLogger("gpuring")

#: the largest message that goes eagerly (a quarter of the ring where that is less): on a
#: 2-core VM, 1 MiB copied into the receiver's ring and out again took less time than one
#: read by cross-memory attach (bench/results/cpu-p2p-vs-mpi.txt)
LARGEST_EAGER = 1 << 20


class InboxHandle(NamedTuple):
    """What a rank tells its peers when the communicator is made: its inbox (None: it has
    none) and what they read to find out whether they may read its memory directly."""

    inbox: Any
    probe: _cma.Probe


class Parts:
    """The inboxes' memory, the MPI link and the GPU part (once made) of a communicator's
    messages, closed with it."""

    def __init__(self, device: HostDevice | None, mpi: MpiLink | None):
        self.device, self.mpi = device, mpi
        self.gpu: list[CudaMessages] = []

    def close(self) -> None:
        """Free the GPU part, unmap the inboxes (the peers' records to this rank go with
        them) and forget the MPI requests. Idempotent."""
        gpu, self.gpu = self.gpu, []
        for part in gpu:
            part.close()
        if self.mpi is not None:
            self.mpi.abandon()
        if self.device is not None:
            self.device.close()


class Lanes:
    """This rank's lanes to its peers: `lanes` by peer (`near`: the peers of its node, whose
    inboxes it maps; `shm` in rank order, as progress polls them), their processes (`pids`),
    whether it may read each one's memory directly (`attach`), why a peer cannot be reached
    (`unreachable`), the MPI link to the other nodes (`mpi`), the largest eager message,
    the rings' size, and what closes with the communicator (`parts`)."""

    def __init__(self) -> None:
        self.lanes: dict[int, ShmLane | MpiLane] = {}
        self.shm: list[ShmLane] = []
        self.near: dict[int, ShmLane] = {}
        self.pids: dict[int, int] = {}
        self.attach: dict[int, bool] = {}
        self.unreachable: dict[int, str] = {}
        self.mpi: MpiLink | None = None
        self.device: HostDevice | None = None
        self.eager_bytes = 0
        self.ring_bytes = 0
        self.parts = Parts(None, None)


def set_up(control: ControlPlane, transport: str, timeout: float,
           ensure_watchdog: Any) -> Lanes:
    """Map the inboxes of this node's peers (every rank at once; `ensure_watchdog()` makes
    the status board, which tells of peers that died, gave up or left, where the ranks share
    a node)."""
    found = Lanes()
    rank, size = control.rank, control.size
    nodes = control.nodes or ("",) * size
    here = [q for q in range(size) if nodes[q] == nodes[rank] and q != rank
            and transport != "mpi"]
    there = [q for q in range(size) if q != rank and q not in here]
    if control.single_node and here:  # (not for MPI's lanes alone: as its collectives)
        ensure_watchdog()
    inbox = device = None
    if here:
        try:
            device = HostDevice(name_prefix=f"{SHM_PREFIX}{control.job_id}-r{rank}-messages-",
                                timeout=timeout)
            ring = ring_bytes_for(len(here), settings.get("GPURING_MESSAGE_BYTES"))
            inbox = Inbox(device, rank, size, ring)
            found.ring_bytes = ring
            found.eager_bytes = min(ring // 4, LARGEST_EAGER)
        except GpuringError as exc:
            for q in here:
                found.unreachable[q] = str(exc)
    found.device = found.parts.device = device
    attach = settings.get("GPURING_MESSAGE_ATTACH")
    mine = InboxHandle(None if inbox is None or device is None
                       else device.export(inbox.mem), _cma.probe())
    handles = control.exchange("setup (message inboxes)", mine, timeout)
    if inbox is not None and device is not None:
        for q in here:
            handle = InboxHandle(*handles[q])
            if handle.inbox is None:
                found.unreachable[q] = f"rank {q} has no inbox"
                continue
            theirs = open_peer(device, handle.inbox, q)
            assert isinstance(theirs, HostMemory)
            lane = ShmLane(inbox, q, theirs)
            found.lanes[q] = found.near[q] = lane
            found.shm.append(lane)
            found.pids[q] = int(handle.inbox[0])
            why = _cma.refusal(handle.probe) if attach else "GPURING_MESSAGE_ATTACH=0"
            found.attach[q] = why is None
            if why is not None:
                log.info("gpuring: rank %d stages messages from rank %d larger than %d "
                         "bytes in pieces: %s", rank, q, found.eager_bytes, why)
        control.barrier(timeout, "setup (message inboxes mapped)")
        device.seal(inbox.mem)
    else:
        control.barrier(timeout, "setup (message inboxes mapped)")
    if there:
        _reach_by_mpi(found, control, there)
    return found


def _reach_by_mpi(found: Lanes, control: ControlPlane, peers: list[int]) -> None:
    from .rendezvous.mpi import MpiControl

    if not isinstance(control, MpiControl):
        for q in peers:
            found.unreachable[q] = (
                f"rank {q} runs on another node ({control.nodes[q]}), and messages "
                "between nodes need MPI: start the ranks with mpiexec (mpi4py installed: "
                "pip install gpuring[mpi])")
        return
    from mpi4py import MPI

    from .transports.mpi_messages import MpiLink

    found.mpi = found.parts.mpi = MpiLink(control.comm, MPI)
    if not found.eager_bytes:
        found.eager_bytes = LARGEST_EAGER
    for q in peers:
        found.lanes[q] = found.mpi.lane(q)
