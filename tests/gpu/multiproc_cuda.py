"""The multi-process suite on CuPy arrays: 2 to 4 ranks sharing one GPU (CUDA IPC between
processes on the same device) or on one GPU each, the small collectives as one kernel or as
stream memory operations (GPURING_CUDA_FUSED=kernel, memops).

The named items (tests/multiproc/cases_*.py) run here on CuPy arrays: each test's id says
the verb, dtype, op, placement and rank count, then the GPU form: `shared_gpu` or
`gpu_per_rank`, then the GPURING_CUDA_FUSED form (`-no_memops`: the GPU's flag waits spin
in kernels, as on a GPU without stream memory operations), e.g.
`all_reduce-float16-sum-in_place-4ranks-gpu_per_rank-memops`.

The tests are collected by tests/gpu/test_multiproc_cuda.py on this machine's GPUs (a form
the machine cannot give is skipped), and on every CI run by
tests/multiproc/test_cuda_simulated.py on the CUDA simulator. Each gives them its
`cuda_platform` fixture: the GPUs the ranks run on, and their environment."""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ..conftest import free_port, launch, run_worker, start_as, start_by_hand, torchrun_env
from ..multiproc.named import Group, params

HERE = Path(__file__).resolve().parent.parent / "multiproc"
TRAINING = HERE / "worker_training.py"
FAULTS = HERE / "worker_faults.py"
PERSISTENT = HERE / "worker_persistent.py"


@dataclasses.dataclass(frozen=True)
class Form:
    """Where a launch's ranks run: every rank on one GPU (`shared_gpu`) or each on its own
    (`gpu_per_rank`); GPURING_CUDA_FUSED (`fused`); whether the GPUs' flag waits use stream
    memory operations (`memops`; else they spin in kernels)."""

    layout: str
    fused: str
    memops: bool = True

    @property
    def tag(self) -> str:
        return f"{self.layout}-{self.fused}" + ("" if self.memops else "-no_memops")


@dataclasses.dataclass(frozen=True)
class CudaPlatform:
    """The ranks' environment on GPUs or on the simulator (`base`: None, this process's)."""

    simulated: bool
    base: Mapping[str, str] | None
    gpus: int
    memops: bool

    def env(self, form: Form, n: int, **extra: str) -> dict[str, str]:
        """The environment of `n` ranks in `form` (skips where the GPUs cannot give it)."""
        env = dict(os.environ if self.base is None else self.base)
        if not form.memops:
            env["GPURING_CUDA_FLAGS"] = "kernel"
        if self.simulated:
            env["GPURING_CUDASIM_DEVICES"] = "1" if form.layout == "shared_gpu" else str(n)
            env["GPURING_CUDASIM_MEMOPS"] = "1" if form.memops else "0"
        else:
            if form.layout == "gpu_per_rank" and self.gpus < n:
                pytest.skip(f"needs {n} GPUs, this machine has {self.gpus}")
            if form.layout == "shared_gpu":
                visible = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
                env["CUDA_VISIBLE_DEVICES"] = visible
            if form.memops and not self.memops:
                pytest.skip("the GPU has no stream memory operations")
        env.update(extra)
        return env


def real_gpus() -> CudaPlatform:
    """This machine's GPUs (skips without CuPy and a GPU)."""
    cupy = pytest.importorskip("cupy")
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        pytest.skip(f"no CUDA device: {exc}")
    if count < 1:
        pytest.skip("no CUDA device")
    if cupy.__version__.endswith("+cudasim"):  # run with tests/cudasim first on PYTHONPATH
        return CudaPlatform(True, None, 0, True)
    from gpuring.devices._cuda_driver import memops_support

    return CudaPlatform(False, None, count, memops_support(0) is None)


SHARED_MEMOPS = Form("shared_gpu", "memops")
SHARED_KERNEL = Form("shared_gpu", "kernel")
SHARED_AUTO = Form("shared_gpu", "auto")
#: the forms every collective runs in
FORMS = (SHARED_MEMOPS, SHARED_KERNEL, Form("gpu_per_rank", "memops"),
         Form("gpu_per_rank", "kernel", memops=False))


