"""Named items of point-to-point messages (families of items: harness.py): send, recv and
sendrecv on both devices (`p2p`); the non-blocking verbs, tags, any source, buffers with
room and refusals on NumPy arrays (`messages`); every order of posting a group's operations
(`group_orders`)."""

from __future__ import annotations

import itertools
import json
import os
import random
from collections.abc import Callable, Iterator

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
    order, collectives of the communicator in between; wrong ranks raise ValueError before
    anything moves, and the ranks go on. NumPy: a receive buffer needs room only, a dtype
    that differs is refused on both ranks, two small sends that cross complete; CuPy: a recv
    of another shape or two sends that cross raise CollectiveMismatchError on both ranks."""
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
                ("sendrecv receiving from itself" if n > 1 else "sendrecv from rank n",
                 lambda: comm.sendrecv(xp.ones(2), right, xp.ones(2), rank) if n > 1 else
                 comm.sendrecv(xp.ones(2), 0, xp.ones(2), n))):
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
        yield from _host_mismatches(plan)

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
            event = "sendrecv: recv from rank {} (tag 0)"
            if plan.device == "cuda" and not comm._messages.gpu_reaches(left):  # on NCCL
                event = "sendrecv with rank {}" if n == 2 else "sendrecv: recv from rank {}"
            c.check(all((q, event.format((q - 1) % n)) in names for q in range(n)),
                    f"events {sorted(names)}")

    yield Item.one("sendrecv-int64-5-ring_shift_right-timeline", timeline)


def _refused_on_both(c: ItemChecker, send: Callable[[], object], recv: Callable[[], object],
                     field: str, want: dict[int, object]) -> None:
    """Between ranks 0 (`send`) and 1 (`recv`): the receive raises CollectiveMismatchError
    naming `field` as `want`; so does the send, or (a small one, complete before it was
    refused) rank 0's next point-to-point call or `synchronize()`: its receive of rank 1's
    answer, which rank 1 sends after the refusal (the receive raises it where it heard the
    refusal before it started, leaving the answer to the next receive), else the
    synchronize after it."""
    comm, rank = c.comm, c.comm.rank
    if rank >= 2:
        return
    errors = []
    try:
        send() if rank == 0 else recv()
    except gpuring.CollectiveMismatchError as exc:
        errors.append(exc)
    if rank == 1:
        comm.send(np.ones(1, np.int8), 0, tag=77)  # (after the refusal, in order)
    elif not errors:
        answered = False
        try:
            comm.recv(np.zeros(1, np.int8), 1, tag=77)
            answered = True
            comm.synchronize()
        except gpuring.CollectiveMismatchError as exc:
            errors.append(exc)
        if not answered:
            comm.recv(np.zeros(1, np.int8), 1, tag=77)
    else:
        comm.recv(np.zeros(1, np.int8), 1, tag=77)
    c.check(len(errors) == 1, f"rank {rank}: {len(errors)} CollectiveMismatchError")
    for exc in errors:
        c.check(exc.differences.get(field) == want, f"differences {exc.differences}")


def _on_nccl(c: ItemChecker) -> bool:
    """Whether ranks 0 and 1 exchange CuPy messages on NCCL (their GPUs do not map each
    other's memory): the pair's channel, whose rules differ (the receiver's array has the
    sender's shape; two sends that cross, or a dtype that differs, raise on both ranks from
    the calls)."""
    if c.xp is np or c.comm.rank >= 2:
        return False
    return not c.comm._messages.gpu_reaches(1 - c.comm.rank)


def _refused_on_nccl(c: ItemChecker, field: str, calls: dict[int, Callable[[], object]]
                     ) -> None:
    """On NCCL: the calls of ranks 0 and 1 raise CollectiveMismatchError naming `field`."""
    if c.comm.rank in calls:
        expect_mismatches(c, [(field, calls[c.comm.rank])])


def _host_mismatches(plan: Plan) -> Iterator[Item]:
    """Between ranks 0 and 1 (the others wait): a buffer of another shape with room, two
    small sends that cross, a dtype that differs and a message larger than the buffer, small
    and large (a large NumPy send raises itself; a CuPy send, queued, from the next call).
    CuPy messages on NCCL keep their rules (`_on_nccl`)."""

    def room(c: ItemChecker) -> None:
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        if _on_nccl(c):
            _refused_on_nccl(c, "shape", {0: lambda: comm.send(xp.arange(10.0), 1),
                                          1: lambda: comm.recv(xp.zeros((2, 7)), 0)})
        elif rank == 0:
            comm.send(xp.arange(10, dtype=np.float64), 1)
        elif rank == 1:
            out = xp.zeros((2, 7))
            got = comm.recv(out, 0)
            c.check(got is out, "recv returned another array")
            c.expect(out.reshape(-1)[:10], np.arange(10.0), "the message", copy=True,
                     shared=False)
            c.expect(out.reshape(-1)[10:], np.zeros(4), "past the message", copy=True,
                     shared=False)

    def crossing(c: ItemChecker) -> None:
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        if _on_nccl(c):
            _refused_on_nccl(c, "root", {r: lambda: comm.send(xp.ones(4), 1 - rank)
                                         for r in (0, 1)})
        elif rank < 2:  # both send first: small messages do not wait for their receive
            comm.send(xp.full(4, rank, np.int64), 1 - rank)
            c.expect(comm.recv(xp.zeros(4, np.int64), 1 - rank), np.full(4, 1 - rank),
                     "crossing sends", copy=True, shared=False)

    def refused(send: Callable[[ItemChecker], object], recv: Callable[[ItemChecker], object],
                field: str, want: dict[int, object], nccl_field: str
                ) -> Callable[[ItemChecker], None]:
        def body(c: ItemChecker) -> None:
            if _on_nccl(c):
                _refused_on_nccl(c, nccl_field, {0: lambda: send(c), 1: lambda: recv(c)})
            else:
                _refused_on_both(c, lambda: send(c), lambda: recv(c), field, want)
        return body

    dtype = refused(lambda c: c.comm.send(c.xp.ones(4), 1),
                    lambda c: c.comm.recv(c.xp.ones(4, np.int8), 0),
                    "dtype", {0: "float64", 1: "int8"}, "dtype")
    larger = refused(lambda c: c.comm.send(c.xp.ones(6), 1),
                     lambda c: c.comm.recv(c.xp.ones(5), 0), "count", {0: 6, 1: 5}, "shape")
    large = refused(lambda c: c.comm.send(c.xp.ones(1 << 20, np.float32), 1),
                    lambda c: c.comm.recv(c.xp.ones(1 << 20, np.int32), 0),
                    "dtype", {0: "float32", 1: "int32"}, "dtype")

    yield Item.one("send_recv-float64-10_into_2x7-room", room)
    yield Item.one("send_send-int64-4-crossing-small", crossing)
    yield Item.one("send_recv-float64_vs_int8-dtype-refused_on_both", dtype)
    yield Item.one("send_recv-float64-6_into_5-too_large-refused_on_both", larger)
    yield Item.one("send_recv-float32_vs_int32-4MiB-dtype-refused_on_both", large)


#: sizes a message's path depends on: empty, eager, the largest eager at the smallest ring,
#: staged in pieces, many pieces
_SIZES = (0, 3, 1000, 40000, 300000, 1 << 21)


def messages(plan: Plan) -> Iterator[Item]:
    """isend and irecv on NumPy arrays: every size (eager to many pieces) into buffers with
    room, what the Work says (source, tag, count), tags received out of order (each tag's
    messages in the order sent), any source from several senders, done() and a wait's own
    timeout, messages to itself, registered arrays, a group and a batch with the receive
    first, a group left by an exception."""
    n = plan.n
    seed = 23000

    def sizes(c: ItemChecker) -> None:
        comm, rank = c.comm, c.comm.rank
        right, left = (rank + 1) % n, (rank - 1) % n
        for i, count in enumerate(_SIZES):
            ins = c.inputs("float32", (count,), seed + i)
            out = np.full(count + 5, -1, np.float32)
            received = comm.irecv(out, left, tag=i)  # posted before the peer's send
            sent = comm.isend(ins[rank], right, tag=i)
            c.check(received.wait() is out, "irecv's wait returned another array")
            c.check(sent.wait() is None, "isend's wait returned something")
            c.check((received.source, received.tag, received.count) == (left, i, count),
                    f"work says {(received.source, received.tag, received.count)}")
            c.check((sent.source, sent.tag, sent.count) == (right, i, count),
                    f"send's work says {(sent.source, sent.tag, sent.count)}")
            c.expect(out[:count], ins[left], f"{count} elements", copy=True, shared=False)
            c.expect(out[count:], np.full(5, -1, np.float32), "past the message", copy=True,
                     shared=False)

    def tags(c: ItemChecker) -> None:  # rank 0 -> 1: tags 0 and 1 interleaved, 1 read first
        comm, rank = c.comm, c.comm.rank
        lengths = [5, 200000, 7, 70000, 1, 3]  # eager and staged, mixed
        if rank == 0:
            works = [comm.isend(np.full(length, k, np.int32), 1, tag=k % 2)
                     for k, length in enumerate(lengths)]
            for work in works:
                work.wait()
        elif rank == 1:
            for tag in (1, 0):
                for k, length in enumerate(lengths):
                    if k % 2 == tag:
                        out = np.zeros(max(lengths), np.int32)
                        work = comm.irecv(out, 0, tag=tag)
                        work.wait()
                        c.check(work.count == length, f"tag {tag}: {work.count} elements, "
                                f"message {k} has {length}")
                        c.expect(out[:length], np.full(length, k, np.int32),
                                 f"message {k} (tag {tag})", copy=True, shared=False)

    def any_source(c: ItemChecker) -> None:  # every rank sends rank 0 two, tag by round
        comm, rank = c.comm, c.comm.rank
        if rank == 0:
            seen: dict[int, list[int]] = {}
            for _ in range(2 * (n - 1)):
                out = np.zeros(3, np.int64)
                work = comm.irecv(out, tag=5)
                work.wait()
                c.check(work.source is not None and out[0] == work.source,
                        f"from {work.source}: {out}")
                seen.setdefault(int(work.source or 0), []).append(int(out[1]))
            c.check(seen == {q: [0, 1] for q in range(1, n)}, f"received {seen}")
        else:
            for k in range(2):
                comm.send(np.array([rank, k, 7], np.int64), 0, tag=5)

    def polling(c: ItemChecker) -> None:
        comm, rank = c.comm, c.comm.rank
        if rank == 0:
            out = np.zeros(4)
            work = comm.irecv(out, 1, tag=3)
            try:
                work.wait(timeout=0.05)  # rank 1 sends only after the barrier
            except TimeoutError:
                c.check(True, "timeout")
            else:
                c.check(False, "wait(timeout) returned before the message was sent")
            c.check(not work.done(), "done() before the message was sent")
            comm.barrier()
            for _ in range(1_000_000):
                if work.done():
                    break
            c.check(work.done(), "done() never became true")
            c.expect(out, np.arange(4.0), "after done()", copy=True, shared=False)
        else:
            comm.barrier()
            if rank == 1:
                comm.send(np.arange(4.0), 0, tag=3)

    def itself(c: ItemChecker) -> None:
        comm, rank = c.comm, c.comm.rank
        x = np.arange(100000, dtype=np.float64) + rank
        out = np.zeros(100001)
        received = comm.irecv(out, rank)
        comm.isend(x, rank).wait()
        received.wait()
        c.expect(out[:100000], x, "to itself", copy=True, shared=False)
        got = comm.sendrecv(np.full(3, rank), rank, np.zeros(4, np.int64), rank)
        c.expect(got[:3], np.full(3, rank), "sendrecv to itself", copy=True, shared=False)

    def registered(c: ItemChecker) -> None:
        comm, rank = c.comm, c.comm.rank
        right, left = (rank + 1) % n, (rank - 1) % n
        ins = c.inputs("float64", (300000,), seed + 50)
        x = comm.empty(300000, "float64")
        x[...] = ins[rank]
        out = comm.sendrecv(x, right, np.zeros(300000), left)
        c.expect(out, ins[left], "from a registered array", copy=True, shared=False)

    def group_first(c: ItemChecker) -> None:
        comm, rank = c.comm, c.comm.rank
        right, left = (rank + 1) % n, (rank - 1) % n
        ins = c.inputs("int16", (50000,), seed + 60)
        out = np.zeros(50000, np.int16)
        with comm.group():
            received = comm.irecv(out, left)
            sent = comm.isend(ins[rank], right)
        received.wait()
        sent.wait()
        c.expect(out, ins[left], "group, receive first", copy=True, shared=False)

    def batch_first(c: ItemChecker) -> None:
        comm, rank = c.comm, c.comm.rank
        right, left = (rank + 1) % n, (rank - 1) % n
        ins = c.inputs("complex64", (70000,), seed + 70)
        out = np.zeros(70000, np.complex64)
        works = comm.batch([("irecv", out, left, 4), (comm.isend, ins[rank], right, 4)])
        for work in works:
            work.wait()
        c.expect(out, ins[left], "batch, receive first", copy=True, shared=False)

    def group_failed(c: ItemChecker) -> None:
        comm = c.comm
        try:
            with comm.group():
                work = comm.irecv(np.zeros(2), 0)
                try:
                    work.wait()
                except gpuring.GpuringError as exc:
                    c.check("after the `with comm.group():`" in str(exc), str(exc))
                else:
                    c.check(False, "a wait inside the group returned")
                raise KeyError("stop")
        except KeyError:
            pass
        try:
            work.wait()
        except gpuring.GpuringError as exc:
            c.check("not posted" in str(exc), str(exc))
        else:
            c.check(False, "the work of a group left by an exception completed")
        comm.barrier()  # nothing was posted: the communicator goes on

    if plan.device == "cuda":
        return
    yield Item.one("isend_irecv-float32-every_size-into_larger-receive_first", sizes)
    if n > 1:
        yield Item.one("isend_irecv-int32-tags_out_of_order-in_order_per_tag", tags)
        yield Item.one("irecv-int64-any_source-several_senders", any_source)
        yield Item.one("irecv-float64-done_and_wait_timeout", polling)
    yield Item.one("isend_irecv_sendrecv-float64-to_itself", itself)
    yield Item.one("sendrecv-float64-300000-from_registered_array", registered)
    yield Item.one("group-int16-50000-receive_first-ring_shift", group_first)
    yield Item.one("batch-complex64-70000-receive_first-ring_shift", batch_first)
    yield Item.one("group-left_by_an_exception-posts_nothing", group_failed)


def _orders(count: int, rank: int) -> list[tuple[int, ...]]:
    """Orders in which a rank posts `count` operations: every one for up to 4 operations,
    else some (receives first, sends first, reversed, interleaved, and random ones, each rank
    its own)."""
    if count <= 4:
        return list(itertools.permutations(range(count)))
    half = count // 2
    fixed = [tuple(range(count)), tuple(reversed(range(count))),
             tuple(range(half, count)) + tuple(range(half)),
             tuple(i for pair in zip(range(half, count), range(half), strict=True)
                   for i in pair)]
    rng = random.Random(1000 + rank)
    return fixed + [tuple(rng.sample(range(count), count)) for _ in range(8)]


def group_orders(plan: Plan) -> Iterator[Item]:
    """Every rank sends to every other and receives from every other in one group, listed in
    every order (receives before sends included; each rank its own order), small and staged
    messages, as a group, as a batch and as plain isend/irecv."""
    n = plan.n
    if plan.device == "cuda" or n < 2:
        return

    def body(form: str, count: int) -> Callable[[ItemChecker], None]:
        def run(c: ItemChecker) -> None:
            comm, rank = c.comm, c.comm.rank
            peers = [q for q in range(n) if q != rank]
            ins = c.inputs("float64", (count,), 24000 + count)
            ops = [("isend", ins[rank], q) for q in peers] + [
                ("irecv", np.zeros(count), q) for q in peers]
            orders = _orders(len(ops), rank)
            for k in range(max(len(_orders(2 * (n - 1), r)) for r in range(n))):
                order = orders[k % len(orders)]
                listed = [ops[i] for i in order]
                for _, out, _ in ops[n - 1:]:
                    out[...] = 0
                if form == "batch":
                    works = comm.batch(listed)
                elif form == "group":
                    with comm.group():
                        works = [comm.isend(a, q) if verb == "isend" else comm.irecv(a, q)
                                 for verb, a, q in listed]
                else:
                    works = [comm.isend(a, q) if verb == "isend" else comm.irecv(a, q)
                             for verb, a, q in listed]
                for work in reversed(works):
                    work.wait()
                for _, out, q in ops[n - 1:]:
                    c.expect(out, ins[q], f"order {order}: from {q}", copy=True,
                             shared=False)
        return run

    for form in ("group", "batch", "plain"):
        for count in (8, 100000):
            yield Item.one(f"{form}-float64-{count}-every_order-all_pairs", body(form, count))


def gpu_messages(plan: Plan) -> Iterator[Item]:
    """isend and irecv of CuPy arrays, queued on the stream: a ring shift in a group at every
    size (one piece to more pieces than the slots) into larger buffers, both directions with
    the receive listed first, a batch, what the Work says, any source, done() before and
    after the sender posted, tags that must come in the order sent (a receive of another tag
    is refused on both ranks), and a driver-call count per small message."""
    n = plan.n
    if plan.device != "cuda" or n < 2:
        return
    seed = 25000

    def sizes(c: ItemChecker) -> None:
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        right, left = (rank + 1) % n, (rank - 1) % n
        for i, count in enumerate(_SIZES):
            ins = c.inputs("float32", (count,), seed + i)
            out = xp.full(count + 5, -1, np.float32)
            with comm.group():
                received = comm.irecv(out, left, tag=i)
                sent = comm.isend(dev(c, ins[rank]), right, tag=i)
            c.check(received.wait() is out and sent.wait() is None, "what wait() returned")
            c.check((received.source, received.tag, received.count) == (left, i, count),
                    f"work says {(received.source, received.tag, received.count)}")
            c.expect(out[:count], ins[left], f"{count} elements", copy=True, shared=False)
            c.expect(out[count:], np.full(5, -1, np.float32), "past the message", copy=True,
                     shared=False)

    def both_ways(c: ItemChecker) -> None:
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        right, left = (rank + 1) % n, (rank - 1) % n
        ins = c.inputs("int64", (3 << 20,), seed + 20)  # 24 MiB: many pieces each way
        from_left, from_right = xp.zeros(3 << 20, np.int64), xp.zeros(3 << 20, np.int64)
        x = dev(c, ins[rank])
        works = comm.batch([("irecv", from_left, left), ("irecv", from_right, right),
                            ("isend", x, right), ("isend", x, left)])
        for work in works:
            work.wait()
        c.expect(from_left, ins[left], "from the left", copy=True, shared=False)
        c.expect(from_right, ins[right], "from the right", copy=True, shared=False)

    def any_source(c: ItemChecker) -> None:
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        if rank == 0:
            seen = set()
            for _ in range(n - 1):
                out = xp.zeros(3, np.int64)
                work = comm.irecv(out, tag=8)
                work.wait()
                c.expect(out, np.full(3, work.source), "from any source", copy=True,
                         shared=False)
                seen.add(work.source)
            c.check(seen == set(range(1, n)), f"sources {seen}")
        else:
            comm.send(xp.full(3, rank, np.int64), 0, tag=8)

    def polling(c: ItemChecker) -> None:
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        if rank == 0:
            out = xp.zeros(4)
            work = comm.irecv(out, 1, tag=3)
            c.check(not work.done(), "done() before the message was sent")
            comm.barrier()  # rank 1 sends after it
            for _ in range(1_000_000):
                if work.done():
                    break
            c.check(work.done(), "done() never became true")
            c.expect(out, np.arange(4.0), "after done()", copy=True, shared=False)
        else:
            comm.barrier()
            if rank == 1:
                comm.send(xp.arange(4.0), 0, tag=3)

    def tag_order(c: ItemChecker) -> None:  # sent with tags 5, 6; received as 6, 6
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        if rank == 0:
            comm.send(xp.full(2, 5.0), 1, tag=5)
            comm.send(xp.full(2, 6.0), 1, tag=6)
            comm.recv(np.zeros(1), 1, tag=77)  # (rank 1 answers once it refused)
            try:
                comm.synchronize()
            except gpuring.CollectiveMismatchError as exc:
                c.check("tag" in exc.differences, f"differences {exc.differences}")
            else:
                c.check(False, "the refused send raised nothing")
        elif rank == 1:
            try:
                comm.recv(xp.zeros(2), 0, tag=6)
            except gpuring.CollectiveMismatchError as exc:
                c.check(exc.differences.get("tag") == {0: 5, 1: 6},
                        f"differences {exc.differences}")
            else:
                c.check(False, "a receive of another tag took the message")
            c.expect(comm.recv(xp.zeros(2), 0, tag=6), np.full(2, 6.0), "the next one",
                     copy=True, shared=False)
            comm.send(np.zeros(1), 0, tag=77)

    def driver_calls(c: ItemChecker) -> None:  # a small message, both sides ready
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        if rank > 1:
            return
        x, out = xp.ones(1000, np.float32), xp.zeros(1000, np.float32)
        before = comm.device_operations
        if rank == 0:
            comm.send(x, 1)
        else:
            comm.recv(out, 0)
        calls = comm.device_operations - before
        c.check(calls <= 3, f"{calls} driver calls for a message of 4000 bytes")

    yield Item.one("group-float32-every_size-into_larger-ring_shift", sizes)
    yield Item.one("batch-int64-24MiB-both_ways-receive_first", both_ways)
    yield Item.one("irecv-int64-any_source-several_senders", any_source)
    yield Item.one("irecv-float64-done_before_and_after_send", polling)
    yield Item.one("send_recv-float64-tags_out_of_order-refused_on_both", tag_order)
    yield Item.one("send_recv-float32-4000B-driver_calls", driver_calls)


FAMILIES = {"p2p": p2p, "messages": messages, "group_orders": group_orders,
            "gpu_messages": gpu_messages}
