"""`gpuring bench`: arguments (nccl-tests' flags where they mean the same), and launching
ranks with `--ranks N` when not already inside `gpuring run` or mpiexec."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from .._config import parse_size
from .._ops import SUPPORTED_DTYPES, ReduceOp, check_op_dtype
from . import preflight
from .metrics import MEASURED, REDUCING
from .options import Settings
from .peers import parse_peers
from .runner import run

__all__ = ["add_arguments", "main", "settings_from_args", "to_argv", "already_launched"]

_OPS = ("sum", "prod", "min", "max", "avg")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `gpuring bench`."""
    p.add_argument("collective", nargs="?", default="all_reduce", choices=MEASURED,
                   help="what to measure (default all_reduce; barrier: its latency; "
                        "sendrecv: each rank to the next and from the previous; pingpong: "
                        "rank 0 to rank 1 and back, the time per message)")
    p.add_argument("-b", "--minbytes", default="8", help="smallest size: 8, 4K, 64M, 1G")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=2,
                   help="multiply the size by this each step (default 2)")
    p.add_argument("-i", "--stepbytes", default=None,
                   help="add this many bytes each step instead of multiplying (linear sizes)")
    p.add_argument("-n", "--iters", type=int, default=20,
                   help="timed calls per size, back to back after one barrier (default 20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5,
                   help="untimed warm-up calls of each system at every size, once before "
                        "the first measurement (default 5)")
    p.add_argument("-a", "--average", type=int, default=1, choices=(0, 1, 2, 3),
                   help="how the ranks' times combine: 0 rank 0's, 1 their average "
                        "(default), 2 the minimum, 3 the maximum")
    p.add_argument("-I", "--per-iteration", dest="per_iteration", action="store_true",
                   help="time every call on its own after a barrier instead; an iteration's "
                        "time is its slowest rank's; reports p50 (shown), p99 and max, and "
                        "each rank's own")
    p.add_argument("-G", "--cudagraph", dest="graph_launches", type=int, default=0,
                   help="CUDA graphs: capture -n calls into one graph, time this many launches "
                        "of it (GPU; systems that cannot be captured say so)")
    p.add_argument("-N", "--repeats", type=int, default=1,
                   help="run the whole sweep this many times and report the spread between "
                        "the repeats (default 1)")
    p.add_argument("-z", "--blocking", type=int, default=0, choices=(0, 1),
                   help="0: calls enqueued back to back (default); 1: wait for each call to "
                        "complete before the next")
    p.add_argument("-c", "--check", type=int, default=1,
                   help="checked iterations, apart from the timed ones (default 1; 0: none)")
    p.add_argument("-o", "--op", default="sum", choices=(*_OPS, "all"),
                   help="reduction (default sum; all: each in turn)")
    p.add_argument("-d", "--datatype", default="float32", choices=(*SUPPORTED_DTYPES, "all"),
                   help="element type (default float32; all: every type the ops take)")
    p.add_argument("-r", "--root", default="0",
                   help="root of broadcast and reduce (default 0; all: each rank in turn)")
    p.add_argument("-R", "--registered", type=int, default=0, choices=(0, 1),
                   help="1: every array in registered memory (Communicator.empty), which "
                        "gpuring's peers read in place; peers run on the same arrays "
                        "(default 0: plain arrays)")
    p.add_argument("-P", "--persistent", action="store_true",
                   help="also time gpuring's persistent form (comm.all_reduce_init and its "
                        "twins: checked and agreed on once, then op() per call), as the "
                        "system 'persist' beside the plain calls")
    p.add_argument("--off-cache", dest="off_cache", action="store_true",
                   help="rotate the timed calls over buffer sets twice the size of the "
                        "largest cache, so no call finds its data in cache")
    p.add_argument("--overlap", action="store_true",
                   help="also measure how much of each collective hides behind compute "
                        "(the non-blocking forms of gpuring and MPI)")
    p.add_argument("--ranks", type=int, default=None,
                   help="launch this many ranks (ignored inside gpuring run or mpiexec)")
    p.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto",
                   help="NumPy arrays on the CPU or CuPy arrays on GPUs (auto: cuda when "
                        "CuPy sees a GPU)")
    p.add_argument("--peers", default="",
                   help="compare with these, comma-separated: mpi, nccl, gloo, or all")
    p.add_argument("--json", metavar="FILE", help="write every number here")
    p.add_argument("--csv", metavar="FILE", help="write the rows here")
    p.add_argument("--plot", metavar="FILE.png", help="draw busbw and latency (matplotlib)")
    p.add_argument("--chunk-bytes", dest="chunk_bytes", default=None,
                   help="pipeline piece size passed to every collective")
    p.add_argument("--channels", type=int, default=None, help="parallel rings per collective")


