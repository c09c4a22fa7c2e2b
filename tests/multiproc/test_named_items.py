"""The named-item machinery (harness.py, named.py) fails a test for each way an item can go
wrong, and says how: items planted to go wrong (cases_selftest.py) on 2 ranks."""

from __future__ import annotations

from .named import Group

PLANTED = Group(("cases_selftest:planted",), 2, tag="selftest", timeout=180)


def test_each_way_an_item_goes_wrong_is_told(named_launches):
    launch = named_launches.launch(PLANTED)
    assert launch.failure is None, launch.failure  # the launch itself went well
    assert launch.problems("passes") == []
    (wrong,) = launch.problems("wrong_on_rank1")
    assert wrong.startswith("rank 1: sum: 1 of 10 elements wrong, the first at index [3]: got "), \
        wrong
    assert ", expected " in wrong and "> bound" in wrong, wrong
    bits = launch.problems("wrong_bits")
    assert len(bits) == 2 and all("1 of 12 elements wrong, the first at index [1, 2]" in p
                                  for p in bits), bits
    (stderr,) = {p.split(" ", 2)[2] for p in launch.problems("writes_to_stderr")}
    assert stderr.startswith("wrote to stderr while it ran:") and "something unexpected" in \
        stderr, stderr
    assert launch.problems("differs_across_ranks") == [
        "rank 1's results differ bitwise from rank 0's, the first at \"this rank's own\""]
    assert launch.problems("checks_nothing") == ["no rank checked a result in it"]
    raised = launch.problems("raises")
    assert len(raised) == 2 and all("raised" in p and "ValueError: planted" in p
                                    for p in raised), raised
    assert launch.problems("after_the_exception") == [
        f"rank {r}: not run: raises raised an exception on this rank first" for r in (0, 1)]
