"""The GPU device check (bench/device_check.sh) end to end on the CUDA simulator of
tests/cudasim: a dry run with small sizes that checks what the device machine will hand back
(at most 8 files, probe.json with every part, summary.txt printed last, the exit status), not
any number: the simulator's figures are not a GPU's.

What cannot pass on the simulator, and is asserted as such: nvidia-smi is absent (env.txt says
so and the step still passes); NCCL and gloo are skipped by the benchmark (no cupy.cuda.nccl,
no CUDA torch), with their reason in the summary; the probe's MPS part is "unsupported"; the
dead-exporter part runs but marks its answer "unsupported here" (the simulator keeps a dead
process's /dev/shm memory mapped). The GPU tests step runs the smoke all_reduce instead of
pytest tests/gpu, which test_cuda_simulated.py already runs on the simulator.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from ..cudasim import kernels_host_build, shm_names

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "bench" / "device_check.sh"
ROUND_TRIPS = 200
SCALE = 5

#: the dry run: tiny sizes, few iterations, one sweep point, the smoke test
DRY_RUN = {
    "GPURING_CUDASIM_MEMOPS": "1",
    "GPURING_DEVICE_CHECK_MAXBYTES": "64K",
    "GPURING_DEVICE_CHECK_PEER_MAXBYTES": "16K",
    "GPURING_DEVICE_CHECK_TUNE_BYTES": "64K",
    "GPURING_DEVICE_CHECK_TUNE": "2M:2",
    "GPURING_DEVICE_CHECK_BENCH_FLAGS": "-n 2 -w 1 -f 4",
    "GPURING_DEVICE_CHECK_TESTS": "smoke",
    "GPURING_PROBE_ROUND_TRIPS": str(ROUND_TRIPS),
    "GPURING_PROBE_BATCH": "50",
    "GPURING_PROBE_COPY_BYTES": "4M",
    "GPURING_PROBE_IPC_BYTES": "1M",
    "GPURING_PROBE_HOST_ITERS": "200",
    "GPURING_PROBE_RELEASE_S": "2",  # (the simulator never releases one hardware queue)
    # time boxes x SCALE: the simulator on a loaded 2-core machine may be slow; the run's own
    # time is checked against one generous bound instead
    "GPURING_DEVICE_CHECK_TIME_SCALE": str(SCALE),
}


class Run:
    """One finished run of the device check."""

    def __init__(self, done: subprocess.CompletedProcess[str], out: Path, seconds: float):
        self.done, self.out, self.seconds = done, out, seconds
        self.output = done.stdout + done.stderr

    def probe(self) -> dict[str, Any]:
        return json.loads((self.out / "probe.json").read_text())

    def detail(self, name: str) -> str:
        """File `name` of details.tar.gz."""
        with tarfile.open(self.out / "details.tar.gz") as tar:
            member = tar.extractfile(f"./{name}")
            assert member is not None, name
            return member.read().decode()

    def steps(self) -> dict[str, dict[str, str]]:
        lines = self.detail("steps.tsv").splitlines()
        header = lines[0].split("\t")
        rows = [dict(zip(header, line.split("\t"), strict=True)) for line in lines[1:]]
        return {row["step"]: row for row in rows}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _group_alive(pgid: int) -> bool:
    """Any live process in process group `pgid` (a probe part and its peer)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def _remove_leaked_memory(probe_json: Path) -> None:
    """The /dev/shm files of the processes the probe killed (a dead exporter, a part stopped
    by the probe): the simulator's sweep removes what dead processes left."""
    shm_names.sweep_dead_allocations()


@pytest.fixture(scope="module")
def check_env(host_build_dir: Path) -> dict[str, str]:
    pytest.importorskip("cuda.bindings.nvrtc", reason=kernels_host_build.NVRTC_MISSING)
    try:
        env = kernels_host_build.simulator_env(host_build_dir,
                                               PYTHON=sys.executable, **DRY_RUN)
    except kernels_host_build.Unavailable as exc:
        pytest.skip(str(exc))
    env.pop("GPURING_CUDASIM_JITTER", None)
    return env


