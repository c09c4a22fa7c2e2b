"""`gpuring bench` pieces on the CPU: sizes, factors, traffic, checking, layout, files, peers."""

from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np
import pytest

from gpuring._cli import build_parser
from gpuring.bench import data, files, metrics, preflight, report
from gpuring.bench.cli import settings_from_args, to_argv
from gpuring.bench.machine import cpu_model
from gpuring.bench.peers import parse_peers, select_peers
from gpuring.bench.progress import Follower, Output, ProgressView


def parse(*argv: str):
    return build_parser().parse_args(["bench", *argv])


def test_sizes_from_flags():
    s = settings_from_args(parse("-b", "4K", "-e", "64M", "-f", "4", "-n", "3", "-o", "all"))
    assert (s.min_bytes, s.max_bytes, s.factor, s.iters) == (4096, 64 << 20, 4, 3)
    assert s.ops == ["sum", "prod", "min", "max", "avg"]
    assert settings_from_args(parse("-e", "1G")).max_bytes == 1 << 30
    with pytest.raises(ValueError):
        settings_from_args(parse("-b", "lots"))
    with pytest.raises(TypeError):  # min is not defined for complex numbers
        settings_from_args(parse("-d", "complex64", "-o", "min"))


def test_cuda_graph_mode_flags():
    """-G N: launches of a graph of -n calls; on the GPU only, and not with the modes that
    time calls one by one or wait after each."""
    s = settings_from_args(parse("-G", "5", "--device", "cuda", "-n", "7"))
    assert (s.graph_launches, s.iters) == (5, 7)
    args = parse("-G", "5", "--device", "cuda")
    again = build_parser().parse_args(["bench", *to_argv(args)])
    assert settings_from_args(again) == dataclasses.replace(s, iters=20)
    for bad in (("-G", "-1"), ("-G", "2", "--device", "cpu"), ("-G", "2", "-I"),
                ("-G", "2", "-z", "1")):
        with pytest.raises(ValueError):
            settings_from_args(parse(*bad))


def test_size_series_rounds_to_blocks_without_repeats():
    assert metrics.size_series(8, 64, 2, 4) == [8, 16, 32, 64]
    assert metrics.size_series(8, 100, 2, 12) == [12, 24, 60]
    assert metrics.size_series(1, 8, 2, 8) == [8]
    with pytest.raises(ValueError):
        metrics.size_series(64, 8, 2, 4)


def test_argv_for_the_ranks_round_trips():
    args = parse("reduce", "-b", "1K", "-e", "2M", "-o", "max", "-r", "1", "--peers", "mpi",
                 "--json", "x.json", "--chunk-bytes", "64K", "--channels", "2", "--ranks", "3")
    again = build_parser().parse_args(["bench", *to_argv(args)])
    assert again.ranks is None
    assert settings_from_args(again) == settings_from_args(args)


@pytest.mark.parametrize("kind,factor", [("all_reduce", 1.5), ("reduce_scatter", 0.75),
                                         ("all_gather", 0.75), ("broadcast", 1.0),
                                         ("reduce", 1.0)])
def test_bus_factors_for_four_ranks(kind, factor):
    assert metrics.bus_factor(kind, 4) == factor


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("kind", metrics.COLLECTIVES)
def test_traffic_counted_from_the_plan_matches_the_documented_formula(kind, n):
    size = 4 * n * 3000  # float32, beyond the one-shot limit, several rounds
    counted = metrics.memory_traffic(kind, n, size, 4, buffer_bytes=16384)
    assert counted == pytest.approx(metrics.closed_form_traffic(kind, n, size), rel=1e-2)
    small = metrics.memory_traffic("all_reduce", n, 4 * n, 4)
    assert small == metrics.closed_form_traffic("all_reduce", n, 4 * n, one_shot=True)


def test_ring_all_reduce_traffic_is_five_n_minus_one_over_n_plus_two():
    for n in (2, 3, 8):
        assert metrics.closed_form_traffic("all_reduce", n, 1000) == pytest.approx(
            (5 * (n - 1) / n + 2) * 1000)


@pytest.mark.parametrize("dtype", ["int8", "uint16", "float16", "float32", "float64",
                                   "complex64"])
def test_inputs_are_random_nonzero_and_reproducible(dtype):
    a = data.make_input(1, 1000, dtype, salt=7)
    assert a.dtype == np.dtype(dtype)
    assert np.all(a != 0)
    assert len(np.unique(a)) > 5
    np.testing.assert_array_equal(a, data.make_input(1, 1000, dtype, salt=7))
    assert not np.array_equal(a, data.make_input(2, 1000, dtype, salt=7))


