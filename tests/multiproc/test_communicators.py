"""Communicators: sub-communicators, mismatched calls, the module-level verbs, simulated
nodes (tests/multiproc/cases_communicators.py), on NumPy arrays."""

from __future__ import annotations

import pytest

from .host_launches import on_host
from .named import params


@pytest.mark.parametrize(("group", "item"), params(
    on_host(1), on_host(4), on_host(3, "mpiexec"), families=["split"]))
def test_sub_communicators(group, item, named_launches):
    """split: rank order, collectives interleaved with the parent's and siblings', a split
    of a split with messages, color None, a mismatch, independent close."""
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(
    on_host(2), on_host(3), on_host(2, "mpiexec"), on_host(3, "mpiexec"),
    on_host(3, "mpiexec", "mpi_transport"), on_host(4, "mpiexec", "nodes_abab"),
    families=["mismatch"]))
def test_mismatch_raises_on_every_rank(group, item, named_launches):
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(
    on_host(3), on_host(3, "mpiexec"), families=["module_api"]))
def test_module_api(group, item, named_launches):
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(
    on_host(4, "mpiexec", "nodes_abab"), families=["nodes"]))
def test_simulated_nodes(group, item, named_launches):
    """Ranks on 2 simulated nodes of 2 (GPURING_HOSTNAME per rank), interleaved (ranks 0 and
    2 on one node): identity from the node names, and the schedules of two levels (shared
    memory in each node, MPI between nodes) and flat ones; the items of one node run in the
    same launch (their tests name it nodes_abab). (Layouts of 3 nodes:
    tests/unit/test_hierarchy.py.)"""
    named_launches.check(group, item)
