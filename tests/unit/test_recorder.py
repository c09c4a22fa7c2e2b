"""The flight recorder in a world of one: what each call leaves in the ring, when and where a
rank writes its dump, and what the dump says of each entry's state."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gpuring import CollectiveMismatchError, CommunicatorClosedError, _recorder
from gpuring._communicator import Communicator
from gpuring._config import Config
from gpuring._recorder import Ring, Standing, What
from gpuring.rendezvous.local import SingleProcess

HERE = Path(__file__).resolve()


@pytest.fixture
def trace_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GPURING_TRACE_DIR", str(tmp_path))
    monkeypatch.setenv("GPURING_TRACE_ENTRIES", "256")
    monkeypatch.delenv("GPURING_TIMELINE", raising=False)
    return tmp_path


def _entries(path: str, group: str) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        document = json.load(f)
    assert document["format"] == "gpuring-flight-recorder" and document["version"] == 1
    (record,) = [c for c in document["communicators"] if c["group"] == group]
    return record["entries"]


def test_each_call_is_recorded_with_the_line_that_made_it(trace_dir: Path) -> None:
    comm = Communicator(SingleProcess())
    try:
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        out = np.empty_like(x)
        line = sys._getframe().f_lineno + 1
        comm.all_reduce(x, out=out, op="max")
        comm.all_gather(x)
        path = comm.dump_trace()
        assert path is not None and Path(path).parent == trace_dir
        first, second = _entries(path, comm._control.job_id)
        assert first["seq"] == 1 and second["seq"] == 2
        assert first["verb"] == "all_reduce" and first["shapes"] == [[2, 3], [2, 3]]
        assert first["dtype"] == "float32" and first["op"] == "max"
        assert first["root"] is None and second["op"] is None  # not theirs to have
        assert first["site"] == f"{HERE}:{line}"
        assert second["site"] == f"{HERE}:{line + 1}"
        assert second["verb"] == "all_gather" and second["shapes"] == [[2, 3], [1, 2, 3]]
        for entry in (first, second):
            assert entry["state"] == "done" and entry["start"] <= entry["end"]
    finally:
        comm.close()


def test_a_call_that_comes_again_keeps_its_description(trace_dir: Path) -> None:
    """The same arrays and arguments again: the checked call, its recorder description
    included, is kept (`LastCalls`), so the site is the first call's."""
    comm = Communicator(SingleProcess())
    try:
        x = np.ones(4)
        line = sys._getframe().f_lineno + 2
        for _ in range(3):
            comm.all_reduce(x, out=x)
        entries = _entries(comm.dump_trace() or "", comm._control.job_id)
        assert [e["seq"] for e in entries] == [1, 2, 3]
        assert {e["site"] for e in entries} == {f"{HERE}:{line}"}
    finally:
        comm.close()


def test_the_ring_keeps_the_last_entries(trace_dir: Path) -> None:
    comm = Communicator(SingleProcess(), Config(trace_entries=4))
    try:
        for i in range(10):
            comm.all_reduce(np.full(3, float(i)))
        entries = _entries(comm.dump_trace() or "", comm._control.job_id)
        assert [e["seq"] for e in entries] == [7, 8, 9, 10]
    finally:
        comm.close()


def test_the_recorder_is_off_by_default(trace_dir: Path) -> None:
    assert Config().trace_entries == 0
    comm = Communicator(SingleProcess(), Config(trace_entries=0))
    try:
        comm.all_reduce(np.ones(3))
        assert comm._path.ring is None
        assert comm.dump_trace() is None
        assert list(trace_dir.iterdir()) == []
    finally:
        comm.close()


def test_an_abort_writes_a_dump_and_a_refused_call_is_recorded_as_refused(
        trace_dir: Path) -> None:
    comm = Communicator(SingleProcess())
    try:
        comm.all_reduce(np.ones(3))
        comm.abort("test")
        (written,) = trace_dir.glob("*.json")
        document = json.loads(written.read_text())
        assert document["reason"] == "abort"
        (record,) = [c for c in document["communicators"] if c["group"] == comm._control.job_id]
        assert record["state"] == "failed"
        assert record["failure"]["type"] == "gpuring.CommunicatorClosedError"
        with pytest.raises(CommunicatorClosedError):
            comm.broadcast(np.ones(2))
        last = _entries(str(written), comm._control.job_id)[-1]  # written again by then
        assert (last["seq"], last["verb"], last["state"]) == (2, "broadcast", "refused")
    finally:
        comm.close()


