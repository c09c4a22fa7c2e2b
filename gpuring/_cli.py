"""The `gpuring` command: `gpuring run` launches ranks; `gpuring bench` measures; `gpuring
tune` writes a tuning table; `gpuring kernels` builds the CUDA kernels ahead of time;
`gpuring doctor` says what went wrong in a job, from its ranks' flight recorders."""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import sys
from collections.abc import Callable

__all__ = ["main"]


def _run(args: argparse.Namespace) -> int:
    from ._launcher import run

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    problem = _run_problem(command, args.nranks)
    if problem is not None:
        print(f"gpuring run: {problem}", file=sys.stderr)
        return 2
    return run(command, args.nranks, grace=args.grace, host=args.host, log_dir=args.log_dir,
               keep_going=args.keep_going)


def _run_problem(command: list[str], nranks: int) -> str | None:
    """What is wrong with `gpuring run`'s arguments, in one line (None: nothing)."""
    if nranks < 1:
        return f"-n must be at least 1, got {nranks}"
    if not command:
        return "nothing to run: give a command, e.g. gpuring run -n 2 python script.py"
    program = command[0]
    if program.endswith(".py"):
        if not os.path.isfile(program):
            return f"no such file: {program}"
    elif os.sep in program:
        if not os.access(program, os.X_OK) or os.path.isdir(program):
            return f"not an executable file: {program}"
    elif shutil.which(program) is None:
        return f"command not found: {program}"
    return None


def _doctor(args: argparse.Namespace) -> int:
    import json

    from . import _doctor as doctor

    try:
        dumps = doctor.load(args.directory)
    except ValueError as exc:
        print(f"gpuring doctor: {exc}", file=sys.stderr)
        return 2
    report = doctor.diagnose(dumps)
    print(json.dumps(report, indent=1) if args.json else doctor.render(report))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench.cli import main as bench_main

    return bench_main(args)


def _tune(args: argparse.Namespace) -> int:
    from .bench.tune import main as tune_main

    return tune_main(args)


