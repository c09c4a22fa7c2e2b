"""Mutation check: plant classic bugs one at a time and see the quick tests turn red.

`python -m tests.mutate [--only NAME[,NAME...]] [--tests PATH...] [--list] [--keep]
[--timeout SECONDS]`

Each mutant is a named (file, exact old text, new text) triple. The script copies the working
tree (what git tracks, and untracked files it does not ignore) into a temporary directory,
plants one mutant at a time there (never in the working tree), runs the quick tests there
(`python -m pytest -q -x -m "not slow" -n 2`, the loop a contributor runs), and reports per
mutant whether they caught it, which test failed first, and how long it took. A mutant whose
old text is not found exactly once fails the script before anything runs: when the code
moves, the mutant must move with it. Before the mutants, the same tests run once on the
unchanged copy, which must pass (`--no-baseline` leaves that out). `--tests` runs some of the
quick tests only (paths or test ids, still without the slow ones): to see which of them
catch a mutant, not to check that the quick tests do.

Exit status: 0 when every mutant was caught, 1 when one was missed (or the tests timed out on
one), 2 when the script could not run (a mutant's text not found, the baseline red).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
#: the quick tests (docs/development.md): what runs against every mutant
FAST_LOOP = ("-m", "pytest", "-q", "-x", "-m", "not slow", "-n", "2", "-p", "no:cacheprovider",
             "-rfE")


class Mutant(NamedTuple):
    """A bug to plant: `old` (found exactly once in `path`) becomes `new`."""

    name: str
    path: str
    old: str
    new: str
    what: str


MUTANTS: tuple[Mutant, ...] = (
    Mutant("ring_segment_off_by_one", "gpuring/algorithms/ring.py",
           "ops.append(Copy(Loc(OUT, seg.out_off + o), theirs, k))",
           "ops.append(Copy(Loc(OUT, seg.out_off + o), theirs, k - 1))",
           "the ring's last all-gather step copies each piece of the segment it receives "
           "one element short"),
    Mutant("wrong_root", "gpuring/algorithms/ring.py",
           "pos = (rank - root) % n",
           "pos = (rank - root + 1) % n",
           "a chain broadcast starts from the rank before the root"),
    Mutant("avg_divisor", "gpuring/_engine.py",
           "self.divisor = engine.size if op is ReduceOp.AVG else 1",
           "self.divisor = engine.size + 1 if op is ReduceOp.AVG else 1",
           "avg divides the sum by one more than the number of ranks"),
    Mutant("flag_value", "gpuring/_engine.py",
           "self._ready_offset(c, self.rank)), o.value,",
           "self._ready_offset(c, self.rank)), o.value + 1,",
           "a READY flag says one piece more than was written (a reader may read a piece "
           "before it is there)"),
    Mutant("skipped_credit_wait", "gpuring/_engine.py",
           "for peer, flag in enumerate(self._done_from)\n"
           "                                      if credits]",
           "for peer, flag in enumerate(self._done_from)\n"
           "                                      if credits and peer != self.rank]",
           "a round skips the buffer credit of this rank's own other channels"),
    Mutant("missing_close_barrier", "gpuring/_engine.py",
           'control.barrier(min(self.timeout, 60.0), "close()")',
           "pass",
           "close frees a rank's memory without first meeting the peers that may still "
           "read it"),
    Mutant("float16_avg_bias", "gpuring/devices/_host_streams.py",
           "d[...] = (x.astype(np.float32) + y) / np.float32(divisor)",
           "d[...] = (x.astype(np.float32) + y) / np.float32(divisor * 1.03)",
           "a 16-bit float avg comes out 3 % small"),
    Mutant("fold_out_of_rank_order", "gpuring/algorithms/two_shot.py",
           "                     for q in range(n))",
           "                     for q in reversed(range(n)))",
           "the two-shot reduce (deterministic mode's) folds the ranks' data in reverse "
           "rank order"),
    Mutant("message_out_of_order", "gpuring/_groups.py",
           "for root in (0, 1):",
           "for root in (mine, theirs):",
           "a sendrecv between two ranks both ways pairs each rank's own message with the "
           "other's (each sends first)"),
)


class Outcome(NamedTuple):
    name: str
    status: str  # "caught", "missed", "timed out"
    by: str  # the first test that failed (or why nothing did)
    seconds: float


def check_texts(mutants: Sequence[Mutant], root: Path) -> list[str]:
    """Why each mutant cannot be planted in the tree at `root` (empty: all can)."""
    problems = []
    for m in mutants:
        path = root / m.path
        if not path.exists():
            problems.append(f"{m.name}: {m.path} does not exist")
            continue
        found = path.read_text(encoding="utf-8").count(m.old)
        if found != 1:
            problems.append(f"{m.name}: its old text is in {m.path} {found} times, not once "
                            f"(the code moved: update the mutant): {m.old!r}")
    return problems


def copy_tree(source: Path, target: Path) -> None:
    """The files of the working tree at `source` (tracked, and untracked ones git does not
    ignore) under `target`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                             "--exclude-standard"], cwd=source, capture_output=True,
                            check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        origin = source / name
        if not origin.is_file():  # deleted in the working tree, not yet in the index
            continue
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(origin, target / name)


