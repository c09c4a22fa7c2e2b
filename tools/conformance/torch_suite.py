"""PyTorch's own distributed suite (`torch.testing._internal.distributed.distributed_test`)
against a backend, driven as torch's `test/distributed/test_distributed_spawn.py` drives it:
every test of `DistributedTest._DistTestBase` in a `TestDistBackend` class whose ranks are
spawned processes, WORLD_SIZE ranks, a file rendezvous in a fresh TEMP_DIR.

    python -m tools.conformance.torch_suite --backend gloo --world-size 2 --json gloo.json
    python -m tools.conformance.torch_suite --backend gpuring --world-size 2 --json ours.json
    python -m tools.conformance.torch_suite --compare gloo.json ours.json > torch-suite.txt

`-k WORD` (repeatable) keeps the tests whose name contains a WORD.

How "gpuring" gets gloo's skip decisions: the suite decides what a backend runs by its name,
mostly in decorators evaluated when the suite is imported (`BACKEND != "gloo"`, the sets of
`DistTestCases`). The suite is imported with BACKEND=gloo, so those decisions are gloo's; the
module's BACKEND is then set to "gpuring", so that every process group the tests make
(`init_process_group(backend=BACKEND)`, `new_group()`) is gpuring's, and the checks made inside
a test body at run time see the name "gpuring" (where such a check lets only torch's
own backends in, the test fails for gpuring: `--compare` lists those as reserved by name).
Spawned ranks import this module again (as multiprocessing's main), and the same steps run there
from the environment the parent set (TORCH_SUITE_BACKEND).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import traceback
import unittest
from pathlib import Path
from typing import Any

_BACKEND_ENV = "TORCH_SUITE_BACKEND"

_DDP_BY_NAME = ("the suite builds this test's DDP model for the backends mpi, gloo and nccl "
                "only, by name")
_MONITORED_BY_NAME = "torch serves dist.monitored_barrier on gloo's groups only, by name"
#: tests that fail for a backend other than torch's own because the suite or torch admits
#: only those by name, with where it does so (see the module's docstring)
RESERVED_BY_NAME = {
    "test_accumulate_gradients_no_sync": _DDP_BY_NAME,
    "test_accumulate_gradients_no_sync_grad_is_view": _DDP_BY_NAME,
    "test_accumulate_gradients_no_sync_allreduce_hook": _DDP_BY_NAME,
    "test_accumulate_gradients_no_sync_allreduce_with_then_hook": _DDP_BY_NAME,
    "test_monitored_barrier_gloo": _MONITORED_BY_NAME,
    "test_monitored_barrier_gloo_subgroup": _MONITORED_BY_NAME,
}


def _suite_class(backend: str) -> type:
    """The suite's test class for `backend` (the environment set up beforehand)."""
    os.environ["BACKEND"] = "gloo"  # the skip decisions made at import: gloo's
    import torch

    if backend != "gloo":
        import gpuring.torch  # noqa: F401 - registers the backend
    from torch.testing._internal.distributed import distributed_test
    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest,
        TestDistBackend,
    )

    distributed_test.BACKEND = backend
    torch.backends.cuda.matmul.allow_tf32 = False

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self) -> None:
            super().setUp()
            self._spawn_processes()

    name = f"TestDistBackendWithSpawn{backend.upper()}"
    TestDistBackendWithSpawn.__name__ = TestDistBackendWithSpawn.__qualname__ = name
    globals()[name] = TestDistBackendWithSpawn  # where a spawned rank finds it by name
    return TestDistBackendWithSpawn


if os.environ.get(_BACKEND_ENV):  # a spawned rank: the parent's set-up again
    _suite_class(os.environ[_BACKEND_ENV])


