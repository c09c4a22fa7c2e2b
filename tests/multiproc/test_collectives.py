"""Every collective on 1 to 5 ranks, under `gpuring run` and `mpiexec`, with jitter on."""

from __future__ import annotations

import pytest

from ..conftest import WORKER, run_worker

LAUNCHERS = ["gpuring", pytest.param("mpiexec", marks=pytest.mark.mpi)]


def _under_both(gpuring: list[int], mpiexec: list[int]) -> list[object]:
    """(launcher, n) cases: the launcher only changes how ranks meet, so mpiexec runs a
    few of the rank counts gpuring runs."""
    return [("gpuring", n) for n in gpuring] + [
        pytest.param("mpiexec", n, marks=pytest.mark.mpi) for n in mpiexec]


def run_case(launcher: str, n: int, case: str, tmp_path,
             env: dict[str, str] | None = None) -> list[str]:
    return run_worker(WORKER, launcher, n, case, tmp_path, env)


@pytest.mark.parametrize(("launcher", "n"), _under_both([1, 2, 3], [2]))
def test_dtypes_and_ops(launcher, n, tmp_path):
    lines = run_case(launcher, n, "dtypes_ops", tmp_path)
    assert len(lines) > 140


@pytest.mark.parametrize(("launcher", "n"), _under_both([1, 2], []))
def test_sizes(launcher, n, tmp_path):
    run_case(launcher, n, "sizes", tmp_path)


@pytest.mark.parametrize(("launcher", "n"), _under_both([2], [2]))
def test_back_to_back(launcher, n, tmp_path):
    assert len(run_case(launcher, n, "back_to_back", tmp_path)) > 130


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("n", [2, 3])
def test_mismatch_raises_on_every_rank(launcher, n, tmp_path):
    run_case(launcher, n, "mismatch", tmp_path)


@pytest.mark.parametrize(("launcher", "n"), _under_both([2, 3], [2]))
def test_the_same_arrays_again(launcher, n, tmp_path):
    """Persistent arrays called again and again, refilled between calls (the calls that
    come again run what they worked out once), and a mismatch among them."""
    run_case(launcher, n, "again", tmp_path)


@pytest.mark.parametrize(("launcher", "n", "buffer"),
                         [("gpuring", 2, "16K"), ("gpuring", 3, "256K"),
                          pytest.param("mpiexec", 3, "256K", marks=pytest.mark.mpi)])
def test_deterministic_mode(launcher, n, buffer, tmp_path):
    """GPURING_DETERMINISTIC=1 with small buffers (several rounds; at 16K some all_reduces
    small enough for one-shot do not fit one buffer region): the rank-order fold's bits,
    whatever the size, chunk_bytes, channels and fusion."""
    run_case(launcher, n, "deterministic", tmp_path,
             env={"GPURING_DETERMINISTIC": "1", "GPURING_BUFFER_BYTES": buffer})


@pytest.mark.parametrize(("launcher", "n", "env"), [
    ("gpuring", 3, {"GPURING_DETERMINISTIC": "1"}),
    pytest.param("mpiexec", 2, {}, marks=pytest.mark.mpi)])
def test_registered_memory(launcher, n, env, tmp_path):
    """Arrays from comm.empty/zeros, read by the peers in place: every verb, the rank-order
    fold's bits, refilled and called again at once, and a mismatch with plain arrays."""
    run_case(launcher, n, "registered", tmp_path, env=env)


@pytest.mark.parametrize("n", [3])
def test_algorithm_per_call(n, tmp_path):
    run_case("gpuring", n, "two_shot", tmp_path)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_module_api(launcher, tmp_path):
    run_case(launcher, 3, "module_api", tmp_path)


