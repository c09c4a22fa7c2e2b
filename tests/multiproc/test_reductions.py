"""all_reduce, reduce_scatter and reduce, with all_gather and broadcast beside them, on NumPy
arrays: 1 to 4 ranks under `gpuring run` and `mpiexec`, jitter on. One test per verb, dtype,
op, placement and rank count (tests/multiproc/cases_reductions.py); each launch of ranks
serves many tests (host_launches.py)."""

from __future__ import annotations

import pytest

from .host_launches import on_host
from .named import params


@pytest.mark.parametrize(("group", "item"), params(
    on_host(1), on_host(2), on_host(3), on_host(2, "mpiexec"),
    on_host(3, "mpiexec", "mpi_transport"), on_host(4, "mpiexec", "nodes_abab"),
    families=["dtypes_ops"]))
def test_dtypes_and_ops(group, item, named_launches):
    """Every dtype and op: all_reduce in and out of place, reduce_scatter, reduce; every
    dtype's all_gather and broadcast. (Under mpi_transport MPI alone carries them, forced on
    one node; on simulated nodes they run in two levels.)"""
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(on_host(1), on_host(2), families=["sizes"]))
def test_sizes(group, item, named_launches):
    """Odd sizes (0, 1, n-1, primes), 1 channel and 3 in small pieces, shapes, 24 MiB."""
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(
    on_host(2), on_host(2, "mpiexec"), on_host(2, variant="buffer8K"),
    on_host(3, variant="nonblocking-buffer64K"), on_host(3, "mpiexec", "mpi_transport"),
    families=["back_to_back"]))
def test_back_to_back(group, item, named_launches):
    """200 collectives back to back, never waiting between: one id per verb. With 8 KiB
    buffers every collective runs in many rounds, on 1 to 3 channels, so buffer halves are
    reused constantly (the write-after-read hazard across rounds; on 2 ranks every round
    hears from the other rank, so rounds after the first skip their credit waits).
    nonblocking: the scheduler's GPU path (no host blocking, events, ordering by the engine)
    on the host device, its ring in another order than the ranks' (as a topology orders
    it). mpi_transport: MPI alone (sizes from 1 to 60000 elements; no rounds of its own)."""
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(
    on_host(2), on_host(3), on_host(2, "mpiexec"), on_host(4, "mpiexec", "nodes_abab"),
    families=["again"]))
def test_the_same_arrays_again(group, item, named_launches):
    """Persistent arrays called again and again, refilled between calls (the calls that
    come again run what they worked out once), and a mismatch among them."""
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(
    on_host(2, variant="deterministic-buffer16K"),
    on_host(3, variant="deterministic-buffer256K"),
    on_host(3, "mpiexec", "deterministic-buffer256K"),
    on_host(4, "mpiexec", "nodes_aabb-deterministic-buffer256K"),
    families=["deterministic"]))
def test_deterministic_mode(group, item, named_launches):
    """GPURING_DETERMINISTIC=1 with small buffers (several rounds; at 16K some all_reduces
    small enough for one-shot do not fit one buffer region): the rank-order fold's bits,
    whatever the size, chunk_bytes, channels and fusion; across simulated nodes the
    node-major fold's."""
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(on_host(3), families=["two_shot"]))
def test_algorithm_per_call(group, item, named_launches):
    named_launches.check(group, item)