class _Outcomes(unittest.TextTestResult):
    """Each test's outcome ("passed", "failed", "skipped") and, for failures, the error's
    last lines."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, dict[str, Any]] = {}
        self._started = 0.0

    @staticmethod
    def _name(test: unittest.TestCase) -> str:
        return test.id().rsplit(".", 1)[-1]

    def startTest(self, test: unittest.TestCase) -> None:
        self._started = time.monotonic()
        super().startTest(test)

    def _put(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
        self.outcomes[self._name(test)] = {
            "outcome": outcome, "seconds": round(time.monotonic() - self._started, 2),
            "detail": detail[-3000:]}

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._put(test, "passed")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._put(test, "failed", ''.join(traceback.format_exception(*err)))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._put(test, "failed", ''.join(traceback.format_exception(*err)))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._put(test, "skipped", reason)

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addExpectedFailure(test, err)
        self._put(test, "passed", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:
        super().addUnexpectedSuccess(test)
        self._put(test, "failed", "unexpected success")


def run(backend: str, world_size: int, keep: list[str], out: Path | None) -> dict[str, Any]:
    os.environ.update({_BACKEND_ENV: backend, "WORLD_SIZE": str(world_size)})
    os.environ.setdefault("GPURING_TIMEOUT", "60")
    with tempfile.TemporaryDirectory() as temp:  # as test_distributed_spawn.py requires
        os.environ["TEMP_DIR"] = temp
        Path(temp, "barrier").mkdir()
        cls = _suite_class(backend)
        names = unittest.TestLoader().getTestCaseNames(cls)
        if keep:
            names = [n for n in names if any(word in n for word in keep)]
        suite = unittest.TestSuite(cls(n) for n in names)
        runner = unittest.TextTestRunner(resultclass=_Outcomes, verbosity=2)
        result: Any = runner.run(suite)
    import torch

    summary = {"backend": backend, "world_size": world_size, "torch": torch.__version__,
               "torch_commit": torch.version.git_version, "outcomes": result.outcomes}
    if out is not None:
        out.write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def _counts(outcomes: dict[str, dict[str, Any]]) -> str:
    kinds = ("passed", "failed", "skipped")
    found = {k: sum(o["outcome"] == k for o in outcomes.values()) for k in kinds}
    return f"{len(outcomes)} tests: " + ", ".join(f"{found[k]} {k}" for k in kinds)


def _error_line(detail: str) -> str:
    """The last line of a failure's text that names an exception ("NameError: ..."), else
    its last line."""
    lines = [ln.strip() for ln in detail.splitlines() if ln.strip()]
    named = [ln for ln in lines if re.match(r"[\w.]*(Error|Exception)\b", ln)]
    return (named or lines or [""])[-1][:240]


def compare(reference: dict[str, Any], ours: dict[str, Any]) -> str:
    """A report: both runs' counts, then the tests that pass for the reference backend and do
    not for ours (the first line of each failure's last error)."""
    ref, got = reference["outcomes"], ours["outcomes"]
    lines = [f"torch {ours['torch']} (commit {ours['torch_commit']}), world size "
             f"{ours['world_size']}",
             f"{reference['backend']}: {_counts(ref)}", f"{ours['backend']}: {_counts(got)}"]
    differ = sorted(n for n, o in ref.items()
                    if o["outcome"] == "passed" and got.get(n, {}).get("outcome") != "passed")
    lines.append(f"passed for {reference['backend']}, not for {ours['backend']}: {len(differ)}")
    for name in differ:
        detail = got.get(name, {"outcome": "not run", "detail": ""})
        if name in RESERVED_BY_NAME:
            why = f"reserved by name: {RESERVED_BY_NAME[name]}"
        else:
            why = _error_line(detail["detail"]) or detail["outcome"]
        lines.append(f"  {name}: {why}")
    better = sorted(n for n, o in got.items() if o["outcome"] == "passed"
                    and ref.get(n, {}).get("outcome") != "passed")
    lines.append(f"passed for {ours['backend']}, not for {reference['backend']}: {len(better)}")
    lines += [f"  {name}" for name in better]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="gpuring")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("-k", action="append", default=[], dest="keep",
                        help="keep the tests whose name contains this (repeatable)")
    parser.add_argument("--json", type=Path, help="write every test's outcome here")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("REFERENCE", "OURS"),
                        help="compare two --json files instead of running")
    args = parser.parse_args(argv)
    if args.compare:
        reference, ours = (json.loads(p.read_text()) for p in args.compare)
        sys.stdout.write(compare(reference, ours))
        return 0
    summary = run(args.backend, args.world_size, args.keep, args.json)
    print(f"{args.backend}, world size {args.world_size}: {_counts(summary['outcomes'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
