"""Runs as every rank of the persistent-collective tests: `worker_persistent.py CASE OUTDIR
[cpu|cuda]`. Each case `persistent_VERB` makes that verb's persistent form
(`comm.VERB_init`) on fresh random inputs of several dtypes, out of place and in place where
the verb has both, refills the inputs in place and starts it several times, and checks every
result against the float64 or exact-integer reference (`Checker.expect`: the first wrong
element named); `persistent_lifecycle` checks the errors around it."""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Checker, dev, host, rank_order_fold, run_case

import gpuring

#: a small size (one operation on a GPU) and one in pieces, per rank
SIZES = (7, 30001)
#: one dtype of each kind the reductions treat apart
DTYPES = ("float32", "int64", "float64")
STARTS = 3


def _fill(c: Checker, target, values: np.ndarray) -> None:
    target[...] = dev(c, values)


def case_persistent_all_reduce(c: Checker) -> None:
    comm, rank = c.comm, c.comm.rank
    for size in SIZES:
        for dtype in DTYPES:
            for op in ("sum", "max"):
                for in_place in (False, True):
                    x = c.xp.zeros(size, dtype)
                    out = x if in_place else c.xp.zeros(size, dtype)
                    persistent = comm.all_reduce_init(x, op=op, out=out)
                    for start in range(STARTS):
                        ins = c.inputs(dtype, (size,), 100 + start + 7 * size)
                        _fill(c, x, ins[rank])
                        persistent.start()
                        assert persistent.wait() is out
                        c.expect(out, c.reduce_reference(ins, op),
                                 f"all_reduce {dtype} {op} {size} "
                                 f"{'in place' if in_place else 'out of place'} start {start}")


def case_persistent_reduce_scatter(c: Checker) -> None:
    comm, n, rank = c.comm, c.comm.size, c.comm.rank
    for size in SIZES:
        for dtype in DTYPES:
            for in_place in (False, True):
                x = c.xp.zeros(n * size, dtype)
                out = x.reshape(n, size)[rank] if in_place else c.xp.zeros(size, dtype)
                persistent = comm.reduce_scatter_init(x, out=out)
                for start in range(STARTS):
                    ins = c.inputs(dtype, (n * size,), 200 + start + 7 * size)
                    _fill(c, x, ins[rank])
                    assert persistent() is out
                    c.expect(out, c.reduce_reference(ins, "sum").reshape(n, -1)[rank],
                             f"reduce_scatter {dtype} {size} in_place={in_place} "
                             f"start {start}", shared=False)


def case_persistent_all_gather(c: Checker) -> None:
    comm, n, rank = c.comm, c.comm.size, c.comm.rank
    for size in SIZES:
        for dtype in DTYPES:
            for in_place in (False, True):
                out = c.xp.zeros((n, size), dtype)
                x = out[rank] if in_place else c.xp.zeros(size, dtype)
                persistent = comm.all_gather_init(x, out=out)
                for start in range(STARTS):
                    ins = c.inputs(dtype, (size,), 300 + start + 7 * size)
                    _fill(c, x, ins[rank])
                    assert persistent() is out
                    c.expect(out, np.stack(ins), f"all_gather {dtype} {size} "
                             f"in_place={in_place} start {start}", copy=True)


def case_persistent_broadcast(c: Checker) -> None:
    comm, n, rank = c.comm, c.comm.size, c.comm.rank
    for root in sorted({0, n - 1}):
        for size in SIZES:
            for dtype in DTYPES:
                for in_place in (False, True):
                    x = c.xp.zeros(size, dtype)
                    out = None if in_place else c.xp.zeros(size, dtype)
                    persistent = comm.broadcast_init(x, root=root, out=out)
                    for start in range(STARTS):
                        ins = c.inputs(dtype, (size,), 400 + start + 7 * size + root)
                        _fill(c, x, ins[rank])
                        got = persistent()
                        assert got is (x if in_place else out)
                        c.expect(got, ins[root], f"broadcast root {root} {dtype} {size} "
                                 f"in_place={in_place} start {start}", copy=True)


def case_persistent_reduce(c: Checker) -> None:
    comm, n, rank = c.comm, c.comm.size, c.comm.rank
    for root in sorted({0, n - 1}):
        for size in SIZES:
            for dtype in DTYPES:
                x = c.xp.zeros(size, dtype)
                out = c.xp.zeros(size, dtype) if rank == root else None
                persistent = comm.reduce_init(x, root=root, out=out)
                for start in range(STARTS):
                    ins = c.inputs(dtype, (size,), 500 + start + 7 * size + root)
                    _fill(c, x, ins[rank])
                    got = persistent()
                    if rank != root:
                        assert got is None, "reduce gave a result off the root"
                        continue
                    assert got is out
                    c.expect(got, c.reduce_reference(ins, "sum"),
                             f"reduce root {root} {dtype} {size} start {start}", shared=False)


