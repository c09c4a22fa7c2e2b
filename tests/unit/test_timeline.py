"""Timeline: the trace file format, and recording around a fake engine."""

from __future__ import annotations

import json

import numpy as np

from gpuring._communicator import Communicator
from gpuring._timeline import Timeline, write_trace
from gpuring.rendezvous.local import SingleProcess


class Plan:
    channels = ((), ())


class Round:
    """One round as the communicator hands it to the timeline (a Launch of one plan)."""

    def __init__(self):
        self.rounds = (Plan(),)


def test_rounds_run_one_at_a_time_and_are_recorded(tmp_path):
    ran = []
    timeline = Timeline(str(tmp_path / "t.json"), rank=1)
    rounds = (Round(), Round(), Round())
    x = np.ones(10, np.float32)
    timeline.record("all_reduce", 7, x, "sum", rounds, ran.append)
    assert ran == list(rounds)
    recorded = [e for e in timeline.events if e["tid"] == 1]
    (collective,) = [e for e in timeline.events if e["tid"] == 0]
    assert [e["args"]["round"] for e in recorded] == [0, 1, 2]
    assert all(e["args"]["channels"] == 2 for e in recorded)
    assert collective["args"] == {"bytes": 40, "dtype": "float32", "seq": 7, "op": "sum",
                                  "rounds": 3}
    assert all(e["pid"] == 1 and e["ph"] == "X" and e["dur"] >= 0 for e in timeline.events)


def test_a_failed_round_still_records_the_collective(tmp_path):
    timeline = Timeline(str(tmp_path / "t.json"), rank=0)

    def fail(rounds):
        raise RuntimeError("round failed")

    try:
        timeline.record("barrier", 3, None, "sum", (Round(),), fail)
    except RuntimeError:
        pass
    else:
        raise AssertionError("the round's error was swallowed")
    (collective,) = timeline.events
    assert collective["args"] == {"bytes": 0, "dtype": "-", "seq": 3, "op": "sum", "rounds": 1}


def test_trace_file_has_a_named_track_per_rank(tmp_path):
    path = tmp_path / "trace.json"
    write_trace(str(path), [[{"name": "a", "ph": "X", "pid": 0, "tid": 0, "ts": 0, "dur": 1}],
                            []])
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    assert sum(e["ph"] == "X" for e in events) == 1


def test_start_stop_alone_writes_a_trace(tmp_path):
    comm = Communicator(SingleProcess())
    assert comm.stop_timeline() is None  # not recording: nothing to do
    path = tmp_path / "alone.json"
    comm.start_timeline(path)
    comm.all_reduce(np.ones(3))
    assert comm.stop_timeline() == str(path)
    assert "traceEvents" in json.loads(path.read_text())
    comm.start_timeline(path)
    comm.close()  # close() stops and writes
    assert path.exists()
