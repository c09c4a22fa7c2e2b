"""gpuring's own host time per small CuPy all_reduce, driver calls excluded.

    gpuring run -n 2 python bench/host_cost.py [--size 1K] [--iters 5000] [--persistent]

Every rank first runs real collectives (warm-up, and a check of the result), then replaces
each driver call CudaDevice makes (kernel launches, copies, stream memory operations, event
creations, records and waits) with a call that does nothing, and times `--iters`
all_reduce calls back to back on the same arrays (as a training step's buckets, or a
loop's buffers, come again): what remains is the call path's Python (argument checks or the
call kept from last time, the scheduler, the status board, the watchdog's bookkeeping), the
CuPy calls it makes (the current stream, whether it captures, the current device), and one
no-op Python call per driver call it would make (an event record still runs gpuring's own
wrapper, reuse and bookkeeping, with a raw event that records nothing). Reported per rank:
the median of 5 runs of the loop and the best, the driver calls one all_reduce makes
(`comm.device_operations`), the Python bytecode instructions run in gpuring's own frames per
call (counted by a tracer: the same on a fast or a slow machine, which timings here are not,
though not weighted by what each costs), and how the median splits between gpuring's own
code, CuPy's and the no-op stand-ins with the loop: a statistical profile of more runs
(SIGPROF every 100 us of CPU time, or as often as the kernel's clock allows; each sample goes to the
innermost frame of gpuring, CuPy or this script, so standard-library and C calls count for
their caller; on a GPU, CuPy's Cython has no frames, so its time counts as gpuring's).
The ranks take turns, so that each times its calls while the others wait idle (2 ranks on
2 cores would otherwise share them with every other thread of the job). Needs CuPy: a
GPU, or the CUDA simulator of tests/cudasim (see tests/multiproc/test_cuda_simulated.py),
whose CuPy is Python.
"""

from __future__ import annotations

import argparse
import collections
import signal
import statistics
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import numpy as np

import gpuring
from gpuring import _lastcalls
from gpuring._config import parse_size
from gpuring.devices import _cuda_fused, _cuda_streams, cuda

if TYPE_CHECKING:
    from _typeshed import TraceFunction


class _RawEvent:
    """A CUDA event whose record is a no-op."""

    ptr = 0

    def record(self, stream: object = None) -> None:
        pass


def _without_driver() -> None:
    """Every CudaDevice call that reaches the driver becomes a no-op: the stream operations
    (copies, kernels, flag waits and writes, event waits, the one-operation collectives'
    launches and stream memory operation, whose arguments are still worked out), and the raw
    event under an event record, whose wrapper, reuse and bookkeeping still run as gpuring
    runs them; every event has completed."""
    stream = _cuda_streams.CudaStream
    for name in ("copy", "reduce", "reduce_n", "wait_flag", "write_flag", "write_flags",
                 "wait_event"):
        setattr(stream, name, lambda self, *args, **kwargs: None)
    _cuda_fused.FusedKernel._enqueue = (  # type: ignore[method-assign]
        lambda self, stream, args: None)
    _cuda_fused.StagedAllReduce._enqueue = (  # type: ignore[method-assign]
        lambda self, stream, args: None)
    _cuda_fused.StagedAllReduce._wait = (  # type: ignore[method-assign]
        lambda self, driver, cu, params: None)
    _cuda_fused.StagedAllReduce._fold = (  # type: ignore[method-assign]
        lambda self, stream, args: None)
    _cuda_streams.take_event = lambda device: _RawEvent()
    cuda.CudaDevice.order_caller_after = (  # type: ignore[method-assign]
        lambda self, event: None)
    _cuda_streams.CudaEvent.query = lambda self: True  # type: ignore[method-assign]


def _without_last_calls(comm: gpuring.Communicator, call: Callable[[], Any]
                        ) -> Callable[[], Any]:
    """Every call checked anew (`_lastcalls.LastCalls` finds nothing)."""
    _lastcalls.LastCalls.find = lambda *args: None  # type: ignore[method-assign]
    return call


def _without_prepared(comm: gpuring.Communicator, call: Callable[[], Any]
                      ) -> Callable[[], Any]:
    """Every call prepared anew (the ranks' agreement on it still kept)."""
    path = comm._path

    def again() -> Any:
        path._forget_prepared()
        return call()

    return again


def _without_runners(comm: gpuring.Communicator, call: Callable[[], Any]
                     ) -> Callable[[], Any]:
    """Each call compiles its rounds' runners anew (`Launch.runners` and the engine's)."""
    def again() -> Any:
        for prepared in comm._path.prepared.values():
            if prepared.launch is not None:
                prepared.launch.runners.clear()
                prepared.launch.channel_runners.clear()
        return call()

    return again


#: --without: what defeats each cache of the call path
_WITHOUT = {"last-calls": _without_last_calls, "prepared": _without_prepared,
            "runners": _without_runners}


def _owner(frame: FrameType | None) -> str:
    """Whose code a sample is in: the innermost frame of gpuring, CuPy (or the simulator
    that stands for it) or this script ("stand-ins": the loop, and the no-op driver calls)."""
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if module == "gpuring" or module.startswith("gpuring."):
            return "gpuring"
        if module.split(".")[0] in ("cupy", "cupyx", "cupy_backends"):
            return "cupy"
        if module == "__main__":
            return "stand-ins"
        frame = frame.f_back
    return "other"


