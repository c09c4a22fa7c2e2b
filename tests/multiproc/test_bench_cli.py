"""`gpuring bench --ranks 2` end to end: it launches its ranks, checks, and writes JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ..conftest import mpiexec
from .named import Group, params

#: each test launches ranks for several seconds
pytestmark = pytest.mark.slow

ENV_DROP = ("GPURING_STORE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK")


def bench(args: list[str], tmp_path, **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_DROP}
    env.update(GPURING_TIMEOUT="60", **extra)
    return subprocess.run([sys.executable, "-m", "gpuring", "bench", *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


def test_two_ranks_small_sizes(tmp_path):
    proc = bench(["all_reduce", "--ranks", "2", "-b", "8", "-e", "64K", "-n", "3", "-w", "1",
                  "--device", "cpu", "--peers", "mpi", "--json", "r.json", "--csv", "r.csv"],
                 tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "out-of-place" in out and "# Wrong elements    : 0 OK" in out
    assert "mpi: skipped (run under mpiexec to compare with MPI)" in out
    assert not any(line.startswith("[0]") for line in out.splitlines())  # no launcher prefix
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["settings"]["ranks"] == 2 and doc["wrong_total"] == 0
    sizes = sorted({r["size"] for r in doc["results"]})
    assert sizes == [8 << i for i in range(14)]
    assert all(len(r["rank_us"]) == 2 for r in doc["results"])
    assert doc["floor"] and doc["memory_bandwidth"]["GBps_per_rank"] > 0
    # both ranks share the host memory: the floor moves both ranks' bytes through it
    (host,) = doc["memory_bandwidth"]["memories"]
    assert host["memory"] == "host memory" and host["ranks"] == [0, 1] and host["GBps"] > 0
    for f in doc["floor"]:
        assert (f["memory"], f["ranks_sharing"]) == ("host memory", 2)
        assert f["memory_bytes"] == 2 * f["traffic_bytes"]  # every rank must move as much
        assert f["floor_us"] == pytest.approx(f["memory_bytes"] / f["memory_GBps"] / 1e3)
        assert f["traffic_bytes"] == 2 * f["size"]  # all_reduce: input read, output written
        assert f["plan_bytes"] > f["traffic_bytes"]
    assert "host memory shared by 2 ranks (0, 1)" in out
    assert (tmp_path / "r.csv").read_text().count("\n") == 1 + 2 * 14


#: nccl-tests' definitions (its src/*.cu and doc/PERFORMANCE.md): busbw / algbw, and the
#: elements per rank its `count` column shows, for n ranks and `elements` in the size column
NCCL_TESTS = {
    "all_reduce": (lambda n: 2 * (n - 1) / n, lambda elements, n: elements),
    "reduce_scatter": (lambda n: (n - 1) / n, lambda elements, n: elements // n),
    "all_gather": (lambda n: (n - 1) / n, lambda elements, n: elements // n),
    "broadcast": (lambda n: 1.0, lambda elements, n: elements),
    "reduce": (lambda n: 1.0, lambda elements, n: elements),
}


@pytest.mark.parametrize("collective", list(NCCL_TESTS))
def test_the_table_means_what_nccl_tests_columns_mean(collective, tmp_path):
    """A fixed run's table, read as nccl-tests' is: size the total bytes, count the elements
    per rank nccl-tests prints, algbw = size / time, busbw = algbw x its factor, both
    placements, the root given; every printed number agrees with the formulas and the
    JSON."""
    n = 3
    proc = bench([collective, "--ranks", str(n), "-b", "1K", "-e", "96K", "-f", "4", "-n", "2",
                  "-w", "0", "-d", "int32", "-r", "1", "--device", "cpu", "--json", "r.json"],
                 tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    factor, count_of = NCCL_TESTS[collective]
    table = proc.stdout.split("# Wrong elements")[0]  # the rows above nccl-tests' footer
    rows = [line.split() for line in table.splitlines()
            if line.strip() and not line.startswith("#")]
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [int(r[0]) for r in rows] == doc["settings"]["sizes"]
    assert len(rows) == 4 and rows[0][0] == str(1020 if collective in (
        "reduce_scatter", "all_gather") else 1024)  # whole blocks of n ranks
    for row in rows:
        size, count, dtype, redop, root = int(row[0]), int(row[1]), row[2], row[3], int(row[4])
        assert dtype == "int32" and count == count_of(size // 4, n)
        assert root == (1 if collective in ("broadcast", "reduce") else -1)
        assert redop == ("sum" if collective in ("all_reduce", "reduce_scatter", "reduce")
                         else "none")
        for place, cells in (("out-of-place", row[5:9]), ("in-place", row[9:13])):
            time_us, algbw, busbw, wrong = float(cells[0]), float(cells[1]), float(cells[2]), \
                cells[3]
            assert wrong == "0"
            assert algbw == pytest.approx(size / time_us / 1e3, abs=0.006, rel=0.01)
            assert busbw == pytest.approx(algbw * factor(n), abs=0.011, rel=0.01)
            (mine,) = [r for r in doc["results"] if r["size"] == size
                       and r["placement"] == place]
            assert f"{mine['time_us']:.2f}" == cells[0] and mine["count"] == count
            assert mine["busbw_GBps"] == pytest.approx(
                size / mine["time_us"] / 1e3 * factor(n))


@pytest.mark.parametrize("kind", ["sendrecv", "pingpong"])
def test_messages_as_nccl_tests_and_osu_measure_them(kind, tmp_path):
    """sendrecv (every rank to the next, from the previous) on 3 ranks and a ping-pong
    (rank 0 to rank 1 and back, time per message): one placement, busbw = algbw = size /
    time, every result checked, the schedule says messages; a wrong result fails the run."""
    proc = bench([kind, "--ranks", "3", "-b", "8", "-e", "1M", "-f", "32", "-n", "3",
                  "-w", "1", "-d", "int64", "--device", "cpu", "--json", "r.json"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["wrong_total"] == 0 and doc["settings"]["sizes"] == [8, 256, 8192, 262144]
    for r in doc["results"]:
        assert r["placement"] == "out-of-place" and r["count"] == r["size"] // 8
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"])
        assert r["algbw_GBps"] == pytest.approx(r["size"] / r["time_us"] / 1e3)
        assert r["schedule"] == "messages" and r["wrong"] == 0
    assert "# Wrong elements    : 0 OK" in proc.stdout
    wrong = bench([kind, "--ranks", "2", "-b", "1K", "-e", "1K", "-n", "1", "-w", "0",
                   "--device", "cpu"], tmp_path, GPURING_BENCH_CORRUPT="1")
    assert wrong.returncode == 1 and "FAILED" in wrong.stdout, wrong.stdout[-2000:]


def test_a_wrong_result_fails_the_run(tmp_path):
    proc = bench(["broadcast", "--ranks", "2", "-b", "1K", "-e", "2K", "-n", "1", "-w", "0",
                  "--device", "cpu"], tmp_path, GPURING_BENCH_CORRUPT="1")
    assert proc.returncode == 1, f"status {proc.returncode}: {proc.stdout[-2000:]}{proc.stderr}"
    assert "# Wrong elements    : 4 FAILED" in proc.stdout  # 2 sizes x 2 placements


def test_an_unwritable_output_stops_the_launch_before_any_rank_starts(tmp_path):
    proc = bench(["all_reduce", "--ranks", "2", "-b", "8", "-e", "64", "--device", "cpu",
                  "--json", "absent/r.json"], tmp_path)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr.startswith("gpuring bench: --json absent/r.json: no directory")
    assert proc.stdout == ""


def test_every_rank_stops_when_rank_zero_cannot_write(tmp_path):
    """Under `gpuring run` each rank checks after the rendezvous and they agree: every rank
    exits with status 2 before measuring, none is left waiting in a collective."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_DROP}
    env.update(GPURING_TIMEOUT="60")
    proc = subprocess.run([sys.executable, "-m", "gpuring", "run", "-n", "2", "--",
                           sys.executable, "-m", "gpuring", "bench", "-b", "8", "-e", "64",
                           "--device", "cpu", "--json", "absent/r.json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "[0] gpuring bench: --json absent/r.json: no directory" in proc.stderr
    assert "[1] gpuring bench: stopped before measuring" in proc.stderr
    assert "out-of-place" not in output and "Traceback" not in output


@pytest.mark.mpi
def test_under_mpiexec_with_the_mpi_peer(tmp_path):
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec with mpi4py is not available")
    env = {k: v for k, v in os.environ.items() if k not in ENV_DROP}
    proc = subprocess.run([exe, "-n", "2", sys.executable, "-m", "gpuring", "bench",
                           "reduce_scatter", "-b", "64", "-e", "4K", "-n", "2", "-w", "1",
                           "--device", "cpu", "--peers", "mpi"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mpi: measured" in proc.stdout
    assert proc.stdout.count(" mpi  out-of-place") == 7


@pytest.mark.mpi
@pytest.mark.parametrize("kind", ["pingpong", "sendrecv"])
def test_messages_under_mpiexec_beside_mpi(kind, tmp_path):
    exe = mpiexec()
    if exe is None:
        pytest.skip("mpiexec with mpi4py is not available")
    env = {k: v for k, v in os.environ.items() if k not in ENV_DROP}
    proc = subprocess.run([exe, "-n", "2", sys.executable, "-m", "gpuring", "bench", kind,
                           "-b", "8", "-e", "4K", "-f", "8", "-n", "20", "-w", "2",
                           "--device", "cpu", "--peers", "mpi", "--json", "r.json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "mpi: measured" in proc.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    systems = {(r["system"], r["size"]) for r in doc["results"] if r["wrong"] == 0}
    assert systems == {(s, size) for s in ("gpuring", "mpi") for size in (8, 64, 512, 4096)}


def _tune(home: Path) -> None:
    """`gpuring tune --ranks 2` into home/t.json; its exit status and output beside it."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_DROP}
    proc = subprocess.run(
        [sys.executable, "-m", "gpuring", "tune", "--ranks", "2", "--device", "cpu",
         "-b", "4K", "-e", "4M", "-f", "32", "-n", "2", "--repeats", "1",
         "--collectives", "all_reduce,reduce_scatter", "-o", "t.json"],
        cwd=home, env=dict(env, GPURING_TIMEOUT="60"), capture_output=True, text=True,
        timeout=300)
    (home / "tune.json").write_text(json.dumps(
        {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}))


@pytest.fixture
def tuned(named_launches) -> Path:  # type: ignore[no-untyped-def]
    """The directory of one `gpuring tune` run for the session (its table: t.json)."""
    return named_launches.once("gpuring-tune", _tune)


def test_tune_writes_a_table(tuned):
    """`gpuring tune --ranks 2` measures every candidate (each checked), writes a table that
    loads, with every measurement and the machine, prints it."""
    from gpuring._tuning import load

    proc = json.loads((tuned / "tune.json").read_text())
    assert proc["returncode"] == 0, proc["stdout"][-3000:] + proc["stderr"][-3000:]
    assert "# gpuring tune: 2 ranks, device cpu" in proc["stdout"]
    table = load(tuned / "t.json")
    assert table.applies("cpu", 2) and set(table.tables) == {"all_reduce", "reduce_scatter"}
    assert table.tables["all_reduce"][-1].max_bytes is None
    doc = json.loads((tuned / "t.json").read_text())
    assert {r["size"] for r in doc["measured"]} == {4096, 131072, 4194304}
    assert {r["algorithm"] for r in doc["measured"]} == {"ring", "two_shot", "one_shot"}
    assert doc["machine"]["cpus"] and doc["machine"]["versions"]


TUNED = Group(("cases_communicators:tuned",), 2, tag="tuning_table", timeout=300)


@pytest.mark.parametrize(("group", "item"), params(TUNED))
def test_the_collectives_follow_the_tuning_table(group, item, tuned, named_launches):
    """Ranks started with GPURING_TUNING (the table above) take its choices, what a call
    asks for wins, and a rank with another table is a mismatch."""
    assert json.loads((tuned / "tune.json").read_text())["returncode"] == 0, "tune failed"
    named_launches.check(group, item, env=dict(os.environ,
                                               GPURING_TUNING=str(tuned / "t.json")))


def test_without_ranks_or_a_launcher_it_says_it_runs_one_rank(tmp_path):
    done = bench(["barrier", "-n", "1", "-w", "0"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no --ranks and no launcher" in done.stderr and "--ranks N" in done.stderr
    assert "1 ranks under one process" in done.stdout


def test_the_persistent_form_beside_the_plain_calls(tmp_path):
    """-P: gpuring's persistent form is timed, checked and printed as the system 'persist'
    beside the plain calls (and in the JSON)."""
    done = bench(["all_reduce", "--ranks", "2", "-b", "1K", "-e", "4K", "-f", "4", "-n", "5",
                  "-P", "--json", "out.json"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    persist = [line.split() for line in done.stdout.splitlines()
               if " persist " in line and not line.startswith("#")]
    assert {(row[0], row[5]) for row in persist} == {
        (size, placement) for size in ("1024", "4096")
        for placement in ("out-of-place", "in-place")}, done.stdout
    assert "persist 0" in done.stdout  # its wrong elements: checked, none
    results = json.loads((tmp_path / "out.json").read_text())["results"]
    assert {r["system"] for r in results} == {"gpuring", "persist"}


@pytest.mark.parametrize(("dtype", "op"), [("float32", "sum"), ("float16", "sum"),
                                           ("float32", "prod")])
def test_many_in_place_calls_keep_their_values_finite(dtype, op, tmp_path):
    """An in-place all_reduce reduces its own result again at every timed call: 200 sums on
    2 ranks multiply the values by 2^200, far past float32's range (and products square
    them). The timed calls start from values the op keeps, so no rank's reduction
    overflows (a RuntimeWarning, made an error here, would end that rank), and the checked
    calls, run apart on the real inputs, are right."""
    proc = bench(["all_reduce", "--ranks", "2", "-b", "64", "-e", "4K", "-f", "8", "-n", "200",
                  "-w", "2", "-d", dtype, "-o", op, "--device", "cpu"],
                 tmp_path, PYTHONWARNINGS="error::RuntimeWarning")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "RuntimeWarning" not in output and "overflow" not in output
    assert "# Wrong elements    : 0 OK" in proc.stdout