def cuda_group(families: tuple[str, ...], n: int, form: Form, *, tag: str = "",
               env: tuple[tuple[str, str], ...] = (), **kw: Any) -> Group:
    """A launch of named items on CuPy arrays in `form` (`tag`: what else the ids say)."""
    return Group(families, n, device="cuda", tag="-".join(filter(None, (form.tag, tag))),
                 env=(("GPURING_CUDA_FUSED", form.fused), ("GPURING_JITTER", "0"), *env),
                 slow=True, context=form, **kw)


def _check(named_launches: Any, platform: CudaPlatform, group: Group, item: str,
           **extra: str) -> None:
    named_launches.check(group, item, env=platform.env(group.context, group.n, **extra))


COLLECTIVES = ("cases_reductions:dtypes_ops", "cases_reductions:sizes",
               "cases_reductions:back_to_back", "cases_communicators:mismatch",
               "cases_reductions:again")
BLOCKS = ("cases_exchange:exchange", "cases_exchange:uneven", "cases_messages:p2p",
          "cases_communicators:split")
#: every form, on 2 and 4 ranks (3 for the verbs that move blocks and messages)
MATRIX = [cuda_group(COLLECTIVES, n, form) for n in (2, 4) for form in FORMS] + [
    cuda_group(BLOCKS, 3, form) for form in FORMS]


@pytest.mark.parametrize(("group", "item"), params(*MATRIX, families=["dtypes_ops"]))
def test_dtypes_and_ops(group, item, named_launches, cuda_platform):
    _check(named_launches, cuda_platform, group, item)


@pytest.mark.parametrize(("group", "item"), params(*MATRIX, families=["sizes"]))
def test_sizes(group, item, named_launches, cuda_platform):
    _check(named_launches, cuda_platform, group, item)


@pytest.mark.parametrize(("group", "item"), params(*MATRIX, families=["back_to_back"]))
def test_back_to_back(group, item, named_launches, cuda_platform):
    _check(named_launches, cuda_platform, group, item)


@pytest.mark.parametrize(("group", "item"), params(*MATRIX, families=["mismatch"]))
def test_mismatch_raises_on_every_rank(group, item, named_launches, cuda_platform):
    _check(named_launches, cuda_platform, group, item)


AGAIN_AUTO = [cuda_group(("cases_reductions:again",), 2, form) for form in (
    SHARED_AUTO, Form("gpu_per_rank", "auto", memops=False))]


@pytest.mark.parametrize(("group", "item"), params(*MATRIX, *AGAIN_AUTO, families=["again"]))
def test_the_same_arrays_again(group, item, named_launches, cuda_platform):
    """Persistent CuPy arrays called again and again, refilled between calls (a call that
    comes again runs the operands it bound once), and a mismatch among them; in every form,
    and in the auto form (memops where the ranks share a GPU, else one kernel)."""
    _check(named_launches, cuda_platform, group, item)


@pytest.mark.parametrize(("group", "item"), params(*MATRIX, families=["exchange"]))
def test_gather_scatter_all_to_all(group, item, named_launches, cuda_platform):
    """gather, scatter and all_to_all (buffer rounds, copies from the peers' buffers; in the
    kernel form the small ones as one kernel)."""
    _check(named_launches, cuda_platform, group, item)


@pytest.mark.parametrize(("group", "item"), params(*MATRIX, families=["uneven"]))
def test_uneven_collectives(group, item, named_launches, cuda_platform):
    _check(named_launches, cuda_platform, group, item)


@pytest.mark.parametrize(("group", "item"), params(*MATRIX, families=["p2p"]))
def test_point_to_point(group, item, named_launches, cuda_platform):
    _check(named_launches, cuda_platform, group, item)


GPU_MESSAGES = [cuda_group(("cases_messages:gpu_messages",), 3, form) for form in FORMS] + [
    cuda_group(("cases_messages:gpu_messages",), 2, SHARED_MEMOPS, tag="one_queue",
               env=(("CUDA_DEVICE_MAX_CONNECTIONS", "1"),))]


@pytest.mark.parametrize(("group", "item"), params(*GPU_MESSAGES, families=["gpu_messages"]))
def test_messages_queued_on_the_stream(group, item, named_launches, cuda_platform):
    """isend/irecv of CuPy arrays queued on the caller's stream, in both flag modes, and
    with one hardware queue for all streams (CUDA_DEVICE_MAX_CONNECTIONS=1): groups and
    batches with the receive first at every size, any source, done(), tags in order, driver
    calls per message."""
    _check(named_launches, cuda_platform, group, item)


