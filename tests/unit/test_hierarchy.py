"""Where collectives across nodes run in two levels: the layout of ranks on nodes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gpuring._hierarchy import Layout, fold
from gpuring._ops import ReduceOp


def test_layout_of_ranks_on_nodes() -> None:
    layout = Layout.of(["a", "b", "a", "b"], 3)
    assert layout is not None
    assert layout.ranks == ((0, 2), (1, 3)) and (layout.node, layout.local) == (1, 1)
    assert layout.node_major() == [0, 1, 2, 3]
    layout = Layout.of(["x", "x", "y", "y", "z", "z"], 4)
    assert layout is not None and (layout.nodes, layout.local_size) == (3, 2)
    assert (layout.node, layout.local) == (2, 0)
    assert layout.node_major() == [0, 2, 4, 1, 3, 5]


def test_no_two_levels_where_they_do_not_apply() -> None:
    assert Layout.of(["a", "a", "a"], 0) is None  # one node
    assert Layout.of(["a", "b", "c"], 1) is None  # one rank per node
    assert Layout.of(["a", "a", "b"], 2) is None  # nodes of different sizes


def test_the_fold_rounds_every_step() -> None:
    a = [np.array([1e-3], np.float16), np.array([2048], np.float16),
         np.array([-2048], np.float16)]
    assert fold(a, ReduceOp.SUM)[0] == np.float16(0)  # (1e-3 + 2048) rounds to 2048 first
    assert fold(a[::-1], ReduceOp.SUM)[0] == np.float16(1e-3)
    assert fold([np.array([3, -5]), np.array([4, -9])], ReduceOp.MIN).tolist() == [3, -9]


def test_integer_avg_rounds_toward_zero_without_overflow() -> None:
    from gpuring._ops import divide_toward_zero

    for dtype in ("int8", "int64", "uint8"):
        info = np.iinfo(dtype)
        values = [v for v in (info.min, info.min + 1, -7, -6, -1, 0, 1, 6, 7, info.max)
                  if info.min <= v <= info.max]
        for n in (2, 3, 6):
            got = np.array(values, dtype)
            divide_toward_zero(got, n)
            want = [abs(v) // n * (1 if v >= 0 else -1) for v in values]
            assert got.tolist() == want, (dtype, n)


class _Failing:
    """A level's communicator whose every call raises `error`."""

    def __init__(self, error: Exception):
        self.error = error

    def all_reduce(self, *args: object, **kwargs: object) -> None:
        raise self.error


def _failing(error: Exception) -> Any:
    return _Failing(error)


def test_a_level_names_the_rank_its_peer_gave_up_because_of() -> None:
    """Between nodes, ranks 0 and 2 of the job (of launcher ranks 4 to 7): rank 0 gave up
    because rank 1 of its node died, which the level has no rank for: the job's rank 1 is
    blamed, not the level's rank 0 that reported it."""
    from gpuring._errors import PeerFailureError
    from gpuring._hierarchy import LevelParts, _Level

    def level_of(comm: Any, ranks: tuple[int, ...], what: str, job: tuple[int, ...]) -> Any:
        return _Level(LevelParts(comm, lambda *_: None, lambda: None), None, ranks, what, job)

    reported = PeerFailureError("rank 0 failed: ...", peer=0, job_peer=5)
    level = level_of(_failing(reported), (0, 2), "between nodes", (4, 5, 6, 7))
    with pytest.raises(PeerFailureError, match=r"between nodes \(ranks \[0, 2\]") as info:
        level.run("all_reduce")
    assert (info.value.peer, info.value.job_peer) == (1, 5)
    level = level_of(_failing(PeerFailureError("rank 1 died", peer=1, job_peer=6)), (0, 2),
                   "between nodes", (4, 5, 6, 7))
    with pytest.raises(PeerFailureError) as info:
        level.run("all_reduce")
    assert info.value.peer == 2
    level = level_of(_failing(PeerFailureError("rank 1 died", peer=1)), (0, 2),
                   "between nodes", (4, 5, 6, 7))
    with pytest.raises(PeerFailureError) as info:
        level.run("all_reduce")
    assert info.value.peer == 2  # named by the level's ranks where the error has no other
