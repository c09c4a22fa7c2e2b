"""The torch.distributed backend "gpuring", used as torch users use a backend: processes
set up as torchrun sets them up (`env://`), `init_process_group("gpuring")`."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

#: each test launches ranks for several seconds
pytestmark = pytest.mark.slow

pytest.importorskip("torch.distributed", reason="torch is not installed")

WORKER = str(Path(__file__).parent / "worker_torch.py")


def torchrun_like(n: int, case: str, device: str = "cpu", timeout: float = 300) -> list[str]:
    """Start `worker_torch.py case device` as n processes with torchrun's variables."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(n):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(n), GPURING_TIMEOUT="60")
        procs.append(subprocess.Popen([sys.executable, WORKER, case, device], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            proc.kill()
    for rank, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
        assert proc.returncode == 0, out[-4000:]
        assert f"rank {rank}: {case} ok" in out, out[-4000:]
    return outputs


@pytest.mark.parametrize("n", [3])
def test_every_call_of_the_backend(n):
    """all_reduce (sync and async), all_gather (list and single tensor), broadcast, reduce,
    reduce_scatter (list and single tensor), all_to_all (list, single, uneven splits),
    gather, scatter, send/recv, barrier, a new_group, a mismatch."""
    torchrun_like(n, "verbs")


@pytest.mark.parametrize("n", [2, 3])
def test_point_to_point_as_torch_users_write_it(n):
    """batch_isend_irecv with the receive listed first, tags received out of order, recv
    from any source, a receive into a tensor that is not contiguous, complex tensors."""
    torchrun_like(n, "p2p")


@pytest.mark.parametrize("n", [2])
def test_ddp_trains_as_with_gloo(n):
    """DistributedDataParallel on "gpuring" and on "gloo" in the same processes: the same
    parameters after every step (bit for bit on 2 ranks)."""
    torchrun_like(n, "ddp")


@pytest.mark.parametrize("n", [3])
def test_rank0_may_end_after_its_last_call(n):
    """Group rank 0 ends its process right after a broadcast it is the root of, without
    destroying the group; the others make that broadcast once its process is gone, get its
    data, and destroy the group without an error: the group's control-plane server runs in
    a process of its own."""
    outputs = torchrun_like(n, "leave")
    for out in outputs[1:]:
        assert "Error" not in out and "Traceback" not in out, out[-4000:]