class _Disagreeing(SingleProcess):
    """A world whose agreement on a call finds a peer that passed float64."""

    def exchange(self, what: str, obj: Any, timeout: float | None = None) -> list[Any]:
        if what == "a collective":
            return [obj, obj._replace(dtype="float64")]
        return super().exchange(what, obj, timeout)


def test_a_mismatch_writes_a_dump_and_the_communicator_goes_on(trace_dir: Path) -> None:
    comm = Communicator(_Disagreeing())
    try:
        with pytest.raises(CollectiveMismatchError):
            comm.all_reduce(np.ones(3, np.float32))
        (written,) = trace_dir.glob("*.json")
        document = json.loads(written.read_text())
        assert document["reason"] == "mismatch"
        (record,) = [c for c in document["communicators"] if c["group"] == comm._control.job_id]
        assert record["state"] == "open"
        assert record["failure"]["type"] == "gpuring.CollectiveMismatchError"
        (entry,) = record["entries"]
        assert (entry["seq"], entry["verb"], entry["state"]) == (1, "all_reduce", "failed")
    finally:
        comm.close()


class _Recorded:
    """A communicator as a dump sees it, in a state the test sets."""

    def __init__(self, ring: Ring, standing: Standing):
        self.ring, self._standing = ring, standing

    def standing(self) -> Standing:
        return self._standing


def _what(verb: str) -> What:
    key = (verb, (4,), np.dtype("float32"), np.ndarray, "sum", 0)
    return What(key, (4,), "ring", None, -1)


@pytest.mark.parametrize(("case", "expected"), [
    ("host, no failure", ["done", "done", "running"]),
    ("GPU, two queued", ["done", "queued", "queued"]),
    ("GPU, failed in flight", ["done", "failed", "failed"]),
    ("host, failed in the call", ["done", "done", "failed"]),
])
def test_the_state_of_each_entry_comes_from_the_lifecycle(trace_dir: Path, case: str,
                                                          expected: list[str]) -> None:
    """Entries 1 and 2 returned, entry 3 returned too on a GPU (queued), not on the host."""
    ring = Ring(8)
    gpu = case.startswith("GPU")
    for seq in (1, 2, 3):
        ring.append([seq - 1, _what("all_reduce"), 10.0 + seq, 10.5 + seq if (
            seq < 3 or gpu) else 0.0, ""])
    failed = "failed" in case
    standing = Standing(
        group="job1", job_ranks=(0,), rank=0, seq=3,
        state="failed" if failed else "open",
        completed_through=1 if gpu else 2, in_flight=3 if gpu else None,
        lost_through=3 if failed else None,
        failure=RuntimeError("boom") if failed else None, broken=failed,
        blames=None)
    recorded = _Recorded(ring, standing)
    _recorder.register(recorded)
    path = _recorder.dump("dump_trace()")
    assert path is not None
    assert [e["state"] for e in _entries(path, "job1")] == expected