def _profile(loop: Callable[[], None], samples_wanted: int = 2000,
             seconds: float = 20.0) -> collections.Counter[str]:
    """Samples of runs of `loop` per owner (`_owner`): runs until `samples_wanted` samples
    or `seconds` (the timer ticks as the kernel's clock allows, often every few ms)."""
    samples: collections.Counter[str] = collections.Counter()

    def sample(signum: int, frame: FrameType | None) -> None:
        samples[_owner(frame)] += 1

    previous = signal.signal(signal.SIGPROF, sample)
    signal.setitimer(signal.ITIMER_PROF, 1e-4, 1e-4)
    deadline = time.monotonic() + seconds
    try:
        while samples.total() < samples_wanted and time.monotonic() < deadline:
            loop()
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        signal.signal(signal.SIGPROF, previous)
    return samples


def _opcodes(call: Callable[[], None], calls: int = 20,
             where: collections.Counter[str] | None = None) -> float:
    """Python bytecode instructions run in gpuring's own frames per `call()`, counted by a
    tracer (so not timed): the same from run to run on any machine for one Python version
    (give or take the watchdog's timing), though not weighted by cost (work done in C, NumPy
    or the CUDA bindings counts as one instruction or none). `where`, if given, gets the
    count per function (module:qualified name)."""
    count = 0

    def trace(frame: FrameType, event: str, arg: Any) -> TraceFunction | None:
        nonlocal count
        if event == "call":
            module = frame.f_globals.get("__name__") or ""
            if module != "gpuring" and not module.startswith("gpuring."):
                return None
            frame.f_trace_opcodes, frame.f_trace_lines = True, False
        elif event == "opcode":
            count += 1
            if where is not None:
                code = frame.f_code
                name = getattr(code, "co_qualname", code.co_name)
                where[f"{frame.f_globals.get('__name__')}:{name}"] += 1
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        for _ in range(calls):
            call()
    finally:
        sys.settrace(previous)
    return count / calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="1K", help="bytes of float32 (default 1K)")
    p.add_argument("--iters", type=int, default=5000)
    p.add_argument("--persistent", action="store_true",
                   help="time a persistent all_reduce's start and wait (comm.all_reduce_init, "
                        "then op() per call) instead of the plain call")
    p.add_argument("--profile", action="store_true",
                   help="rank 0 also prints where the time goes (cProfile, top 25)")
    p.add_argument("--without", choices=sorted(_WITHOUT), action="append", default=[],
                   help="time the plain call without one of the call path's caches (again "
                        "for several): what each is worth")
    p.add_argument("--where", action="store_true",
                   help="rank 0 also prints gpuring's opcodes per call by function")
    args = p.parse_args()
    import cupy

    n = parse_size(args.size) // 4
    with gpuring.init() as comm:
        x = cupy.asarray(np.random.default_rng(comm.rank).standard_normal(n, np.float32))
        out = cupy.empty_like(x)
        want = comm.all_gather(x).sum(axis=0)
        for _ in range(20):
            comm.all_reduce(x, out=out)
        cupy.cuda.Device().synchronize()
        assert float(abs(out - want).max()) < 1e-3, "a wrong result before timing"

        def plain() -> None:
            comm.all_reduce(x, out=out)

        call: Callable[[], Any] = comm.all_reduce_init(x, out=out) if args.persistent \
            else plain
        for cache in args.without:
            call = _WITHOUT[cache](comm, call)
        form = "persistent " if args.persistent else ""
        form += "".join(f"(without {cache}) " for cache in args.without)
        out.fill(0)
        call()
        cupy.cuda.Device().synchronize()
        assert float(abs(out - want).max()) < 1e-3, f"a wrong {form}result before timing"
        before = comm.device_operations
        for _ in range(100):
            call()
        calls = (comm.device_operations - before) / 100
        comm.barrier()
        cupy.cuda.Device().synchronize()
        _without_driver()
        runs = []
        samples: collections.Counter[str] = collections.Counter()
        opcodes = 0.0

        def loop() -> None:
            for _ in range(args.iters):
                call()

        for turn in range(comm.size):  # one rank at a time: the others wait, idle
            comm._control.barrier(60.0, "host_cost turn")
            if turn != comm.rank:
                continue
            for _ in range(5):
                t0 = time.perf_counter()
                loop()
                runs.append((time.perf_counter() - t0) / args.iters * 1e6)
            samples = _profile(loop)
            where: collections.Counter[str] = collections.Counter()
            opcodes = _opcodes(call, where=where)
            if args.where and comm.rank == 0:
                for function, ops in where.most_common():
                    print(f"{ops / 20:7.1f}  {function}")
            if args.profile and comm.rank == 0:
                import cProfile
                import pstats

                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(args.iters):
                    call()
                profiler.disable()
                pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
        # every rank makes as many calls as the busiest one (the profile ran for a while): the
        # ranks close as after the same collectives (else each would rightly report that a
        # peer closed without entering a collective it entered)
        calls_so_far = comm._control.exchange("host_cost calls", comm._path.seq, 60.0)
        for _ in range(max(calls_so_far) - comm._path.seq):
            call()
        comm._control.barrier(60.0, "host_cost done")
        median, total = statistics.median(runs), samples.total() or 1
        split = ", ".join(f"{owner} {median * count / total:.2f} us ({count / total:.0%})"
                          for owner, count in samples.most_common())
        print(f"rank {comm.rank}: {form}all_reduce of {n * 4} B float32 on {comm.size} ranks: "
              f"{median:.2f} us of host time per call without the driver, best run "
              f"{min(runs):.2f} (runs: {', '.join(f'{r:.2f}' for r in runs)}), "
              f"{calls:.0f} driver calls and {opcodes:.0f} Python opcodes of gpuring per call; "
              f"of the median ({total} samples): {split}",
              flush=True)


if __name__ == "__main__":
    main()
