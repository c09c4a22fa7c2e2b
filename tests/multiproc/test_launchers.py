"""gpuring.init() in processes started as torchrun and Slurm's srun start them (their
variables set by hand, no launcher): rank 0 serves the control plane, the others meet it."""

from __future__ import annotations

import pytest

from gpuring.rendezvous.launchers import first_host, from_environment

from .named import Group, params

CLOSE = Group(("cases_communicators:close_and_again",), 3, launcher="torchrun",
              tag="torchrun", timeout=180, slow=True)
SLURM = Group(("cases_communicators:module_api",), 2, launcher="slurm", tag="slurm",
              timeout=180)
NODES = Group(("cases_communicators:nodes_without_mpi",), 4, launcher="torchrun",
              nodes=("a", "a", "b", "b"), tag="torchrun-nodes_aabb", timeout=180, slow=True)


@pytest.mark.parametrize(("group", "item"), params(CLOSE))
def test_close_and_init_again_under_torchrun(group, item, named_launches):
    """torchrun's variables on 3 ranks. Rank 0's process serves for its whole life: a
    communicator made again after a close meets on it, and a sub-communicator outlives its
    parent."""
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(SLURM))
def test_slurm_variables(group, item, named_launches):
    """srun's variables; rank 0 serves on the step's first host, at GPURING_PORT."""
    named_launches.check(group, item)


@pytest.mark.parametrize(("group", "item"), params(NODES))
def test_simulated_nodes_without_mpi(group, item, named_launches):
    """2 simulated nodes of 2 under torchrun's variables: local ranks follow the node names;
    NumPy collectives across nodes need MPI, and say so on every rank."""
    named_launches.check(group, item)


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