@pytest.mark.parametrize("n", [2])
def test_many_rounds_with_small_buffers(n, tmp_path):
    """Buffers of 8 KiB: every collective runs in many rounds, on 1 to 3 channels, so buffer
    halves are reused constantly (the write-after-read hazard across rounds). On 2 ranks
    every round hears from the other rank, so rounds after the first skip their credit
    waits."""
    run_case("gpuring", n, "back_to_back", tmp_path, env={"GPURING_BUFFER_BYTES": "8K"})


@pytest.mark.parametrize("case", ["back_to_back"])
def test_nonblocking_device_path(case, tmp_path):
    """The scheduler's GPU path (no host blocking, events, ordering by the engine) on the
    host device, so that it is tested without a GPU; its ring in another order than the
    ranks' (as a topology orders it)."""
    run_case("gpuring", 3, case, tmp_path, env={"GPURING_TEST_NONBLOCKING": "1",
                                                "GPURING_BUFFER_BYTES": "64K"})


@pytest.mark.parametrize(("launcher", "n"), _under_both([1, 5], [2]))
def test_gather_scatter_all_to_all(launcher, n, tmp_path):
    """Blocks moved, not reduced: every dtype, empty to multi-round blocks, every root,
    registered arrays, mismatches."""
    run_case(launcher, n, "exchange", tmp_path)


@pytest.mark.parametrize(("launcher", "n", "env"), [
    ("gpuring", 1, {}), ("gpuring", 3, {}),
    pytest.param("mpiexec", 3, {"GPURING_DETERMINISTIC": "1"}, marks=pytest.mark.mpi)])
def test_uneven_collectives(launcher, n, env, tmp_path):
    """all_gather_v, all_to_all_v and reduce_scatter_v against NumPy (in deterministic mode
    the rank-order fold's bits), with mismatched shapes, counts and dtypes."""
    run_case(launcher, n, "uneven", tmp_path, env=env)


@pytest.mark.parametrize(("launcher", "n"), _under_both([1, 2, 3], [3]))
def test_point_to_point(launcher, n, tmp_path):
    """send, recv and sendrecv against NumPy: ring shifts, exchanges, messages in order,
    mismatched shapes, dtypes and crossing sends, wrong ranks."""
    run_case(launcher, n, "p2p", tmp_path)


@pytest.mark.parametrize(("launcher", "n"), _under_both([1, 4], [3]))
def test_sub_communicators(launcher, n, tmp_path):
    """split: rank order, collectives interleaved with the parent's and siblings', a split
    of a split with messages, color None, a mismatch, independent close."""
    run_case(launcher, n, "split", tmp_path)


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["dtypes_ops", "back_to_back", "mismatch"])
def test_mpi_transport(case, tmp_path):
    """NumPy collectives carried by MPI alone, forced on one node (sizes from 1 to 60000
    elements come in back_to_back; MPI has no rounds of its own here). The verbs that move
    blocks and messages run over MPI in `test_simulated_nodes`."""
    run_case("mpiexec", 3, case, tmp_path, env={"GPURING_TRANSPORT": "mpi"})


@pytest.mark.mpi
def test_simulated_nodes(tmp_path):
    """Ranks on 2 simulated nodes of 2 (GPURING_HOSTNAME per rank), interleaved (ranks 0 and
    2 on one node): the collectives of two levels (shared memory in each node, MPI between
    nodes) and the flat ones, bit for bit alike on every rank. (Layouts of 3 nodes:
    tests/unit/test_hierarchy.py.)"""
    run_worker(WORKER, "mpiexec", 4, "nodes", tmp_path, nodes=["a", "b", "a", "b"])


@pytest.mark.mpi
def test_simulated_nodes_deterministic(tmp_path):
    """Deterministic mode across nodes: the node-major fold's bits (small buffers: several
    rounds in each node)."""
    run_worker(WORKER, "mpiexec", 4, "deterministic", tmp_path, nodes=["a", "a", "b", "b"],
               env={"GPURING_DETERMINISTIC": "1", "GPURING_BUFFER_BYTES": "256K"})