def _run(env: dict[str, str], out: Path) -> Run:
    start = time.monotonic()
    done = subprocess.run(["bash", str(CHECK), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    seconds = time.monotonic() - start
    _remove_leaked_memory(out / "probe.json")
    return Run(done, out, seconds)


@pytest.mark.slow
def test_the_dry_run(check_env: dict[str, str], tmp_path: Path) -> None:
    """One dry run, every check of what it hands back. One test, not one per check: the dry
    run takes minutes, and pytest-xdist would make a module fixture once per worker (and again
    whenever a worker's queue runs dry)."""
    out = tmp_path / "device-check"
    out.mkdir()
    run = _run(check_env, out)
    _passes_within_a_bound(run)
    _leaves_at_most_8_files(run)
    _probe_json_has_every_part(run)
    _summary_is_printed_last(run)


def _passes_within_a_bound(dry_run: Run) -> None:
    assert dry_run.done.returncode == 0, dry_run.output[-6000:]
    assert dry_run.seconds < 420, dry_run.seconds  # generous: about a minute unloaded
    steps = dry_run.steps()
    assert list(steps) == ["env", "kernels", "probe", "gpu-smoke", "allreduce-2ranks",
                           "allreduce-4ranks", "allreduce-2ranks-large", "allreduce-4ranks-large",
                           "small-2ranks-kernel", "small-2ranks-rounds", "small-2ranks-graph",
                           "graph-2ranks-pieces", "tune-chunk2M-ch2"]
    assert {row["status"] for row in steps.values()} == {"ok"}, steps


def _leaves_at_most_8_files(dry_run: Run) -> None:
    files = sorted(p.name for p in dry_run.out.iterdir())
    assert files == ["details.tar.gz", "probe.json", "summary.txt"]
    with tarfile.open(dry_run.out / "details.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    kernels_log = dry_run.detail("kernels.log")  # the CUBIN was built before the probe
    assert "GPU 0: all " in kernels_log and " kernels loaded" in kernels_log, kernels_log
    for name in ("steps.tsv", "env.txt", "probe.log", "gpu-tests.log", "allreduce-2ranks.txt",
                 "allreduce-2ranks.json", "allreduce-4ranks-large.json",
                 "tune-chunk2M-ch2.json"):
        assert name in names, sorted(names)


def _probe_json_has_every_part(dry_run: Run) -> None:
    probe = dry_run.probe()
    assert probe["schema"] == "gpuring.probe/1" and probe["complete"] is True
    assert probe["settings"]["round_trips"] == ROUND_TRIPS
    assert probe["host"]["nvidia_smi"] == "not on PATH"
    versions = probe["versions"]
    assert versions["status"] == "ok" and versions["simulated"] is True
    assert probe["ipc"]["status"] == "ok" and probe["ipc"]["ok"] is True
    assert probe["memops"]["status"] == "ok" and probe["memops"]["works"] is True
    assert probe["kernels"]["status"] == "ok"
    assert probe["copy_bandwidth"]["memcpy_GBps"] > 0
    assert probe["copy_bandwidth"]["kernel_GBps"] > 0
    host = probe["host_cost"]
    assert host["status"] == "ok" and host["iters"] == 200
    for key in ("kernel_launch_us", "write_value_built_us", "write_value_prebuilt_us",
                "wait_value_prebuilt_us", "gpuring_reduce_us", "gpuring_write_flag_us"):
        assert host[key] > 0, (key, host)
    for mode in ("memops", "kernel", "gpuring"):
        pp = probe[f"pingpong_{mode}"]
        assert pp["status"] == "ok", pp
        assert pp["samples"] == ROUND_TRIPS and pp["values_ok"] is True, pp
        assert 0 < pp["median_us"] <= pp["p99_us"] <= pp["max_us"], pp
    release = probe["abort_release"]
    assert release["status"] == "ok" and release["released"] is True, release
    assert release["blocked_before_abort"] == 12, release
    # one hardware queue for every stream: the simulator runs it in queue order, so the side
    # stream's release waits behind the blocked streams (what a GPU does there is the
    # question this part asks of it)
    one = probe["abort_release_1conn"]
    assert one["max_connections"] == "1" and one["blocked_before_abort"] == 12, one
    assert one.get("released") is not True, one
    dead = probe["dead_exporter"]
    assert dead["status"] == "ok" and dead["exporter_exit"] == -9, dead
    assert not _alive(dead["peer_pid"])
    # the simulator's answer, and its mark that it says nothing of a GPU
    assert (dead["queued_read"], dead["later_read"]) == ("done", "done"), dead
    assert dead["queued_data"] == dead["later_data"] == ["intact", "intact"], dead
    assert dead["context_after"] == "works" and dead["answer"].startswith("unsupported here")
    assert probe["mps"]["status"] == "unsupported"


def _summary_is_printed_last(dry_run: Run) -> None:
    summary = (dry_run.out / "summary.txt").read_text()
    assert dry_run.done.stdout.rstrip().endswith(summary.rstrip())
    assert summary.startswith("gpuring device check: summary")
    assert "CUDA SIMULATOR" in summary and "result: PASS" in summary
    assert "nccl: skipped" in summary and "gloo: skipped" in summary
    for heading in ("== steps ==", "== probe (probe.json) ==", "== benchmarks ==",
                    "== what to look at ==", "== more notes (device_check_notes.txt"):
        assert heading in summary, heading
    assert f"({ROUND_TRIPS} of {ROUND_TRIPS} round trips, values right)" in summary


@pytest.mark.slow
def test_a_failed_step_fails_the_check(check_env: dict[str, str], tmp_path: Path) -> None:
    """Benches that refuse their flags: the check still leaves its three files, names the
    failed steps and their logs' last lines in the summary, and exits 1."""
    env = dict(check_env, GPURING_DEVICE_CHECK_BENCH_FLAGS="-n 0", GPURING_PROBE_PARTS="versions",
               GPURING_DEVICE_CHECK_TUNE="8M:1")
    run = _run(env, tmp_path / "out")
    assert run.done.returncode == 1, run.output[-4000:]
    assert sorted(p.name for p in run.out.iterdir()) == [
        "details.tar.gz", "probe.json", "summary.txt"]
    steps = run.steps()
    assert steps["allreduce-2ranks"]["status"] == "failed"
    assert steps["probe"]["status"] == steps["gpu-smoke"]["status"] == "ok"
    summary = (run.out / "summary.txt").read_text()
    assert "result: FAIL (exit status 1)" in summary
    assert "-n must be at least 1" in summary  # the failed bench's log, quoted
    assert run.done.stdout.rstrip().endswith(summary.rstrip())


def _probe_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@pytest.mark.slow
def test_sigterm_keeps_the_probes_record(check_env: dict[str, str], tmp_path: Path) -> None:
    """`timeout` stops the probe with SIGTERM: the running part and its peer are killed, and
    probe.json keeps every part so far, the interrupted one included."""
    env = dict(check_env, GPURING_PROBE_PARTS="versions,pingpong_memops",
               GPURING_PROBE_ROUND_TRIPS="100000", GPURING_PROBE_BATCH="20")
    out = tmp_path / "probe.json"
    proc = subprocess.Popen([sys.executable, "-m", "tools.device_check.probe", str(out)],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + 120
        while "versions" not in _probe_json(out):  # the ping-pong starts next
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.2)
        time.sleep(1)  # the ping-pong (100,000 round trips) runs for many seconds
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
        _remove_leaked_memory(out)
    assert proc.returncode == 1, stdout + stderr[-3000:]
    probe = _probe_json(out)
    assert probe["interrupted"] == f"signal {int(signal.SIGTERM)}" and not probe["complete"]
    assert probe["versions"]["status"] == "ok"
    part = probe["pingpong_memops"]
    assert part["status"] == "interrupted", part  # with what it recorded, if anything yet
    assert not _group_alive(part["pid"])


FAKE_MPS = """#!/bin/sh
# a stand-in for nvidia-cuda-mps-control: logs how it was called
if [ "$1" = "-d" ]; then what=start; else what="$(cat)"; fi
echo "$what pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> "$FAKE_MPS_CALLS"
echo "fake control log" > "$CUDA_MPS_LOG_DIRECTORY/control.log"
"""


@pytest.mark.slow
def test_mps_is_started_for_the_ping_pongs_and_stopped(check_env: dict[str, str],
                                                       tmp_path: Path) -> None:
    """The MPS part's orchestration, with a fake nvidia-cuda-mps-control (the simulator has
    no MPS): the daemon starts with private pipe and log directories, both ping-pongs run as
    its clients, and it is told to quit."""
    fake = tmp_path / "bin" / "nvidia-cuda-mps-control"
    fake.parent.mkdir()
    fake.write_text(FAKE_MPS)
    fake.chmod(0o755)
    calls = tmp_path / "calls"
    env = dict(check_env, PATH=f"{fake.parent}{os.pathsep}{os.environ['PATH']}",
               FAKE_MPS_CALLS=str(calls), GPURING_PROBE_MPS_DIR=str(tmp_path / "mps"),
               GPURING_PROBE_ROUND_TRIPS="20", GPURING_PROBE_BATCH="10")  # (not measured)
    code = ("import json, sys, time; from tools.device_check.probe import run_mps; "
            f"json.dump(run_mps(time.monotonic() + 400, {SCALE}, {{}}), sys.stdout)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stderr[-4000:]
    record = json.loads(done.stdout)
    pipe, logs = tmp_path / "mps" / "pipe", tmp_path / "mps" / "log"
    assert calls.read_text().splitlines() == [f"start pipe={pipe} log={logs}",
                                              f"quit pipe={pipe} log={logs}"]
    assert record["status"] == "ok" and record["start"]["rc"] == record["stop"]["rc"] == 0
    assert record["control.log"].strip() == "fake control log"
    for name in ("pingpong_memops", "pingpong_kernel", "pingpong_gpuring"):
        assert record[name]["status"] == "ok" and record[name]["mps"] is True, record[name]


#: stand-ins for CuPy where there is no GPU: not installed, or installed and finding none
NO_GPU = {
    "no CuPy": 'raise ImportError("No module named cupy (a stand-in)")\n',
    "no GPU": ("class _Runtime:\n"
               "    @staticmethod\n"
               "    def getDeviceCount():\n"
               "        raise RuntimeError('cudaErrorNoDevice: no CUDA-capable device')\n"
               "class cuda:\n"
               "    runtime = _Runtime\n"),
}


@pytest.mark.parametrize("lacks", sorted(NO_GPU))
def test_without_a_gpu_it_stops_at_once_with_one_line(tmp_path: Path, lacks: str) -> None:
    """Where CuPy does not import, or sees no GPU, every step would fail for that one reason:
    the check says it in one line, writes nothing and exits 2, before its first step."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "cupy.py").write_text(NO_GPU[lacks])
    env = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(fake))
    out = tmp_path / "out"
    done = subprocess.run(["bash", str(CHECK), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    want = "needs CuPy" if lacks == "no CuPy" else "needs a CUDA GPU"
    assert lines[0].startswith("gpuring device check: stopped before the first step: " + want)
    assert not out.exists()  # nothing written, not even the output folder
