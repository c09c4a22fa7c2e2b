"""Point-to-point messages on NumPy arrays, one test per verb, dtype, size and pattern
(tests/multiproc/cases_messages.py): on 1 to 5 ranks, under `gpuring run` and `mpiexec`,
across simulated nodes (where messages between nodes travel on MPI), and with 16 KiB rings
and no cross-memory attach (large messages in many pieces, the rings wrapping)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ..conftest import launch
from .host_launches import on_host
from .named import params

SCALE = str(Path(__file__).parent / "worker_messages_scale.py")


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


@pytest.mark.slow
@pytest.mark.parametrize(("launcher", "n", "nodes"), [
    ("gpuring", 64, None), ("mpiexec", 64, tuple("abcd") * 16)])
def test_many_ranks_message_without_a_thread_or_a_communicator_per_pair(launcher, n, nodes):
    """64 ranks on one node, and 64 across four simulated nodes (under mpiexec), shift a ring
    both ways and exchange with every other rank in one group: no rank starts a thread or
    makes a pair's communicator; each has one lane per peer of its node (the inboxes it
    mapped when the communicator was made), and one MPI link for the peers of the other
    nodes."""
    proc = launch(launcher, n, [SCALE], env={"GPURING_JITTER": "0"}, nodes=nodes,
                  timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    found = {int(m.group(1)): m.groups()[1:] for m in re.finditer(
        r"RANK (\d+) threads (\d+) (\d+) channels (\d+) lanes (\d+) mpi (\d) ok",
        proc.stdout)}
    assert set(found) == set(range(n)), out[-4000:]
    same_node = n - 1 if nodes is None else n // len(set(nodes)) - 1
    for rank, (before, after, channels, lanes, mpi) in found.items():
        assert before == after and channels == "0", (rank, found[rank])
        assert int(lanes) == same_node and mpi == ("0" if nodes is None else "1"), found[rank]
