"""The control plane: who is in the job, and a few small collective messages between ranks."""

from __future__ import annotations

import abc
import socket
from collections.abc import Callable, Sequence
from typing import Any

from .. import settings
from .._errors import CollectiveMismatchError, GpuringError, PeerFailureError

__all__ = ["ControlPlane", "host_name"]


def host_name() -> str:
    """The name of this rank's node: GPURING_HOSTNAME, else the host's name. Ranks that
    report the same name are one node (they map each other's memory)."""
    return settings.get("GPURING_HOSTNAME") or socket.gethostname()


class ControlPlane(abc.ABC):
    """Rank identity plus allgather of small picklable objects. Every call is collective."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    #: a name shared by every rank of the job, unique per job
    job_id: str
    #: True when every rank runs on this node (peers can map each other's memory)
    single_node: bool = True
    #: each rank's node name, in rank order (`host_name()` of each)
    nodes: tuple[str, ...] = ()
    #: the ranks meet through MPI (started by mpiexec): MPI reaches between them
    over_mpi: bool = False

    def __init__(self) -> None:
        self._failure_callbacks: list[Callable[[PeerFailureError], None]] = []
        self._watches: list[Callable[[], BaseException | None]] = []
        self._device_slot: int | None = None
        self._job_ranks: tuple[int, ...] | None = None

    @property
    def job_ranks(self) -> tuple[int, ...]:
        """Each rank's rank in the job (the launcher's ranks), in this group's rank order:
        its own ranks where it is the job's control plane, its members' in a sub-group."""
        return tuple(range(self.size)) if self._job_ranks is None else self._job_ranks

    @job_ranks.setter
    def job_ranks(self, ranks: tuple[int, ...]) -> None:
        self._job_ranks = ranks

    def in_job(self, peer: int | None, job_peer: int | None = None) -> int | None:
        """The rank of the job a failure blames: `job_peer` where given, else this group's
        rank `peer` in the job's ranks; None where neither names one."""
        if job_peer is not None:
            return job_peer
        return self.job_ranks[peer] if peer is not None and 0 <= peer < self.size else None

    @property
    def device_slot(self) -> int:
        """Which of the node's GPUs this rank uses (modulo their count): its local rank in
        the job, kept by the sub-groups it joins."""
        return self.local_rank if self._device_slot is None else self._device_slot

    @device_slot.setter
    def device_slot(self, slot: int) -> None:
        """Use the node's GPU `slot` (where the caller chose one: the current device)."""
        self._device_slot = slot

    def subgroup(self, members: tuple[int, ...], name: str) -> ControlPlane:
        """The control plane of the ranks `members` (ranks of this one, in the new group's
        rank order), named `name` (unique in the job, the same on every member; it is the
        group's `job_id`). Called by the members only; bounded: it waits for no peer (a
        control plane that must meet them does so in its first exchange)."""
        raise NotImplementedError(f"{type(self).__name__} has no sub-groups")

    def join_subgroup(self, group: ControlPlane, members: tuple[int, ...], name: str,
              nodes: tuple[str, ...]) -> None:
        """Set up `group`, a sub-group of this control plane: its rank, size, job_id and
        where its members run (`nodes`: every member's node, in group order)."""
        ControlPlane.__init__(group)
        if self.rank not in members or len(set(members)) != len(members):
            raise ValueError(f"sub-group {members} of rank {self.rank}: it must list this "
                             "rank, each rank once")
        group.rank, group.size, group.job_id = members.index(self.rank), len(members), name
        group.job_ranks = tuple(self.job_ranks[m] for m in members)
        group.locate(nodes)
        group._device_slot = self.device_slot

    def locate(self, nodes: Sequence[str]) -> None:
        """Set where the ranks run from `nodes` (each rank's node name, in rank order): this
        rank's local rank and local size among the ranks of its node, and `single_node`."""
        self.nodes = tuple(nodes)
        here = self.nodes[self.rank]
        self.local_rank = sum(1 for node in self.nodes[:self.rank] if node == here)
        self.local_size = self.nodes.count(here)
        self.single_node = len(set(self.nodes)) == 1

    @abc.abstractmethod
    def allgather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        """Every rank's `obj`, in rank order."""

    def exchange(self, what: str, obj: Any, timeout: float | None = None) -> list[Any]:
        """`allgather` for a named purpose: raises CollectiveMismatchError on every rank when
        ranks exchange for different purposes (one closes while another starts a collective,
        say), instead of handing one step's data to another."""
        gathered = self.allgather((what, obj), timeout)
        purposes = [g[0] if isinstance(g, tuple) and len(g) == 2 else "?" for g in gathered]
        if any(p != what for p in purposes):
            raise CollectiveMismatchError(
                "ranks are out of step: " + "; ".join(
                    f"rank {r} is at {p}" for r, p in enumerate(purposes)),
                differences={"step": dict(enumerate(purposes))})
        return [g[1] for g in gathered]

    def barrier(self, timeout: float | None = None, what: str = "a barrier") -> None:
        self.exchange(what, None, timeout)

    def on_peer_failure(self, callback: Callable[[PeerFailureError], None]) -> None:
        """Call `callback(error)` (from any thread) when a peer is known to have failed."""
        self._failure_callbacks.append(callback)

    def _peer_failed(self, error: PeerFailureError) -> None:
        for callback in list(self._failure_callbacks):
            callback(error)

    def report_failure(self, reason: str, peer: int | None = None,
                       timed_out: bool = False, job_peer: int | None = None) -> None:
        """Tell the peers this rank gave up (`peer`: the rank it blames, where known, or
        `job_peer`: that rank in the job's ranks, which names one outside this group too;
        `timed_out`: it waited its whole timeout), where the control plane can (best
        effort)."""

    def watch(self, check: Callable[[], BaseException | None]) -> None:
        """Poll `check` (every few tens of milliseconds) in this control plane's waits: what
        it returns fails the wait (a peer that died, seen by other means). Control planes
        that learn of deaths themselves need none, and ignore it."""
        self._watches.append(check)

    def watched_failure(self) -> GpuringError | None:
        """The first failure a watch (`watch`) sees now, if any."""
        for check in list(self._watches):
            found = check()
            if isinstance(found, GpuringError):
                return found
        return None

    def follow(self, other: ControlPlane) -> None:
        """Fail this control plane's waits on failures reported in `other` too (a group that
        only lives as a part of `other`'s collectives). Control planes that tell every group
        of a rank's failure by themselves need nothing."""

    def failure_notice(self) -> GpuringError | None:
        """A failure another rank reported to the whole job, once one arrived (a control
        plane whose failures reach the ranks otherwise has none)."""
        return None

    def interrupt(self, reason: str) -> None:
        """Make a pending or later exchange of this rank fail with PeerFailureError(reason)."""

    def departed(self) -> frozenset[int]:
        """The ranks of the job this control plane knows are gone for good (they died, or
        dropped their connection): what the survivors leave out when they shrink. Control
        planes that cannot tell know none."""
        return frozenset()

    @abc.abstractmethod
    def close(self) -> None:
        """Leave the job. Idempotent."""
