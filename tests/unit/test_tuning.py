"""Tuning tables: loading and checking them, the choice per size, and how `gpuring tune`
turns measurements into a table."""

from __future__ import annotations

import json

import pytest

from gpuring._tuning import FORMAT, Choice, from_dict, load
from gpuring.bench.tune import Candidate, candidates, choose


def table(**tables):
    return {"format": FORMAT, "device": "cpu", "ranks": 2, "tables": tables}


def entry(max_bytes, algorithm="ring", chunk_bytes=1 << 20, channels=1):
    return {"max_bytes": max_bytes, "algorithm": algorithm, "chunk_bytes": chunk_bytes,
            "channels": channels}


def test_a_table_chooses_by_size(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table(all_reduce=[entry(1000, "one_shot"),
                                                 entry(5000, "two_shot", 4096, 2),
                                                 entry(None)])))
    t = load(path)
    assert t.choose("all_reduce", 0).algorithm == "one_shot"
    assert t.choose("all_reduce", 1000).algorithm == "one_shot"
    assert t.choose("all_reduce", 1001) == Choice(5000, "two_shot", 4096, 2)
    assert t.choose("all_reduce", 1 << 40).algorithm == "ring"
    assert t.choose("reduce_scatter", 10) is None
    assert t.applies("cpu", 2) and not t.applies("cuda", 2) and not t.applies("cpu", 3)


def test_a_table_written_before_the_rename_reads_direct_as_two_shot():
    """"direct" (the two-shot schedule's former name) in an old table: read as "two_shot",
    without a warning, with the digest of the same table written today (the ranks agree)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        old = from_dict(table(all_reduce=[entry(5000, "direct"), entry(None)],
                              reduce=[entry(None, "direct")]))
    new = from_dict(table(all_reduce=[entry(5000, "two_shot"), entry(None)],
                          reduce=[entry(None, "two_shot")]))
    assert old.choose("all_reduce", 10).algorithm == "two_shot"
    assert old.choose("reduce", 10).algorithm == "two_shot"
    assert old.digest == new.digest


def test_the_digest_covers_the_choices_not_the_measurements():
    a = from_dict({**table(all_reduce=[entry(None)]), "measured": [1, 2]})
    b = from_dict({**table(all_reduce=[entry(None)]), "machine": {"cpus": 2}})
    c = from_dict(table(all_reduce=[entry(None, channels=2)]))
    assert a.digest == b.digest != c.digest


@pytest.mark.parametrize(("data", "message"), [
    ({"format": "other"}, "format"),
    ({**table(all_reduce=[entry(None)]), "device": "tpu"}, "device"),
    ({**table(all_reduce=[entry(None)]), "ranks": 1}, "ranks"),
    (table(all_gather=[entry(None)]), "cannot tune"),
    (table(all_reduce=[]), "non-empty"),
    (table(all_reduce=[entry(None, "tree")]), "no algorithm"),
    (table(reduce_scatter=[entry(None, "one_shot")]), "no algorithm"),
    (table(all_reduce=[entry(None, chunk_bytes=0)]), "chunk_bytes"),
    (table(all_reduce=[entry(None, channels=33)]), "32 channels"),
    (table(all_reduce=[entry(500), entry(100), entry(None)]), "ordered"),
    (table(all_reduce=[entry(None), entry(100)]), "ordered"),
    (table(all_reduce=[{"max_bytes": None}]), "each entry needs"),
])
def test_a_bad_table_says_what_is_wrong(data, message):
    with pytest.raises(ValueError, match=message):
        from_dict(data)


def test_an_unreadable_table(tmp_path):
    with pytest.raises(ValueError, match="cannot read"):
        load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        load(tmp_path / "bad.json")


def test_the_fastest_per_size_neighbours_merged():
    def row(size, algorithm, time_us, chunk=1024, channels=1):
        return {"collective": "all_reduce", "size": size, "algorithm": algorithm,
                "chunk_bytes": chunk, "channels": channels, "time_us": time_us}

    measured = [row(1024, "one_shot", 5), row(1024, "ring", 9),
                row(4096, "one_shot", 7), row(4096, "ring", 8),
                row(16384, "two_shot", 10), row(16384, "ring", 12, channels=2),
                row(65536, "ring", 20, channels=2), row(65536, "two_shot", 21),
                {**row(65536, "ring", 1), "collective": "reduce"}]
    assert choose("all_reduce", measured) == [
        Choice(8192, "one_shot", 1024, 1),  # 1 and 4 KiB merged, up to halfway to 16 KiB
        Choice(32768, "two_shot", 1024, 1),
        Choice(None, "ring", 1024, 2)]


def test_candidates():
    found = candidates("all_reduce", 3000, [1024, 4096, 16384], [1, 2])
    # pieces larger than the size are one candidate (the smallest of them)
    assert {c.chunk_bytes for c in found} == {1024, 4096}
    assert {c.algorithm for c in found} == {"ring", "two_shot", "one_shot"}
    assert Candidate("two_shot", 4096, 2) in found and len(found) == 12
    assert {c.algorithm for c in candidates("reduce_scatter", 3000, [1024], [1])} == {
        "ring", "two_shot"}
    assert "one_shot" not in {c.algorithm for c in candidates("all_reduce", 64 << 20,
                                                              [1 << 20], [1])}