def run_tests(tree: Path, timeout: float, tests: Sequence[str] = ()
              ) -> tuple[int | None, str, float]:
    """The quick tests in `tree` (those of `tests` only, where given): (exit status, None on
    a timeout; their output; seconds)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(tree), os.environ.get("PYTHONPATH")) if p))
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, *FAST_LOOP, *tests], cwd=tree, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout or ""
        return None, output if isinstance(output, str) else output.decode(), \
            time.monotonic() - start
    return done.returncode, done.stdout + done.stderr, time.monotonic() - start


def first_failure(output: str) -> str:
    """The first test pytest's summary says failed (or erred), else the output's last line."""
    found = re.search(r"^(?:FAILED|ERROR) (\S+)", output, re.M)
    if found:
        return found.group(1)
    lines = output.strip().splitlines()
    return lines[-1] if lines else "(no output)"


def plant_and_run(mutant: Mutant, tree: Path, timeout: float,
                  tests: Sequence[str] = ()) -> Outcome:
    """Plant `mutant` in the copy at `tree`, run the quick tests (of `tests`), take it out
    again."""
    path = tree / mutant.path
    original = path.read_text(encoding="utf-8")
    path.write_text(original.replace(mutant.old, mutant.new, 1), encoding="utf-8")
    try:
        status, output, seconds = run_tests(tree, timeout, tests)
    finally:
        path.write_text(original, encoding="utf-8")
    if status is None:
        return Outcome(mutant.name, "timed out", f"no result in {timeout:.0f} s", seconds)
    if status in (1, 2):  # tests failed, or collection did
        return Outcome(mutant.name, "caught", first_failure(output), seconds)
    if status == 0:
        return Outcome(mutant.name, "missed", "every test passed", seconds)
    raise RuntimeError(f"pytest exited with {status} on {mutant.name}:\n{output[-3000:]}")


def report(outcomes: Sequence[Outcome]) -> str:
    width = max(len(o.name) for o in outcomes)
    lines = [f"{'mutant':<{width}}  {'result':<9}  {'seconds':>7}  first failing test"]
    lines += [f"{o.name:<{width}}  {o.status:<9}  {o.seconds:>7.0f}  {o.by}" for o in outcomes]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.mutate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[],
                        help="plant only these mutants (a name, or names separated by commas)")
    parser.add_argument("--tests", nargs="+", default=[], metavar="PATH",
                        help="run these of the quick tests only (paths or test ids)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true",
                        help="do not run the tests on the unchanged copy first")
    parser.add_argument("--timeout", type=float, default=1800,
                        help="seconds the tests may take on one mutant (default 1800)")
    parser.add_argument("--keep", action="store_true",
                        help="keep the temporary copy (its path is printed)")
    args = parser.parse_args(argv)
    if args.list:
        for m in MUTANTS:
            print(f"{m.name}: {m.path}: {m.what}")
        return 0
    names = [n for value in args.only for n in value.split(",") if n]
    unknown = sorted(set(names) - {m.name for m in MUTANTS})
    if unknown:
        parser.error(f"no mutant {', '.join(unknown)} (--list lists them)")
    chosen = [m for m in MUTANTS if not names or m.name in names]
    problems = check_texts(chosen, ROOT)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 2
    tree = Path(tempfile.mkdtemp(prefix="gpuring-mutate-"))
    try:
        copy_tree(ROOT, tree)
        print(f"copied the working tree to {tree}", flush=True)
        if not args.no_baseline:
            status, output, seconds = run_tests(tree, args.timeout, args.tests)
            if status != 0:
                print(f"the quick tests fail on the unchanged tree ({seconds:.0f} s): "
                      f"{first_failure(output)}\n{output[-3000:]}", file=sys.stderr)
                return 2
            print(f"baseline: the quick tests pass on the unchanged tree ({seconds:.0f} s)",
                  flush=True)
        outcomes = []
        for mutant in chosen:
            outcome = plant_and_run(mutant, tree, args.timeout, args.tests)
            print(f"{outcome.name}: {outcome.status} ({outcome.seconds:.0f} s) {outcome.by}",
                  flush=True)
            outcomes.append(outcome)
    finally:
        if args.keep:
            print(f"kept {tree}")
        else:
            shutil.rmtree(tree, ignore_errors=True)
    print(report(outcomes))
    return 0 if all(o.status == "caught" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
