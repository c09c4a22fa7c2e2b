"""CuPy's own tests of cupyx.distributed, run against gpuring.distributed on the CUDA simulator:

    python -m tools.conformance.cupyx_suite --cupy PATH [--mode store|mpi|both] [-k EXPR]
        [--out bench/results/cupyx-suite.txt]

PATH is a CuPy source tree or git repository (its tests/cupyx_tests/distributed_tests/
test_comm.py and comm_runner.py are copied into a temporary directory, unchanged). There,
`cupyx.distributed` is gpuring's facade, `cupyx.scipy.sparse` the simulator's, and what the
tests import beside them comes from stand-ins written here from CuPy's documentation:
`cupy.testing`'s dtype loops, `multi_gpu` and `assert_allclose`, and
`cupyx.distributed._store.ExceptionAwareProcess` (a process whose exception `join` raises).
The tests run in pytest, one at a time (they all use port 13333), in the TCP-port mode
(`TestNCCLBackend*`, `TestInitDistributed`) and the MPI mode (`*WithMPI`, under mpiexec; an
`mpiexec` here drops Open MPI's `--allow-run-as-root`, which MPICH's does not take). The
simulated GPUs have 64-bit stream memory operations, as GPUs of the last years do, and
the buffers are 1 MiB (GPURING_BUFFER_BYTES: the tests move a few hundred bytes).

Prints, and writes to --out, the counts per class and each failure's last line.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SUITE = "tests/cupyx_tests/distributed_tests"
FILES = ("test_comm.py", "comm_runner.py")

#: the stand-ins, by file under the shim directory
SHIM = {
    "cupyx/distributed/__init__.py": """
        from gpuring.distributed import NCCLBackend, init_process_group  # noqa: F401
    """,
    "cupyx/distributed/_nccl_comm.py": """
        import importlib.util

        from gpuring.distributed import NCCLBackend  # noqa: F401

        _mpi_available = importlib.util.find_spec("mpi4py") is not None
    """,
    "cupyx/distributed/_store.py": '''
        import multiprocessing

        _DEFAULT_HOST = "127.0.0.1"
        _DEFAULT_PORT = 13333


        class ExceptionAwareProcess(multiprocessing.Process):
            """A process whose target's exception `join` raises in the parent."""

            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self._receiver, self._sender = multiprocessing.Pipe(duplex=False)

            def run(self):
                try:
                    super().run()
                except Exception as exc:
                    self._sender.send(exc)
                    return
                self._sender.send(None)

            def join(self, timeout=None):
                super().join(timeout)
                if self._receiver.poll():
                    error = self._receiver.recv()
                    if error is not None:
                        raise error
    ''',
    "cupy_testing.py": '''
        """cupy.testing's parts that the distributed tests use."""
        import functools
        import os

        import numpy
        import pytest

        _ALL = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
                "uint16", "uint32", "uint64", "complex64", "complex128")


        def _for(dtypes):
            def decorate(test):
                @pytest.mark.parametrize("dtype", [numpy.dtype(d).type for d in dtypes],
                                         ids=[numpy.dtype(d).name for d in dtypes])
                @functools.wraps(test)
                def run(*args, **kwargs):
                    return test(*args, **kwargs)
                return run
            return decorate


        def for_all_dtypes(name="dtype", no_bool=False, **_):
            return _for(_ALL if no_bool else ("bool",) + _ALL)


        def for_dtypes(dtypes, name="dtype"):
            return _for(list(dtypes))


        def multi_gpu(n):
            import cupy

            count = cupy.cuda.runtime.getDeviceCount()
            return pytest.mark.skipif(count < n, reason=f"needs {n} GPUs, has {count}")


        def assert_allclose(actual, desired, rtol=1e-7, atol=0, err_msg="", verbose=True):
            def host(x):
                return x.get() if hasattr(x, "get") else numpy.asarray(x)
            numpy.testing.assert_allclose(host(actual), host(desired), rtol=rtol, atol=atol,
                                          err_msg=err_msg, verbose=verbose)
    ''',
    "sitecustomize.py": """
        import sys

        import cupy
        import cupy_testing

        cupy.testing = cupy_testing
        sys.modules["cupy.testing"] = cupy_testing
    """,
    "bin/mpiexec": """
        #!/bin/sh
        # MPICH's mpiexec, without Open MPI's --allow-run-as-root
        for arg do
            shift
            [ "$arg" = "--allow-run-as-root" ] || set -- "$@" "$arg"
        done
        exec "$GPURING_REAL_MPIEXEC" "$@"
    """,
}

#: the pytest selection of each mode
MODES = {"store": "not WithMPI", "mpi": "WithMPI"}


def copy_suite(cupy: Path, into: Path) -> str:
    """Copy CuPy's distributed tests from `cupy` (a source tree, or a git repository) into
    `into`; what was copied (the commit, where known)."""
    into.mkdir(parents=True, exist_ok=True)
    tree = cupy / SUITE
    if tree.is_dir():
        for name in FILES:
            shutil.copy(tree / name, into / name)
    else:
        for name in FILES:
            text = subprocess.run(["git", "--git-dir", str(cupy), "show", f"HEAD:{SUITE}/{name}"],
                                  check=True, capture_output=True, text=True).stdout
            (into / name).write_text(text)
    done = subprocess.run(["git", "-C", str(cupy), "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    return done.stdout.strip() if done.returncode == 0 else "(no git commit)"


def write_shim(into: Path) -> None:
    for name, text in SHIM.items():
        path = into / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
        if name.startswith("bin/"):
            path.chmod(0o755)


def environment(work: Path, simulator: Path | None = None, memops: bool = True
                ) -> dict[str, str]:
    """The tests' environment: the shim, then the simulator (`simulator`: the directory of
    another cupy.py to use, before this tree's), then this tree."""
    sys.path.insert(0, str(ROOT))
    from tests.cudasim import kernels_host_build

    # the kernels' host build is cached across runs (its name is a hash of its inputs)
    env = kernels_host_build.simulator_env(Path(tempfile.gettempdir()) / "gpuring-cudasim-build")
    shim = work / "shim"
    first = [str(shim)] + ([str(simulator)] if simulator is not None else [])
    env["PYTHONPATH"] = os.pathsep.join([*first, env["PYTHONPATH"], str(ROOT)])
    real = shutil.which("mpiexec")
    if real is not None:
        env["GPURING_REAL_MPIEXEC"] = real
    env["PATH"] = os.pathsep.join([str(shim / "bin"), env.get("PATH", "")])
    env.update(GPURING_CUDASIM_DEVICES="2", GPURING_CUDASIM_MEMOPS="1" if memops else "0",
               GPURING_BUFFER_BYTES="1M",
               GPURING_TIMEOUT=env.get("GPURING_TIMEOUT", "30"))
    for name in ("GPURING_STORE", "PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "RANK",
                 "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def run_mode(mode: str, suite: Path, env: dict[str, str], select: str | None,
             timeout: float) -> tuple[str, float]:
    expr = MODES[mode] if select is None else f"({MODES[mode]}) and ({select})"
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "-o", "addopts=", "-q", "-rfEs", "--tb=line", "-k", expr,
                           "test_comm.py"], cwd=suite, env=env, capture_output=True, text=True,
                          timeout=timeout)
    return done.stdout + done.stderr, time.monotonic() - start


def summary(mode: str, output: str, seconds: float) -> str:
    counts = re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", output)
    totals = {word: int(n) for n, word in counts}
    passed, failed = totals.get("passed", 0), totals.get("failed", 0) + totals.get("error", 0)
    lines = [f"mode {mode}: {passed} passed, {failed} failed, {totals.get('skipped', 0)} "
             f"skipped ({seconds:.0f} s)"]
    by_class: dict[str, list[int]] = {}
    for status, test in re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED)\S* (\S+)", output, re.M):
        cls = test.split("::")[1] if "::" in test else test
        row = by_class.setdefault(cls, [0, 0])
        row[status != "PASSED"] += 1
    failures = re.findall(r"^(?:FAILED|ERROR) (\S+)(?: - (.*))?$", output, re.M)
    for test, why in failures:
        lines.append(f"  FAILED {test}: {(why or '').strip()[:300]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cupy", type=Path, required=True,
                        help="a CuPy source tree or git repository")
    parser.add_argument("--mode", choices=("store", "mpi", "both"), default="both")
    parser.add_argument("-k", dest="select", help="a pytest -k expression within each mode")
    parser.add_argument("--out", type=Path, help="where to write the summary")
    parser.add_argument("--timeout", type=float, default=5400, help="seconds per mode")
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory")
    parser.add_argument("--no-memops", dest="memops", action="store_false",
                        help="simulated GPUs without 64-bit stream memory operations")
    parser.add_argument("--simulator", type=Path,
                        help="a directory whose cupy.py stands in for this tree's simulator's")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gpuring-cupyx-suite-"))
    try:
        commit = copy_suite(args.cupy, work / "suite")
        write_shim(work / "shim")
        env = environment(work, args.simulator, args.memops)
        reports = [f"CuPy's {SUITE} (test_comm.py, comm_runner.py) at {commit}, against "
                   "gpuring.distributed on the CUDA simulator (2 GPUs, "
                   + ("memops" if args.memops else "no memops")
                   + (f", cupy.py of {args.simulator}" if args.simulator else "") + ")"]
        for mode in (("store", "mpi") if args.mode == "both" else (args.mode,)):
            output, seconds = run_mode(mode, work / "suite", env, args.select, args.timeout)
            (work / f"{mode}.log").write_text(output)
            reports.append(summary(mode, output, seconds))
        text = "\n".join(reports) + "\n"
        print(text, end="")
        if args.out is not None:
            args.out.write_text(text)
    finally:
        if args.keep:
            print(f"(kept {work})")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