@pytest.mark.parametrize(("group", "item"), params(*MATRIX, families=["split"]))
def test_sub_communicators(group, item, named_launches, cuda_platform):
    _check(named_launches, cuda_platform, group, item)


@pytest.mark.parametrize(("group", "item"), params(
    cuda_group(("cases_cuda:one_kernel",), 2, SHARED_KERNEL),
    cuda_group(("cases_cuda:one_kernel",), 4, SHARED_AUTO)))
def test_small_all_reduce_as_one_operation(group, item, named_launches, cuda_platform):
    """A small all_reduce is one operation on the caller's stream: one kernel (kernel; auto
    where no two ranks share a GPU or stream memory operations are missing), three stream
    operations (auto where ranks share a GPU), or rounds (off); each item checks the driver
    calls each call made."""
    _check(named_launches, cuda_platform, group, item)


@pytest.mark.parametrize(("group", "item"), params(
    cuda_group(("cases_reductions:deterministic",), 2, SHARED_AUTO, tag="deterministic-"
               "buffer256K", env=(("GPURING_DETERMINISTIC", "1"),
                                  ("GPURING_BUFFER_BYTES", "256K"))),
    cuda_group(("cases_reductions:two_shot",), 3, SHARED_KERNEL)))
def test_two_shot_and_deterministic(group, item, named_launches, cuda_platform):
    """Deterministic mode (small buffers: several rounds) and algorithm= per call on CuPy
    arrays: the rank-order fold's bits, as on the host."""
    _check(named_launches, cuda_platform, group, item)


@pytest.mark.parametrize(("group", "item"), params(
    *[cuda_group(("cases_registered:registered",), 3, form) for form in (SHARED_AUTO, *FORMS)]))
def test_registered_memory(group, item, named_launches, cuda_platform):
    """CuPy arrays from comm.empty/zeros (CUDA IPC memory every rank maps), read by the peers
    in place: every verb, the rank-order fold's bits, refilled and called again at once, and
    a mismatch with plain arrays."""
    _check(named_launches, cuda_platform, group, item)


@pytest.mark.parametrize(("group", "item"), params(
    # one kernel up to 1 MiB, then 1 MiB pieces
    cuda_group(("cases_cuda:graph_capture",), 2, SHARED_KERNEL, tag="fused1M",
               env=(("GPURING_FUSED_BYTES", "1M"),)),
    # one kernel up to 64 KiB, then 1 MiB pieces in a graph
    cuda_group(("cases_cuda:graph_capture",), 4, SHARED_KERNEL)))
def test_collectives_captured_in_a_cuda_graph(group, item, named_launches, cuda_platform):
    """Collectives from a few elements to 4 MiB captured into a CUDA graph (as one kernel, or
    one per piece) and replayed with fresh inputs; what cannot be captured is refused, and
    the communicator goes on."""
    _check(named_launches, cuda_platform, group, item)


@pytest.mark.parametrize(("group", "item"), params(
    cuda_group(("cases_cuda:graph_capture_shared",), 2, SHARED_AUTO),
    cuda_group(("cases_cuda:graph_capture_shared",), 2, SHARED_MEMOPS)))
def test_capture_where_ranks_share_a_gpu(group, item, named_launches, cuda_platform):
    """2 ranks on one GPU with stream memory operations: in the default form (auto), whose
    small all_reduces use them outside graphs, a capture records the kernel form (warning
    once per process) and replays between eager calls of both forms give every result;
    GPURING_CUDA_FUSED=memops refuses the capture, and the communicator goes on. (Skipped
    on a GPU without stream memory operations.)"""
    _check(named_launches, cuda_platform, group, item)


@pytest.mark.parametrize(("group", "item"), params(
    cuda_group(("cases_cuda:uneven_close",), 2, SHARED_AUTO, timeout=300)))
def test_close_waits_until_every_peer_unmapped(group, item, named_launches, cuda_platform):
    """A rank frees its buffers only once every peer has unmapped them (the simulator aborts
    a process that frees memory a live peer still maps: undefined behaviour on a GPU)."""
    _check(named_launches, cuda_platform, group, item)


