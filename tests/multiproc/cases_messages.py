"""Named items of point-to-point messages: send, recv and sendrecv (families of items:
harness.py)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator

import numpy as np
from harness import Item, ItemChecker, Plan, dev, expect_mismatches, moved_blocks, shape_name

import gpuring


def _ring(dtype: str, block: tuple[int, ...], seed: int) -> Iterator[Item]:
    shape = shape_name(block)

    def right(c: ItemChecker) -> None:
        comm, rank, n = c.comm, c.comm.rank, c.comm.size
        ins = c.inputs(dtype, block, seed)
        out = c.xp.zeros(block, dtype)
        got = comm.sendrecv(dev(c, ins[rank]), (rank + 1) % n, out, (rank - 1) % n)
        c.check(got is out, "sendrecv(..., out, ...) is not out")
        c.expect(out, ins[(rank - 1) % n], f"ring shift {dtype} {shape}", copy=True,
                 shared=False)

    def left(c: ItemChecker) -> None:
        comm, rank, n = c.comm, c.comm.rank, c.comm.size
        ins = c.inputs(dtype, block, seed)
        got = comm.sendrecv(dev(c, ins[rank]), (rank - 1) % n, c.xp.zeros(block, dtype),
                            (rank + 1) % n)
        c.expect(got, ins[(rank + 1) % n], f"ring shift back {dtype} {shape}", copy=True,
                 shared=False)

    def between(c: ItemChecker) -> None:
        ins = c.inputs(dtype, block, seed)
        c.expect(c.comm.all_reduce(dev(c, ins[c.comm.rank])), c.reduce_reference(ins, "sum"),
                 f"all_reduce between messages {dtype} {shape}")

    yield Item.one(f"sendrecv-{dtype}-{shape}-ring_shift_right", right)
    yield Item.one(f"sendrecv-{dtype}-{shape}-ring_shift_left", left)
    yield Item.one(f"all_reduce-{dtype}-sum-{shape}-between_messages-out_of_place", between)


def p2p(plan: Plan) -> Iterator[Item]:
    """send, recv and sendrecv: ring shifts both ways (every dtype, empty to several buffer
    rounds), one peer both ways, to itself, a gather to rank 0 and back by messages in
    order, collectives of the communicator in between; a recv of another shape or two sends
    that cross raise CollectiveMismatchError on both ranks naming them, wrong ranks raise
    ValueError before anything moves, and the ranks go on."""
    n = plan.n
    seed = 21000
    for dtype, block in moved_blocks():
        seed += 1
        yield from _ring(dtype, block, seed)

    def one_peer(c: ItemChecker) -> None:  # pairs both ways (the odd one: itself)
        rank = c.comm.rank
        ins = c.inputs("int32", (1000,), seed + 1)
        partner = rank ^ 1 if rank ^ 1 < n else rank
        got = c.comm.sendrecv(dev(c, ins[rank]), partner, c.xp.zeros(1000, "int32"), partner)
        c.expect(got, ins[partner], "sendrecv with one peer", copy=True, shared=False)

    def to_rank_0(c: ItemChecker) -> None:  # messages in order, each of its own shape
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        if rank == 0:
            for q in range(1, n):
                for k in range(3):
                    got = comm.recv(xp.zeros((q, k + 1), "float64"), q)
                    c.expect(got, np.full((q, k + 1), 10.0 * q + k), f"recv {k} from {q}",
                             copy=True, shared=False)
        else:
            for k in range(3):
                comm.send(xp.full((rank, k + 1), 10.0 * rank + k), 0)

    def from_rank_0(c: ItemChecker) -> None:
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        ins = c.inputs("int32", (1000,), seed + 1)
        if rank == 0:
            for q in range(1, n):
                comm.send(dev(c, ins[q]), q)
        else:
            c.expect(comm.recv(xp.zeros(1000, "int32"), 0), ins[rank], "recv from 0",
                     copy=True, shared=False)

    def strided(c: ItemChecker) -> None:  # refused before anything moves
        strided = c.xp.zeros((1000, 2), "int32")
        try:
            c.comm.recv(strided[:, 0], (c.comm.rank + 1) % n)
        except TypeError as exc:
            c.check("C-contiguous" in str(exc), f"refused as: {exc}")
        else:
            c.check(False, "recv into a strided array")

    def wrong_ranks(c: ItemChecker) -> None:
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        right = (rank + 1) % n
        for what, bad in (
                ("send to itself", lambda: comm.send(xp.ones(2), rank)),
                ("recv from rank n", lambda: comm.recv(xp.ones(2), n)),
                ("sendrecv receiving from itself" if n > 1 else
                 "sendrecv with itself of another shape",
                 lambda: comm.sendrecv(xp.ones(2), right, xp.ones(2), rank) if n > 1 else
                 comm.sendrecv(xp.ones(2), 0, xp.ones(3), 0))):
            try:
                bad()
            except ValueError:
                c.check(True, what)
            else:
                c.check(False, f"{what}: no ValueError")

    yield Item.one("sendrecv-int32-1000-one_peer", one_peer)
    if n > 1:
        yield Item.one("send_recv-float64-to_rank0_in_order", to_rank_0)
        yield Item.one("send_recv-int32-1000-from_rank0", from_rank_0)
        yield Item.one("recv-int32-strided-refused", strided)
    yield Item.one("send_recv_sendrecv-wrong_ranks-refused", wrong_ranks)
    if n > 1:
        yield from _mismatches()

    def timeline(c: ItemChecker) -> None:
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        right, left = (rank + 1) % n, (rank - 1) % n
        trace = os.path.join(c.outdir, "p2p-trace.json")
        comm.start_timeline(trace)
        got = comm.sendrecv(xp.full(5, rank), right, xp.zeros(5, xp.full(5, rank).dtype), left)
        c.expect(got, np.full(5, left), "ring shift in a timeline", copy=True, shared=False)
        if comm.stop_timeline() is not None and n > 1:  # rank 0 wrote every rank's events
            with open(trace) as f:
                names = {(e["pid"], e["name"]) for e in json.load(f)["traceEvents"]}
            event = "sendrecv with rank {}" if n == 2 else "sendrecv: recv from rank {}"
            c.check(all((q, event.format((q - 1) % n)) in names for q in range(n)),
                    f"events {sorted(names)}")

    yield Item.one("sendrecv-int64-5-ring_shift_right-timeline", timeline)


def _mismatches() -> Iterator[Item]:
    """Between ranks 0 and 1 (the others wait): a recv of another shape, two sends that
    cross, a recv of another dtype."""

    def shape(c: ItemChecker) -> None:
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        if rank < 2:
            expect_mismatches(c, [("shape", lambda: comm.send(xp.ones(4), 1) if rank == 0 else
                                   comm.recv(xp.ones(5), 0))])

    def crossing(c: ItemChecker) -> None:
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        if rank < 2:  # both send first
            expect_mismatches(c, [("root", lambda: comm.send(xp.ones(4), 1 - rank))])

    def dtype(c: ItemChecker) -> None:
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        if rank >= 2:
            return
        try:
            comm.send(xp.ones(4), 1) if rank == 0 else comm.recv(xp.ones(4, "int8"), 0)
        except gpuring.CollectiveMismatchError as exc:
            c.check(exc.differences.get("dtype") == {0: "float64", 1: "int8"},
                    f"differences {exc.differences}")
            c.check("ranks 0 and 1" in str(exc), str(exc))
        else:
            c.check(False, "no CollectiveMismatchError for another dtype")

    yield Item.one("send_recv-float64-4_vs_5-shape-mismatch", shape)
    yield Item.one("send_send-float64-4-crossing-mismatch", crossing)
    yield Item.one("send_recv-float64_vs_int8-dtype-mismatch", dtype)


FAMILIES = {"p2p": p2p}
