"""How the survivors agree on who is alive (`_shrink`), on a control plane scripted by the test:
the ranks its server knows are gone are left out, a rank that dies during the agreement is
left out by a new one, an answer that says a member is gone is heeded by every survivor
alike, and mpiexec's control plane is refused in words."""

from __future__ import annotations

from typing import Any

import pytest

from gpuring import GpuringError, PeerFailureError
from gpuring._shrink import shrink
from gpuring.rendezvous.base import ControlPlane


class _Group(ControlPlane):
    """A group the world made: its exchange gives what the world's script says."""

    def __init__(self, world: _World, members: tuple[int, ...], name: str):
        super().__init__()
        world.join_subgroup(self, members, name, ("n",) * len(members))
        self.world, self.members, self.closed = world, members, False

    def allgather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        self.world.proposals.append(self.members)
        outcome = self.world.script.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome(self.members, obj)

    def close(self) -> None:
        self.closed = True


class _World(ControlPlane):
    """Rank `rank` of `size`; `gone`: what its server says is gone; `script`: each
    exchange's outcome, in order (an error, or a function of the members and this rank's
    answer that gives every member's answer)."""

    def __init__(self, rank: int, size: int, gone: set[int], script: list[Any],
                 over_mpi: bool = False):
        super().__init__()
        self.rank, self.size, self.local_rank, self.local_size = rank, size, rank, size
        self.job_id, self.over_mpi = "job", over_mpi
        self.gone, self.script = gone, script
        self.proposals: list[tuple[int, ...]] = []
        self.groups: list[_Group] = []

    def departed(self) -> frozenset[int]:
        return frozenset(self.gone)

    def subgroup(self, members: tuple[int, ...], name: str) -> _Group:
        group = _Group(self, members, name)
        self.groups.append(group)
        return group

    def allgather(self, obj: Any, timeout: float | None = None) -> list[Any]:
        raise AssertionError("the failed communicator's own control plane is not used")

    def close(self) -> None:
        pass


def _alike(members: tuple[int, ...], answer: Any) -> list[Any]:
    return [answer for _ in members]


def test_the_ranks_known_gone_are_left_out_and_the_rest_renumbered() -> None:
    world = _World(3, 5, {1}, [_alike])
    group = shrink(world, lambda: 1, lambda g: g, timeout=10)
    assert world.proposals == [(0, 2, 3, 4)]
    assert (group.rank, group.size, group.job_ranks) == (2, 4, (0, 2, 3, 4))
    assert group.job_id.startswith("job-k1x")


def test_a_rank_that_dies_during_the_agreement_is_left_out_by_a_new_one() -> None:
    """Rank 1 is known dead; rank 3 dies while the survivors agree: the control plane says
    so in the group (a PeerFailureError blaming it), and the survivors agree again."""
    died = PeerFailureError("rank 3 failed: it was killed by SIGKILL", peer=2, job_peer=3)
    world = _World(0, 5, {1}, [died, _alike])
    group = shrink(world, lambda: 1, lambda g: g, timeout=10)
    assert world.proposals == [(0, 2, 3, 4), (0, 2, 4)]
    assert world.groups[0].closed and not world.groups[1].closed
    assert group.job_ranks == (0, 2, 4)


def test_an_answer_that_says_a_member_is_gone_is_heeded_alike() -> None:
    """Every member answered, but rank 4's control plane had learnt that rank 2 died after
    it answered: every survivor holds that answer, and leaves rank 2 out."""
    def rank_4_saw_2_die(members: tuple[int, ...], answer: Any) -> list[Any]:
        return [("shrink()", [2]) if m == 4 else answer for m in members]

    world = _World(0, 5, set(), [rank_4_saw_2_die, _alike])
    group = shrink(world, lambda: 2, lambda g: g, timeout=10)
    assert world.proposals == [(0, 1, 2, 3, 4), (0, 1, 3, 4)]
    assert group.job_ranks == (0, 1, 3, 4)


def test_the_same_proposal_meets_in_the_same_group_on_every_rank() -> None:
    names = set()
    for rank in (0, 2, 3):
        world = _World(rank, 4, {1}, [_alike])
        names.add(shrink(world, lambda: 1, lambda g: g, timeout=10).job_id)
    assert len(names) == 1


def test_a_failure_of_the_control_plane_itself_is_raised() -> None:
    lost = PeerFailureError("the launcher's control connection closed")
    with pytest.raises(GpuringError, match=r"shrink on rank 0: the control plane failed"):
        shrink(_World(0, 3, set(), [lost]), lambda: 1, lambda g: g, timeout=10)


def test_mpiexec_is_refused_in_words() -> None:
    with pytest.raises(GpuringError, match=r"mpiexec ends the whole job when a rank dies .*"
                                           r"gpuring run --keep-going"):
        shrink(_World(0, 3, set(), [], over_mpi=True), lambda: 1, lambda g: g, timeout=10)
