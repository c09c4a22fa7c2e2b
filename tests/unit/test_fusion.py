"""Fusion: bucket planning (pure) and all_reduce_many in a world of one."""

from __future__ import annotations

import numpy as np
import pytest

from gpuring import _fusion as fusion
from gpuring._communicator import Communicator
from gpuring._fusion import Bucket, plan_buckets
from gpuring.rendezvous.local import SingleProcess


def test_buckets_group_per_dtype_in_input_order():
    groups = ["f4", "i4", "f4", "f4", "i4", "f4"]
    sizes = [40, 8, 40, 40, 8, 200]
    assert plan_buckets(groups, sizes, 100) == [
        Bucket((0, 2), True), Bucket((3,), False), Bucket((5,), False), Bucket((1, 4), True)]
    assert plan_buckets(["a"] * 4, [10, 500, 10, 10], 100) == [
        Bucket((0,), False), Bucket((1,), False), Bucket((2, 3), True)]


def test_every_index_once_and_buckets_within_limit():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(0, 30))
        groups = [int(g) for g in rng.integers(0, 3, n)]
        sizes = [int(s) for s in rng.integers(0, 300, n)]
        limit = int(rng.integers(1, 400))
        buckets = plan_buckets(groups, sizes, limit)
        flat = sorted(i for b in buckets for i in b.indices)
        assert flat == list(range(n))
        for b in buckets:
            assert len({groups[i] for i in b.indices}) == 1
            assert list(b.indices) == sorted(b.indices)
            assert b.packed == (len(b.indices) > 1)
            if b.packed:
                assert sum(sizes[i] for i in b.indices) <= limit


def test_limit_must_be_positive():
    with pytest.raises(ValueError):
        plan_buckets(["a"], [1], 0)


def test_fusion_bytes_from_environment(monkeypatch):
    monkeypatch.delenv("GPURING_FUSION_BYTES", raising=False)
    assert fusion.default_fusion_bytes() == 64 << 20
    monkeypatch.setenv("GPURING_FUSION_BYTES", "4K")
    assert fusion.default_fusion_bytes() == 4096
    monkeypatch.setenv("GPURING_FUSION_BYTES", "lots")
    with pytest.raises(ValueError):
        fusion.default_fusion_bytes()


def test_all_reduce_many_alone_returns_equal_arrays_in_order():
    comm = Communicator(SingleProcess())
    arrays = [np.arange(5, dtype=np.int32), np.ones((2, 3)), np.full((), 2.5, np.float32),
              np.arange(12, dtype=np.int32).reshape(3, 4)[:, ::2], np.zeros(0, np.int8)]
    for limit in (1, 16, None):
        got = comm.all_reduce_many(arrays, op="avg", fusion_bytes=limit)
        for a, g in zip(arrays, got, strict=True):
            assert g.dtype == a.dtype and g.shape == a.shape
            np.testing.assert_array_equal(g, a)
    assert comm.all_reduce_many([]) == []
    comm.close()
