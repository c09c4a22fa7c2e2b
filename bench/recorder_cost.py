"""What the flight recorder costs a small NumPy all_reduce: the same calls with it on and off,
in the same processes, taking turns.

    mpiexec -n 2 python bench/recorder_cost.py [--iters 3000] [--rounds 6]
    gpuring run -n 2 python bench/recorder_cost.py
    python bench/recorder_cost.py --alone      (a world of one, in thread CPU time)

For 8 B, 256 B and 4 KiB (float32, sum) two kinds of call: `out=` given (the call that comes
again: `LastCalls` keeps its checks) and a new output each call (`comm.all_reduce(x)`: checked
anew every time). Either way the recorder's entry holds the prepared call, described when it
was prepared. Each round times `--iters` back-to-back calls with the recorder on, then off
(`comm._path.ring` set to None, the only thing that turns it off), or off then on (the order
alternates), as the median of 3 repetitions of the per-call mean; the line gives the median
over the rounds of each and of their difference (on - off, per round), and "best" the
difference of the best repetitions (the lowest per-call mean of all rounds with it on, less
that with it off: a busy machine only adds time, so the best ones are the least disturbed).
Rank 0 also counts the Python bytecode instructions run in gpuring's frames per call but the
devices' (whose flag waits spin as long as the peer takes), with the recorder on and off (a
tracer: not timed, the same on a busy machine or a quiet one). Each line is rank 0's view.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import numpy as np

import gpuring

if TYPE_CHECKING:
    from _typeshed import TraceFunction


def per_call_us(comm: gpuring.Communicator, fn: Callable[[], object], iters: int,
                clock: Callable[[], float] = time.perf_counter) -> list[float]:
    """The per-call mean of `iters` calls, 3 times."""
    reps = []
    for _ in range(3):
        comm.barrier()
        t0 = clock()
        for _ in range(iters):
            fn()
        reps.append((clock() - t0) / iters * 1e6)
    return reps


def opcodes(fn: Callable[[], object], calls: int = 50) -> float:
    """Python bytecode instructions run in gpuring's frames per `fn()` (a tracer), those of
    the devices left out (the host device's flag waits spin in Python, as long as the peer
    takes: a count that depends on timing)."""
    count = 0

    def trace(frame: FrameType, event: str, arg: Any) -> TraceFunction | None:
        nonlocal count
        if event == "call":
            module = frame.f_globals.get("__name__") or ""
            if (module != "gpuring" and not module.startswith("gpuring.")) or \
                    module.startswith("gpuring.devices."):
                return None
            frame.f_trace_opcodes, frame.f_trace_lines = True, False
        elif event == "opcode":
            count += 1
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        for _ in range(calls):
            fn()
    finally:
        sys.settrace(previous)
    return count / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--alone", action="store_true",
                        help="a world of one (no launcher): the call path and the recorder "
                             "with no peer to wait for, timed in this thread's CPU time "
                             "(time.thread_time), which other processes' load disturbs less")
    args = parser.parse_args()
    comm = gpuring.init()
    clock = time.thread_time if args.alone else time.perf_counter
    path = comm._path
    ring = path.ring
    if ring is None:
        raise SystemExit("the recorder is off (GPURING_TRACE_ENTRIES=0): nothing to compare")
    if comm.rank == 0:
        print(f"# {comm.size} ranks{' (thread CPU time)' if args.alone else ''}, "
              f"float32 sum, {args.iters} calls x 3 per measure, "
              f"{args.rounds} rounds; python {sys.version.split()[0]}, numpy {np.__version__}, "
              f"{ring.capacity} entries per communicator")
        print(f"{'bytes':>6} {'call':>8} {'on us':>7} {'off us':>7} {'on-off':>7} "
              f"{'opcodes on':>10} {'off':>5} {'best':>6}")
    for nbytes in (8, 256, 4096):
        x = np.random.default_rng(comm.rank).standard_normal(nbytes // 4).astype(np.float32)
        out = np.empty_like(x)
        expected = sum(np.random.default_rng(r).standard_normal(nbytes // 4).astype(np.float32)
                       for r in range(comm.size))
        comm.all_reduce(x, out=out)
        assert np.allclose(out, expected, rtol=1e-5, atol=1e-5), "wrong result"
        kinds: dict[str, Callable[[], object]] = {
            "out=": functools.partial(comm.all_reduce, x, out=out),
            "new": functools.partial(comm.all_reduce, x),
        }
        for kind, fn in kinds.items():
            for _ in range(args.iters // 5):  # warm-up, with the recorder on
                fn()
            on, off, diff = [], [], []
            best = {True: float("inf"), False: float("inf")}
            for i in range(args.rounds):
                order = (ring, None) if i % 2 == 0 else (None, ring)
                times = {}
                for setting in order:
                    path.ring = setting
                    reps = per_call_us(comm, fn, args.iters, clock)
                    times[setting is not None] = statistics.median(reps)
                    best[setting is not None] = min(best[setting is not None], *reps)
                path.ring = ring
                on.append(times[True])
                off.append(times[False])
                diff.append(times[True] - times[False])
            counted = {}
            for setting in (ring, None):  # every rank counts, so the ranks keep in step
                path.ring = setting
                counted[setting is not None] = opcodes(fn)
            path.ring = ring
            if comm.rank == 0:
                print(f"{nbytes:>6} {kind:>8} {statistics.median(on):7.2f} "
                      f"{statistics.median(off):7.2f} {statistics.median(diff):7.2f} "
                      f"{counted[True]:10.0f} {counted[False]:5.0f} "
                      f"{best[True] - best[False]:6.2f}", flush=True)
    comm.close()


if __name__ == "__main__":
    main()
