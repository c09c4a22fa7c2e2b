"""The `gpuring` command: `gpuring run` launches ranks; `gpuring bench` measures; `gpuring
tune` writes a tuning table."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _run(args: argparse.Namespace) -> int:
    from ._launcher import run

    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    return run(command, args.nranks, grace=args.grace, host=args.host)


def _bench(args: argparse.Namespace) -> int:
    from .bench.cli import main as bench_main

    return bench_main(args)


def _tune(args: argparse.Namespace) -> int:
    from .bench.tune import main as tune_main

    return tune_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpuring", description=__doc__)
    commands = parser.add_subparsers(dest="subcommand", required=True)
    run = commands.add_parser(
        "run", help="start N ranks of a program on this node",
        description="Start N ranks of COMMAND on this node, each with its rank in the "
                    "environment; output lines are prefixed with the rank. When one rank "
                    "fails the others are told, then stopped after --grace seconds.")
    run.add_argument("-n", "--nranks", type=int, required=True, help="number of ranks")
    run.add_argument("--grace", type=float, default=3.0,
                     help="seconds the survivors get after a rank fails (default 3)")
    run.add_argument("--host", default="127.0.0.1",
                     help="interface the control plane listens on (default loopback)")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