def test_reference_matches_numpy_and_avg_of_integers_truncates():
    xs = [np.array([3, -7, 5], np.int32), np.array([2, 2, -8], np.int32)]
    np.testing.assert_array_equal(data.reference("sum", iter(xs)), [5, -5, -3])
    np.testing.assert_array_equal(data.reference("avg", xs), [2, -2, -1])
    np.testing.assert_array_equal(data.reference("min", xs), [2, -7, -8])
    wrap = [np.array([100], np.int8), np.array([100], np.int8)]
    assert data.reference("sum", wrap)[0] == np.int8(-56)


def test_expected_per_collective():
    def make(r: int) -> np.ndarray:
        return np.arange(6, dtype=np.int64) + 10 * r

    assert list(data.expected_for_rank("reduce_scatter", "sum", make, 3, 1, 0)) == [36, 39]
    assert data.expected_for_rank("all_gather", "none", make, 3, 0, 0).shape == (3, 6)
    assert list(data.expected_for_rank("broadcast", "none", make, 3, 0, 2)) == list(make(2))
    assert data.expected_for_rank("reduce", "sum", make, 3, 1, 0) is None


def test_count_wrong_catches_a_corrupted_result():
    n = 4
    inputs = [data.make_input(r, 10000, "float32") for r in range(n)]
    expected = data.reference("sum", inputs)
    got = inputs[0].copy()
    for x in inputs[1:]:  # another order: differs in the last bits only
        got = got + x
    rtol = data.tolerance("float32", n)
    assert data.count_wrong(got, expected, rtol) == 0
    data.corrupt(got)
    assert data.count_wrong(got, expected, rtol) == 1
    got[5] = np.nan
    assert data.count_wrong(got, expected, rtol) == 2
    ints = np.arange(1, 9, dtype=np.int16)
    spoiled = ints.copy()
    data.corrupt(spoiled)
    assert data.count_wrong(spoiled, ints, 0.0) == 1
    poisoned = np.empty(8, np.uint8)
    data.poison(poisoned)
    assert data.count_wrong(poisoned, ints.astype(np.uint8), 0.0) == 8


def result(placement: str, wrong: int = 0, system: str = "gpuring") -> report.Result:
    return report.Result(system=system, collective="all_reduce", size=1 << 20, count=1 << 18,
                         type="float32", redop="sum", root=-1, placement=placement, ranks=2,
                         time_us=250.0, min_us=240.0, max_us=300.0, algbw_GBps=4.19,
                         busbw_GBps=4.19, wrong=wrong)


def test_table_layout_lines_up():
    head = report.table_header()
    both = report.table_row({"out-of-place": result("out-of-place"),
                             "in-place": result("in-place", wrong=3)})
    one = report.table_row({"out-of-place": result("out-of-place")})
    assert len(head) == 3
    assert len(head[1]) == len(head[2]) == len(both) == len(one)
    assert both.split() == ["1048576", "262144", "float32", "sum", "-1", "250.00", "4.19",
                            "4.19", "0", "250.00", "4.19", "4.19", "3"]
    assert one.split()[-1] == "n/a"
    # the time column ends where its header ends
    assert head[1].index("time") + 4 == both.index("250.00") + 6
    footer = report.footer_lines([result("out-of-place", wrong=1)])
    assert "FAILED" in footer[0] and "Avg bus bandwidth" in footer[1]


def test_json_schema_and_csv(tmp_path):
    rows = [result("out-of-place"), result("out-of-place", system="mpi")]
    rows[1].time_us = 500.0
    floor = report.Floor(size=1 << 20, redop="sum", traffic_bytes=4.5 * (1 << 20),
                         traffic_over_size=4.5, floor_us=200.0, time_us=250.0,
                         efficiency_pct=80.0)
    doc = files.to_json(settings={"collective": "all_reduce"}, machine={"cpu": "x"},
                         bandwidth={"GBps_per_rank": 20.0, "per_rank": [20.0], "method": "m"},
                         peers=["mpi: measured"], results=rows, floors=[floor])
    path = tmp_path / "r.json"
    files.write_json(str(path), doc)
    back = json.loads(path.read_text())
    assert back["schema"] == report.SCHEMA
    assert set(back) >= {"settings", "machine", "memory_bandwidth", "peers", "results",
                         "ratios", "floor", "avg_busbw_GBps", "wrong_total"}
    assert set(back["results"][0]) >= {"system", "size", "count", "type", "redop", "root",
                                       "placement", "time_us", "min_us", "max_us",
                                       "algbw_GBps", "busbw_GBps", "wrong"}
    assert back["ratios"] == [{"peer": "mpi", "size": 1 << 20, "type": "float32",
                               "redop": "sum", "root": -1, "placement": "out-of-place",
                               "gpuring_placement": "out-of-place", "ratio": 2.0,
                               "repeat": 0}]
    csv_path = tmp_path / "r.csv"
    files.write_csv(str(csv_path), rows)
    lines = csv_path.read_text().splitlines()
    assert lines[0].startswith("system,collective,size") and len(lines) == 3


