"""Where collectives across nodes run in two levels: the layout of ranks on nodes."""

from __future__ import annotations

import numpy as np

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
