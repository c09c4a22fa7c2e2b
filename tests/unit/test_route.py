"""The route of a call (`gpuring._route.choose`) as a pure function of the call and the
communicator's facts: every case of the table that `_route`'s docstring states, without a
process or a peer."""

from __future__ import annotations

import pytest

from gpuring._call import Route
from gpuring._errors import GpuringError
from gpuring._route import Choice, Facts, choose, numpy_via_mpi

ONE_NODE = Facts(size=4, single_node=True)
NODES = Facts(size=4, single_node=False, two_levels=True)
NODES_MPI = NODES._replace(over_mpi=True)


def test_a_world_of_one_runs_nothing_whatever_else_holds() -> None:
    for facts in (Facts(1, True), Facts(1, False, "nccl", True, True, True)):
        for kind in (None, "cpu", "cuda"):
            assert choose(facts, "all_reduce", kind, "ring") == Choice(Route.ALONE, "alone")


@pytest.mark.parametrize("kind", [None, "cpu", "cuda"])
def test_one_node_runs_on_the_engine(kind: str | None) -> None:
    assert choose(ONE_NODE, "all_reduce", kind, "ring") == Choice(Route.ENGINE)


def test_cuda_without_peer_access_runs_on_nccl_and_host_arrays_do_not_care() -> None:
    assert choose(ONE_NODE, "all_gather", "cuda", mappable=False).route is Route.NCCL
    assert choose(ONE_NODE, "all_gather", "cpu", mappable=False).route is Route.ENGINE


def test_transport_nccl_sends_cuda_arrays_to_nccl_and_leaves_host_arrays_and_barriers() -> None:
    facts = ONE_NODE._replace(transport="nccl")
    assert choose(facts, "broadcast", "cuda").route is Route.NCCL
    assert choose(facts, "broadcast", "cpu").route is Route.ENGINE
    assert choose(facts, "barrier", None).route is Route.ENGINE


def test_transport_mpi_needs_mpi_and_then_takes_host_arrays_and_barriers() -> None:
    facts = ONE_NODE._replace(transport="mpi")
    with pytest.raises(GpuringError, match="mpiexec"):
        choose(facts, "all_reduce", "cpu")
    facts = facts._replace(over_mpi=True)
    assert choose(facts, "all_reduce", "cpu") == Choice(Route.MPI, "mpi")
    assert choose(facts, "barrier", None) == Choice(Route.MPI, "mpi")
    assert choose(facts, "all_reduce", "cuda").route is Route.ENGINE


def test_across_nodes_a_barrier_is_an_agreement_of_the_job() -> None:
    assert choose(NODES, "barrier", None) == Choice(Route.NODES, "agreement")
    # (without two levels too: a barrier is the job's)
    assert choose(NODES._replace(two_levels=False), "barrier", None).route is Route.NODES


@pytest.mark.parametrize("name", ["all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                  "reduce"])
def test_across_nodes_the_reductions_and_gathers_run_in_two_levels(name: str) -> None:
    assert choose(NODES, name, "cuda") == Choice(Route.NODES, "nodes")
    assert choose(NODES_MPI, name, "cpu") == Choice(Route.NODES, "nodes")
    with pytest.raises(GpuringError, match="need MPI between the nodes"):
        choose(NODES, name, "cpu")


@pytest.mark.parametrize("name", ["all_to_all", "gather", "scatter"])
def test_across_nodes_the_other_verbs_run_flat(name: str) -> None:
    assert choose(NODES, name, "cuda") == Choice(Route.NCCL, "nccl")
    assert choose(NODES_MPI, name, "cpu") == Choice(Route.MPI, "mpi")


def test_across_nodes_without_two_levels_everything_runs_flat() -> None:
    flat = NODES_MPI._replace(two_levels=False)
    assert choose(flat, "all_reduce", "cuda").route is Route.NCCL
    assert choose(flat, "all_reduce", "cpu").route is Route.MPI


def test_deterministic_mode_refuses_the_ring_on_every_route_with_a_plan() -> None:
    for facts in (ONE_NODE, NODES_MPI):
        choice = choose(facts._replace(deterministic=True), "all_reduce", "cpu", "ring")
        assert choice.refusal is not None and "rank order" in choice.refusal
        assert choose(facts._replace(deterministic=True), "all_reduce", "cpu",
                      "two_shot").refusal is None


def test_deterministic_mode_refuses_folds_on_mpi_and_nccl_but_not_moves() -> None:
    det = NODES_MPI._replace(deterministic=True, two_levels=False)
    refusal = choose(det, "reduce_scatter", "cpu").refusal
    assert refusal is not None and "through MPI" in refusal
    refusal = choose(det, "all_reduce", "cuda").refusal
    assert refusal is not None and "through NCCL" in refusal
    assert choose(det, "all_gather", "cuda").refusal is None
    assert choose(det, "barrier", None).route is Route.NODES


def test_numpy_goes_through_mpi_only_across_nodes_or_when_asked() -> None:
    assert numpy_via_mpi(ONE_NODE._replace(over_mpi=True)) is False
    assert numpy_via_mpi(NODES_MPI) is True
    assert numpy_via_mpi(ONE_NODE._replace(transport="mpi", over_mpi=True)) is True