@pytest.mark.slow
@pytest.mark.parametrize("repeats", [1, 3])
def test_plot_draws_a_png(tmp_path, repeats):
    """A real plot, with matplotlib: one sweep (whose bars are empty: the slowest repeat is
    the median, and rounding must not make a bar negative) and several."""
    pytest.importorskip("matplotlib")
    from gpuring.bench.plot import plot
    from gpuring.bench.stats import summarize

    rows = []
    for repeat in range(repeats):
        # (at 256 MiB in 72301.48... us, busbw * t / t rounds above busbw)
        for size, time_us in ((1 << 28, 72301.48511166534), (1 << 20, 250.0 - repeat)):
            for placement in ("out-of-place", "in-place"):
                r = result(placement)
                r.size, r.time_us = size, time_us
                r.algbw_GBps = r.busbw_GBps = size / time_us / 1e3
                r.repeat = repeat
                rows.append(r)
    path = tmp_path / "p.png"
    note = plot(str(path), summarize(rows), [], "t")
    assert note == f"# plot written to {path}"
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch):
    from gpuring.bench.plot import plot
    from gpuring.bench.stats import summarize

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    note = plot(str(tmp_path / "p.png"), summarize([result("out-of-place")]), [], "t")
    assert "matplotlib is not installed" in note
    assert not (tmp_path / "p.png").exists()


class _Comm:
    """Rank 0 of two; `other_ok` is what the other rank reports to the agreement."""

    rank, size = 0, 2

    def __init__(self, other_ok: bool | list[bool] = True):
        self.other_ok = other_ok  # a list: one answer per agreement, in turn

    def all_reduce(self, x, op="sum"):
        assert op == "min"
        ok = self.other_ok.pop(0) if isinstance(self.other_ok, list) else self.other_ok
        return np.minimum(x, 1 if ok else 0)


def test_missing_peers_are_named_and_skipped(monkeypatch):
    for name in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
                 "SLURM_MPI_TYPE", "MV2_COMM_WORLD_SIZE", "I_MPI_HYDRA_TOPOLIB"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(sys.modules, "torch", None)
    peers, notes = select_peers(parse_peers("all"), _Comm(), "cpu")
    assert peers == []
    assert notes == ["mpi: skipped (run under mpiexec to compare with MPI)",
                     "nccl: skipped (NCCL needs --device cuda and GPUs)",
                     "gloo: skipped (torch is not importable)"]
    with pytest.raises(ValueError):
        parse_peers("mpi,carrier-pigeon")


def test_a_peer_runs_only_where_every_rank_started_it(monkeypatch):
    """A peer that started here but not on another rank is closed and skipped here too (its
    calls are collective: running it on some ranks only would hang them)."""
    from gpuring.bench import peers as peers_module

    closed = []

    class Started:
        name = "gloo"

        def __init__(self, comm, device="cpu"):
            pass

        def close(self):
            closed.append(True)

    monkeypatch.setattr(peers_module, "GlooPeer", Started)
    # every rank could try it; it started here, not on the other rank
    found, notes = select_peers(["gloo"], _Comm(other_ok=[True, False]), "cpu")
    assert found == [] and closed == [True]
    assert notes == ["gloo: skipped (it failed to start on another rank)"]
    # another rank cannot even try it: nobody starts it
    found, notes = select_peers(["gloo"], _Comm(other_ok=False), "cpu")
    assert found == [] and closed == [True]
    assert notes == ["gloo: skipped (it cannot run on another rank)"]
    found, notes = select_peers(["gloo"], _Comm(), "cpu")
    assert len(found) == 1 and notes == ["gloo: measured"]


def test_cpu_model_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Example CPU @ 3.0GHz\n")
    assert cpu_model(str(info)) == "Example CPU @ 3.0GHz"
    assert cpu_model(str(tmp_path / "absent"))


def test_the_follower_replays_what_came_before_a_stop_it_sees_at_the_end(tmp_path, capsys):
    """The writer finishes and stops the follower just as the follower reached the end of the
    file: the last lines are still replayed (the follower reads again after seeing the stop)."""
    path = tmp_path / "s.jsonl"
    path.write_text("")
    follower = Follower(str(path), ProgressView(enabled=False))
    out = Output(True, str(path))

    class _StopAtFirstLook:
        def is_set(self) -> bool:
            if out.active and out._file is not None:
                out.line("# Wrong elements    : 1 FAILED")
                out.close()
            return True

    follower.finished = _StopAtFirstLook()  # type: ignore[assignment]
    follower.run()  # (in this thread)
    assert capsys.readouterr().out.splitlines() == ["# Wrong elements    : 1 FAILED"]
    assert follower.saw_failure


