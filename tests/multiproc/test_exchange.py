"""gather, scatter, all_to_all and the uneven forms (all_gather_v, all_to_all_v,
reduce_scatter_v) on NumPy arrays, one test per verb, dtype, block shape, root and rank count
(tests/multiproc/cases_exchange.py)."""

from __future__ import annotations

import pytest

from .host_launches import on_host
from .named import params


@pytest.mark.parametrize(("group", "item"), params(
    on_host(1), on_host(5), on_host(2, "mpiexec"), on_host(4, "mpiexec", "nodes_abab"),
    families=["exchange"]))
def test_gather_scatter_all_to_all(group, item, named_launches):
    """Blocks moved, not reduced: every dtype, empty to multi-round blocks, every root,
    registered arrays, mismatches (across simulated nodes: flat, over MPI)."""
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(
    on_host(1), on_host(3), on_host(3, "mpiexec", "deterministic-buffer256K"),
    families=["uneven"]))
def test_uneven_collectives(group, item, named_launches):
    """all_gather_v, all_to_all_v and reduce_scatter_v against the reference (in
    deterministic mode the rank-order fold's bits), with mismatched shapes, counts and
    dtypes."""
    named_launches.check(group, item)
