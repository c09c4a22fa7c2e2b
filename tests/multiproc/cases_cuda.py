"""Named items only CuPy arrays have: collectives captured into CUDA graphs (also where
ranks share a GPU and small all_reduces use stream memory operations outside graphs), small
all_reduces as one operation on the caller's stream, GPUs without peer access (NCCL's
route), NCCL refusing ranks that share a GPU, closing while a peer still maps the buffers.
On a GPU or on the CUDA simulator (families of items: harness.py)."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterator

import numpy as np
from harness import Item, ItemChecker, Plan, dev, rank_order_fold

import gpuring
from gpuring import GpuringError

GRAPH_SHAPES = [(5, "float32", "sum"), (3000, "int32", "max"), (20000, "float32", "avg"),
                (1 << 18, "float32", "sum"),  # 1 MiB
                ((1 << 20) + 5, "float32", "sum")]  # 4 MiB and a ragged piece: in rounds
GATHERED = (700, 300_001)  # the blocks gathered, small and in pieces


def _graph_ids(n: int) -> dict[str, str]:
    root = n - 1
    others = [(700, "float32"), (300_001 if n == 2 else 150_001, "float32")]
    ids = {"refused": "graph_capture-first_call_barrier_all_gather_v-refused",
           "schedules": "graph_capture-schedules"}
    for size, dtype, op in GRAPH_SHAPES:
        ids[f"all_reduce {size}"] = f"graph_replay-all_reduce-{dtype}-{op}-{size}elems-" \
                                    "out_of_place"
    ids["in place"] = "graph_replay-all_reduce-float32-sum-5elems-in_place"
    ids["in pieces"] = "graph_replay-all_reduce-float32-sum-300001elems-in_place"
    for m, dt in others:
        ids[f"reduce_scatter {m}"] = f"graph_replay-reduce_scatter-{dt}-sum-{m}elems_each-" \
                                     "out_of_place"
        ids[f"all_gather {m}"] = f"graph_replay-all_gather-int32-{m}elems-out_of_place"
        ids[f"broadcast {m}"] = f"graph_replay-broadcast-float64-root{root}-{m}elems-" \
                                "out_of_place"
        ids[f"reduce {m}"] = f"graph_replay-reduce-{dt}-sum-root{root}-{m}elems-out_of_place"
    for m in (64, others[1][0] + 2):
        ids[f"reduce_scatter in place {m}"] = f"graph_replay-reduce_scatter-float32-sum-" \
                                              f"{m}elems_each-in_place"
    for m in GATHERED:
        ids[f"gather {m}"] = f"graph_replay-gather-float32-{m}elems-root0-out_of_place"
    for m, _ in others:
        ids[f"scatter {m}"] = f"graph_replay-scatter-{others[0][1]}-{m}elems-root0-out_of_place"
        ids[f"all_to_all {m}"] = f"graph_replay-all_to_all-int32-{m}elems-out_of_place"
    ids["eager"] = "eager_after_replays-all_reduce-float32-sum-5elems-out_of_place"
    ids["eager rounds"] = "eager_after_replays-all_reduce-float32-sum-300001elems-out_of_place"
    return ids


def graph_capture(plan: Plan) -> Iterator[Item]:
    """Collectives captured into a CUDA graph (CuPy stream capture) and replayed: each replay
    works on what the input buffers hold then (the bits of the rank-order fold), several
    replays with fresh inputs; all_reduce from a few elements to 4 MiB, out of place and in
    place; reduce_scatter, all_gather, broadcast, reduce (those out of place and in place),
    gather and scatter (root 0, the others' root the last rank) and all_to_all, small and in
    pieces. Those that run in rounds outside a graph run as one kernel per piece in it. An
    empty collective records nothing. A first call during a capture, a barrier and an
    uneven form are refused without harm to the capture or the communicator. Needs
    GPURING_CUDA_FUSED=kernel (GPURING_FUSED_BYTES and GPURING_CUDA_GRAPH_PIECE_BYTES as
    the test sets them). It runs last: the communicator's close keeps the buffers the graphs
    use."""
    ids = _graph_ids(plan.n)
    yield Item(tuple(ids.values()), lambda c: _graph_body(c, ids), last=True,
               stderr=KEEPS_CAPTURED_BUFFERS)


#: what closing a communicator whose collectives a CUDA graph captured says (a warning and
#: the line it names): a graph may still be replayed
KEEPS_CAPTURED_BUFFERS = (r".*RuntimeWarning: gpuring: keeping \d+ bytes of GPU communication "
                          r"buffers allocated: a CUDA graph captured a collective that uses "
                          r"them\n.*",)


def _graph_body(c: ItemChecker, ids: dict[str, str]) -> None:
    comm, xp, n, rank = c.comm, c.xp, c.comm.size, c.comm.rank
    root = n - 1
    stream = xp.cuda.Stream(non_blocking=True)
    bufs = [(xp.zeros(size, dtype), xp.zeros(size, dtype)) for size, dtype, _ in GRAPH_SHAPES]
    big = xp.zeros(300_001, "float32")  # in place, in pieces
    # (per-rank block, dtype) of each of the others, small and in pieces
    others = [(700, "float32"), (300_001 if n == 2 else 150_001, "float32")]
    rs = [(xp.zeros(n * m, dt), xp.zeros(m, dt)) for m, dt in others]
    ag = [(xp.zeros(m, "int32"), xp.zeros((n, m), "int32")) for m, _ in others]
    bc = [(xp.zeros(m, "float64"), xp.zeros(m, "float64")) for m, _ in others]
    rd = [(xp.zeros(m, dt), xp.zeros(m, dt)) for m, dt in others]
    rs_place = [xp.zeros(n * m, "float32") for m in (64, others[1][0] + 2)]  # into its block
    ga = [(xp.zeros(m, "float32"), xp.zeros((n, m), "float32")) for m in GATHERED]
    sc = [(xp.zeros((n, m), dt), xp.zeros(m, dt)) for m, dt in others]
    a2a = [(xp.zeros((n, m), "int32"), xp.zeros((n, m), "int32")) for m, _ in others]
    empty = (xp.zeros((n, 0), "float32"), xp.zeros((n, 0), "float32"))  # nothing to record

    def family() -> None:  # every call of the graph beside the all_reduces
        for (ri, ro), (gi, go), (bi, bo), (di, do) in zip(rs, ag, bc, rd, strict=True):
            comm.reduce_scatter(ri, out=ro)
            comm.all_gather(gi, out=go)
            comm.broadcast(bi, root=root, out=bo)
            comm.reduce(di, root=root, out=do if rank == root else None)
            comm.all_gather(go[rank], out=go)  # in place: its block already there
        for place in rs_place:
            comm.reduce_scatter(place, out=place.reshape(n, -1)[rank])
        for (gi, go), (si, so), (ai, ao) in zip(ga, sc, a2a, strict=True):
            got = comm.gather(gi, root=0, out=go if rank == 0 else None)
            with c.into(ids[f"gather {gi.size}"]):
                c.check(got is (go if rank == 0 else None), "gather(out=) returned another")
            comm.scatter(si, root=0, out=so)
            comm.all_to_all(ai, out=ao)
        comm.all_reduce(big, out=big)

    with stream:
        for (_, _, op), (x, out) in zip(GRAPH_SHAPES, bufs, strict=True):  # warm-up
            comm.all_reduce(x, op=op, out=out)
        comm.all_reduce(bufs[0][0], out=bufs[0][0])
        comm.all_to_all(empty[0], out=empty[1])
        family()
        stream.synchronize()
        refused, schedules = [], []
        graphs = []  # CuPy's default capture mode (relaxed), then torch.cuda.graph's own
        for mode in (None, xp.cuda.runtime.streamCaptureModeThreadLocal):
            stream.begin_capture(mode)
            with c.into(ids["schedules"]):
                c.check(comm.all_to_all(empty[0], out=empty[1]) is empty[1],
                        "all_to_all(out=) returned another array")
            schedules.append(comm.last_schedule)
            for attempt in (lambda: comm.broadcast(bufs[1][0], root=0),  # never called
                            comm.barrier,
                            lambda: comm.all_gather_v(bufs[2][0])):  # shapes on the host
                try:
                    attempt()
                except GpuringError as exc:
                    refused.append(str(exc))
            for (_, _, op), (x, out) in zip(GRAPH_SHAPES, bufs, strict=True):
                comm.all_reduce(x, op=op, out=out)
                schedules.append(comm.last_schedule)
            comm.all_reduce(bufs[0][0], out=bufs[0][0])  # after the first read it
            family()
            graphs.append(stream.end_capture())
    with c.into(ids["refused"]):
        c.check(len(refused) == 6, f"refused: {refused}")
        if len(refused) == 6:
            for mode in (0, 3):  # each capture's refusals
                c.check("outside the capture first" in refused[mode], refused[mode])
                c.check("barrier cannot be captured" in refused[mode + 1], refused[mode + 1])
                c.check("all_gather_v cannot be captured" in refused[mode + 2],
                        refused[mode + 2])
    with c.into(ids["schedules"]):
        c.check(schedules[0] == "nothing", f"an empty all_to_all: {schedules[0]}")
        one_shot = gpuring.settings.get("GPURING_FUSED_BYTES")
        c.check(schedules[1:6] == [
            "fused" if size * np.dtype(dtype).itemsize <= one_shot else "kernels"
            for size, dtype, _ in GRAPH_SHAPES], f"schedules {schedules}")
    for replay in range(3):  # each graph, then the first again
        folds = []
        seed = 9500 + 40 * replay
        with stream:
            for i, ((size, dtype, op), (x, _)) in enumerate(zip(GRAPH_SHAPES, bufs,
                                                                strict=True)):
                ins = c.inputs(dtype, (size,), seed + i)
                x[...] = dev(c, ins[rank])
                folds.append(rank_order_fold(ins, op))
            want = []  # per shape of `others`: reduce_scatter, all_gather, broadcast, reduce
            for k, ((m, dt), (ri, _), (gi, _), (bi, _), (di, _)) in enumerate(
                    zip(others, rs, ag, bc, rd, strict=True)):
                at = seed + 10 + 5 * k
                rss, ags = c.inputs(dt, (n * m,), at), c.inputs("int32", (m,), at + 1)
                bcs, rds = c.inputs("float64", (m,), at + 2), c.inputs(dt, (m,), at + 3)
                ri[...], gi[...] = dev(c, rss[rank]), dev(c, ags[rank])
                bi[...], di[...] = dev(c, bcs[rank]), dev(c, rds[rank])
                want.append((rank_order_fold([a.reshape(n, -1)[rank] for a in rss], "sum"),
                             np.stack(ags), bcs[root], rank_order_fold(rds, "sum")))
            places = []
            for k, place in enumerate(rs_place):
                rps = c.inputs("float32", (place.size,), seed + 30 + k)
                place[...] = dev(c, rps[rank])
                places.append(rank_order_fold([a.reshape(n, -1)[rank] for a in rps], "sum"))
            bigs = c.inputs("float32", (big.size,), seed + 35)
            big[...] = dev(c, bigs[rank])
            moved = []  # per shape of `others`: gather, scatter, all_to_all
            for k, ((m, dt), (gi, _), (si, _), (ai, _)) in enumerate(
                    zip(others, ga, sc, a2a, strict=True)):
                at = seed + 40 + 3 * k
                gas = c.inputs("float32", gi.shape, at)
                scs, a2as = c.inputs(dt, (n, m), at + 1), c.inputs("int32", (n, m), at + 2)
                gi[...], si[...], ai[...] = dev(c, gas[rank]), dev(c, scs[rank]), \
                    dev(c, a2as[rank])
                moved.append((np.stack(gas), scs[0][rank], np.stack([a[rank] for a in a2as])))
            graphs[replay % 2].launch(stream)
            stream.synchronize()
        for (size, _, _), (_, out), fold in zip(GRAPH_SHAPES, bufs, folds, strict=True):
            with c.into(ids[f"all_reduce {size}"]):
                c.expect(out, fold, f"replay {replay}", copy=True)
        with c.into(ids["in place"]):
            c.expect(bufs[0][0], folds[0], f"replay {replay}", copy=True)
        with c.into(ids["in pieces"]):
            c.expect(big, rank_order_fold(bigs, "sum"), f"replay {replay}", copy=True)
        for (m, _), (_, ro), (_, go), (_, bo), (_, do), (w_rs, w_ag, w_bc, w_rd) in zip(
                others, rs, ag, bc, rd, want, strict=True):
            with c.into(ids[f"reduce_scatter {m}"]):
                c.expect(ro, w_rs, f"replay {replay}", copy=True, shared=False)
            with c.into(ids[f"all_gather {m}"]):
                c.expect(go, w_ag, f"replay {replay}", copy=True)
            with c.into(ids[f"broadcast {m}"]):
                c.expect(bo, w_bc, f"replay {replay}", copy=True)
            if rank == root:
                with c.into(ids[f"reduce {m}"]):
                    c.expect(do, w_rd, f"replay {replay}", copy=True, shared=False)
        for place, fold in zip(rs_place, places, strict=True):
            with c.into(ids[f"reduce_scatter in place {place.size // n}"]):
                c.expect(place.reshape(n, -1)[rank], fold, f"replay {replay}", copy=True,
                         shared=False)
        for (m, _), (_, go), (_, so), (_, ao), (w_ga, w_sc, w_a2a) in zip(
                others, ga, sc, a2a, moved, strict=True):
            if rank == 0:
                with c.into(ids[f"gather {go.shape[1]}"]):
                    c.expect(go, w_ga, f"replay {replay}", copy=True, shared=False)
            with c.into(ids[f"scatter {m}"]):
                c.expect(so, w_sc, f"replay {replay}", copy=True, shared=False)
            with c.into(ids[f"all_to_all {m}"]):
                c.expect(ao, w_a2a, f"replay {replay}", copy=True, shared=False)
    # eager calls go on, ordered after the replays (on the default stream: after `stream`)
    with c.into(ids["eager"]):
        ins = c.inputs("float32", (5,), 9600)
        c.expect(comm.all_reduce(dev(c, ins[rank])), rank_order_fold(ins, "sum"),
                 "eager after replays", copy=True)
    with c.into(ids["eager rounds"]):
        ins = c.inputs("float32", (300_001,), 9601)  # in rounds again
        c.expect(comm.all_reduce(dev(c, ins[rank])), c.reduce_reference(ins, "sum"),
                 "eager in rounds after replays")



def graph_capture_shared(plan: Plan) -> Iterator[Item]:
    """Ranks that share a GPU with stream memory operations. GPURING_CUDA_FUSED=auto: their
    small all_reduces run with stream memory operations outside graphs, and a capture records
    the kernel form instead (small ones, larger ones in pieces, the other collectives),
    warning once per process that it spins; replays and eager calls of both forms then take
    turns, each with fresh inputs, and every result holds (the forms' counters, inboxes and
    slots are apart). GPURING_CUDA_FUSED=memops: a capture is refused, briefly, and the
    communicator goes on. It runs last: the communicator's close keeps the buffers the graphs
    use."""
    mode = plan.env.get("GPURING_CUDA_FUSED", "auto")
    ids = {"before": "eager_before_capture-all_reduce-float32-sum-3000elems-in_place-fused"}
    if mode == "memops":
        ids["refused"] = "capture-all_reduce-float32-sum-1000elems-memops-refused"
        ids["after"] = "eager_after_refusal-all_reduce-float32-sum-3000elems-in_place-fused"
        yield Item(tuple(ids.values()), lambda c: _shared_body(c, ids, mode), last=True)
        return
    ids.update({
        "capture": "capture-all_reduce_all_gather-kernel_form-warns_once",
        "small": "graph_replay-all_reduce-float32-sum-1000elems-out_of_place",
        "in pieces": "graph_replay-all_reduce-float32-sum-300001elems-out_of_place",
        "all_gather": "graph_replay-all_gather-int32-700elems-out_of_place",
        "between": "eager_between_replays-all_reduce-float32-sum-3000elems-in_place-fused",
        "rounds": "eager_after_replays-all_reduce-float32-sum-300001elems-out_of_place"})
    yield Item(tuple(ids.values()), lambda c: _shared_body(c, ids, mode), last=True,
               stderr=KEEPS_CAPTURED_BUFFERS)


def _shared_body(c: ItemChecker, ids: dict[str, str], mode: str) -> None:
    comm, xp, n, rank = c.comm, c.xp, c.comm.size, c.comm.rank
    stream = xp.cuda.Stream(non_blocking=True)
    small, big = (xp.zeros(1000, "float32"), xp.zeros(1000, "float32")), \
        (xp.zeros(300_001, "float32"), xp.zeros(300_001, "float32"))
    gathered = (xp.zeros(700, "int32"), xp.zeros((n, 700), "int32"))
    eager = xp.zeros(3000, "float32")

    def calls() -> list[str]:  # what the graph holds, and each call's schedule
        schedules = []
        for x, out in (small, big):
            comm.all_reduce(x, out=out)
            schedules.append(comm.last_schedule)
        comm.all_gather(gathered[0], out=gathered[1])
        schedules.append(comm.last_schedule)
        return schedules

    def eager_call(seed: int) -> None:  # an all_reduce outside the graph, in the form it takes
        ins = c.inputs("float32", (eager.size,), seed)
        eager[...] = dev(c, ins[rank])
        comm.all_reduce(eager, out=eager)
        c.check(comm.last_schedule == "fused", f"eager {seed}: {comm.last_schedule}")
        c.expect(eager, rank_order_fold(ins, "sum"), f"eager {seed}", copy=True)

    with stream:
        with c.into(ids["before"]):
            first = calls()[0]
            c.check(first == "fused", f"a small all_reduce before capture: {first}")
            eager_call(9700)
        stream.synchronize()
        if mode == "memops":
            with c.into(ids["refused"]):
                text = None
                stream.begin_capture()
                try:
                    comm.all_reduce(small[0], out=small[1])
                except GpuringError as exc:
                    text = str(exc)
                finally:
                    stream.end_capture()
                c.check(text is not None, "a capture in the memops form was not refused")
                if text is not None:
                    c.check("GPURING_CUDA_FUSED auto or kernel" in text and len(text) < 250,
                            f"refused as: {text}")
            with c.into(ids["after"]):
                eager_call(9701)
            return
        with c.into(ids["capture"]):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                graphs = []
                for _ in range(2):  # two graphs: one warning
                    stream.begin_capture()
                    schedules = calls()
                    graphs.append(stream.end_capture())
                    c.check(schedules == ["kernels"] * 3, f"captured as {schedules}")
            spins = [str(w.message) for w in caught if "captured into a CUDA graph" in
                     str(w.message)]
            c.check(len(spins) == 1 and "MPS" in spins[0] and "spin" in spins[0] and
                    "GPURING_CUDA_FUSED=kernel" in spins[0],
                    f"warnings: {[str(w.message) for w in caught]}")
        for replay in range(4):  # each graph, eager calls between them
            seed = 9710 + 10 * replay
            smalls, bigs = c.inputs("float32", (1000,), seed), \
                c.inputs("float32", (300_001,), seed + 1)
            gathers = c.inputs("int32", (700,), seed + 2)
            small[0][...], big[0][...] = dev(c, smalls[rank]), dev(c, bigs[rank])
            gathered[0][...] = dev(c, gathers[rank])
            graphs[replay % 2].launch(stream)
            stream.synchronize()
            with c.into(ids["small"]):
                c.expect(small[1], rank_order_fold(smalls, "sum"), f"replay {replay}",
                         copy=True)
            with c.into(ids["in pieces"]):
                c.expect(big[1], rank_order_fold(bigs, "sum"), f"replay {replay}", copy=True)
            with c.into(ids["all_gather"]):
                c.expect(gathered[1], np.stack(gathers), f"replay {replay}", copy=True)
            with c.into(ids["between"]):
                eager_call(seed + 3)
                eager_call(seed + 4)
    with c.into(ids["rounds"]):  # in rounds after the replays
        ins = c.inputs("float32", (300_001,), 9800)
        c.expect(comm.all_reduce(dev(c, ins[rank])), c.reduce_reference(ins, "sum"),
                 "eager in rounds after replays")

def one_kernel(plan: Plan) -> Iterator[Item]:
    """Small all_reduces on CuPy arrays, which run as one operation on the caller's stream
    unless GPURING_CUDA_FUSED is off (one kernel, or stream memory operations where ranks
    share a GPU): the bits of the rank-order fold, from one element to 64 KiB, several calls
    with fresh inputs, out of place and in place, on the default stream and on another,
    between collectives that run in rounds on the engine's streams; at most 4 driver calls
    each where fused (one more where the stream changed), more where not."""
    seed = 9000
    for size in (1, 3, 17, 1000, 4099, 16384):  # 16384 float32: 64 KiB
        for dtype, op in (("float32", "sum"), ("int32", "max"), ("float32", "avg"),
                          ("float16", "sum")):
            seed += 1
            where = "other_stream-in_place" if seed % 2 else "default_stream-out_of_place"
            yield Item.one(f"all_reduce-{dtype}-{op}-{size}elems-{where}",
                           _one_operation(dtype, op, size, seed))
        yield Item.one(f"all_reduce-float32-sum-{size}elems-one_stream-3calls-out_of_place",
                       _one_stream(size, seed))
        yield Item.one(f"all_reduce_broadcast-int32-70000elems-in_rounds-after_{size}elems",
                       _in_rounds(size, seed))


def _fused() -> bool:
    return os.environ.get("GPURING_CUDA_FUSED", "auto") != "off"


def _one_operation(dtype: str, op: str, size: int, seed: int):  # type: ignore
    def body(c: ItemChecker) -> None:
        comm, xp, fused = c.comm, c.xp, _fused()
        ins = c.inputs(dtype, (size,), seed)
        if seed % 2:
            other = xp.cuda.Stream(non_blocking=True)
            with other:  # the input arrives on `other` too
                x = dev(c, ins[comm.rank])
                calls = comm.device_operations
                got = comm.all_reduce(x, op=op, out=x)
                c.check(got is x, "all_reduce(x, out=x) is not x")
                other.synchronize()
        else:
            x = dev(c, ins[comm.rank])
            calls = comm.device_operations
            got = comm.all_reduce(x, op=op)
        calls = comm.device_operations - calls
        # one more where the stream changed: it waits for the collective before
        c.check((calls <= 5) == fused, f"{calls} driver calls (fused: {fused})")
        c.expect(got, rank_order_fold(ins, op), f"{dtype} {op} {size}", copy=True)
    return body


def _one_stream(size: int, seed: int):  # type: ignore[no-untyped-def]
    def body(c: ItemChecker) -> None:  # on one stream: at most 4 driver calls each
        comm, fused = c.comm, _fused()
        for call in range(3):
            ins = c.inputs("float32", (size,), seed + 100 + call)
            x = dev(c, ins[comm.rank])
            calls = comm.device_operations
            got = comm.all_reduce(x)
            calls = comm.device_operations - calls
            c.check((calls <= 4) == fused, f"call {call}: {calls} driver calls")
            c.expect(got, rank_order_fold(ins, "sum"), f"call {call}", copy=True)
    return body


def _in_rounds(size: int, seed: int):  # type: ignore[no-untyped-def]
    def body(c: ItemChecker) -> None:  # its streams ordered after the kernel's
        comm, n = c.comm, c.comm.size
        ins = c.inputs("int32", (70000,), seed)
        c.expect(comm.all_reduce(dev(c, ins[comm.rank])), c.reduce_reference(ins, "sum"),
                 f"all_reduce in rounds after {size}")
        x = dev(c, ins[comm.rank].copy())
        c.expect(comm.broadcast(x, root=n - 1), ins[n - 1], f"broadcast after {size}",
                 copy=True)
    return body


def uneven_close(plan: Plan) -> Iterator[Item]:
    """The last rank is slow to close: the others must not free their buffers while it still
    maps them (its peers wait for it at close; the launch closes after this item)."""

    def body(c: ItemChecker) -> None:
        comm = c.comm
        ins = c.inputs("float32", (5000,), 900)
        c.expect(comm.all_reduce(dev(c, ins[comm.rank])), c.reduce_reference(ins, "sum"),
                 "before an uneven close")
        comm.synchronize()
        if comm.rank == comm.size - 1:
            time.sleep(1.0)

    yield Item.one("close-last_rank_late-all_reduce-float32-sum-5000elems", body, last=True)


def nccl_on_a_shared_gpu(plan: Plan) -> Iterator[Item]:
    """CuPy collectives on NCCL (GPURING_TRANSPORT=nccl) from ranks that share one GPU,
    without NCCL_MULTI_RANK_GPU_ENABLE: every rank raises the same clear error before NCCL's
    init (NCCL would fail the ranks that share a GPU and leave the others waiting)."""

    def body(c: ItemChecker) -> None:
        os.environ.pop("NCCL_MULTI_RANK_GPU_ENABLE", None)
        try:
            c.comm.all_reduce(dev(c, np.ones(3, np.float32)))
        except gpuring.GpuringError as exc:
            c.check("NCCL_MULTI_RANK_GPU_ENABLE=1" in str(exc), f"refused as: {exc}")
        else:
            c.check(False, "NCCL ran ranks that share a GPU")

    yield Item.one("all_reduce-float32-nccl_on_a_shared_gpu-refused", body)


def peer_access(plan: Plan) -> Iterator[Item]:
    """CuPy arrays on GPUs that cannot access each other peer to peer: CUDA IPC cannot map a
    peer's buffers, so every collective runs on NCCL (the ranks find it out together, at
    their first CuPy collective), every pair's messages too; NCCL's route is refused under
    capture, harmlessly. (The collectives' and messages' items run beside these.)"""
    n = plan.n

    def route(c: ItemChecker) -> None:
        comm = c.comm
        comm.all_reduce(dev(c, np.ones(3, np.float32)))
        c.check(comm.last_schedule == "nccl", f"schedule {comm.last_schedule}")
        c.check(comm._path.mappable == {"cuda": False}, f"mappable {comm._path.mappable}")

    def pairs(c: ItemChecker) -> None:  # the pairs p2p uses, made here too
        comm, rank, xp = c.comm, c.comm.rank, c.xp
        right, left = (rank + 1) % n, (rank - 1) % n
        partner = rank ^ 1 if rank ^ 1 < n else rank
        out = comm.sendrecv(xp.full(4, rank), right, xp.zeros(4, "int64"), left)
        c.expect(out, np.full(4, left), "ring shift", copy=True, shared=False)
        out = comm.sendrecv(xp.full(4, rank), left, xp.zeros(4, "int64"), right)
        c.expect(out, np.full(4, right), "ring shift back", copy=True, shared=False)
        out = comm.sendrecv(xp.full(4, rank), partner, xp.zeros(4, "int64"), partner)
        c.expect(out, np.full(4, partner), "with one peer", copy=True, shared=False)
        if rank == 0:
            for q in range(1, n):
                c.expect(comm.recv(xp.zeros(4, "int64"), q), np.full(4, q), f"from {q}",
                         copy=True, shared=False)
        else:
            comm.send(xp.full(4, rank), 0)
        peers = {right, left, partner} | (set(range(n)) if rank == 0 else {0})
        channels = comm._pairs.channels
        c.check(set(channels) == peers - {rank}, f"pairs {sorted(channels)}")
        c.check(all(ch.comm.last_schedule == "nccl" for ch in channels.values()),
                f"{[ch.comm.last_schedule for ch in channels.values()]}")

    def capture(c: ItemChecker) -> None:
        comm, xp = c.comm, c.xp
        stream = xp.cuda.Stream(non_blocking=True)
        with stream:  # NCCL's route is refused under capture, harmlessly
            x = dev(c, np.ones(3, np.float32))  # (written on `stream`, before the call reads it)
            comm.all_reduce(x, out=x)
            stream.synchronize()
            stream.begin_capture()
            try:
                comm.all_reduce(x, out=x)
            except gpuring.GpuringError as exc:
                c.check("cannot be captured" in str(exc) and "on NCCL" in str(exc), str(exc))
            else:
                c.check(False, "captured on NCCL's route")
            finally:
                stream.end_capture()
        c.expect(comm.all_reduce(x), np.full(3, n ** 2, np.float32), "after capture")

    yield Item.one("all_reduce-float32-sum-3-route_is_nccl", route)
    yield Item.one("sendrecv_send_recv-int64-4-every_pair_on_nccl", pairs)
    yield Item.one("all_reduce-float32-sum-3-capture_on_nccl-refused", capture)


FAMILIES = {"graph_capture": graph_capture, "graph_capture_shared": graph_capture_shared,
            "one_kernel": one_kernel,
            "uneven_close": uneven_close, "nccl_on_a_shared_gpu": nccl_on_a_shared_gpu,
            "peer_access": peer_access}