def test_stream_output_is_replayed_by_the_follower(tmp_path, capsys):
    path = tmp_path / "s.jsonl"
    path.write_text("")
    follower = Follower(str(path), ProgressView(enabled=False))
    follower.start()
    out = Output(True, str(path))
    out.line("row one")
    out.progress(1, 2, "all_reduce 8B")
    out.line("# Wrong elements    : 1 FAILED")
    out.close()
    follower.stop()
    assert capsys.readouterr().out.splitlines() == ["row one", "# Wrong elements    : 1 FAILED"]
    assert follower.saw_failure
    silent = Output(False, str(tmp_path / "never.jsonl"))
    silent.line("x")
    assert not (tmp_path / "never.jsonl").exists()


def _no_launcher(monkeypatch):
    for name in ("GPURING_STORE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_one_rank_run_in_process_writes_json(tmp_path, monkeypatch, capsys):
    from gpuring._cli import main

    _no_launcher(monkeypatch)
    monkeypatch.setattr("gpuring.bench.runner.Settings.membw_bytes", 1 << 20)
    path = tmp_path / "one.json"
    code = main(["bench", "reduce_scatter", "-b", "8", "-e", "256", "-n", "2", "-w", "0",
                 "-d", "int64", "--device", "cpu", "--json", str(path)])
    assert code == 0
    doc = json.loads(path.read_text())
    assert doc["settings"]["ranks"] == 1 and doc["wrong_total"] == 0
    sizes = [8, 16, 32, 64, 128, 256]
    assert [(r["size"], r["placement"]) for r in doc["results"]] == [
        (size, placement) for size in sizes for placement in ("out-of-place", "in-place")]
    assert "# Wrong elements    : 0 OK" in capsys.readouterr().out


def test_corruption_hook_makes_the_exit_status_nonzero(monkeypatch, capsys):
    from gpuring._cli import main

    _no_launcher(monkeypatch)
    monkeypatch.setattr("gpuring.bench.runner.Settings.membw_bytes", 1 << 20)
    monkeypatch.setenv("GPURING_BENCH_CORRUPT", "1")
    code = main(["bench", "-b", "64", "-e", "128", "-n", "1", "-w", "0", "-c", "2",
                 "--device", "cpu"])
    assert code == 1
    text = capsys.readouterr().out
    assert "# Wrong elements    : 8 FAILED" in text  # 2 sizes x 2 placements x 2 checks


def test_preflight_names_what_the_options_lack(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "cupy", None)
    s = settings_from_args(parse("--device", "cuda", "--plot", str(tmp_path / "p.png"),
                                 "--json", str(tmp_path / "absent" / "r.json"),
                                 "--csv", str(tmp_path)))
    found = preflight.problems(s, writes_files=True)
    assert len(found) == 4, found
    csv, cuda, json_path, plot = sorted(found, key=lambda p: p.split()[0])
    assert cuda.startswith("--device cuda needs CuPy")
    assert csv == f"--csv {tmp_path}: is a directory"
    assert plot.startswith(f"--plot {tmp_path / 'p.png'}: needs matplotlib")
    assert json_path.startswith(f"--json {tmp_path / 'absent' / 'r.json'}: no directory")
    # ranks that write no files check only what they need themselves
    assert preflight.problems(s, writes_files=False) == [cuda]
    same = settings_from_args(parse("--json", "x", "--csv", "./x"))
    assert preflight.problems(same, writes_files=True) == ["--csv ./x: the same file as --json"]


def test_preflight_passes_and_leaves_nothing_behind(tmp_path):
    s = settings_from_args(parse("--json", str(tmp_path / "r.json"), "--csv",
                                 str(tmp_path / "r.csv")))
    assert preflight.problems(s, writes_files=True) == []
    assert list(tmp_path.iterdir()) == []


def test_every_rank_stops_when_any_rank_has_a_problem():
    assert preflight.agree(_Comm(), [])
    assert not preflight.agree(_Comm(), ["--json r.json: no directory"])
    assert not preflight.agree(_Comm(other_ok=False), [])  # the other rank has one


@pytest.mark.parametrize("flag", ["--plot", "--json"])
def test_a_missing_dependency_or_directory_fails_before_measuring(tmp_path, monkeypatch,
                                                                   capsys, flag):
    from gpuring._cli import main

    _no_launcher(monkeypatch)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    target = tmp_path / ("p.png" if flag == "--plot" else "absent/r.json")
    code = main(["bench", "-b", "8", "-e", "16", "-n", "1", "-w", "0", "--device", "cpu",
                 flag, str(target)])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""  # nothing measured: not even the header
    assert err.startswith(f"gpuring bench: {flag} {target}: ")
    assert not target.exists()


def test_files_are_replaced_whole_or_not_at_all(tmp_path):
    """A writer that fails half-way (as a killed run would) leaves the previous file whole."""
    path = tmp_path / "r.json"
    files.write_json(str(path), {"complete": False, "results": [1]})
    with pytest.raises(TypeError):
        files.write_json(str(path), {"complete": True, "results": [1, object()]})
    assert json.loads(path.read_text()) == {"complete": False, "results": [1]}
    csv_path = tmp_path / "r.csv"
    files.write_csv(str(csv_path), [result("in-place")])
    before = csv_path.read_text()
    rows: list = [result("out-of-place"), _Unwritable()]
    with pytest.raises(TypeError):
        files.write_csv(str(csv_path), rows)
    assert csv_path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.csv", "r.json"]


class _Unwritable:
    """Not a Result: asdict() fails on it, after the CSV header and first row are out."""


def _stop_at(monkeypatch, size: int) -> None:
    """Make the run fail when it reaches `size`, as a timeout would end it."""
    from gpuring.bench import runner

    measure = runner.Measurer.measure

    def stopping(self, system, case, *args):
        if case.size >= size:
            raise KeyboardInterrupt("stopped")
        return measure(self, system, case, *args)

    monkeypatch.setattr(runner.Measurer, "measure", stopping)


def test_json_and_csv_hold_every_finished_size_when_a_run_is_stopped(tmp_path, monkeypatch):
    from gpuring._cli import main

    _no_launcher(monkeypatch)
    monkeypatch.setattr("gpuring.bench.runner.Settings.membw_bytes", 1 << 20)
    _stop_at(monkeypatch, 64)
    path, csv_path = tmp_path / "r.json", tmp_path / "r.csv"
    with pytest.raises(KeyboardInterrupt):
        main(["bench", "-b", "8", "-e", "256", "-n", "1", "-w", "0", "--device", "cpu",
              "--json", str(path), "--csv", str(csv_path)])
    doc = json.loads(path.read_text())
    assert doc["complete"] is False
    assert sorted({r["size"] for r in doc["results"]}) == [8, 16, 32]
    assert doc["settings"]["sizes"] == [8, 16, 32, 64, 128, 256]  # what was still to come
    assert csv_path.read_text().count("\n") == 1 + 2 * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.csv", "r.json"]


def test_a_finished_run_marks_its_json_complete(tmp_path, monkeypatch):
    from gpuring._cli import main

    _no_launcher(monkeypatch)
    monkeypatch.setattr("gpuring.bench.runner.Settings.membw_bytes", 1 << 20)
    path = tmp_path / "r.json"
    assert main(["bench", "-b", "8", "-e", "16", "-n", "1", "-w", "0", "--device", "cpu",
                 "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    assert doc["complete"] is True and len(doc["results"]) == 4


def test_the_floor_counts_the_bytes_of_every_rank_that_shares_a_memory():
    """k ranks on one memory move k times the bytes of one through it: the floor is the most
    loaded memory's bytes over its bandwidth, not one rank's bytes over it."""
    four = [100.0] * 4
    gpus = [metrics.Memory("GPU 0", [0, 2], 10.0), metrics.Memory("GPU 1", [1, 3], 10.0)]
    seconds, memory = metrics.shared_floor(four, gpus)
    assert seconds == pytest.approx(200 / 10e9) and memory.name == "GPU 0"
    host = [metrics.Memory("host memory", [0, 1, 2, 3], 10.0)]
    assert metrics.shared_floor(four, host) == (pytest.approx(400 / 10e9), host[0])
    uneven = [metrics.Memory("GPU 0", [0, 2], 10.0), metrics.Memory("GPU 1", [1], 10.0)]
    assert metrics.shared_floor([100.0] * 3, uneven)[1].name == "GPU 0"
    slower = [metrics.Memory("GPU 0", [0, 2], 10.0), metrics.Memory("GPU 1", [1], 4.0)]
    assert metrics.shared_floor([100.0] * 3, slower) == (pytest.approx(100 / 4e9), slower[1])
    rooted = metrics.shared_floor([400.0, 200.0], [metrics.Memory("host memory", [0, 1], 2.0)])
    assert rooted[0] == pytest.approx(600 / 2e9)  # ranks that move different amounts: summed


def test_memories_are_grouped_from_what_every_rank_measured():
    """A memory's bandwidth: the bytes all its ranks copied at once / the longest time."""
    gpus = metrics.group_memories([(7, 0), (7, 1), (7, 0), (7, 1)], [2e9] * 4,
                                  [1.0, 0.5, 2.0, 0.5], "cuda")
    assert gpus == [metrics.Memory("GPU 0", [0, 2], 2.0), metrics.Memory("GPU 1", [1, 3], 8.0)]
    hosts = metrics.group_memories([(5, 0), (9, 0), (5, 0)], [1e9] * 3, [1.0] * 3, "cpu")
    assert [(m.name, m.ranks) for m in hosts] == [("host memory of node 0", [0, 2]),
                                                  ("host memory of node 1", [1])]
    one = metrics.group_memories([(5, 0), (5, 0)], [1e9] * 2, [0.5, 1.0], "cpu")
    assert one == [metrics.Memory("host memory", [0, 1], 2.0)]


def test_ranks_on_one_node_share_gpu_local_rank_mod_count(monkeypatch):
    import types

    from gpuring.bench import timing

    runtime = types.SimpleNamespace(getDeviceCount=lambda: 2)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=runtime)))
    assert [timing.cuda_backend().memory_of(r) for r in range(5)] == [0, 1, 0, 1, 0]
    assert {timing.host_backend().memory_of(r) for r in range(5)} == {0}


