"""Point-to-point messages on NumPy arrays, one test per verb, dtype, size and pattern
(tests/multiproc/cases_messages.py): on 1 to 5 ranks, under `gpuring run` and `mpiexec`,
across simulated nodes (where messages between nodes travel on MPI), and with 16 KiB rings
and no cross-memory attach (large messages in many pieces, the rings wrapping)."""

from __future__ import annotations

import pytest

from .host_launches import on_host
from .named import params


@pytest.mark.parametrize(("group", "item"), params(
    on_host(1), on_host(2), on_host(3), on_host(3, "gpuring", "staged_messages"),
    on_host(3, "mpiexec"), on_host(4, "mpiexec", "nodes_abab"), families=["p2p"]))
def test_point_to_point(group, item, named_launches):
    """Ring shifts, exchanges, messages in order, buffers with room, refusals on both
    ranks, crossing sends, wrong ranks."""
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(
    on_host(1), on_host(2), on_host(3), on_host(3, "gpuring", "staged_messages"),
    on_host(3, "mpiexec"), on_host(4, "mpiexec", "nodes_abab"), families=["messages"]))
def test_nonblocking_messages(group, item, named_launches):
    """isend/irecv: every size into larger buffers, tags out of order, any source, done()
    and timeouts, messages to itself, registered arrays, groups and batches."""
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(
    on_host(2), on_host(3), on_host(3, "gpuring", "staged_messages"), on_host(4), on_host(5),
    on_host(4, "mpiexec", "nodes_abab"), families=["group_orders"]))
def test_every_order_of_a_group(group, item, named_launches):
    """Every rank sends to and receives from every other, its operations listed in every
    order (receives first included), as a group, a batch and plain isend/irecv."""
    named_launches.check(group, item)
