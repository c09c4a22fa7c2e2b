"""The pieces of `gpuring run`'s one summary and of the errors' words, without processes: what
a rank's output shows and holds back, the traceback's error and the user's line, the root
cause and the exit status, and how a mismatch says what differs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpuring import CollectiveMismatchError
from gpuring._call import Signature, check_alike
from gpuring._reports import Outcome, Raised, RankOutput, root_cause, summary
from gpuring._wording import call_fields, compare_calls, differences_text, ranks_text

TRACEBACK = [
    "Traceback (most recent call last):",
    '  File "/home/user/train.py", line 12, in main',
    "    comm.all_reduce(x)",
    '  File "/site/gpuring/_work.py", line 210, in verb',
    "    return method(self, *args, **kwargs)",
    "gpuring.CollectiveMismatchError: all_reduce #1 on rank 2: rank 2 passed float64",
]


class _Screen:
    def __init__(self) -> None:
        self.lines: list[tuple[str, bool]] = []

    def __call__(self, text: str, stderr: bool) -> None:
        self.lines.append((text, stderr))


def test_a_failing_ranks_traceback_is_held_and_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("gpuring._reports._NOT_THE_USERS", ("/site/gpuring/",))
    screen = _Screen()
    out = RankOutput(None, screen)
    out.line("step 1", False)
    for line in TRACEBACK:
        out.line(line, True)
    assert screen.lines == [("step 1", False)]
    assert out.raised == Raised(TRACEBACK[-1], "/home/user/train.py:12, in main: "
                                               "comm.all_reduce(x)")


def test_a_traceback_the_rank_goes_on_after_is_shown() -> None:
    screen = _Screen()
    out = RankOutput(None, screen)
    for line in TRACEBACK:
        out.line(line, True)
    out.line("warning: retrying", True)
    assert [t for t, _ in screen.lines] == [*TRACEBACK, "warning: retrying"]
    assert out.raised is None  # shown: it is not how the rank ended


def test_a_chained_traceback_is_one_and_its_last_exception_counts() -> None:
    chained = ["Traceback (most recent call last):", '  File "a.py", line 1, in f', "    g()",
               "KeyError: 'x'", "", "During handling of the above exception, another "
               "exception occurred:", "", *TRACEBACK]
    screen = _Screen()
    out = RankOutput(None, screen)
    for line in chained:
        out.line(line, True)
    assert screen.lines == []
    assert out.raised is not None and out.raised.error == TRACEBACK[-1]
    out.release()  # (the rank ended well after all)
    assert [t for t, _ in screen.lines] == chained


def test_every_line_goes_to_the_log(tmp_path: Any) -> None:
    path = tmp_path / "rank-0.log"
    with open(path, "w") as log:
        out = RankOutput(log, _Screen())
        out.line("hello", False)
        for line in TRACEBACK:
            out.line(line, True)
    assert path.read_text().splitlines() == ["hello", *TRACEBACK]


def _outcome(rank: int, status: int | None, stopped: bool = False,
             error: str | None = None) -> Outcome:
    return Outcome(rank, status, stopped, None if error is None else Raised(error, ""))


def test_the_root_cause_is_the_blamed_rank_and_its_status_the_jobs() -> None:
    outcomes = [_outcome(0, 1, error="gpuring.PeerFailureError: x"), _outcome(1, 3),
                _outcome(2, 1, error="gpuring.PeerFailureError: y")]
    report = root_cause(outcomes, first=0, blamed=[1], why="they blame rank 1")
    assert report is not None
    assert report.cause.rank == 1 and report.status == 3
    assert [o.rank for o in report.others] == [0, 2]
    lines = summary(report, "/logs/rank-N.log", "/logs")
    assert lines[0] == "gpuring run: rank 1 failed: it exited with code 3"
    assert "  2 other ranks gave up because of it: ranks 0, 2 (gpuring.PeerFailureError)" \
        in lines
    assert lines[-1] == "gpuring run: exit status 3"


def test_without_blame_the_first_failure_is_the_root_cause() -> None:
    outcomes = [_outcome(0, 0), _outcome(1, -9), _outcome(2, 1)]
    report = root_cause(outcomes, first=1, blamed=[], why="")
    assert report is not None and report.cause.rank == 1 and report.status == 137
    assert summary(report, None, None)[0] == "gpuring run: rank 1 failed: it was killed by " \
                                              "SIGKILL"


def test_a_root_cause_the_launcher_stopped_gives_the_first_failures_status() -> None:
    """Rank 1 hung: the others timed out and exited 1; the launcher stopped rank 1."""
    outcomes = [_outcome(0, 1), _outcome(1, -15, stopped=True), _outcome(2, 1)]
    report = root_cause(outcomes, first=0, blamed=[1], why="rank 1 never entered #4")
    assert report is not None and report.cause.rank == 1 and report.status == 1
    assert summary(report, None, None)[0] == ("gpuring run: rank 1 caused the failure: was "
                                              "killed by SIGTERM (stopped by gpuring run)")


def test_no_failure_no_report() -> None:
    assert root_cause([_outcome(0, 0)], first=0, blamed=[], why="") is None


def test_ranks_in_words() -> None:
    assert ranks_text([2]) == "rank 2"
    assert ranks_text([0, 1, 3, 4, 5, 9]) == "ranks 0-1, 3-5, 9"


def _signatures(*changes: dict[str, Any]) -> list[Signature]:
    base = Signature("all_reduce", "cpu", (10,), "float32", "sum", 0, chunk_bytes=1 << 20,
                     channels=1, one_shot_bytes=65536, buffer_bytes=1 << 24,
                     device_settings=(("a", "b"),))
    return [base._replace(**change) for change in changes]


@pytest.mark.parametrize(("changes", "said", "field"), [
    ([{}, {}, {"dtype": "float64", "buffer_bytes": 1 << 25}],
     "rank 2 passed float64, ranks 0-1 float32", "dtype"),
    ([{"op": "max"}, {}, {}], "rank 0 passed op=max, ranks 1-2 op=sum", "op"),
    ([{}, {"shape": (12,)}], "rank 1 passed shape (12,), rank 0 (10,)", "shape"),
    ([{}, {"collective": "all_gather", "shape": (3,)}],
     "rank 1 called all_gather(float32[3]), rank 0 all_reduce(float32[10], op=sum)",
     "collective"),
    ([{}, {"chunk_bytes": 4096, "one_shot_bytes": 1}],
     "rank 1 ran chunk_bytes=4096, rank 0 chunk_bytes=1048576", "chunk_bytes"),
    ([{}, {"deterministic": True}], "rank 1 has GPURING_DETERMINISTIC=True, rank 0 False",
     "deterministic"),
])
def test_a_mismatch_says_what_the_user_set_and_what_differs(
        changes: list[dict[str, Any]], said: str, field: str) -> None:
    with pytest.raises(CollectiveMismatchError) as caught:
        check_alike(_signatures(*changes), "all_reduce", 0, 3)
    assert str(caught.value) == f"all_reduce #3 on rank 0: {said}"
    assert field in caught.value.differences
    for internal in ("one_shot_bytes", "buffer_bytes", "device_settings"):
        assert internal not in str(caught.value)


def test_a_mismatch_of_settings_alone_names_the_variable() -> None:
    differences = {"one_shot_bytes": {0: 65536, 1: 131072}}
    assert differences_text(differences) == ("rank 1 has GPURING_ONE_SHOT_BYTES=131072, rank 0 "
                                             "65536")


def test_calls_entered_differently_say_what_differs() -> None:
    mine = ("all_reduce(shape=(64,), dtype=float32, op=sum, root=0, device=cpu, "
            "chunk_bytes=1048576, channels=1, algorithm=auto)")
    theirs = ("all_gather(shape=(1,), dtype=float32, op=sum, root=0, device=cpu, "
              "chunk_bytes=1048576, channels=1, algorithm=auto)")
    assert call_fields(mine)["shape"] == "(64,)"
    said, differences = compare_calls({5: mine, 0: theirs})
    assert said == "rank 5 called all_reduce(float32[64], op=sum), rank 0 all_gather(float32[1])"
    assert differences["collective"] == {5: "all_reduce", 0: "all_gather"}
    said, differences = compare_calls({1: mine, 0: mine.replace("float32", "int8") + " fused"})
    assert said == "rank 1 passed float32, rank 0 int8"
    assert set(differences) == {"dtype", "form"}


def test_a_signature_of_numpy_values_reads_plainly() -> None:
    signatures = _signatures({}, {"dtype": np.dtype("float16").name})
    with pytest.raises(CollectiveMismatchError, match="rank 1 passed float16, rank 0 float32"):
        check_alike(signatures, "all_reduce", 1)