class _FourRanks:
    rank, size, local_rank, config = 0, 4, 0, None


def test_the_floor_of_four_ranks_sharing_host_memory():
    from gpuring.bench import runner

    bench = runner.Measurer(runner.Settings(), _FourRanks(), runner.host_backend())
    gp = result("out-of-place")
    gp.ranks = 4
    host = [metrics.Memory("host memory", [0, 1, 2, 3], 20.0)]
    floor = bench.floor(gp, host)
    per_rank = 2.0 * gp.size  # all_reduce: its input read once, its output written once
    assert floor is not None
    assert floor.traffic_bytes == per_rank
    assert floor.plan_bytes == metrics.memory_traffic("all_reduce", 4, gp.size, 4)
    assert floor.plan_bytes > floor.traffic_bytes  # the ring moves more than it must
    assert (floor.memory, floor.ranks_sharing) == ("host memory", 4)
    assert floor.memory_bytes == pytest.approx(4 * per_rank)
    assert floor.floor_us == pytest.approx(4 * per_rank / 20e9 * 1e6)
    assert floor.efficiency_pct == pytest.approx(100 * floor.floor_us / gp.time_us)


def test_the_report_says_which_bandwidth_the_floor_assumes_and_who_shares_it():
    bandwidth = {"GBps_per_rank": 5.0, "per_rank": [5.0] * 4, "method": "m",
                 "memories": [{"memory": "GPU 0", "ranks": [0, 2], "GBps": 10.0},
                              {"memory": "GPU 1", "ranks": [1, 3], "GBps": 12.5}]}
    basis = "GPU 0 shared by 2 ranks (0, 2) at 10.00 GB/s; GPU 1 shared by 2 ranks (1, 3) " \
            "at 12.50 GB/s"
    header = report.header_lines({}, {"collective": "all_reduce", "ranks": 4, "device": "cuda",
                                      "dtypes": ["float32"], "ops": ["sum"], "roots": [0],
                                      "min_bytes": 8, "max_bytes": 64, "factor": 2,
                                      "iters": 1, "warmup": 0, "check_iters": 1},
                                 bandwidth)
    assert any(basis in line for line in header)
    floor = report.Floor(size=1 << 20, redop="sum", traffic_bytes=3.5 * (1 << 20),
                         traffic_over_size=3.5, floor_us=200.0, time_us=250.0,
                         efficiency_pct=80.0, memory="GPU 0", ranks_sharing=2,
                         memory_bytes=7.0 * (1 << 20), memory_GBps=10.0,
                         plan_bytes=4.5 * (1 << 20))
    lines = report.floor_lines(bandwidth, [floor])
    assert basis in lines[0]
    assert lines[-1].split() == ["1048576", "sum", "3670016", "3.50", "4.50", "2", "10.00",
                                 "no", "200.00", "250.00", "80.0"]