@pytest.mark.parametrize(("group", "item"), params(*[
    cuda_group(("cases_cuda:peer_access", "cases_reductions:dtypes_ops",
                "cases_exchange:exchange", "cases_messages:p2p"), n,
               Form("gpu_per_rank", "auto"), tag="no_peer_access",
               options=(("dtypes", ("float32", "int16", "complex64")), ("blocks", 3)))
    for n in (2, 3)]))
def test_gpus_without_peer_access_run_on_nccl(group, item, named_launches, cuda_platform):
    """n ranks on n GPUs that cannot access each other peer to peer: CUDA IPC cannot map
    their buffers, so their CuPy collectives and messages run on NCCL (on 3 ranks a
    sendrecv's two pairs' channels at once, from two threads), bit for bit alike on every
    rank. Simulator only: it alone can take peer access away (GPURING_CUDASIM_NO_P2P)."""
    if not cuda_platform.simulated:
        pytest.skip("needs GPUs without peer access: the simulator's GPURING_CUDASIM_NO_P2P")
    _check(named_launches, cuda_platform, group, item, GPURING_CUDASIM_NO_P2P="1")


@pytest.mark.parametrize(("group", "item"), params(
    cuda_group(("cases_cuda:nccl_on_a_shared_gpu",), 2, SHARED_AUTO, tag="nccl",
               env=(("GPURING_TRANSPORT", "nccl"),), timeout=300)))
def test_nccl_refuses_ranks_that_share_a_gpu_alike(group, item, named_launches,
                                                   cuda_platform):
    """Flat NCCL on one GPU shared by 2 ranks, without NCCL_MULTI_RANK_GPU_ENABLE: a clear
    error on both ranks, before NCCL's init."""
    _check(named_launches, cuda_platform, group, item)


@pytest.mark.parametrize(("group", "item"), params(
    cuda_group(("cases_communicators:nodes", "cases_reductions:dtypes_ops",
                "cases_exchange:exchange", "cases_reductions:again"), 4, SHARED_AUTO,
               launcher="mpiexec", nodes=("a", "a", "b", "b"), tag="mpiexec-nodes_aabb",
               env=(("NCCL_MULTI_RANK_GPU_ENABLE", "1"),),
               options=(("dtypes", ("float32", "int16", "float16", "complex64")),
                        ("blocks", 3)))))
def test_simulated_nodes(group, item, named_launches, cuda_platform):
    """2 simulated nodes of 2 ranks (GPURING_HOSTNAME): CuPy collectives in two levels (CUDA
    IPC in each node, NCCL between nodes) and flat on NCCL (gather, scatter, all_to_all),
    bit for bit alike on every rank: the verbs of two levels on the types NCCL reduces as
    they are, wider (int16) and as reals (complex), and calls that come again. The ranks of
    an NCCL communicator between nodes share the one GPU: NCCL takes them as ranks of
    different hosts because gpuring sets NCCL_HOSTID from GPURING_HOSTNAME; the flat one has
    two ranks of a node on it, which NCCL takes only with NCCL_MULTI_RANK_GPU_ENABLE=1 (else
    it refuses them, as its stand-in in the simulator does)."""
    _check(named_launches, cuda_platform, group, item)


@pytest.mark.parametrize("case", ["async", "async_mismatch", "torch_stream"])
def test_cuda_training_features(case, tmp_path, cuda_platform):
    """Async work on CuPy arrays and torch CUDA tensors on a torch stream, 2 ranks sharing a
    GPU."""
    run_worker(TRAINING, "gpuring", 2, case, tmp_path, env=cuda_platform.env(
        SHARED_AUTO, 2, GPURING_JITTER="0"), device="cuda")


@pytest.mark.parametrize("form", FORMS, ids=lambda form: form.tag)
@pytest.mark.parametrize("case", ["fusion", "compression"])
def test_fusion_and_compression(case, form, tmp_path, cuda_platform):
    """all_reduce_many (mixed dtypes and shapes, several fusion buffer sizes) and the fp16 and
    bf16 wire formats on CuPy arrays, 2 ranks in every form."""
    run_worker(TRAINING, "gpuring", 2, case, tmp_path, env=cuda_platform.env(
        form, 2, GPURING_JITTER="0", GPURING_CUDA_FUSED=form.fused), device="cuda")


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


