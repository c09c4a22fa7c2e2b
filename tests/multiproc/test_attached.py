"""Collectives on plain NumPy arrays that read and write the peers' arrays where they lie, by
cross-memory attach (tests/multiproc/cases_attached.py): 2, 3 and 4 ranks, with jitter, in
deterministic mode, under mpiexec, and with one rank's probe refused (every rank stages)."""

from __future__ import annotations

import pytest

from .host_launches import on_host
from .named import params


@pytest.mark.parametrize(("group", "item"), params(
    on_host(2, variant="attach64K"), on_host(3, variant="attach64K-jitter"),
    on_host(4, variant="attach64K"), on_host(3, variant="attach64K-refused_on_rank1"),
    on_host(3, variant="attach64K-deterministic"), on_host(2, "mpiexec", "attach64K"),
    families=["attached"]))
def test_attached_collectives(group, item, named_launches):
    """Every dtype and op of all_reduce just above GPURING_ATTACH_BYTES, float32 at sizes
    around it (staged below it), odd counts, several pieces, in place and out of place, the
    same arrays again at once; reduce_scatter and all_gather: the rank-order fold's bits (or
    the inputs) on every rank, attached where it must be, staged where a rank is refused."""
    named_launches.check(group, item)
