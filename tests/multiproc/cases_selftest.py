"""Items that go wrong on purpose, each in one way, for the tests of the named-item machinery
itself (test_named_items.py): what each test of a real item would say in its place."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import numpy as np
from harness import Item, ItemChecker, Plan


def planted(plan: Plan) -> Iterator[Item]:
    def passes(c: ItemChecker) -> None:
        ins = c.inputs("int32", (10,), 1)
        c.expect(c.comm.all_reduce(ins[c.comm.rank]), c.reduce_reference(ins, "sum"), "sum")

    def wrong_on_rank_1(c: ItemChecker) -> None:
        ins = c.inputs("float32", (10,), 2)
        got = c.comm.all_reduce(ins[c.comm.rank])
        if c.comm.rank == 1:
            got[3] += 1  # as a wrong element would come
        c.expect(got, c.reduce_reference(ins, "sum"), "sum", shared=False)

    def wrong_bits(c: ItemChecker) -> None:
        ins = c.inputs("float16", (6,), 3)
        want = c.comm.all_gather(ins[c.comm.rank])
        want[1, 2] = -want[1, 2]
        c.expect(c.comm.all_gather(ins[c.comm.rank]), want, "gathered", copy=True)

    def writes_to_stderr(c: ItemChecker) -> None:
        c.check(True, "nothing wrong")
        print("something unexpected", file=sys.stderr)

    def differs_across_ranks(c: ItemChecker) -> None:
        c.expect(np.full(3, c.comm.rank), np.full(3, c.comm.rank), "this rank's own")

    def checks_nothing(c: ItemChecker) -> None:
        c.comm.barrier()

    def raises(c: ItemChecker) -> None:
        raise ValueError("planted")

    def after(c: ItemChecker) -> None:
        c.check(True, "never run")

    yield Item.one("passes", passes)
    yield Item.one("wrong_on_rank1", wrong_on_rank_1)
    yield Item.one("wrong_bits", wrong_bits)
    yield Item.one("writes_to_stderr", writes_to_stderr)
    yield Item.one("differs_across_ranks", differs_across_ranks)
    yield Item.one("checks_nothing", checks_nothing)
    yield Item.one("raises", raises)
    yield Item.one("after_the_exception", after)


FAMILIES = {"planted": planted}
