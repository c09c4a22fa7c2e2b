"""`gpuring doctor` on dumps written for the purpose: a rank that called another collective, a
rank that never entered one, a rank that died, ranks whose rings wrapped, and the command."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from gpuring import _doctor
from gpuring._cli import main

JOB = "feedc0de"


def _entry(seq: int, verb: str = "all_reduce", state: str = "done", line: int = 10,
           dtype: str = "float32", shape: tuple[int, ...] = (4,)) -> dict[str, Any]:
    reducing = verb in ("all_reduce", "reduce_scatter", "reduce")
    return {"seq": seq, "verb": verb, "shapes": [list(shape), list(shape)], "dtype": dtype,
            "op": "sum" if reducing else None, "root": None, "schedule": "ring",
            "site": f"train.py:{line}", "state": state, "start": 100.0 + seq,
            "end": None if state == "running" else 100.5 + seq}


def _write(directory: Path, rank: int, entries: list[dict[str, Any]], size: int,
           failure: dict[str, Any] | None = None, *, job: str = JOB,
           written: float = 200.0) -> None:
    document = {
        "format": "gpuring-flight-recorder", "version": 1, "job": job, "rank": rank,
        "pid": 1000 + rank, "host": "node", "reason": "failure", "written": written + rank,
        "communicators": [{
            "group": job, "ranks": list(range(size)), "rank": rank, "size": size,
            "seq": max((e["seq"] for e in entries), default=0),
            "state": "broken" if failure else "open", "failure": failure,
            "entries": entries}]}
    (directory / f"gpuring-trace-{job}-rank{rank}.json").write_text(json.dumps(document))


def _mismatch(blames: int | None = None) -> dict[str, Any]:
    return {"type": "gpuring.CollectiveMismatchError", "message": "they differ",
            "blames": blames}


def test_ranks_in_words() -> None:
    assert _doctor.ranks_text([5]) == "rank 5"
    assert _doctor.ranks_text([7, 0, 1, 2, 4, 6, 3]) == "ranks 0-4, 6-7"
    assert _doctor.ranks_text([1, 3]) == "ranks 1, 3"


def test_a_rank_that_called_another_collective(tmp_path: Path) -> None:
    """Rank 5 of 8 skipped all_gather #6 (line 12) and entered its next all_reduce (line 9)."""
    for rank in range(8):
        entries = [_entry(s, "all_reduce" if s % 2 else "all_gather", line=9 if s % 2 else 12)
                   for s in range(1, 6)]
        entries.append(_entry(6, "all_reduce", "failed", 9) if rank == 5
                       else _entry(6, "all_gather", "failed", 12))
        _write(tmp_path, rank, entries, 8, _mismatch())
    report = _doctor.diagnose(_doctor.load(str(tmp_path)))
    (comm,) = report["communicators"]
    assert comm["last_completed"]["seq"] == 5
    assert comm["divergence"]["seq"] == 6
    assert comm["root_cause"]["ranks"] == [5] and comm["root_cause"]["kind"] == "mismatch"
    lines = _doctor.render(report).splitlines()
    assert "  last collective every rank completed: #5 all_reduce(float32[4], op=sum) at " \
           "train.py:9" in lines
    assert "  first divergence: #6" in lines
    assert "    ranks 0-4, 6-7 entered all_gather(float32[4]) at train.py:12 (failed)" in lines
    assert "    rank 5 entered all_reduce(float32[4], op=sum) at train.py:9 (failed)" in lines
    assert any(line.startswith("  root cause: rank 5: ") for line in lines)
    assert any(line.startswith("  check: why rank 5 called all_reduce at train.py:9 where "
                               "the others called all_gather at train.py:12") for line in lines)


def test_a_rank_that_passed_another_dtype(tmp_path: Path) -> None:
    for rank in range(3):
        dtype = "float64" if rank == 2 else "float32"
        _write(tmp_path, rank, [_entry(1), _entry(2, state="failed", dtype=dtype)], 3,
               _mismatch())
    (comm,) = _doctor.diagnose(_doctor.load(str(tmp_path)))["communicators"]
    assert comm["root_cause"]["ranks"] == [2]
    assert "float64" in comm["check"][0] and "dtype" in comm["check"][0]


def test_a_rank_that_never_entered_the_collective(tmp_path: Path) -> None:
    """Rank 2 of 4 stalled after #3; the others timed out in #4, blaming it."""
    timeout = {"type": "gpuring.CollectiveTimeoutError", "message": "timed out", "blames": 2}
    for rank in range(4):
        entries = [_entry(s) for s in (1, 2, 3)]
        if rank != 2:
            entries.append(_entry(4, "broadcast", "failed", line=20))
        _write(tmp_path, rank, entries, 4,
               {**timeout, "blames": 2} if rank != 2 else {**timeout, "blames": 0})
    (comm,) = _doctor.diagnose(_doctor.load(str(tmp_path)))["communicators"]
    assert comm["divergence"]["seq"] == 4
    assert [n["rank"] for n in comm["divergence"]["not_entered"]] == [2]
    assert comm["root_cause"]["ranks"] == [2]
    lines = _doctor.render(_doctor.diagnose(_doctor.load(str(tmp_path)))).splitlines()
    assert "    rank 2 did not enter it (its last: #3 all_reduce(float32[4], op=sum) at " \
           "train.py:10, done)" in lines


def test_a_rank_that_left_no_dump(tmp_path: Path) -> None:
    """Rank 1 of 3 was killed: no dump; the others' failures blame it."""
    dead = {"type": "gpuring.PeerFailureError", "message": "rank 1 died", "blames": 1}
    for rank in (0, 2):
        _write(tmp_path, rank, [_entry(1), _entry(2, state="failed")], 3, dead)
    (comm,) = _doctor.diagnose(_doctor.load(str(tmp_path)))["communicators"]
    assert comm["no_dump"] == [1]
    assert comm["root_cause"] == {"ranks": [1], "kind": "dead",
                                  "why": "the failures of ranks 0, 2 blame rank 1"}


def test_a_ring_that_no_longer_holds_the_collective(tmp_path: Path) -> None:
    """Rank 1's ring wrapped past #2, where rank 0 stopped: it is not blamed for it."""
    _write(tmp_path, 0, [_entry(1), _entry(2, state="running")], 2)
    _write(tmp_path, 1, [_entry(s) for s in range(5, 9)], 2)
    (comm,) = _doctor.diagnose(_doctor.load(str(tmp_path)))["communicators"]
    assert comm["divergence"] is None or comm["divergence"]["not_entered"] == []


def test_only_the_newest_job_is_read(tmp_path: Path) -> None:
    _write(tmp_path, 0, [_entry(1)], 1, job="old", written=10.0)
    _write(tmp_path, 0, [_entry(1), _entry(2)], 1, job="new", written=20.0)
    dumps = _doctor.load(str(tmp_path))
    assert dumps.job == "new" and len(dumps.skipped) == 1


def test_the_command_prints_the_report_or_json(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    for rank in range(2):
        _write(tmp_path, rank, [_entry(1), _entry(2, "barrier" if rank else "all_reduce",
                                                  "failed")], 2, _mismatch(blames=1 - rank))
    assert main(["doctor", str(tmp_path)]) == 0
    assert "first divergence: #2" in capsys.readouterr().out
    assert main(["doctor", str(tmp_path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["job"] == JOB and report["communicators"][0]["divergence"]["seq"] == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["doctor", str(empty)]) == 2
    assert "no flight recorder dumps" in capsys.readouterr().err