def _floor(size: int, efficiency: float) -> report.Floor:
    return report.Floor(size=size, redop="sum", traffic_bytes=3.5 * size, traffic_over_size=3.5,
                        floor_us=efficiency * 2.5, time_us=250.0, efficiency_pct=efficiency,
                        memory="host memory", ranks_sharing=2, memory_bytes=7.0 * size,
                        memory_GBps=20.0, placement="out-of-place",
                        beats_floor=efficiency > 100, type="float32")


def test_efficiency_above_100_percent_is_marked_as_cache_not_dram():
    bandwidth = {"GBps_per_rank": 10.0, "per_rank": [10.0] * 2, "method": "m",
                 "memories": [{"memory": "host memory", "ranks": [0, 1], "GBps": 20.0}]}
    lines = report.floor_lines(bandwidth, [_floor(1 << 16, 180.0), _floor(1 << 20, 80.0)])
    cached, dram = lines[3], lines[4]
    assert cached.endswith("180.0*") and dram.endswith("80.0")
    assert len(cached) == len(dram) + 1  # the numbers stay aligned
    assert lines[-1].startswith("# * ") and "noise" in lines[-1]
    unmarked = report.floor_lines(bandwidth, [_floor(1 << 20, 80.0)])
    assert not any("*" in line for line in unmarked)