def test_cupyx_distributed_drop_in(cuda_platform):
    """gpuring.distributed on CuPy arrays, 3 processes started by hand (each makes its GPU
    current first, as cupyx users do), one call with a stream of its own."""
    done = start_by_hand(3, [str(HERE / "worker_distributed.py"), "cuda"],
                         env=cuda_platform.env(SHARED_AUTO, 3, GPURING_JITTER="0"))
    for rank, proc in enumerate(done):
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert f"rank {rank}: ok" in proc.stdout


def test_survivors_of_a_killed_rank_keep_their_gpu(cuda_platform):
    """Rank 1 of 3 is SIGKILLed mid all_reduce. Every survivor raises PeerFailureError naming
    it, closes, synchronizes its GPU, computes and frees, and exits by itself: well before
    the launcher's grace period would stop it (a stream left waiting for the dead rank's
    flag would hang the synchronize forever)."""
    grace = 120
    start = time.monotonic()
    proc = launch("gpuring", 3, [str(FAULTS), "kill_cuda"],
                  env=cuda_platform.env(SHARED_AUTO, 3, GPURING_TIMEOUT="600",
                                        GPURING_JITTER="0"), grace=grace,
                  timeout=2 * grace + 60)
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert "gpuring run: rank 1 failed: it was killed by SIGKILL" in proc.stderr, out[-4000:]
    failed = dict(re.findall(r"RESULT (\d+) (\w+) peer=1 ", proc.stdout))
    assert failed == {"0": "PeerFailureError", "2": "PeerFailureError"}, out[-4000:]
    recovered = set(re.findall(r"RECOVERED (\d+) ", proc.stdout))
    assert recovered == {"0", "2"}, out[-4000:]
    assert took < grace, f"the survivors were stopped by the launcher after {took:.0f} s"


def test_a_killed_rank_on_a_simulated_node(cuda_platform):
    """2 simulated nodes of 2 ranks met as torchrun starts them (no MPI: NCCL between the
    nodes); rank 1 is SIGKILLed inside CuPy all_reduces. Every survivor raises
    PeerFailureError naming it (the control plane sees it go), closes (the NCCL calls
    waiting for it are aborted), and goes on using its GPU."""
    envs = torchrun_env(4, free_port(), ["a", "a", "b", "b"])
    base = cuda_platform.env(SHARED_AUTO, 4)
    for env in envs:
        env.update(GPURING_TIMEOUT="120", GPURING_JITTER="0")
    done = start_as(envs, [str(FAULTS), "kill_cuda"], timeout=300, base=base)
    out = "".join(p.stdout + p.stderr for p in done)
    for rank in (0, 2, 3):
        found = re.search(rf"RESULT {rank} (\w+) peer=(\S+) after=([\d.]+)", done[rank].stdout)
        assert found and found.group(1) == "PeerFailureError", out[-4000:]
        assert found.group(2) == "1" and float(found.group(3)) < 30, out[-4000:]
        assert f"RECOVERED {rank} " in done[rank].stdout, out[-4000:]


@pytest.mark.parametrize(("case", "mode"), [
    (f"persistent_{verb}", "kernel") for verb in (
        "all_reduce", "reduce_scatter", "all_gather", "broadcast", "reduce", "gather",
        "scatter", "all_to_all", "barrier")] + [
    ("persistent_all_reduce", "auto"), ("persistent_cuda", "kernel"),
    ("persistent_cuda", "auto")])
def test_persistent_collectives(case, mode, tmp_path, cuda_platform):
    """Persistent collectives on CuPy arrays, 2 ranks on one GPU: every verb in the kernel
    form, all_reduce in the auto form (stream memory operations where the GPU has them, as
    the simulator does under GPURING_CUDASIM_MEMOPS=1); a small start's driver calls (at most
    2 in the kernel form), started results in both forms, and starts captured into a CUDA
    graph (persistent_cuda; the kernel form in both)."""
    run_worker(PERSISTENT, "gpuring", 2, case, tmp_path, env=cuda_platform.env(
        SHARED_AUTO, 2, GPURING_JITTER="0", GPURING_CUDA_FUSED=mode), device="cuda")