def already_launched() -> bool:
    """Inside `gpuring run` (GPURING_STORE set) or an MPI launcher."""
    from ..rendezvous.mpi import launched_by_mpi
    from ..rendezvous.store import ENV_ADDR

    return bool(os.environ.get(ENV_ADDR)) or launched_by_mpi()


def _dtypes(choice: str, collective: str, ops: list[str]) -> list[str]:
    """`-d`: one dtype, or with "all" every dtype every op takes (that NumPy has)."""
    if choice != "all":
        return [choice]
    found = []
    for dtype in SUPPORTED_DTYPES:
        if dtype == "bfloat16":
            try:
                import ml_dtypes  # noqa: F401
            except ImportError:
                continue
        try:
            if collective in REDUCING:
                for op in ops:
                    check_op_dtype(ReduceOp.parse(op), dtype)
        except TypeError:
            continue
        found.append(dtype)
    return found


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Validated Settings (ValueError or TypeError with a message for the user); the device
    stays as given ("auto" is resolved by the ranks)."""
    if args.iters < 1 or args.warmup_iters < 0 or args.check < 0 or args.repeats < 1:
        raise ValueError("-n must be at least 1, -N at least 1, -w and -c at least 0")
    if args.graph_launches < 0:
        raise ValueError("-G must be 0 (no CUDA graphs) or more")
    if args.graph_launches and (args.per_iteration or args.blocking or args.overlap):
        raise ValueError("-G times launches of a graph: not with -I, -z 1 or --overlap")
    if args.graph_launches and args.device == "cpu":
        raise ValueError("-G needs the GPU (--device cuda)")
    ops = list(_OPS) if args.op == "all" else [args.op]
    if args.datatype == "bfloat16":
        try:
            import ml_dtypes  # noqa: F401 - gives NumPy the bfloat16 dtype
        except ImportError:
            raise ValueError("-d bfloat16 needs ml_dtypes: pip install ml_dtypes") from None
    dtypes = _dtypes(args.datatype, args.collective, ops)
    if args.collective in REDUCING:
        for op in ops:
            for dtype in dtypes:
                check_op_dtype(ReduceOp.parse(op), dtype)
    if args.channels is not None and not 1 <= args.channels <= 32:
        raise ValueError("--channels must be between 1 and 32")
    if str(args.root) == "all":
        roots: list[int] | None = None  # every rank: known once the ranks are up
    else:
        try:
            roots = [int(args.root)]
        except ValueError:
            raise ValueError(f"-r takes a rank or all, not {args.root!r}") from None
        if roots[0] < 0:
            raise ValueError("-r must be a rank (0 or more) or all")
    if parse_size(args.minbytes) > parse_size(args.maxbytes):
        raise ValueError(f"-b {args.minbytes} is larger than -e {args.maxbytes}: the sweep "
                         "would be empty")
    step = parse_size(args.stepbytes) if args.stepbytes else None
    if step is not None and step < 1:
        raise ValueError("-i must be at least 1 byte")
    return Settings(
        collective=args.collective, min_bytes=parse_size(args.minbytes),
        max_bytes=parse_size(args.maxbytes), factor=args.stepfactor, step_bytes=step,
        iters=args.iters, warmup=args.warmup_iters, average=args.average,
        per_iteration=args.per_iteration, repeats=args.repeats, blocking=bool(args.blocking),
        graph_launches=args.graph_launches,
        check_iters=args.check, ops=ops, dtypes=dtypes, roots=roots or [],
        device=args.device, peers=parse_peers(args.peers),
        chunk_bytes=parse_size(args.chunk_bytes) if args.chunk_bytes else None,
        channels=args.channels, off_cache=args.off_cache, overlap=args.overlap,
        persistent=args.persistent,
        registered=bool(args.registered), json=args.json, csv=args.csv, plot=args.plot)


def to_argv(args: argparse.Namespace) -> list[str]:
    """The same run as arguments for the ranks (without --ranks)."""
    argv = [args.collective, "-b", str(args.minbytes), "-e", str(args.maxbytes),
            "-f", str(args.stepfactor), "-n", str(args.iters), "-w", str(args.warmup_iters),
            "-a", str(args.average), "-c", str(args.check), "-o", args.op, "-d",
            args.datatype, "-r", str(args.root), "--device", args.device,
            "-N", str(args.repeats), "-z", str(args.blocking), "-G", str(args.graph_launches),
            "-R", str(args.registered)]
    for flag, on in (("-I", args.per_iteration), ("--off-cache", args.off_cache),
                     ("--overlap", args.overlap), ("-P", args.persistent)):
        if on:
            argv.append(flag)
    for flag, value in (("-i", args.stepbytes), ("--peers", args.peers), ("--json", args.json),
                        ("--csv", args.csv), ("--plot", args.plot),
                        ("--chunk-bytes", args.chunk_bytes), ("--channels", args.channels)):
        if value not in (None, ""):
            argv += [flag, str(value)]
    return argv


def _spawn(args: argparse.Namespace) -> int:
    from .._launcher import run
    from .progress import STREAM_ENV, Follower, ProgressView

    with tempfile.TemporaryDirectory(prefix="gpuring-bench-") as tmp:
        stream = os.path.join(tmp, "rank0.jsonl")
        open(stream, "w").close()
        follower = Follower(stream, ProgressView())
        follower.start()
        try:
            env = dict(os.environ, **{STREAM_ENV: stream})
            code = run([sys.executable, "-m", "gpuring", "bench", *to_argv(args)], args.ranks,
                       env=env, quiet=True)
        finally:
            follower.stop()
    if code and not follower.saw_failure:
        print(f"gpuring bench: the ranks failed (exit status {code})", file=sys.stderr)
    return code


def main(args: argparse.Namespace) -> int:
    """Run `gpuring bench`; the exit status is 1 when any result was wrong, 2 when the
    arguments are wrong or what they need is missing (found before measuring)."""
    try:
        settings = settings_from_args(args)
    except (ValueError, TypeError) as exc:  # TypeError: op not defined for the dtype
        print(f"gpuring bench: {exc}", file=sys.stderr)
        return 2
    if args.ranks is not None and args.ranks < 1:
        print("gpuring bench: --ranks must be at least 1", file=sys.stderr)
        return 2
    if args.ranks is not None and not already_launched():
        cores = os.cpu_count() or 1
        if args.ranks > cores:
            print(f"gpuring bench: {args.ranks} ranks on {cores} cores: the ranks share "
                  "cores, so times include waiting for one; compare ratios within a run, "
                  "not times across runs", file=sys.stderr)
        problems = preflight.problems(settings, writes_files=True)
        for line in problems:
            print(f"gpuring bench: {line}", file=sys.stderr)
        return 2 if problems else _spawn(args)
    from .timing import resolve_device

    settings.device = resolve_device(settings.device)
    return run(settings)