def test_where_dumps_go(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPURING_TRACE_DIR", raising=False)
    monkeypatch.delenv("GPURING_TIMELINE", raising=False)
    assert Path(_recorder.trace_dir("abc")).name == "gpuring-trace-abc"
    monkeypatch.setenv("GPURING_TIMELINE", str(tmp_path / "t" / "trace.json"))
    assert _recorder.trace_dir("abc") == str(tmp_path / "t")
    monkeypatch.setenv("GPURING_TRACE_DIR", str(tmp_path / "d"))
    assert _recorder.trace_dir("abc") == str(tmp_path / "d")
    assert _recorder.trace_file("d", "abc", 3) == os.path.join("d", "gpuring-trace-abc-rank3.json")


def test_sigusr1_writes_a_dump(tmp_path: Path) -> None:
    """A process whose program does not handle SIGUSR1 writes its recorder on it, and goes
    on (in a process of its own: the handler is the process's)."""
    script = textwrap.dedent("""
        import os, signal
        import numpy as np
        import gpuring
        comm = gpuring.init()
        comm.all_reduce(np.ones(3))
        os.kill(os.getpid(), signal.SIGUSR1)
        comm.barrier()
        comm.close()
        print("went on")
    """)
    env = dict(os.environ, GPURING_TRACE_DIR=str(tmp_path), GPURING_TRACE_ENTRIES="16")
    for name in ("GPURING_STORE", "GPURING_RANK", "GPURING_WORLD_SIZE"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0 and "went on" in done.stdout, done.stderr
    (written,) = tmp_path.glob("*.json")
    document = json.loads(written.read_text())
    assert document["reason"] == "SIGUSR1"
    (record,) = document["communicators"]
    assert [(e["seq"], e["verb"], e["state"]) for e in record["entries"]] == [
        (1, "all_reduce", "done")]


def test_a_kind_of_call_takes_its_first_calls_site_but_a_refused_one_its_own(
        trace_dir: Path) -> None:
    """Two all_reduce calls of one kind (new arrays, so nothing kept of the first) from two
    lines: the second shows the first's line (worked out once per kind); after an abort, a
    refused call of that kind shows its own."""
    comm = Communicator(SingleProcess())
    try:
        first = sys._getframe().f_lineno + 1
        comm.all_reduce(np.ones(3))
        comm.all_reduce(np.ones(3))
        comm.abort("test")
        refused = sys._getframe().f_lineno + 2
        with pytest.raises(CommunicatorClosedError):
            comm.all_reduce(np.ones(3))
        entries = _entries(comm.dump_trace() or "", comm._control.job_id)
        assert [(e["seq"], e["state"], e["site"]) for e in entries] == [
            (1, "done", f"{HERE}:{first}"), (2, "done", f"{HERE}:{first}"),
            (3, "refused", f"{HERE}:{refused}")]
    finally:
        comm.close()


def test_a_call_prepared_with_the_recorder_off_is_described_once_it_is_on(
        trace_dir: Path) -> None:
    """The description is made when a call is prepared, recorder on or off: a ring turned
    on later shows the calls prepared before, with the line of the call that prepared them."""
    comm = Communicator(SingleProcess(), Config(trace_entries=0))
    try:
        x = np.ones((2, 2), np.float32)
        line = sys._getframe().f_lineno + 1
        comm.all_reduce(x, op="min")
        comm._path.ring = Ring(8)  # (as a recorder on from the start would be, registered)
        _recorder.register(comm._path)
        comm.all_reduce(x, op="min")
        (entry,) = _entries(comm.dump_trace() or "", comm._control.job_id)
        assert (entry["seq"], entry["verb"], entry["op"], entry["shapes"], entry["site"]) == (
            2, "all_reduce", "min", [[2, 2], [2, 2]], f"{HERE}:{line}")
    finally:
        comm.close()


def test_a_persistent_collective_shows_where_it_was_made_and_keeps_the_ring_full(
        trace_dir: Path) -> None:
    """Preparing a call shows it in the ring meanwhile, then leaves the ring as it was (a
    full ring keeps its oldest entry); its runs show the line that made it."""
    comm = Communicator(SingleProcess(), Config(trace_entries=3))
    try:
        for _ in range(3):
            comm.all_reduce(np.ones(3))
        x = np.ones(5)
        line = sys._getframe().f_lineno + 1
        op = comm.all_reduce_init(x, out=np.empty_like(x))
        entries = _entries(comm.dump_trace() or "", comm._control.job_id)
        assert [e["seq"] for e in entries] == [1, 2, 3]
        op()
        op()
        entries = _entries(comm.dump_trace() or "", comm._control.job_id)
        assert [(e["seq"], e["state"], e["shapes"]) for e in entries] == [
            (3, "done", [[3], [3]]), (4, "done", [[5], [5]]), (5, "done", [[5], [5]])]
        assert entries[-1]["site"] == f"{HERE}:{line}"
    finally:
        comm.close()
