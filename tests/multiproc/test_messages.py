"""send, recv and sendrecv on NumPy arrays, one test per verb, dtype, shape and pattern
(tests/multiproc/cases_messages.py)."""

from __future__ import annotations

import pytest

from .host_launches import on_host
from .named import params


@pytest.mark.parametrize(("group", "item"), params(
    on_host(1), on_host(2), on_host(3), on_host(3, "mpiexec"),
    on_host(4, "mpiexec", "nodes_abab"), families=["p2p"]))
def test_point_to_point(group, item, named_launches):
    """Ring shifts, exchanges, messages in order, mismatched shapes, dtypes and crossing
    sends, wrong ranks."""
    named_launches.check(group, item)
