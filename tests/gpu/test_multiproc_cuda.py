"""The multi-process suite on CuPy arrays: 2 and 4 ranks sharing one GPU (CUDA IPC between
processes on the same device)."""

from __future__ import annotations

import re
import time

import pytest

from ..conftest import WORKER, free_port, launch, start_as, start_by_hand, torchrun_env

TRAINING = WORKER.parent / "worker_training.py"
FAULTS = WORKER.parent / "worker_faults.py"

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _need_a_gpu():
    cupy = pytest.importorskip("cupy")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:
        pytest.skip(f"no CUDA device: {exc}")
    if count < 1:
        pytest.skip("no CUDA device")


def _on_simulator() -> bool:
    try:
        import cupy
    except ImportError:
        return False
    return bool(cupy.__version__.endswith("+cudasim"))


@pytest.mark.parametrize(("case", "n"), [
    (case, n) for case in ("dtypes_ops", "sizes", "back_to_back", "mismatch") for n in (2, 4)
    # sizes, and back-to-back and dtypes_ops on 4 ranks, on a GPU only: the simulator's
    # ranks on 2 cores take long there (back-to-back's sizes run on it, mismatches and the
    # one-kernel and graph tests run 4 ranks on it)
    if (case, n) not in (("sizes", 2), ("sizes", 4), ("back_to_back", 4), ("dtypes_ops", 4))
    or not _on_simulator()])
