"""Named items of communicators themselves: sub-communicators (split), mismatched calls, the
module-level verbs, close and init again, simulated nodes, tuning tables (families of
items: harness.py)."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator

import numpy as np
from harness import Item, ItemChecker, Plan, dev, expect_mismatches, host

import gpuring

SPLIT = {"sub_all_reduce": "split-all_reduce-int64-sum-300x7-siblings_interleaved",
         "sub_all_gather": "split-all_gather-int64-300x7-siblings_interleaved",
         "parent": "split-parent_all_reduce-float64-sum-5000-between_siblings",
         "ranks": "split-key_orders_the_ranks",
         "inner": "split_of_split-sendrecv-int16-64-ring_shift",
         "bad_colors": "split-bad_colors-refused",
         "mismatch": "split_vs_all_reduce-mismatch",
         "whole": "split-whole-all_reduce-int64-sum-3",
         "after": "split-parent_after_close-all_reduce-int64-sum-3"}


def split(plan: Plan) -> Iterator[Item]:
    """split: members ranked by (key, rank); collectives of sub-communicators interleaved
    with their parent's and with their siblings' (each color runs a different number), a
    split of a split, messages inside one, color None, a mismatch with a collective of the
    parent, bad colors; the sub-communicators close on their own and the parent goes on."""
    n = plan.n

    def body(c: ItemChecker) -> None:
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        seed = 22000
        colors = [q % 2 if q < n - 1 or n < 3 else None for q in range(n)]
        sub = comm.split(colors[rank], key=-rank)  # descending parent rank
        members = sorted((q for q in range(n) if colors[q] == colors[rank]), key=lambda q: -q)
        with c.into(SPLIT["ranks"]):
            if colors[rank] is None:
                c.check(sub is None, "color None gave a communicator")
            else:
                c.check(sub is not None and (sub.rank, sub.size) == (
                    members.index(rank), len(members)),
                    f"rank {getattr(sub, 'rank', None)} of {getattr(sub, 'size', None)}, "
                    f"expected {members.index(rank)} of {len(members)}")
        for step in range(3):
            seed += 1
            ins = c.inputs("float64", (5000,), seed)
            if sub is not None:
                for k in range(1 + (colors[rank] or 0) + step):  # siblings run different counts
                    mine = c.inputs("int64", (300, 7), seed * 10 + k)
                    with c.into(SPLIT["sub_all_reduce"]):
                        c.expect(sub.all_reduce(dev(c, mine[rank])),
                                 c.reduce_reference([mine[q] for q in members], "sum"),
                                 f"step {step} call {k}", shared=False)
                    with c.into(SPLIT["sub_all_gather"]):
                        c.expect(sub.all_gather(dev(c, mine[rank])),
                                 np.stack([mine[q] for q in members]), f"step {step} call {k}",
                                 copy=True, shared=False)
            with c.into(SPLIT["parent"]):
                c.expect(comm.all_reduce(dev(c, ins[rank])), c.reduce_reference(ins, "sum"),
                         f"step {step}")
        if sub is not None:
            with c.into(SPLIT["inner"]):
                inner = sub.split(0, key=sub.rank)  # the same ranks, the same order
                c.check(inner is not None and (inner.rank, inner.size) == (sub.rank, sub.size),
                        "a split of a split does not keep the ranks and their order")
                assert inner is not None
                x = dev(c, c.inputs("int16", (64,), seed + 1)[rank])
                got = inner.sendrecv(x, (inner.rank + 1) % inner.size, xp.zeros(64, "int16"),
                                     (inner.rank - 1) % inner.size)
                sender = members[(inner.rank - 1) % inner.size]
                c.expect(got, c.inputs("int16", (64,), seed + 1)[sender],
                         "sendrecv in a split of a split", copy=True, shared=False)
                inner.close()
                sub.close()
        with c.into(SPLIT["bad_colors"]):
            for bad, error in ((-1, ValueError), (True, TypeError), (1.5, TypeError)):
                try:
                    comm.split(bad)
                except error:
                    c.check(True, f"split({bad!r})")
                else:
                    c.check(False, f"split({bad!r}) raised no {error.__name__}")
        if n > 1:
            with c.into(SPLIT["mismatch"]):
                expect_mismatches(c, [("step", lambda: comm.split(0) if rank == 1 else
                                       comm.all_reduce(xp.ones(3)))])
        with c.into(SPLIT["whole"]):
            whole = comm.split(7)
            c.check(whole is not None and whole.rank == rank, "split(7) of every rank")
            assert whole is not None
            c.expect(whole.all_reduce(xp.full(3, rank)), np.full(3, n * (n - 1) // 2),
                     "split whole", copy=True)
            whole.close()
        with c.into(SPLIT["after"]):
            c.expect(comm.all_reduce(xp.full(3, rank)), np.full(3, n * (n - 1) // 2),
                     "parent after its sub-communicators closed", copy=True)

    yield Item(tuple(name for key, name in SPLIT.items() if n > 1 or key != "mismatch"), body)


def mismatch(plan: Plan) -> Iterator[Item]:
    """Mismatched dtype, shape, op, root and kind raise CollectiveMismatchError on every rank
    naming rank 1 (the rank that differs); the communicator works on after them."""
    ring = plan.env.get("GPURING_TRANSPORT") != "mpi"  # (chunk_bytes, channels: the ring's)
    fields = [
        ("dtype", "all_reduce-float32_vs_float64",
         lambda comm, x, r: comm.all_reduce(x.astype("float64" if r == 1 else "float32"))),
        ("shape", "all_reduce-float32-8_vs_9",
         lambda comm, x, r: comm.all_reduce(np.ones(8 + (r == 1), np.float32))),
        ("op", "all_reduce-float32-sum_vs_max",
         lambda comm, x, r: comm.all_reduce(x, op="max" if r == 1 else "sum")),
        ("root", "broadcast-float32-root0_vs_root1",
         lambda comm, x, r: comm.broadcast(x.copy(), root=1 if r == 1 else 0)),
        ("collective", "all_gather_vs_all_reduce-float32",
         lambda comm, x, r: comm.all_reduce(x) if r == 1 else comm.all_gather(x)),
    ] + ([
        ("chunk_bytes", "all_reduce-float32-chunk_bytes_1024_vs_default",
         lambda comm, x, r: comm.all_reduce(x, chunk_bytes=1024 if r == 1 else None)),
        ("channels", "all_reduce-float32-channels_2_vs_default",
         lambda comm, x, r: comm.all_reduce(x, channels=2 if r == 1 else None)),
    ] if ring else [])
    for field, name, call in fields:
        yield Item.one(f"{name}-{field}-mismatch", _mismatch_one(field, call))

    def after(c: ItemChecker) -> None:
        r = c.comm.rank
        c.expect(c.comm.all_reduce(np.full(4, r, np.int64)),
                 np.full(4, sum(range(c.comm.size)), np.int64), "after mismatch")

    yield Item.one("all_reduce-int64-sum-4-after_mismatch-out_of_place", after)


def _mismatch_one(field: str, call):  # type: ignore[no-untyped-def]
    def body(c: ItemChecker) -> None:
        try:
            call(c.comm, np.ones(8, np.float32), c.comm.rank)
        except gpuring.CollectiveMismatchError as exc:
            c.check(field in exc.differences, f"the mismatch names {sorted(exc.differences)}")
            c.check("rank 1" in str(exc), f"the mismatch does not name rank 1: {exc}")
            c.note(f"mismatch {field} raised")
        else:
            c.check(False, f"no CollectiveMismatchError for a different {field}")
    return body


def module_api(plan: Plan) -> Iterator[Item]:
    """Module-level verbs, init() twice, ReduceOp members."""
    n = plan.n

    def inputs(c: ItemChecker) -> np.ndarray:
        return np.arange(6, dtype=np.float64) + c.comm.rank

    def init_again(c: ItemChecker) -> None:
        c.check(gpuring.init() is c.comm, "init() again made another communicator")
        if not os.environ.get("GPURING_HOSTNAME"):  # one node (else `nodes` checks)
            c.check(c.comm.local_rank == c.comm.rank and c.comm.local_size == n,
                    f"local rank {c.comm.local_rank} of {c.comm.local_size}")

    def all_reduce(c: ItemChecker) -> None:
        want = c.reduce_reference([np.arange(6.0) + r for r in range(n)], "sum")
        c.expect(gpuring.all_reduce(inputs(c), op=gpuring.ReduceOp.SUM), want,
                 "module all_reduce")

    def all_gather(c: ItemChecker) -> None:
        c.expect(gpuring.all_gather(inputs(c)), np.stack([np.arange(6.0) + r for r in range(n)]),
                 "module all_gather", copy=True)

    def barrier_broadcast(c: ItemChecker) -> None:
        gpuring.barrier()
        y = inputs(c)
        c.expect(gpuring.broadcast(y, root=0), np.arange(6.0), "module broadcast", copy=True)

    yield Item.one("module-init_twice", init_again)
    yield Item.one("module-all_reduce-float64-ReduceOp.SUM-out_of_place", all_reduce)
    yield Item.one("module-all_gather-float64-out_of_place", all_gather)
    yield Item.one("module-barrier_then_broadcast-float64-root0-in_place", barrier_broadcast)


CLOSE = ("close-sub_outlives_parent-all_reduce-int64-sum",
         "close-init_again-all_reduce-int64-sum",
         "close-sub_after_reinit-all_reduce-int64-sum")


def close_and_again(plan: Plan) -> Iterator[Item]:
    """A sub-communicator outlives the communicator it came from, which closes (rank 0 slow to
    close: the others make theirs again first); gpuring.init() then makes a new one, and
    both work. (It closes the launch's communicator: it runs last.)"""

    def body(c: ItemChecker) -> None:
        comm, n = c.comm, c.comm.size
        sub = comm.split(0, key=-comm.rank)  # every rank, in reverse order
        x = np.arange(5, dtype=np.int64) + comm.rank
        want = np.arange(5, dtype=np.int64) * n + sum(range(n))
        if comm.rank == 0:
            time.sleep(0.5)
        comm.close()
        with c.into(CLOSE[0]):
            c.expect(sub.all_reduce(x), want, "the sub-communicator after its parent closed")
        again = gpuring.init()
        with c.into(CLOSE[1]):
            c.check(again is not comm, "init() after close gave the closed communicator")
            c.expect(again.all_reduce(x), want, "a communicator made again")
        again.close()
        with c.into(CLOSE[2]):
            c.expect(sub.all_reduce(x), want, "the sub-communicator again")
        sub.close()

    yield Item(CLOSE, body, last=True)


NODES_WITHOUT_MPI = ("nodes_without_mpi-identity_from_node_names",
                     "nodes_without_mpi-all_reduce-float32-refused",
                     "nodes_without_mpi-barrier",
                     "nodes_without_mpi-sendrecv-int64-3-inside_a_node")


def nodes_without_mpi(plan: Plan) -> Iterator[Item]:
    """Simulated nodes whose ranks met without MPI (torchrun, Slurm): identity follows the
    node names; a NumPy collective across nodes raises a clear error on every rank, before
    anything moves, and the communicator goes on (a barrier, messages inside a node)."""

    def body(c: ItemChecker) -> None:
        comm = c.comm
        here = os.environ["GPURING_HOSTNAME"]
        nodes = comm._control.nodes
        with c.into(NODES_WITHOUT_MPI[0]):
            c.check(nodes[comm.rank] == here and len(set(nodes)) > 1, f"nodes {nodes}")
            c.check((comm.local_rank, comm.local_size) == (nodes[:comm.rank].count(here),
                                                           nodes.count(here)),
                    f"local rank {comm.local_rank} of {comm.local_size} on {nodes}")
        with c.into(NODES_WITHOUT_MPI[1]):
            try:
                comm.all_reduce(np.ones(4, np.float32))
            except gpuring.GpuringError as exc:
                c.check("need MPI between the nodes" in str(exc), f"refused as: {exc}")
            else:
                c.check(False, "a NumPy collective across nodes ran without MPI")
        with c.into(NODES_WITHOUT_MPI[2]):
            comm.barrier()  # the control plane's own exchange: no MPI needed
            c.check(comm.last_schedule == "agreement", f"schedule {comm.last_schedule}")
        with c.into(NODES_WITHOUT_MPI[3]):
            peer = comm.rank ^ 1  # the neighbour on the same node
            if nodes[peer] == here:
                out = comm.sendrecv(np.full(3, comm.rank, np.int64), peer,
                                    np.empty(3, np.int64), peer)
                c.expect(out, np.full(3, peer, np.int64), "a message inside the node",
                         shared=False)

    yield Item(NODES_WITHOUT_MPI, body)


TUNED = ("tuned-all_reduce-float32-sum-table_choices",
         "tuned-all_reduce-float32-sum-asked_wins",
         "tuned-other_table_on_rank1-mismatch",
         "tuned-all_reduce-float32-sum-after_mismatch")


def tuned(plan: Plan) -> Iterator[Item]:
    """GPURING_TUNING (a table from `gpuring tune`): an all_reduce that asks for nothing takes
    the table's algorithm, piece size and channels for its size (checked in the call's
    agreed description), results right; what a call asks for wins; a rank whose table
    differs is a mismatch on every rank, and the communicator goes on."""

    def body(c: ItemChecker) -> None:
        comm, n, rank = c.comm, c.comm.size, c.comm.rank
        tuning = comm._path.choices.tuning
        assert tuning is not None and tuning.applies("cpu", n), "no tuning table for this job"

        def described(shape: tuple[int, ...]) -> str:
            texts = [p.text for p in comm._path.prepared.values()
                     if p.text.startswith(f"all_reduce(shape={shape},")]
            c.check(len(texts) == 1, f"descriptions {texts}")
            return texts[0] if texts else ""

        # an element count at the top of each entry's range (one or many entries: the table
        # is whatever this machine measured), and one above the last bound
        bounds = [ch.max_bytes for ch in tuning.tables["all_reduce"] if ch.max_bytes]
        sizes = [b // 4 for b in bounds] + [(bounds[-1] if bounds else 4096) // 4 + 1024]
        with c.into(TUNED[0]):
            for i, count in enumerate(sorted(set(sizes))):
                count = max(n, count - count % n)
                ins = c.inputs("float32", (count,), 18000 + i)
                c.expect(comm.all_reduce(ins[rank]), c.reduce_reference(ins, "sum"),
                         f"all_reduce {count}")
                choice = tuning.choose("all_reduce", count * 4)
                text = described((count,))
                c.check(f"chunk_bytes={choice.chunk_bytes}, channels={choice.channels}, "
                        f"algorithm={choice.algorithm})" in text, f"{choice} not in {text}")
        with c.into(TUNED[1]):
            ins = c.inputs("float32", (4 * n + 1,), 18100)
            comm.all_reduce(ins[rank], algorithm="ring", chunk_bytes=4096)
            unasked = tuning.choose("all_reduce", (4 * n + 1) * 4).channels  # the table's
            text = described((4 * n + 1,))
            c.check(f"chunk_bytes=4096, channels={unasked}, algorithm=ring)" in text, text)
        with c.into(TUNED[2]):
            if rank == 1:  # another table on rank 1
                comm._path.choices.tuning = dataclasses.replace(tuning, digest="0" * 16)
            try:
                comm.all_reduce(np.ones(77, np.float32))
            except gpuring.CollectiveMismatchError as exc:
                c.check("tuning" in exc.differences, f"differences {exc.differences}")
            else:
                c.check(False, "no CollectiveMismatchError for different tuning tables")
            comm._path.choices.tuning = tuning
        with c.into(TUNED[3]):
            c.expect(comm.all_reduce(np.ones(78, np.float32)), np.full(78, n, np.float32),
                     "tuned after mismatch")

    yield Item(TUNED, body)


def nodes(plan: Plan) -> Iterator[Item]:
    """Simulated nodes (GPURING_HOSTNAME set per rank): each rank's node, local rank and local
    size follow the names; all_reduce, reduce_scatter, all_gather, broadcast and reduce run
    in two levels (between nodes MPI for NumPy, NCCL for CuPy), a barrier is the agreement
    every call across nodes begins with, the other verbs run flat (MPI for NumPy, NCCL for
    CuPy). (The cases of one node run beside these in the same launch.)"""

    def identity(c: ItemChecker) -> None:
        comm = c.comm
        here = os.environ["GPURING_HOSTNAME"]
        label = np.frombuffer(here.encode().ljust(32), np.uint8)
        names = [bytes(row).decode().strip() for row in host(comm.all_gather(label))]
        c.check(comm.rank < len(names) and names[comm.rank] == here, f"names {names}")
        c.check(comm.local_size == names.count(here),
                f"local size {comm.local_size} on {names}")
        c.check(comm.local_rank == names[:comm.rank].count(here),
                f"local rank {comm.local_rank} on {names}")
        c.check(len(set(names)) > 1, f"one node: {names}")

    def schedules(c: ItemChecker) -> None:
        comm = c.comm
        comm.barrier()
        c.check(comm.last_schedule == "agreement", f"barrier: {comm.last_schedule}")
        comm.all_reduce(dev(c, np.ones(3, np.float32)))
        c.check(comm.last_schedule == "nodes", f"all_reduce: {comm.last_schedule}")
        comm.gather(dev(c, np.ones(3, np.float32)), root=0)
        flat = "mpi" if c.xp is np else "nccl"
        c.check(comm.last_schedule == flat, f"gather: {comm.last_schedule}")

    yield Item.one("nodes-identity_from_node_names", identity)
    yield Item.one("nodes-schedules-barrier_all_reduce_gather", schedules)


FAMILIES = {"split": split, "mismatch": mismatch, "module_api": module_api,
            "close_and_again": close_and_again, "nodes_without_mpi": nodes_without_mpi,
            "tuned": tuned, "nodes": nodes}