def case_persistent_gather(c: Checker) -> None:
    comm, n, rank = c.comm, c.comm.size, c.comm.rank
    root = n - 1
    for size in SIZES:
        for dtype in DTYPES:
            x = c.xp.zeros(size, dtype)
            persistent = comm.gather_init(x, root=root)
            for start in range(STARTS):
                ins = c.inputs(dtype, (size,), 600 + start + 7 * size)
                _fill(c, x, ins[rank])
                got = persistent()
                if rank != root:
                    assert got is None, "gather gave a result off the root"
                    continue
                c.expect(got, np.stack(ins), f"gather {dtype} {size} start {start}",
                         copy=True, shared=False)


def case_persistent_scatter(c: Checker) -> None:
    comm, n, rank = c.comm, c.comm.size, c.comm.rank
    root = n - 1
    for size in SIZES:
        for dtype in DTYPES:
            x = c.xp.zeros((n, size), dtype)
            persistent = comm.scatter_init(x, root=root)
            for start in range(STARTS):
                ins = c.inputs(dtype, (n, size), 700 + start + 7 * size)
                _fill(c, x, ins[rank])
                c.expect(persistent(), ins[root][rank], f"scatter {dtype} {size} start {start}",
                         copy=True, shared=False)


def case_persistent_all_to_all(c: Checker) -> None:
    comm, n, rank = c.comm, c.comm.size, c.comm.rank
    for size in SIZES:
        for dtype in DTYPES:
            x, out = c.xp.zeros((n, size), dtype), c.xp.zeros((n, size), dtype)
            persistent = comm.all_to_all_init(x, out=out)
            for start in range(STARTS):
                ins = c.inputs(dtype, (n, size), 800 + start + 7 * size)
                _fill(c, x, ins[rank])
                assert persistent() is out
                c.expect(out, np.stack([ins[j][rank] for j in range(n)]),
                         f"all_to_all {dtype} {size} start {start}", copy=True, shared=False)


def case_persistent_barrier(c: Checker) -> None:
    """Every start holds every rank until the last one started it: the last rank starts
    late, after it made a file, and the others find that file after their start."""
    import time

    comm = c.comm
    persistent = comm.barrier_init()
    late = comm.size - 1
    for start in range(STARTS):
        mark = os.path.join(os.path.dirname(c.path), f"barrier-{start}")
        if comm.rank == late:
            time.sleep(0.3)
            open(mark, "w").close()
        assert persistent() is None
        assert os.path.exists(mark), f"start {start} returned before rank {late} started it"
    # a barrier's worth: a result every rank reads after it was written by the last rank
    x = c.xp.zeros(3, "int64")
    total = comm.all_reduce_init(x, out=x)
    for start in range(STARTS):
        _fill(c, x, np.arange(3) + comm.rank + start)
        persistent.start()
        persistent.wait()
        c.expect(total(), np.arange(3) * comm.size + sum(range(comm.size)) + comm.size * start,
                 f"barrier then all_reduce start {start}")


def case_persistent_lifecycle(c: Checker) -> None:
    """What is refused, and said clearly: a start again before wait(), an input that is not
    C-contiguous; plain calls and persistent starts of the same collective interleave; a
    start once the communicator closed raises its error."""
    comm, n, rank, xp = c.comm, c.comm.size, c.comm.rank, c.xp
    x, out = xp.zeros(64, "float32"), xp.zeros(64, "float32")
    persistent = comm.all_reduce_init(x, out=out)
    assert "all_reduce" in repr(persistent)
    ins = c.inputs("float32", (64,), 900)
    _fill(c, x, ins[rank])
    persistent.start()
    try:
        persistent.start()
    except RuntimeError as exc:
        assert "before wait()" in str(exc), exc
    else:
        raise AssertionError("a second start() before wait() was taken")
    persistent.wait()
    c.expect(out, c.reduce_reference(ins, "sum"), "lifecycle first start")
    strided = xp.zeros(128, "float32")[::2]
    try:
        comm.all_reduce_init(strided)
    except ValueError as exc:
        assert "C-contiguous" in str(exc), exc
    else:
        raise AssertionError("a strided input was taken")
    for i in range(4):  # plain and persistent calls of the same collective, interleaved
        ins = c.inputs("float32", (64,), 910 + i)
        _fill(c, x, ins[rank])
        if i % 2:
            persistent()
        else:
            comm.all_reduce(x, out=out)
        c.expect(out, c.reduce_reference(ins, "sum"), f"lifecycle interleaved {i}")
    assert host(out).shape == (64,)
    comm.close()
    try:
        persistent.start()
    except gpuring.CommunicatorClosedError:
        pass
    else:
        raise AssertionError("a start after close() was taken")
    assert n >= 1