def test_cuda_collectives(case, n, tmp_path):
    proc = launch("gpuring", n, [str(WORKER), case, str(tmp_path), "cuda"],
                  env={"GPURING_JITTER": "0"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    digests = [(tmp_path / f"{case}-{r}.txt").read_text() for r in range(n)]
    assert all(d == digests[0] for d in digests), "ranks differ bitwise"


@pytest.mark.parametrize(("mode", "n"), [("kernel", 2), ("auto", 4)])
def test_small_all_reduce_as_one_operation(n, mode, tmp_path):
    """A small all_reduce is one operation on the caller's stream: one kernel (kernel; auto
    where no two ranks share a GPU or stream memory operations are missing), three stream
    operations (auto where ranks share a GPU), or rounds (off); the worker checks the driver
    calls each call made."""
    proc = launch("gpuring", n, [str(WORKER), "one_kernel", str(tmp_path), "cuda"],
                  env={"GPURING_JITTER": "0", "GPURING_CUDA_FUSED": mode}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    digests = [(tmp_path / f"one_kernel-{r}.txt").read_text() for r in range(n)]
    assert all(d == digests[0] for d in digests), "ranks differ bitwise"


@pytest.mark.parametrize(("mode", "n"), [("kernel", 2)] + (
    [] if _on_simulator() else [("auto", 2)]))  # (auto: the same operands, on a GPU only)
def test_the_same_arrays_again(n, mode, tmp_path):
    """Persistent CuPy arrays called again and again, refilled between calls (a call that
    comes again runs the operands it bound once), and a mismatch among them."""
    proc = launch("gpuring", n, [str(WORKER), "again", str(tmp_path), "cuda"],
                  env={"GPURING_JITTER": "0", "GPURING_CUDA_FUSED": mode}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    digests = [(tmp_path / f"again-{r}.txt").read_text() for r in range(n)]
    assert all(d == digests[0] for d in digests), "ranks differ bitwise"


@pytest.mark.parametrize(("case", "n", "env"), [
    ("deterministic", 2, {"GPURING_DETERMINISTIC": "1", "GPURING_BUFFER_BYTES": "256K"}),
    ("two_shot", 3, {"GPURING_CUDA_FUSED": "kernel"})])
def test_two_shot_and_deterministic(case, n, env, tmp_path):
    """Deterministic mode (small buffers: several rounds) and algorithm= per call on CuPy
    arrays: the rank-order fold's bits, as on the host."""
    proc = launch("gpuring", n, [str(WORKER), case, str(tmp_path), "cuda"],
                  env={"GPURING_JITTER": "0", **env}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.parametrize(("case", "fused"), [("exchange", "auto"), ("p2p", "auto")] + (
    [("exchange", "kernel")] if _on_simulator() else [("uneven", "auto"), ("split", "auto")]))
def test_gather_scatter_all_to_all(case, fused, tmp_path):
    """gather, scatter and all_to_all (buffer rounds, copies from the peers' buffers; with
    GPURING_CUDA_FUSED=kernel the small ones as one kernel), the uneven forms (all_gather_v,
    all_to_all_v, reduce_scatter_v), point to point and sub-communicators, of CuPy arrays on
    3 ranks. On the simulator, the uneven forms and sub-communicators are left to their NumPy
    tests: the same code over the same verbs. On a GPU, the kernel form of these verbs runs in
    the CUDA graph test (its every call spins on a GPU the ranks share, taking turns)."""
    proc = launch("gpuring", 3, [str(WORKER), case, str(tmp_path), "cuda"],
                  env={"GPURING_JITTER": "0", "GPURING_CUDA_FUSED": fused}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def _real_cuda_torch() -> bool:
    """A torch with CUDA (not on the simulator: a real torch cannot run on simulated devices,
    nor always import beside the simulator's driver module)."""
    try:
        import cupy

        if cupy.__version__.endswith("+cudasim"):
            return False
        import torch
        import torch.distributed
    except Exception:
        return False
    return bool(torch.distributed.is_available() and torch.cuda.is_available())


if _real_cuda_torch():  # defined only where it can run: the simulator runs must not skip
    def test_torch_backend_on_cuda_tensors():
        """The "gpuring" torch.distributed backend on CUDA tensors, 3 ranks sharing the
        GPU: every call, async work ordered on torch's stream."""
        from ..multiproc.test_torch_backend import torchrun_like

        torchrun_like(3, "verbs", "cuda")


def test_cupyx_distributed_drop_in():
    """gpuring.distributed on CuPy arrays, 3 processes started by hand (each makes its GPU
    current first, as cupyx users do), one call with a stream of its own."""
    done = start_by_hand(3, [str(WORKER.parent / "worker_distributed.py"), "cuda"],
                         env={"GPURING_JITTER": "0"})
    for rank, proc in enumerate(done):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"rank {rank}: ok" in proc.stdout


@pytest.mark.parametrize(("n", "mode"), [(3, "auto")])
def test_registered_memory(n, mode, tmp_path):
    """CuPy arrays from comm.empty/zeros (CUDA IPC memory every rank maps), read by the peers
    in place: every verb, the rank-order fold's bits, refilled and called again at once, and
    a mismatch with plain arrays."""
    proc = launch("gpuring", n, [str(WORKER), "registered", str(tmp_path), "cuda"],
                  env={"GPURING_JITTER": "0", "GPURING_CUDA_FUSED": mode}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    digests = [(tmp_path / f"registered-{r}.txt").read_text() for r in range(n)]
    assert all(d == digests[0] for d in digests), "ranks differ bitwise"


@pytest.mark.parametrize(("n", "sizes"), [
    (2, {"GPURING_FUSED_BYTES": "1M"}),  # one kernel up to 1 MiB, then 1 MiB pieces
    (4, {})])  # one kernel up to 64 KiB, then 1 MiB pieces in a graph
def test_collectives_captured_in_a_cuda_graph(n, sizes, tmp_path):
    """Collectives from a few elements to 4 MiB captured into a CUDA graph (as one kernel, or
    one per piece) and replayed with fresh inputs; what cannot be captured is refused, and
    the communicator goes on."""
    proc = launch("gpuring", n, [str(WORKER), "graph_capture", str(tmp_path), "cuda"],
                  env={"GPURING_JITTER": "0", "GPURING_CUDA_FUSED": "kernel", **sizes},
                  timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    digests = [(tmp_path / f"graph_capture-{r}.txt").read_text() for r in range(n)]
    assert all(d == digests[0] for d in digests), "ranks differ bitwise"


@pytest.mark.parametrize("mode", ["auto", "memops"])
def test_capture_where_ranks_share_a_gpu(mode, tmp_path):
    """2 ranks on one GPU with stream memory operations: in the default form (auto), whose
    small all_reduces use them outside graphs, a capture records the kernel form (warning
    once per process) and replays between eager calls of both forms give every result;
    GPURING_CUDA_FUSED=memops refuses the capture, and the communicator goes on."""
    from gpuring.devices import _cuda_driver

    if _cuda_driver.memops_support(0) is not None:
        pytest.skip("the GPU has no stream memory operations")
    proc = launch("gpuring", 2, [str(WORKER), "graph_capture_shared", str(tmp_path), "cuda"],
                  env={"GPURING_JITTER": "0", "GPURING_CUDA_FUSED": mode}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    digests = [(tmp_path / f"graph_capture_shared-{r}.txt").read_text() for r in range(2)]
    assert digests[0] == digests[1], "ranks differ bitwise"


def test_close_waits_until_every_peer_unmapped(tmp_path):
    """A rank frees its buffers only once every peer has unmapped them (the simulator aborts
    a process that frees memory a live peer still maps: undefined behaviour on a GPU)."""
    proc = launch("gpuring", 2, [str(WORKER), "uneven_close", str(tmp_path), "cuda"],
                  env={"GPURING_JITTER": "0"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("case", ["async", "async_mismatch", "torch_stream"] + (
    [] if _on_simulator() else ["fusion", "compression"]))
def test_cuda_training_features(case, tmp_path):
    """Async work, fusion and compression on CuPy arrays, 2 ranks sharing a GPU (fusion and
    compression on a GPU only: on the simulator their NumPy tests run the same code)."""
    n = 2
    proc = launch("gpuring", n, [str(TRAINING), case, str(tmp_path), "cuda"],
                  env={"GPURING_JITTER": "0"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    digests = [(tmp_path / f"{case}-{r}.txt").read_text() for r in range(n)]
    assert all(d == digests[0] for d in digests), "ranks differ bitwise"


def test_survivors_of_a_killed_rank_keep_their_gpu():
    """Rank 1 of 3 is SIGKILLed mid all_reduce. Every survivor raises PeerFailureError naming
    it, closes, synchronizes its GPU, computes and frees, and exits by itself: well before
    the launcher's grace period would stop it (a stream left waiting for the dead rank's
    flag would hang the synchronize forever)."""
    grace = 120
    start = time.monotonic()
    proc = launch("gpuring", 3, [str(FAULTS), "kill_cuda"],
                  env={"GPURING_TIMEOUT": "600", "GPURING_JITTER": "0"}, grace=grace,
                  timeout=2 * grace + 60)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert "rank 1 failed first: it was killed by SIGKILL" in proc.stderr, out[-4000:]
    failed = dict(re.findall(r"RESULT (\d+) (\w+) peer=1 ", proc.stdout))
    assert failed == {"0": "PeerFailureError", "2": "PeerFailureError"}, out[-4000:]
    recovered = set(re.findall(r"RECOVERED (\d+) ", proc.stdout))
    assert recovered == {"0", "2"}, out[-4000:]
    assert took < grace, f"the survivors were stopped by the launcher after {took:.0f} s"


@pytest.mark.parametrize("n", [2, 3])
def test_gpus_without_peer_access_run_on_nccl(tmp_path, n):
    """n ranks on n GPUs that cannot access each other peer to peer: CUDA IPC cannot map
    their buffers, so their CuPy collectives and messages run on NCCL (on 3 ranks a
    sendrecv's two pairs' channels at once, from two threads), bit for bit alike on every
    rank. Simulator only: it alone can take peer access away (GPURING_CUDASIM_NO_P2P)."""
    if not _on_simulator():
        pytest.skip("needs GPUs without peer access: the simulator's GPURING_CUDASIM_NO_P2P")
    proc = launch("gpuring", n, [str(WORKER), "without_peer_access", str(tmp_path), "cuda"],
                  env={"GPURING_JITTER": "0", "GPURING_CUDASIM_DEVICES": str(n),
                       "GPURING_CUDASIM_NO_P2P": "1"}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    digests = [(tmp_path / f"without_peer_access-{r}.txt").read_text() for r in range(n)]
    assert all(d == digests[0] for d in digests), "ranks differ bitwise"


def test_nccl_refuses_ranks_that_share_a_gpu_alike(tmp_path):
    """Flat NCCL on one GPU shared by 2 ranks, without NCCL_MULTI_RANK_GPU_ENABLE: a clear
    error on both ranks, before NCCL's init."""
    proc = launch("gpuring", 2, [str(WORKER), "nccl_on_a_shared_gpu", str(tmp_path), "cuda"],
                  env={"GPURING_JITTER": "0", "GPURING_TRANSPORT": "nccl"}, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


@pytest.mark.mpi
def test_simulated_nodes(tmp_path):
    """2 simulated nodes of 2 ranks (GPURING_HOSTNAME): CuPy collectives in two levels (CUDA
    IPC in each node, NCCL between nodes) and flat on NCCL (gather, scatter, all_to_all),
    bit for bit alike on every rank. The ranks of an NCCL communicator between nodes share
    the one GPU: NCCL takes them as ranks of different hosts because gpuring sets NCCL_HOSTID
    from GPURING_HOSTNAME; the flat one has two ranks of a node on it, which NCCL takes only
    with NCCL_MULTI_RANK_GPU_ENABLE=1 (else it refuses them, as its stand-in in the
    simulator does)."""
    proc = launch("mpiexec", 4, [str(WORKER), "nodes", str(tmp_path), "cuda"],
                  nodes=["a", "a", "b", "b"], timeout=600,
                  env={"GPURING_JITTER": "0", "NCCL_MULTI_RANK_GPU_ENABLE": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    digests = [(tmp_path / f"nodes-{r}.txt").read_text() for r in range(4)]
    assert all(d == digests[0] for d in digests), "ranks differ bitwise"


def test_a_killed_rank_on_a_simulated_node(tmp_path):
    """2 simulated nodes of 2 ranks met as torchrun starts them (no MPI: NCCL between the
    nodes); rank 1 is SIGKILLed inside CuPy all_reduces. Every survivor raises
    PeerFailureError naming it (the control plane sees it go), closes (the NCCL calls
    waiting for it are aborted), and goes on using its GPU."""
    envs = torchrun_env(4, free_port(), ["a", "a", "b", "b"])
    for env in envs:
        env.update(GPURING_TIMEOUT="120", GPURING_JITTER="0")
    done = start_as(envs, [str(FAULTS), "kill_cuda"], timeout=300)
    out = "".join(p.stdout + p.stderr for p in done)
    for rank in (0, 2, 3):
        found = re.search(rf"RESULT {rank} (\w+) peer=(\S+) after=([\d.]+)", done[rank].stdout)
        assert found and found.group(1) == "PeerFailureError", out[-4000:]
        assert found.group(2) == "1" and float(found.group(3)) < 30, out[-4000:]
        assert f"RECOVERED {rank} " in done[rank].stdout, out[-4000:]


PERSISTENT = WORKER.parent / "worker_persistent.py"


@pytest.mark.parametrize(("case", "mode"), [
    (f"persistent_{verb}", "kernel") for verb in (
        "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather",
        "scatter", "all_to_all", "barrier")] + [
    ("persistent_all_reduce", "auto"), ("persistent_cuda", "kernel"),
    ("persistent_cuda", "auto")])
def test_persistent_collectives(case, mode, tmp_path):
    """Persistent collectives on CuPy arrays, 2 ranks on one GPU: every verb in the kernel
    form, all_reduce in the auto form (stream memory operations where the GPU has them, as
    the simulator does under GPURING_CUDASIM_MEMOPS=1); a small start's driver calls (at most
    2 in the kernel form), started results in both forms, and starts captured into a CUDA
    graph (persistent_cuda; the kernel form in both)."""
    proc = launch("gpuring", 2, [str(PERSISTENT), case, str(tmp_path), "cuda"],
                  env={"GPURING_JITTER": "0", "GPURING_CUDA_FUSED": mode}, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    digests = [(tmp_path / f"{case}-{r}.txt").read_text() for r in range(2)]
    assert digests[0] == digests[1], "ranks differ bitwise"
