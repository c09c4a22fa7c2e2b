"""Shrinking a communicator after ranks died (MPI ULFM's `MPIX_Comm_shrink`): the survivors
agree on who is alive and go on in a new communicator of those, renumbered in order.

Every survivor calls `Communicator.shrink()`. Each proposes as members the ranks it does not
know to be gone (`ControlPlane.departed`: the control server's word that a process died or
dropped its connection: `gpuring run`'s launcher, or rank 0's server under torchrun and
Slurm), in a group of the control plane named after that proposal, so that survivors that
propose the same members meet in the same group. The exchange there is the agreement (ULFM's
`MPIX_Comm_agree`): it completes only where every proposed member takes part, and then every
one of them holds the same answers. A member that dies meanwhile fails it (the control plane
tells the group), and so does one that a survivor's control plane knows is gone: each
survivor proposes again without it (a survivor that learns of a death later meets the others
in the next group, once it does). An exchange that completed but whose answers say a member
is gone (it died after it answered) is proposed again without that member, by every survivor
alike: they hold the same answers. Every wait is bounded by the communicator's timeout.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from typing import Any

from ._errors import CollectiveTimeoutError, GpuringError, PeerFailureError
from .rendezvous.base import ControlPlane

__all__ = ["shrink", "REFUSED_UNDER_MPI"]

#: why `shrink` refuses to run on MPI's control plane
REFUSED_UNDER_MPI = (
    "shrink: the ranks were started by mpiexec, whose processes gpuring cannot regroup: "
    "MPICH's mpiexec ends the whole job when a rank dies (unless started with "
    "-disable-auto-cleanup), and MPI communicators shrink only with ULFM's MPIX_Comm_shrink, "
    "which mpi4py does not offer on MPICH; start the ranks with `gpuring run --keep-going` "
    "(or torchrun, or by hand) to shrink and go on")


def shrink(control: ControlPlane, count: Callable[[], int], make: Callable[[ControlPlane], Any],
           timeout: float) -> Any:
    """A new communicator (`make` of its control plane) of the ranks of `control` that are
    alive, as they agree (`count()`: this communicator's shrinks so far, the same on every
    survivor)."""
    if control.over_mpi:
        raise GpuringError(REFUSED_UNDER_MPI)
    job_ranks = tuple(control.job_ranks)
    number = count()
    deadline = time.monotonic() + timeout
    gone: set[int] = set()  # (ranks of this communicator)
    while True:
        gone |= {job_ranks.index(r) for r in control.departed() if r in job_ranks}
        members = tuple(r for r in range(control.size) if r not in gone)
        name = (f"{control.job_id}-k{number}x"
                f"{zlib.crc32(repr(members).encode()):08x}")
        group = control.subgroup(members, name)
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise CollectiveTimeoutError(f"shrink: the survivors did not agree within "
                                             f"{timeout} s")
            answers = group.exchange("shrink()", sorted(gone), left)
        except PeerFailureError as exc:
            group.close()
            failed = _member(exc, members, job_ranks)
            if failed is None or failed == control.rank:
                raise GpuringError(f"shrink on rank {control.rank}: the control plane failed "
                                   f"({exc})") from exc
            gone.add(failed)
            continue
        except BaseException:
            group.close()
            raise
        named = set().union(*map(set, answers)) & set(members)
        if named:  # a member answered, then died: every survivor saw these same answers
            group.close()
            gone |= named
            continue
        return make(group)


def _member(error: PeerFailureError, members: tuple[int, ...],
            job_ranks: tuple[int, ...]) -> int | None:
    """The rank (of the communicator shrinking) that `error`, raised in the group of
    `members`, blames."""
    if error.job_peer is not None and error.job_peer in job_ranks:
        return job_ranks.index(error.job_peer)
    if error.peer is not None and 0 <= error.peer < len(members):
        return members[error.peer]
    return None