def _arch(value: str) -> str:
    """An --arch value: a real GPU architecture (NVRTC builds a CUBIN only for those)."""
    if not re.fullmatch(r"sm_\d+[a-z]?", value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a GPU architecture such as sm_90")
    return value


#: seconds between the lines `gpuring kernels` prints while one build runs
KERNELS_PROGRESS_S = 15.0


def _with_progress(what: str, build: Callable[[], object]) -> None:
    """Run `build`, saying on stderr every KERNELS_PROGRESS_S seconds that `what` still
    runs (NVRTC compiles reduce.cu for one architecture in one call, minutes of CPU: it
    reports nothing on the way)."""
    import threading
    import time

    start = time.perf_counter()
    done = threading.Event()

    def tick() -> None:
        while not done.wait(KERNELS_PROGRESS_S):
            print(f"gpuring kernels: {what}: still running after "
                  f"{time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)

    ticker = threading.Thread(target=tick, name="gpuring-kernels-progress", daemon=True)
    ticker.start()
    try:
        build()
    finally:
        done.set()
        ticker.join()


def _kernels(args: argparse.Namespace) -> int:
    """Build reduce.cu's CUBIN for each --arch, or for GPU 0 here and load every kernel; a
    line before each build, and one every KERNELS_PROGRESS_S seconds while it runs."""
    import time

    from .devices import _kernels as kernels

    archs = list(args.arch)
    try:
        if not archs:
            import cupy

            archs = [f"sm_{cupy.cuda.Device(0).compute_capability}"]
        for number, arch in enumerate(archs, 1):
            start = time.perf_counter()
            path = kernels.cubin_path(arch)
            if not path.is_file():
                print(f"gpuring kernels: {arch} ({number} of {len(archs)}): compiling "
                      f"{kernels.SOURCE_NAME} ({len(kernels.ALL_KERNEL_NAMES)} kernels) with "
                      "NVRTC: tens of seconds to minutes of CPU (or waiting for another "
                      "process's build of it)", file=sys.stderr, flush=True)
            _with_progress(f"{arch}'s build", functools.partial(kernels.cubin_for, arch))
            if not path.is_file():
                print(f"gpuring kernels: built the {arch} CUBIN but could not write {path}",
                      file=sys.stderr)
                return 1
            print(f"{arch}: {path} (ready in {time.perf_counter() - start:.1f} s)", flush=True)
        if not args.arch:
            for name in kernels.ALL_KERNEL_NAMES:
                kernels.get_function(name, 0)
            print(f"GPU 0: all {len(kernels.ALL_KERNEL_NAMES)} kernels loaded", flush=True)
    except ImportError as exc:
        print(f"gpuring kernels: {exc} (NVRTC comes with cuda-bindings; without --arch, CuPy "
              "finds the GPU)", file=sys.stderr)
        return 1
    except Exception as exc:  # no GPU, an NVRTC that fails to load or compile, the driver
        hint = "" if args.arch else "; without a GPU here, name an architecture with --arch"
        print(f"gpuring kernels: {type(exc).__name__}: {exc}{hint}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = argparse.ArgumentParser(prog="gpuring", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gpuring {__version__}")
    commands = parser.add_subparsers(dest="subcommand", required=True)
    run = commands.add_parser(
        "run", help="start N ranks of a program on this node",
        description="Start N ranks of COMMAND on this node, each with its rank in the "
                    "environment; output lines are prefixed with the rank. When one rank "
                    "fails the others are told, then stopped after --grace seconds; the job "
                    "ends with one summary of the root cause, and exits with its status.")
    run.add_argument("-n", "--nranks", type=int, required=True, help="number of ranks")
    run.add_argument("--grace", type=float, default=3.0,
                     help="seconds the survivors get after a rank fails (default 3)")
    run.add_argument("--host", default="127.0.0.1",
                     help="interface the control plane listens on (default loopback)")
    run.add_argument("--keep-going", action="store_true",
                     help="a rank that dies does not stop the others: they are told (a "
                          "PeerFailureError) and may go on in comm.shrink(); the job ends "
                          "well where every other rank does")
    run.add_argument("--log-dir", default=None,
                     help="where each rank's whole output goes (rank-N.log) and, unless "
                          "GPURING_TRACE_DIR says otherwise, the flight recorder's dumps "
                          "(default: gpuring-run-JOB in the temporary directory, removed "
                          "when the job ends well)")
    run.add_argument("command", nargs=argparse.REMAINDER,
                     help="the program, e.g. python train.py (a .py file runs with this Python)")
    run.set_defaults(func=_run)
    bench = commands.add_parser(
        "bench", help="measure collectives like nccl-tests, checked, beside MPI/NCCL/Gloo",
        description="Time a collective over a range of sizes (nccl-tests' columns: time, "
                    "algbw, busbw, #wrong, out-of-place and in-place), check every result, "
                    "compare with peers and with the memory-bandwidth floor. Exits 1 when a "
                    "result is wrong. Example: gpuring bench all_reduce --ranks 2 -b 8 -e 64M")
    from .bench.cli import add_arguments

    add_arguments(bench)
    bench.set_defaults(func=_bench)
    tune = commands.add_parser(
        "tune", help="measure algorithm x piece size x channels, write a tuning table",
        description="Time every algorithm, piece size and channel count of the collectives "
                    "over a size sweep on this machine (each result checked), pick the "
                    "fastest per size, write the table (JSON, with the machine, versions and "
                    "every time measured) and print it. GPURING_TUNING=FILE makes the "
                    "collectives' default choice follow it. Example: gpuring tune --ranks 2 "
                    "-o tuning.json")
    from .bench.tune import add_arguments as add_tune_arguments

    add_tune_arguments(tune)
    tune.set_defaults(func=_tune)
    kernels = commands.add_parser(
        "kernels", help="build the CUDA kernels now, not in the first collective",
        description="Compile kernels/reduce.cu with NVRTC (tens of seconds of CPU) into the "
                    "on-disk cache the collectives load from (~/.cache/gpuring/cubin, or "
                    "under $XDG_CACHE_HOME), for GPU 0 here (then load every kernel on it) "
                    "or for each --arch (no GPU needed): for container images and job "
                    "prologues. Example: gpuring kernels --arch sm_90")
    kernels.add_argument("--arch", action="append", default=[], type=_arch,
                         help="an architecture such as sm_90; may be repeated")
    kernels.set_defaults(func=_kernels)
    doctor = commands.add_parser(
        "doctor", help="say what went wrong in a job, from its ranks' flight recorders",
        description="Read the flight recorder's dumps of every rank of a job (what "
                    "GPURING_TRACE_DIR, or `gpuring run`'s log directory, holds) and print "
                    "on one screen, for each communicator in trouble: the last collective "
                    "every rank completed, the first one where the ranks diverge (who "
                    "entered what, where in their code, who did not), the failures, the root "
                    "cause, and what to check. Example: gpuring doctor /tmp/gpuring-run-JOB")
    doctor.add_argument("directory", help="the directory of the dumps")
    doctor.add_argument("--json", action="store_true",
                        help="print the report as JSON, for tools")
    doctor.set_defaults(func=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
