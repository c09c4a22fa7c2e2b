"""gpuring.init() in processes started as torchrun and Slurm's srun start them (their
variables set by hand, no launcher): rank 0 serves the control plane, the others meet it."""

from __future__ import annotations

import pytest

from gpuring.rendezvous.launchers import first_host, from_environment

from ..conftest import WORKER, free_port, start_as, torchrun_env


def start(envs: list[dict[str, str]], case: str, tmp_path) -> list[str]:
    """Run worker.py CASE as one process per entry of `envs` (its launcher's variables);
    check every process succeeded and wrote the same digests; rank 0's digest lines."""
    done = start_as(envs, [str(WORKER), case, str(tmp_path)], timeout=180)
    for proc in done:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    digests = [(tmp_path / f"{case}-{r}.txt").read_text() for r in range(len(envs))]
    assert all(d == digests[0] for d in digests), "results differ bitwise across ranks"
    return digests[0].splitlines()


def test_close_and_init_again_under_torchrun(tmp_path):
    """torchrun's variables on 3 ranks. Rank 0's process serves for its whole life: a
    communicator made again after a close meets on it, and a sub-communicator outlives its
    parent."""
    start(torchrun_env(3, free_port()), "close_and_again", tmp_path)


def test_slurm_variables(tmp_path):
    """srun's variables; rank 0 serves on the step's first host, at GPURING_PORT."""
    port = str(free_port())
    envs = [{"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r),
             "SLURM_JOB_ID": "4242", "SLURM_STEP_NODELIST": "localhost",
             "GPURING_PORT": port} for r in range(2)]
    start(envs, "module_api", tmp_path)


def test_simulated_nodes_without_mpi(tmp_path):
    """2 simulated nodes of 2 under torchrun's variables: local ranks follow the node names;
    NumPy collectives across nodes need MPI, and say so on every rank."""
    start(torchrun_env(4, free_port(), ["a", "a", "b", "b"]), "nodes_without_mpi", tmp_path)


def test_where_rank_0_serves():
    assert first_host("gpu[07-09,12],cpu1") == "gpu07"
    assert first_host("node3,node4") == "node3"
    assert first_host("a[1]") == "a1"
    job = from_environment({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0",
                            "MASTER_ADDR": "h0", "MASTER_PORT": "29500"})
    assert job is not None and (job.launcher, job.rank, job.size, job.local_rank, job.host,
                                job.port) == ("torchrun", 2, 4, 0, "h0", 29501)
    job = from_environment({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                            "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"})
    assert job is not None and (job.launcher, job.host, job.port, job.local_rank) == (
        "slurm", "gpu07", 29500 + 3456, 1)
    job = from_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "MASTER_ADDR": "m",
                            "MASTER_PORT": "100", "GPURING_PORT": "7000"})
    assert job is not None and (job.host, job.port) == ("m", 7000)
    assert from_environment({"RANK": "0"}) is None
    assert first_host("n-[3-4]-ib,m1") == "n-3-ib"
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        from_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    torchrun = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1000"}
    for bad, match in [({"RANK": "2"}, "no rank"), ({"WORLD_SIZE": "0"}, "no rank"),
                       ({"RANK": "x"}, "RANK='x'"), ({"MASTER_PORT": "65535"}, "out of range"),
                       ({"GPURING_PORT": "zero"}, "GPURING_PORT")]:
        with pytest.raises(ValueError, match=match):
            from_environment({**torchrun, **bad})
    one = from_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "14242",
                            "SLURM_JOB_NODELIST": "a"})
    two = from_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "24242",
                            "SLURM_JOB_NODELIST": "a"})
    assert one is not None and two is not None and one.port == two.port
    assert one.salt != two.salt  # two jobs on one port: different keys, never one job
