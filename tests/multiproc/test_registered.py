"""Registered memory (comm.empty/zeros) on NumPy arrays, read by the peers in place
(tests/multiproc/cases_registered.py)."""

from __future__ import annotations

import pytest

from .host_launches import on_host
from .named import params


@pytest.mark.parametrize(("group", "item"), params(
    on_host(3, variant="deterministic"), on_host(2, "mpiexec"), families=["registered"]))
def test_registered_memory(group, item, named_launches):
    """Every verb, the rank-order fold's bits, refilled and called again at once, and a
    mismatch with plain arrays."""
    named_launches.check(group, item)