def case_persistent_cuda(c: Checker) -> None:
    """CuPy only: a small persistent all_reduce's start makes at most 2 driver calls in the
    kernel form (GPURING_CUDA_FUSED=kernel), and persistent starts captured into a CUDA
    graph replay with fresh inputs (the rank-order fold's bits, on every rank), in the kernel
    form and in auto (where ranks that share a GPU capture the kernel form)."""
    comm, rank, xp = c.comm, c.comm.rank, c.xp
    assert xp is not np, "a CuPy case"
    fused = os.environ.get("GPURING_CUDA_FUSED")
    x, out = xp.zeros(4096, "float32"), xp.zeros(4096, "float32")  # 16 KiB: one operation
    persistent = comm.all_reduce_init(x, out=out)
    persistent()
    before = comm.device_operations
    for _ in range(10):
        persistent()
    calls = (comm.device_operations - before) / 10
    if fused == "kernel":
        assert calls <= 2, f"a persistent start made {calls} driver calls"
        assert comm.last_schedule == "fused", comm.last_schedule
    print(f"rank {rank}: {calls:g} driver calls per persistent start ({fused})")
    stream = xp.cuda.Stream(non_blocking=True)
    big_x, big_out = xp.zeros(300_001, "float32"), xp.zeros(300_001, "float32")
    with stream:
        small = comm.all_reduce_init(x, out=out)
        big = comm.all_reduce_init(big_x, out=big_out)  # in pieces: one kernel per piece
        gather = comm.all_gather_init(x[:5], out=xp.zeros((comm.size, 5), "float32"))
        for replay in range(2):  # started as they are (every form)
            ins = c.inputs("float32", (4096,), 900 + replay)
            bigs = c.inputs("float32", (300_001,), 950 + replay)
            x[...], big_x[...] = dev(c, ins[rank]), dev(c, bigs[rank])
            for op in (small, big, gather):
                op()
            c.expect(small.wait(), c.reduce_reference(ins, "sum"), f"started {replay} small")
            c.expect(big.wait(), c.reduce_reference(bigs, "sum"), f"started {replay} big")
            c.expect(gather.wait(), np.stack([a[:5] for a in ins]),
                     f"started {replay} all_gather", copy=True)
        stream.synchronize()
        if fused in ("memops", "off"):  # (these forms refuse captures)
            return
        stream.begin_capture()
        for op in (small, big, gather):
            op.start()
        graph = stream.end_capture()
        for replay in range(3):
            ins = c.inputs("float32", (4096,), 1000 + replay)
            bigs = c.inputs("float32", (300_001,), 1100 + replay)
            x[...], big_x[...] = dev(c, ins[rank]), dev(c, bigs[rank])
            graph.launch(stream)
            stream.synchronize()
            c.expect(small.wait(), rank_order_fold(ins, "sum"), f"graph replay {replay} small",
                     copy=True)
            c.expect(big.wait(), rank_order_fold(bigs, "sum"), f"graph replay {replay} big",
                     copy=True)
            c.expect(gather.wait(), np.stack([a[:5] for a in ins]),
                     f"graph replay {replay} all_gather", copy=True)


def _frames_below(top_file: str, top_name: str) -> int:
    """Frames from the nearest caller frame of function `top_name` in `top_file` (itself not
    counted) down to the caller of this function (counted); -1 where there is none."""
    frame, depth = sys._getframe(2), 1
    while frame is not None:
        code = frame.f_code
        if code.co_name == top_name and code.co_filename.endswith(top_file):
            return depth - 1
        frame, depth = frame.f_back, depth + 1
    return -1


#: the most Python frames a repeated small call may take from the public verb (below it) or
#: a persistent start (itself counted) to the engine's run
MOST_FRAMES = 6


def case_call_depth(c: Checker) -> None:
    """A repeated small all_reduce reaches `Engine.run` in at most MOST_FRAMES frames below
    the public verb, and a persistent start in at most MOST_FRAMES from `start`: counted by
    a probe that wraps `Engine.run` (its result checked, so the probe ran the call)."""
    from gpuring._engine import Engine

    comm, rank = c.comm, c.comm.rank
    depths: list[tuple[int, int]] = []
    plain_run = Engine.run

    def probe(self, *args, **kwargs):
        start = _frames_below("_persistent.py", "start")
        depths.append((_frames_below("_work.py", "verb"), start + 1 if start >= 0 else -1))
        return plain_run(self, *args, **kwargs)

    Engine.run = probe
    try:
        ins = c.inputs("float32", (64,), 77)
        x = dev(c, ins[rank])
        for _ in range(3):  # the first call prepares; the others come again
            got = comm.all_reduce(x)
        c.expect(got, c.reduce_reference(ins, "sum"), "probed all_reduce")
        plain = [below for below, _ in depths]
        depths.clear()
        persistent = comm.all_reduce_init(x, out=dev(c, np.zeros(64, "float32")))
        for _ in range(2):
            persistent()
        c.expect(persistent.wait(), c.reduce_reference(ins, "sum"), "probed start")
        starts = [start for _, start in depths]
    finally:
        Engine.run = plain_run
    assert plain and 0 < plain[-1] <= MOST_FRAMES, \
        f"a repeated all_reduce reached Engine.run {plain[-1]} frames below the verb " \
        f"(at most {MOST_FRAMES})"
    assert starts and 0 < starts[-1] <= MOST_FRAMES, \
        f"a persistent start reached Engine.run in {starts[-1]} frames (at most {MOST_FRAMES})"
    print(f"rank {rank}: {plain[-1]} frames below the verb, {starts[-1]} from a start")


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}

if __name__ == "__main__":
    run_case(CASES)
