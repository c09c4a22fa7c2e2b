"""`gpuring tune`: measure algorithm x piece size x channels over a size sweep on this
machine, and write the tuning table (`gpuring._tuning`) whose choices the collectives then
take by default (GPURING_TUNING=FILE or `init(tuning=FILE)`).

Every candidate of every size is timed on the same arrays, checked once on integer-valued
data (whose sums are exact), and the fastest (median of `--repeats` loops of `-n` calls, the
slowest rank's time) is chosen; neighbouring sizes with the same choice merge into one entry,
whose range ends halfway (geometrically) to the next size measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import tempfile
from typing import Any, NamedTuple

import numpy as np

from .._tuning import FORMAT, TUNED, Choice, from_dict
from ..settings import parse_size
from .metrics import size_series
from .progress import STREAM_ENV, Follower, Output, ProgressView, stream_path_from_env
from .timing import Backend, cuda_backend, host_backend, resolve_device, time_loop

__all__ = ["add_arguments", "main", "choose", "Candidate"]

#: the largest all_reduce tried one-shot (it reads every rank's whole input on every rank)
ONE_SHOT_LIMIT = 4 << 20


class Candidate(NamedTuple):
    algorithm: str
    chunk_bytes: int
    channels: int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=None,
                   help="launch this many ranks (ignored inside gpuring run or mpiexec)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto",
                   help="NumPy arrays on the CPU or CuPy arrays on GPUs (auto: cuda when "
                        "CuPy sees a GPU)")
    p.add_argument("-o", "--output", default=None,
                   help="the table's file (default gpuring-tuning-DEVICE-NRANKS.json)")
    p.add_argument("--collectives", default="all_reduce",
                   help=f"comma-separated, of {', '.join(TUNED)} (default all_reduce)")
    p.add_argument("-b", "--minbytes", default="1K", help="smallest size (default 1K)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=4,
                   help="each size is this many times the last (default 4)")
    p.add_argument("-n", "--iters", type=int, default=10,
                   help="calls per timed loop (default 10)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed loops per candidate; the median counts (default 3)")
    p.add_argument("--chunk-bytes", dest="chunk_bytes", default=None,
                   help="piece sizes to try, comma-separated (default: the device's default "
                        "piece / 4, x1 and x4)")
    p.add_argument("--channels", default="1,2",
                   help="channel counts to try, comma-separated (default 1,2)")


def main(args: argparse.Namespace) -> int:
    """Run `gpuring tune` (launching `--ranks` ranks unless already among them)."""
    from .cli import already_launched

    try:
        _check(args)
    except ValueError as exc:
        print(f"gpuring tune: {exc}", file=sys.stderr)
        return 2
    if args.ranks is not None and not already_launched():
        if args.ranks < 2:
            print("gpuring tune: --ranks must be at least 2", file=sys.stderr)
            return 2
        return _spawn(args)
    return _tune(args)


def _check(args: argparse.Namespace) -> None:
    for name in _list(args.collectives):
        if name not in TUNED:
            raise ValueError(f"cannot tune {name!r}; choose from {', '.join(TUNED)}")
    if args.iters < 1 or args.repeats < 1:
        raise ValueError("-n and --repeats must be at least 1")
    size_series(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor, 1)
    for value in _list(args.channels):
        if not 1 <= int(value) <= 32:
            raise ValueError(f"channels must be between 1 and 32, not {value}")
    for value in _list(args.chunk_bytes or ""):
        if parse_size(value) < 1:
            raise ValueError("piece sizes must be positive")


def _list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _spawn(args: argparse.Namespace) -> int:
    from .._launcher import run

    argv = [sys.executable, "-m", "gpuring", "tune", "--device", args.device,
            "--collectives", args.collectives, "-b", args.minbytes, "-e", args.maxbytes,
            "-f", str(args.stepfactor), "-n", str(args.iters), "--repeats", str(args.repeats),
            "--channels", args.channels]
    if args.chunk_bytes:
        argv += ["--chunk-bytes", args.chunk_bytes]
    if args.output:
        argv += ["-o", os.path.abspath(args.output)]
    with tempfile.TemporaryDirectory(prefix="gpuring-tune-") as tmp:
        stream = os.path.join(tmp, "rank0.jsonl")
        open(stream, "w").close()
        follower = Follower(stream, ProgressView(delay=0.5))
        follower.start()
        try:
            code = run(argv, args.ranks, env=dict(os.environ, **{STREAM_ENV: stream}),
                       quiet=True)
        finally:
            follower.stop()
    if code:
        print(f"gpuring tune: the ranks failed (exit status {code})", file=sys.stderr)
    return code


def candidates(collective: str, size: int, chunks: list[int],
               channels: list[int]) -> list[Candidate]:
    """What is tried at `size`: each algorithm the collective has (one-shot up to
    ONE_SHOT_LIMIT) with each piece size (those larger than the size tried once, as the
    smallest of them) and channel count."""
    algorithms = ["ring", "two_shot"] + (
        ["one_shot"] if collective == "all_reduce" and size <= ONE_SHOT_LIMIT else [])
    fitting = sorted({c for c in chunks if c < size} | {min((c for c in chunks if c >= size),
                                                            default=max(chunks))})
    return [Candidate(a, c, k) for a in algorithms for c in fitting for k in channels]


def choose(collective: str, measured: list[dict[str, Any]]) -> list[Choice]:
    """The table of `collective` from its measurements (rows with size, algorithm,
    chunk_bytes, channels, time_us): the fastest per size, neighbouring sizes with the same
    choice merged, each range ending halfway (geometrically) to the next size."""
    rows = [r for r in measured if r["collective"] == collective]
    sizes = sorted({r["size"] for r in rows})
    best = []
    for size in sizes:
        fastest = min((r for r in rows if r["size"] == size), key=lambda r: r["time_us"])
        best.append((size, Candidate(fastest["algorithm"], fastest["chunk_bytes"],
                                     fastest["channels"])))
    table: list[Choice] = []
    for i, (size, pick) in enumerate(best):
        end = int(math.sqrt(size * best[i + 1][0])) if i + 1 < len(best) else None
        if table and tuple(table[-1])[1:] == tuple(pick):
            table[-1] = table[-1]._replace(max_bytes=end)
        else:
            table.append(Choice(end, *pick))
    return table


def _tune(args: argparse.Namespace) -> int:
    import gpuring

    from .machine import describe

    device = resolve_device(args.device)
    comm = gpuring.init()
    backend = cuda_backend() if device == "cuda" else host_backend()
    backend.use_device(comm.local_rank)
    out = Output(comm.rank == 0, stream_path_from_env())
    try:
        if comm.size < 2:
            out.line("gpuring tune: needs at least 2 ranks (--ranks N, gpuring run or mpiexec)")
            return 2
        measured = _measure(args, comm, backend, device, out)
        tables = {c: choose(c, measured) for c in _list(args.collectives)}
        data = {"format": FORMAT, "device": device, "ranks": comm.size,
                "tables": {c: [t._asdict() for t in table] for c, table in tables.items()},
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "method": f"median of {args.repeats} loops of {args.iters} calls back to "
                          "back after a barrier, the slowest rank's time per call",
                "machine": describe() if comm.rank == 0 else {}, "measured": measured}
        from_dict(data)  # what is written loads
        path = args.output or f"gpuring-tuning-{device}-{comm.size}ranks.json"
        if comm.rank == 0:
            with open(path, "w") as f:
                json.dump(data, f, indent=1)
                f.write("\n")
        for line in _describe(tables, path, comm.size, device):
            out.line(line)
        comm.barrier()
        return 0
    finally:
        out.close()
        comm.close()


def _measure(args: argparse.Namespace, comm: Any, backend: Backend, device: str,
             out: Output) -> list[dict[str, Any]]:
    """Every candidate of every collective and size, timed and checked (rank 0's rows)."""
    from ..devices import device_class

    n, rank = comm.size, comm.rank
    default = device_class(device).default_chunk_bytes
    chunks = ([parse_size(v) for v in _list(args.chunk_bytes)] if args.chunk_bytes else
              [default // 4, default, 4 * default])
    channels = [int(v) for v in _list(args.channels)]
    plan = []
    for collective in _list(args.collectives):
        for size in size_series(parse_size(args.minbytes), parse_size(args.maxbytes),
                                args.stepfactor, 4 * n):
            plan += [(collective, size, c) for c in candidates(collective, size, chunks,
                                                                channels)]
    rows: list[dict[str, Any]] = []
    arrays: dict[tuple[str, int], tuple[Any, Any, np.ndarray]] = {}
    for done, (collective, size, cand) in enumerate(plan):
        out.progress(done, len(plan), f"{collective} {size} B {cand.algorithm} "
                                      f"{cand.chunk_bytes} B x{cand.channels}")
        if (collective, size) not in arrays:
            arrays.clear()
            arrays[(collective, size)] = _arrays(collective, size, n, rank, backend)
        x, result, want = arrays[(collective, size)]
        verb = getattr(comm, collective)
        kwargs = dict(out=result, algorithm=cand.algorithm, chunk_bytes=cand.chunk_bytes,
                      channels=cand.channels)

        def call(verb: Any = verb, x: Any = x, kwargs: dict[str, Any] = kwargs) -> None:
            verb(x, **kwargs)

        call()
        backend.synchronize()
        got = backend.to_host(result) if result is not None else None
        if got is not None and not np.array_equal(got, want):
            raise AssertionError(f"gpuring tune: {collective} of {size} bytes with {cand} "
                                 "gave a wrong result")
        times = [time_loop(call, iters=args.iters, backend=backend, sync=comm.barrier)
                 for _ in range(args.repeats)]
        slowest = comm.all_gather(np.array([float(np.median(times))]))
        rows.append({"collective": collective, "size": size, **cand._asdict(),
                     "time_us": float(np.max(slowest)) * 1e6})
    out.progress(len(plan), len(plan), "done")
    return rows


def _arrays(collective: str, size: int, n: int, rank: int,
            backend: Backend) -> tuple[Any, Any, np.ndarray]:
    """(input, output, the output every rank must get) of `collective` on `size` bytes of
    float32 with small integer values (every sum exact, whatever the order)."""
    count = size // 4
    count -= count % n
    def values(r: int) -> np.ndarray:
        return ((np.arange(count) + 7 * r) % 13).astype(np.float32)

    host = values(rank)
    total = np.zeros(count, np.float32)
    for r in range(n):
        total += values(r)
    x = backend.to_device(host)
    if collective == "reduce_scatter":
        block = count // n
        return x, backend.empty(block, "float32"), total[rank * block:(rank + 1) * block]
    if collective == "reduce":
        root_out = backend.empty(count, "float32") if rank == 0 else None
        return x, root_out, total
    return x, backend.empty(count, "float32"), total


def _describe(tables: dict[str, list[Choice]], path: str, n: int, device: str) -> list[str]:
    lines = [f"# gpuring tune: {n} ranks, device {device}; the table is in {path}",
             "#   collective        up to (B)  algorithm  chunk_bytes  channels"]
    for collective, table in tables.items():
        for choice in table:
            upto = "any" if choice.max_bytes is None else str(choice.max_bytes)
            lines.append(f"    {collective:<14} {upto:>12}  {choice.algorithm:<9} "
                         f"{choice.chunk_bytes:>12}  {choice.channels:>8}")
    lines.append(f"# use it: GPURING_TUNING={path} (or gpuring.init(tuning=...)) on every rank")
    return lines
