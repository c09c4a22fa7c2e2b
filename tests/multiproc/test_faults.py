"""Dead, stalled and diverging ranks: every survivor raises a clear error, nothing hangs, and
nothing is left in /dev/shm."""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ..conftest import launch, mpiexec, on_nodes

#: each test launches ranks for several seconds
pytestmark = pytest.mark.slow

WORKER = str(Path(__file__).parent / "worker_faults.py")


def results(stdout: str) -> dict[int, tuple[str, str, float]]:
    found = {}
    for m in re.finditer(r"RESULT (\d+) (\w+) peer=(\S+) after=([\d.]+)", stdout):
        found[int(m.group(1))] = (m.group(2), m.group(3), float(m.group(4)))
    return found


@pytest.mark.parametrize(("n", "verb"), [(3, "all_reduce"), (4, "all_reduce"),
                                         (3, "all_to_all"), (3, "sendrecv"),
                                         (4, "split"), (2, "attached"), (3, "attached")])
def test_sigkill_mid_allreduce(n, verb):
    """Rank 1 dies inside large collectives: every survivor raises PeerFailureError naming
    it within seconds (the timeout is 600 s), and nothing is left in /dev/shm (attached: in
    all_reduces that read and write the peers' arrays where they lie, as a survivor's read of
    the dead rank's memory fails, or its wait for the dead rank's signal)."""
    env = {"GPURING_TIMEOUT": "600", "GPURING_JITTER": "0", "GPURING_TEST_VERB": verb}
    if verb == "attached":
        env["GPURING_ATTACH_BYTES"] = "4M"
    proc = launch("gpuring", n, [WORKER, "kill"], env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "gpuring run: rank 1 failed: it was killed by SIGKILL" in proc.stderr, out
    got = results(proc.stdout)
    survivors = set(range(n)) - {1}
    assert set(got) == survivors, out
    for rank, (name, peer, after) in got.items():
        assert name == "PeerFailureError", out
        assert peer == ("2" if verb == "split" else "1"), out  # split: the sub's ranks
        assert after < 60, f"rank {rank} took {after} s (timeout is 600 s)"
    job = re.search(r"JOB (\w+)", proc.stdout).group(1)
    assert glob.glob(f"/dev/shm/gpuring-{job}-*") == []


@pytest.mark.parametrize(("launcher", "n", "verb"), [("gpuring", 3, "irecv"),
                                                     ("gpuring", 2, "send"),
                                                     ("mpiexec", 4, "irecv")])
def test_sigkill_while_others_wait_in_irecv(tmp_path, launcher, n, verb):
    """Rank 1 dies while rank 0 waits in irecv from it (or in a large isend to it) and the
    others in irecv from any rank: every survivor raises PeerFailureError naming rank 1
    within seconds (the timeout is 600 s), and nothing is left in /dev/shm."""
    env = {"GPURING_TIMEOUT": "600", "GPURING_JITTER": "0", "GPURING_TEST_VERB": verb}
    args = [WORKER, "kill_irecv", str(tmp_path)]
    if launcher == "mpiexec":  # (hydra must not see the death and end the job first)
        proc = mpiexec_lazy(n, args, tmp_path, env=env, timeout=300)
    else:
        proc = launch(launcher, n, args, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    got = results("\n".join(dir_results(tmp_path).values()))
    assert set(got) == set(range(n)) - {1}, out
    for rank, (name, peer, after) in got.items():
        assert name == "PeerFailureError" and peer == "1", out
        assert after < 60, f"rank {rank} took {after} s (timeout is 600 s)"
    job = re.search(r"JOB (\w+)", proc.stdout).group(1)
    assert glob.glob(f"/dev/shm/gpuring-{job}-*") == []


def test_a_rank_that_closes_while_waited_for_in_recv_fails_it_fast():
    proc = launch("gpuring", 2, [WORKER, "leave_while_waited_for"],
                  env={"GPURING_TIMEOUT": "600"}, timeout=300)
    out = proc.stdout + proc.stderr
    got = results(proc.stdout)
    assert set(got) == {1}, out
    name, peer, after = got[1]
    assert name == "PeerFailureError" and peer == "0" and after < 60, out


def test_sleeper_times_out_the_others():
    proc = launch("gpuring", 3, [WORKER, "sleep"], env={"GPURING_TIMEOUT": "2"}, timeout=120)
    out = proc.stdout + proc.stderr
    got = results(proc.stdout)
    for rank in (0, 2):
        name, peer, _ = got[rank]
        assert name == "CollectiveTimeoutError", out
        assert peer == "1", out
    assert "RESULT 1" in proc.stdout, out  # the sleeper learns it was left behind


@pytest.mark.parametrize("n", [2, 3])
def test_mismatched_order_is_an_error_not_a_hang(n):
    proc = launch("gpuring", n, [WORKER, "order"], env={"GPURING_TIMEOUT": "60"}, timeout=120)
    out = proc.stdout + proc.stderr
    lines = re.findall(r"RESULT (\d+) (\w+)", proc.stdout)
    # every rank reports twice: the fresh and the cached mismatch
    assert sorted(lines) == sorted([(str(r), "CollectiveMismatchError")
                                    for r in range(n)] * 2), out


@pytest.mark.parametrize(("launcher", "nonblocking"),
                         [("gpuring", "0"), ("gpuring", "1"), ("mpiexec", "1")])
def test_a_rank_that_closes_early_fails_the_others_fast(launcher, nonblocking):
    proc = launch(launcher, 3, [WORKER, "leave_early"],
                  env={"GPURING_TIMEOUT": "600", "GPURING_TEST_NONBLOCKING": nonblocking},
                  timeout=300)
    out = proc.stdout + proc.stderr
    got = results(proc.stdout)
    assert set(got) == {1, 2}, out
    for name, peer, after in got.values():
        assert name == "PeerFailureError" and peer == "0", out
        assert after < 60, out


@pytest.mark.parametrize("launcher", ["gpuring", "mpiexec"])
def test_a_failure_while_idle_lets_every_rank_close_and_reinit(launcher):
    proc = launch(launcher, 3, [WORKER, "fail_while_idle"],
                  env={"GPURING_TIMEOUT": "60", "GPURING_TEST_NONBLOCKING": "1"}, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert all(f"CLEAN {r}" in proc.stdout for r in range(3)), out


def test_abort_unblocks_and_reinit_works():
    proc = launch("gpuring", 2, [WORKER, "abort"], env={"GPURING_TIMEOUT": "60"}, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    got = results(proc.stdout)
    assert got[0][0] == "CommunicatorClosedError", out
    assert got[0][2] < 30, out
    assert got[1][0] in ("PeerFailureError", "CommunicatorClosedError"), out
    assert "REINIT 0 ok" in proc.stdout and "REINIT 1 ok" in proc.stdout, out


def test_interrupt_inside_a_collective_breaks_it_everywhere():
    proc = launch("gpuring", 3, [WORKER, "interrupt"], env={"GPURING_TIMEOUT": "60",
                                                            "GPURING_JITTER": "0"}, timeout=120)
    out = proc.stdout + proc.stderr
    got = results(proc.stdout)
    assert got[0][0] == "PeerFailureError" and got[2][0] == "PeerFailureError", out
    assert got[1][0] == "CommunicatorClosedError", out


def test_stall_warning_names_the_missing_rank():
    proc = launch("gpuring", 3, [WORKER, "stall"], env={"GPURING_STALL_WARNING": "0.5"},
                  timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"rank [02] has waited \d+ s in all_reduce #2; ranks \[1\] have not "
                     r"entered it", proc.stderr), out


def test_verify_mode_catches_results_that_differ():
    proc = launch("gpuring", 2, [WORKER, "verify"], env={"GPURING_VERIFY": "1"}, timeout=120)
    out = proc.stdout + proc.stderr
    got = results(proc.stdout)
    assert set(got) == {0, 1}, out
    assert all(name == "GpuringError" for name, _, _ in got.values()), out
    assert "results differ across ranks" in proc.stdout, out


@pytest.mark.slow
def test_soak_4_ranks():
    proc = launch("gpuring", 4, [WORKER, "soak"], env={"GPURING_JITTER": "0",
                                                      "SOAK_COUNT": "1500"}, timeout=900)
    out = proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, out
    assert proc.stdout.count("ok soak 1500") == 4, out


def test_sigterm_to_launcher_reaches_every_rank(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import os, time\nprint('PID', os.getpid(), flush=True)\ntime.sleep(600)\n")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "gpuring", "run", "-n", "3", "--grace", "1", "--",
         sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    assert launcher.stdout is not None
    while len(pids) < 3:
        line = launcher.stdout.readline()
        assert line, "launcher ended early"
        pids += [int(p) for p in re.findall(r"PID (\d+)", line)]
    launcher.send_signal(signal.SIGTERM)
    code = launcher.wait(timeout=60)
    assert code != 0
    for pid in pids:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"rank process {pid} survived SIGTERM to the launcher")


# -- failures that come after the call returned, agreement, the launcher, MPI, channels ------

MPIEXEC = pytest.param("mpiexec", marks=pytest.mark.mpi)


def dir_results(directory: Path) -> dict[int, str]:
    """rank -> the RESULT line it wrote to DIR/result-<rank>.txt."""
    found = {}
    for path in directory.glob("result-*.txt"):
        found[int(path.stem.split("-")[1])] = path.read_text()
    return found


def remove_mpich_segments(directory: Path) -> None:
    """Remove the shared memory MPICH made for a job that is over, which it leaves behind when
    ranks are killed or skip MPI_Finalize (the ranks listed it in DIR/mpich-shm-<rank>.txt)."""
    for listing in directory.glob("mpich-shm-*.txt"):
        for name in listing.read_text().split():
            try:
                os.unlink(f"/dev/shm/{name}")
            except FileNotFoundError:
                pass


def mpiexec_lazy(n: int, args: list[str], directory: Path, env: dict[str, str],
                 timeout: float = 120, nodes: list[str] | None = None
                 ) -> subprocess.CompletedProcess[str]:
    """`mpiexec -n N lazy_parent.py DIR python args...`: a rank a signal kills stays an
    unreaped zombie, so hydra does not see it die (and kill the job) before the survivors
    have reported; they can only learn of the death from its process id."""
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec with mpi4py is not available")
    lazy = str(Path(__file__).parent / "lazy_parent.py")
    full_env = dict(os.environ, GPURING_JITTER="1", GPURING_TIMEOUT="60")
    full_env.update(env)
    try:
        command = [sys.executable, lazy, str(directory), sys.executable, *args]
        where = ["-n", str(n), *command] if nodes is None else on_nodes(nodes, command)
        return subprocess.run([exe, *where], env=full_env, capture_output=True, text=True,
                              timeout=timeout)
    finally:
        remove_mpich_segments(directory)


def after(line: str) -> float:
    return float(re.search(r" after=([\d.]+) ", line).group(1))


@pytest.mark.parametrize("when", ["during", "before"])
@pytest.mark.parametrize("call", ["synchronize", "close"])
@pytest.mark.parametrize("launcher", ["gpuring", MPIEXEC])
def test_a_failure_after_the_call_returned_is_raised_later(launcher, call, when, tmp_path):
    """Collectives that return before they complete (GPU-like): rank 1 gives up only once the
    others' all_reduce returned, while they wait in synchronize() or close() or before they
    call it (the failure then waits, recorded, for a call to raise it). That call raises it,
    naming rank 1."""
    proc = launch(launcher, 3, [WORKER, "late_failure", str(tmp_path)],
                  env={"GPURING_TEST_NONBLOCKING": "1", "FAULT_CALL": call, "FAULT_WHEN": when,
                       "GPURING_TIMEOUT": "60"}, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    got = dir_results(tmp_path)
    assert set(got) == {0, 2}, out
    for rank, line in got.items():
        assert f"RESULT {rank} PeerFailureError peer=1 " in line, out
        assert after(line) < 30, out  # not at the timeout
        assert f":: {call} #2 on rank {rank}: " in line, out  # said once, by that call
        assert f"CLOSED {rank}" in proc.stdout, out  # and close() after it stayed quiet


@pytest.mark.mpi
def test_sigkill_under_mpiexec_ends_the_job(tmp_path):
    """What plain mpiexec (MPICH's hydra) does when a rank is SIGKILLed: as soon as its proxy
    reaps the rank it sends SIGUSR1 and then SIGKILL to every other rank (even with
    -disable-auto-cleanup), so the job ends at once with the killed rank's status. A survivor
    that reported first names rank 1; none may hang or see anything else."""
    try:
        proc = launch("mpiexec", 3, [WORKER, "kill", str(tmp_path)],
                      env={"GPURING_TIMEOUT": "600", "GPURING_JITTER": "0"}, timeout=120)
    finally:
        remove_mpich_segments(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 9, out  # the status of the killed rank
    assert "Killed (signal 9)" in out, out
    for rank, (name, peer, after) in results(proc.stdout).items():
        assert rank != 1 and name == "PeerFailureError" and peer == "1", out
        assert after < 60, out
    job = re.search(r"JOB (\w+)", proc.stdout).group(1)
    assert glob.glob(f"/dev/shm/gpuring-{job}-*") == []


@pytest.mark.mpi
def test_sigkill_under_mpiexec_is_seen_in_the_process_id(tmp_path):
    """Under mpiexec nothing but the status board tells the survivors a rank died, through
    its process id, which must count a zombie (dead, not yet reaped) as dead. GPURING_TIMEOUT
    is short so that a detection that fails ends as a CollectiveTimeoutError, not a hang."""
    proc = mpiexec_lazy(3, [WORKER, "kill", str(tmp_path)], tmp_path,
                        env={"GPURING_TIMEOUT": "20", "GPURING_JITTER": "0"})
    out = proc.stdout + proc.stderr
    got = dir_results(tmp_path)
    assert set(got) == {0, 2}, out
    for rank, line in got.items():
        assert f"RESULT {rank} PeerFailureError peer=1 " in line, out
        assert re.search(r"rank 1 \(pid \d+\) is gone", line), out
        assert after(line) < 10, out  # not at the timeout


@pytest.mark.mpi
def test_sigkill_on_a_simulated_node(tmp_path):
    """Two simulated nodes of two ranks; rank 1 (node a) is SIGKILLed inside all_reduces that
    run in two levels. Rank 0 learns it from the status board of its node, and tells the
    job (MPI failure notices); ranks 2 and 3 (node b) hear it in their waits. Every survivor
    raises PeerFailureError naming rank 1, within seconds."""
    proc = mpiexec_lazy(4, [WORKER, "kill", str(tmp_path)], tmp_path, nodes=["a", "a", "b", "b"],
                        env={"GPURING_TIMEOUT": "30", "GPURING_JITTER": "0"})
    out = proc.stdout + proc.stderr
    got = dir_results(tmp_path)
    assert set(got) == {0, 2, 3}, out
    for rank, line in got.items():
        assert f"RESULT {rank} PeerFailureError peer=1 " in line, out
        assert after(line) < 15, out  # not at the timeout
        assert re.search(r"rank 1 \(pid \d+\) is gone", line), out


@pytest.mark.parametrize("how", ["abort", "kill"])
@pytest.mark.parametrize("launcher", ["gpuring", MPIEXEC])
def test_a_failure_while_ranks_agree_on_a_call(launcher, how, tmp_path):
    """Rank 1 gives up or dies in the control-plane exchange of a signature not seen before
    (rank 2 is in it too, rank 0 comes later): both raise PeerFailureError naming rank 1."""
    env = {"FAULT_HOW": how, "GPURING_TIMEOUT": "30"}
    args = [WORKER, "agree_failure", str(tmp_path)]
    if launcher == "mpiexec" and how == "kill":
        proc = mpiexec_lazy(3, args, tmp_path, env)
    else:
        proc = launch(launcher, 3, args, env=env, timeout=120)
    out = proc.stdout + proc.stderr
    got = dir_results(tmp_path)
    assert set(got) == ({0, 2} if how == "kill" else {0, 1, 2}), out
    for rank in (0, 2):
        assert f"RESULT {rank} PeerFailureError peer=1 " in got[rank], out
        assert f":: all_reduce #2 on rank {rank}: " in got[rank], out
        assert after(got[rank]) < 15, out  # not at the timeout
        assert re.search(r"rank 1 (failed|disconnected|\(pid \d+\) is gone)", got[rank]), out
    if how == "abort":
        assert "RESULT 1 CommunicatorClosedError" in got[1], out


@pytest.mark.parametrize("launcher", ["gpuring", MPIEXEC])
def test_a_control_plane_timeout_fails_the_late_rank_too(launcher, tmp_path):
    """Rank 1 calls a new signature only after the others timed out agreeing on it. They
    raise CollectiveTimeoutError; rank 1 must not complete the exchange they left (and then
    wait out its own timeout in a collective nobody runs): it raises at once, saying that a
    peer timed out."""
    proc = launch(launcher, 3, [WORKER, "agree_timeout", str(tmp_path)],
                  env={"GPURING_TIMEOUT": "2"}, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    got = dir_results(tmp_path)
    assert set(got) == {0, 1, 2}, out
    # the control plane (the launcher's, or MPI's) knows who did not take part, and the
    # errors name it
    for rank in (0, 2):  # its own timeout, or the other's if that one said so first
        assert f"RESULT {rank} CollectiveTimeoutError peer=1 " in got[rank], out
        assert f":: all_reduce #2 on rank {rank}: control-plane exchange " in got[rank] or (
            f":: all_reduce #2 on rank {rank}: rank {2 - rank} timed out waiting for rank 1: "
            in got[rank]), out
        assert "rank 1 did not take part" in got[rank], out
    assert "RESULT 1 CollectiveTimeoutError " in got[1], out
    assert re.search(r"all_reduce #2 on rank 1: rank [02] timed out waiting for rank 1: "
                     r"all_reduce #2: ",
                     got[1]), out
    assert after(got[1]) < 1.5, out  # told, not timed out itself (the timeout is 2 s)


@pytest.mark.parametrize("launcher", ["gpuring", MPIEXEC])
def test_a_rank_missing_from_the_first_call_is_named(launcher, tmp_path):
    """Rank 2 enters its first all_reduce only once the others timed out waiting for it
    there (in the control plane's exchange that sets the call up: under mpiexec, MPI's).
    They raise CollectiveTimeoutError naming the collective and rank 2 (`.peer` too), alike
    under both launchers; rank 2 raises at once, told."""
    proc = launch(launcher, 3, [WORKER, "first_call_stall", str(tmp_path)],
                  env={"GPURING_TIMEOUT": "3"}, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    got = dir_results(tmp_path)
    assert set(got) == {0, 1, 2}, out
    for rank in (0, 1):  # its own timeout, or the other's where that one said so first
        assert re.search(rf"RESULT {rank} (CollectiveTimeoutError|PeerFailureError) peer=2 ",
                         got[rank]), out
        assert f":: all_reduce #1 on rank {rank}: " in got[rank], out
        assert re.search(r"control-plane exchange #\d+ timed out after 3.0 s on rank ",
                         got[rank]), out  # (#1 and those setting the call up: any of them)
        assert "rank 2 did not take part" in got[rank], out
    assert re.search(r"RESULT 2 (CollectiveTimeoutError|PeerFailureError) ", got[2]), out
    assert after(got[2]) < 2.5, out  # told, not timed out itself (the timeout is 3 s)


def test_a_lost_launcher_fails_the_exchanges(tmp_path):
    """`gpuring run` is SIGKILLed while ranks 0 and 2 wait in a control-plane exchange; rank 1
    starts one only once they raised. All three raise PeerFailureError saying the launcher's
    connection is gone (not a timeout, not an OSError). The ranks outlive the launcher (their
    own sessions): the test ends them if they do not end by themselves."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "gpuring", "run", "-n", "3", "--", sys.executable, WORKER,
         "launcher_lost", str(tmp_path)], env=dict(os.environ, GPURING_TIMEOUT="20"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        def wait_for(*names: str) -> None:
            deadline = time.monotonic() + 60
            while not all((tmp_path / f"{n}.txt").exists() for n in names):
                assert launcher.poll() is None, "the launcher ended early"
                assert time.monotonic() < deadline, f"no {names} after 60 s"
                time.sleep(0.02)

        wait_for("pid-0", "pid-1", "pid-2", "entering-0", "entering-2")
        pids = [int((tmp_path / f"pid-{r}.txt").read_text().split()[0]) for r in range(3)]
        job = (tmp_path / "pid-0.txt").read_text().split()[1]
        launcher.kill()
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 60
        while len(dir_results(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        (tmp_path / "launcher-killed.txt").write_text("")  # rank 1 starts its exchange now
        while len(dir_results(tmp_path)) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        got = dir_results(tmp_path)
        assert set(got) == {0, 1, 2}, got
        for rank, line in got.items():
            assert f"RESULT {rank} PeerFailureError " in line, got
            assert "the launcher's control connection" in line, got
            assert after(line) < 10, got  # not at the timeout
        for pid in pids:  # they end by themselves
            deadline = time.monotonic() + 30
            while _running(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _running(pid), f"rank process {pid} outlived its work"
        assert glob.glob(f"/dev/shm/gpuring-{job}-*") == []
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in pids:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("nonblocking", ["0", "1"])
def test_the_root_cause_wins_over_the_aborts_it_caused(nonblocking, tmp_path):
    """channels=2, rank 1 late: on the others, stream 1 times out waiting for it and aborts
    the device, which fails stream 0 (held until then). The error raised, by the call or (a
    device that does not block) by synchronize(), is the timeout naming rank 1, not the abort
    and not an internal exception."""
    proc = launch("gpuring", 3, [WORKER, "channels", str(tmp_path)],
                  env={"GPURING_TIMEOUT": "2", "GPURING_TEST_NONBLOCKING": nonblocking},
                  timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    got = dir_results(tmp_path)
    assert set(got) == {0, 1, 2}, out
    # its own streams' timeout, or the other's, if that one timed out first and said so
    said = ("synchronize #2 on rank {}: collectives up to all_reduce #2 did not complete"
            if nonblocking == "1" else "all_reduce #2 timed out after 2.0 s on rank {}")
    call = "synchronize" if nonblocking == "1" else "all_reduce"
    for rank in (0, 2):
        assert f"RESULT {rank} CollectiveTimeoutError peer=1 " in got[rank], out
        assert f":: {said.format(rank)}" in got[rank] or (
            f":: {call} #2 on rank {rank}: rank {2 - rank} timed out waiting for rank 1: "
            in got[rank]), out
    assert "RESULT 1 CollectiveTimeoutError peer=1 " in got[1], out  # told by the others


@pytest.mark.mpi
def test_mpi_transport_a_late_rank_times_out_every_rank(tmp_path):
    """GPURING_TRANSPORT=mpi: rank 1 enters an all_reduce only after the others timed out in
    it. Every rank raises CollectiveTimeoutError naming the call; nothing hangs."""
    proc = launch("mpiexec", 3, [WORKER, "mpi_sleep", str(tmp_path)],
                  env={"GPURING_TRANSPORT": "mpi", "GPURING_TIMEOUT": "2"}, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    got = dir_results(tmp_path)
    assert set(got) == {0, 1, 2}, out
    for rank, line in got.items():  # its own timeout, or a rank's that timed out first
        assert f"RESULT {rank} CollectiveTimeoutError " in line, out
        assert f":: all_reduce #2 on rank {rank}: " in line, out
        assert "MPI all_reduce timed out" in line, out


@pytest.mark.mpi
def test_mpi_transport_a_dead_peer_times_out_the_others(tmp_path):
    """GPURING_TRANSPORT=mpi, rank 1 SIGKILLed mid all_reduce, its death hidden from hydra
    (which would end the job at once, as test_sigkill_under_mpiexec_ends_the_job shows): the
    MPI path has no status board and MPI does not notice, so the survivors' waits end at the
    timeout, with CollectiveTimeoutError, not a hang."""
    proc = mpiexec_lazy(3, [WORKER, "mpi_kill", str(tmp_path)], tmp_path,
                        env={"GPURING_TRANSPORT": "mpi", "GPURING_TIMEOUT": "3"})
    out = proc.stdout + proc.stderr
    got = dir_results(tmp_path)
    assert set(got) == {0, 2}, out
    for rank, line in got.items():  # its own timeout, or the other's, told
        assert f"RESULT {rank} CollectiveTimeoutError " in line, out
        assert re.search(rf":: all_reduce #\d+ on rank {rank}: ", line), out
        assert "MPI all_reduce timed out" in line, out