def test_efficiency_above_100_percent_is_flagged_in_json_and_csv(tmp_path):
    floors = [_floor(1 << 20, 180.0)]
    rows = [result("out-of-place"), result("in-place"), result("out-of-place", system="mpi")]
    doc = files.to_json(settings={}, machine={}, bandwidth={}, peers=[], results=rows,
                         floors=floors)
    assert doc["floor"][0]["beats_floor"] is True
    path = tmp_path / "r.csv"
    files.write_csv(str(path), rows, floors)
    import csv

    back = list(csv.DictReader(path.open()))
    assert [r["beats_floor"] for r in back] == ["True", "", ""]  # the row the floor is of
    assert back[0]["efficiency_pct"] == "180.0" and back[2]["floor_us"] == ""


class _TwoRanksAlike:
    """Two ranks of one node, rank 1 measuring what rank 0 measures (all_gather stacks this
    rank's row twice)."""

    rank, size, local_rank, config = 0, 2, 0, None

    def all_gather(self, x: np.ndarray) -> np.ndarray:
        return np.stack([x, x])

    def barrier(self) -> None:
        pass


#: the memory's true copy bandwidth in the test below, and how much slower a disturbed sample is
TRUE_GBPS, SLOWDOWN = 10.0, 10.0


@pytest.mark.parametrize("slowed", [
    [True, True, False, False],  # something else ran before the size, not after it
    [True, False],  # one sample of two disturbed
    [False, True, True, True]])
def test_the_floor_takes_the_fastest_copy_the_memory_showed(monkeypatch, slowed):
    """Copies disturbed on purpose (some samples take SLOWDOWN times as long) would set the
    floor's bandwidth too low and the efficiency above 100 %: the floor takes the fastest
    sample measured around the size instead, so a collective at 80 % of the true floor shows
    80 %, whichever samples were slowed."""
    from gpuring.bench import measure, runner

    turns = iter(slowed)

    def copy_seconds(nbytes, repeats, sync):
        moved = 2.0 * nbytes * repeats
        return moved, moved / (TRUE_GBPS * 1e9) * (SLOWDOWN if next(turns) else 1.0)

    backend = runner.host_backend()
    monkeypatch.setattr(backend, "copy_seconds", copy_seconds)
    bench = runner.Measurer(runner.Settings(), _TwoRanksAlike(), backend)
    gp = result("out-of-place")
    # each rank copies at TRUE_GBPS, both at once: the memory moves 2 x TRUE_GBPS, and must
    # move 2 x size for each of the 2 ranks
    true_floor_us = 2 * 2.0 * gp.size / (2 * TRUE_GBPS * 1e9) * 1e6
    gp.time_us = true_floor_us / 0.8
    for _ in range(len(slowed) // measure.COPY_SAMPLES):  # before and after the size
        bench.memories_at(gp.size)
    floor = bench.floor(gp, bench.memories_known(gp.size))
    assert floor is not None and floor.memory_GBps == pytest.approx(2 * TRUE_GBPS)
    assert floor.efficiency_pct == pytest.approx(80.0)
    assert not floor.beats_floor


def test_the_bench_flags_a_time_below_the_floor():
    from gpuring.bench import runner

    bench = runner.Measurer(runner.Settings(), _FourRanks(), runner.host_backend())
    host = [metrics.Memory("host memory", [0, 1, 2, 3], 20.0)]
    fast, slow = result("out-of-place"), result("out-of-place")
    fast.ranks = slow.ranks = 4
    fast.time_us, slow.time_us = 1.0, 1e6
    assert bench.floor(fast, host).beats_floor is True
    assert bench.floor(slow, host).beats_floor is False
    assert bench.floor(slow, host).placement == "out-of-place"


def test_ranks_combine_as_nccl_tests_average_flag() -> None:
    from gpuring.bench.runner import combine_ranks

    seconds = np.array([3.0, 1.0, 2.0])
    assert combine_ranks(seconds, 0) == 3.0  # rank 0's
    assert combine_ranks(seconds, 1) == 2.0  # the average
    assert combine_ranks(seconds, 2) == 1.0
    assert combine_ranks(seconds, 3) == 3.0


def test_the_loop_times_back_to_back_calls_after_one_untimed_call_and_one_barrier() -> None:
    from gpuring.bench.timing import host_backend, time_loop

    events: list[str] = []
    per_call = time_loop(lambda: events.append("call"), iters=7, backend=host_backend(),
                         sync=lambda: events.append("barrier"))
    assert events == ["call", "barrier"] + ["call"] * 7
    assert per_call >= 0


def test_the_bytes_a_collective_must_move() -> None:
    """Every input byte read once, every output byte written once, per rank (size S = the
    size column: the whole array for reduce_scatter's input and all_gather's output)."""
    S = 1 << 20
    assert metrics.required_traffic("all_reduce", 4, S) == [2.0 * S] * 4
    assert metrics.required_traffic("reduce_scatter", 4, S) == [1.25 * S] * 4
    assert metrics.required_traffic("all_gather", 4, S) == [1.25 * S] * 4
    assert metrics.required_traffic("broadcast", 3, S, root=1) == [float(S)] * 3
    assert metrics.required_traffic("reduce", 3, S, root=1) == [S, 2.0 * S, S]
    assert metrics.required_traffic("all_reduce", 1, S) == [0.0]
    assert metrics.copy_repeats(8) == 2000 and metrics.copy_repeats(1 << 30) == 5
    assert metrics.copy_repeats(1 << 20) == 64



def test_per_iteration_statistics_take_each_iterations_slowest_rank() -> None:
    from gpuring.bench.stats import per_iteration

    times = np.array([[1.0, 2.0, 3.0, 100.0], [2.0, 1.0, 5.0, 1.0]])  # rank x iteration
    it = per_iteration(times)
    assert it.p50 == pytest.approx(np.median([2.0, 2.0, 5.0, 100.0]))
    assert it.max == 100.0 and it.fastest == 1.0
    assert it.p99 == pytest.approx(np.percentile([2.0, 2.0, 5.0, 100.0], 99))
    assert it.rank_p50 == [2.5, 1.5] and it.rank_max == [100.0, 5.0]


def test_repeats_are_summarized_with_their_spread() -> None:
    from gpuring.bench.stats import summarize

    rows = []
    for repeat, t in enumerate((300.0, 200.0, 250.0)):
        r = result("out-of-place")
        r.time_us, r.repeat = t, repeat
        rows.append(r)
    unchecked = result("in-place", wrong=0)
    unchecked.wrong = None
    (line, other) = summarize([*rows, unchecked])
    assert (line.time_us, line.fastest_us, line.slowest_us) == (250.0, 200.0, 300.0)
    assert line.spread_pct == pytest.approx(40.0) and line.repeats_us == [300.0, 200.0, 250.0]
    assert line.algbw_GBps == pytest.approx((1 << 20) / 250.0 / 1e3)
    assert line.wrong == 0 and other.wrong is None
    assert report.footer_lines([unchecked])[0].startswith("# Wrong elements    : N/A")


def test_linear_sizes_and_rotating_calls() -> None:
    from gpuring.bench.timing import rotating

    assert metrics.size_series(1000, 4000, 2, 8, step=1000) == [1000, 2000, 3000, 4000]
    with pytest.raises(ValueError):
        metrics.size_series(8, 64, 2, 8, step=0)
    seen: list[int] = []
    call = rotating([lambda i=i: seen.append(i) for i in range(3)])
    for _ in range(7):
        call()
    assert seen == [0, 1, 2, 0, 1, 2, 0]


def test_every_dtype_and_every_root_on_request() -> None:
    import argparse

    from gpuring.bench import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    s = cli.settings_from_args(p.parse_args(["all_reduce", "-d", "all", "-o", "max"]))
    assert "float32" in s.dtypes and "int8" in s.dtypes
    assert not any(d.startswith("complex") for d in s.dtypes)  # no max for complex
    s = cli.settings_from_args(p.parse_args(["broadcast", "-r", "all", "-i", "4K", "-N", "3"]))
    assert s.roots == [] and s.step_bytes == 4096 and s.repeats == 3  # roots: every rank
    with pytest.raises(ValueError):
        cli.settings_from_args(p.parse_args(["broadcast", "-r", "x"]))


@pytest.mark.parametrize(("collective", "op", "root"), [
    ("all_reduce", "op sum", "root none"), ("broadcast", "op none", "root 0"),
    ("all_gather", "op none", "root none"), ("reduce", "op sum", "root 0")])
def test_the_header_names_op_and_root_only_where_the_collective_has_them(collective, op, root):
    """The rows say "none" for an op a broadcast does not have (and -1 for a root an
    all_reduce does not have): the header says the same."""
    header = report.header_lines({}, {"collective": collective, "ranks": 2, "device": "cpu",
                                      "dtypes": ["float32"], "ops": ["sum"], "roots": [0],
                                      "factor": 2, "iters": 1, "warmup": 0,
                                      "check_iters": 1})
    sizes = next(line for line in header if line.startswith("# sizes"))
    assert f"; {op}; {root};" in sizes, sizes
