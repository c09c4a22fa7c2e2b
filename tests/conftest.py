"""Helpers to launch ranks under `gpuring run` or `mpiexec` from tests."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
#: set (CI does) to make every skip a failure, except in tests that need a real GPU
NO_SKIPS_ENV = "GPURING_TESTS_NO_SKIPS"


def _skip_allowed(node: pytest.Item | pytest.Collector) -> bool:
    if os.environ.get(NO_SKIPS_ENV) != "1":
        return True
    return node.get_closest_marker("gpu") is not None or (HERE / "gpu") in Path(
        str(node.path)).parents


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Under GPURING_TESTS_NO_SKIPS=1 a skip is a failure (a missing tool must not make the
    suite silently check less), except in tests that need a real GPU."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail") and not _skip_allowed(item):
        report.outcome = "failed"
        report.longrepr = f"skipped, which {NO_SKIPS_ENV}=1 forbids: {report.longrepr}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector):  # type: ignore[no-untyped-def]
    """The same for a whole module skipped while it is collected."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not _skip_allowed(collector):
        report.outcome = "failed"
        report.longrepr = f"skipped, which {NO_SKIPS_ENV}=1 forbids: {report.longrepr}"


#: the launch a named test's id ends with (tests/multiproc/named.py): "...-3ranks-mpiexec]"
_LAUNCH_IN_ID = re.compile(r"\[[^\[\]]*?-(\d+ranks(?:-[^\[\]]*)?)\]$")


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under pytest-xdist's default distribution (-n, --dist load): the named tests of one
    launch go to one worker, as a unit, so that the workers run different launches at once
    instead of one waiting for the other's; every other test is a unit of its own, as
    before."""
    if config.getvalue("dist") != "load":
        return None
    try:
        from xdist.scheduler import LoadScopeScheduling
    except ImportError:  # another pytest-xdist: its own default
        return None

    class ByLaunch(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            launch = _LAUNCH_IN_ID.search(nodeid)
            return f"launch {launch.group(1)}" if launch else nodeid

    return ByLaunch(config, log)


def mpiexec() -> str | None:
    found = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                         + os.environ.get("PATH", ""))
    if found is None:
        return None
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    return found


def on_nodes(nodes: list[str], command: list[str]) -> list[str]:
    """mpiexec's arguments that run `command` as one rank per entry of `nodes`, each with
    GPURING_HOSTNAME set to its entry (simulated nodes), in rank order."""
    blocks: list[list[str]] = []
    for name in nodes:
        blocks.append(["-n", "1", "-env", "GPURING_HOSTNAME", name, *command])
    return [arg for i, block in enumerate(blocks) for arg in ([":"] if i else []) + block]


def launch(launcher: str, n: int, args: list[str], *, env: dict[str, str] | None = None,
           timeout: float = 600, grace: float | None = None, nodes: list[str] | None = None
           ) -> subprocess.CompletedProcess[str]:
    """Run `python args...` as n ranks; returns the finished process (output captured).
    `grace`: the `gpuring run --grace` seconds survivors of a failed rank get; `nodes`
    (mpiexec): each rank's simulated node (`on_nodes`)."""
    full_env = dict(os.environ, GPURING_JITTER="1", GPURING_TIMEOUT="60")
    full_env.update(env or {})
    if launcher == "gpuring":
        cmd = [sys.executable, "-m", "gpuring", "run", "-n", str(n),
               *(["--grace", str(grace)] if grace is not None else []), "--",
               sys.executable, *args]
    else:
        exe = mpiexec()
        if exe is None:
            pytest.skip("mpiexec with mpi4py is not available")
        cmd = [exe, "-n", str(n), sys.executable, *args] if nodes is None else \
            [exe, *on_nodes(nodes, [sys.executable, *args])]
        assert nodes is None or len(nodes) == n
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)


def start_by_hand(n: int, args: list[str], *, env: dict[str, str] | None = None,
                  timeout: float = 300) -> list[subprocess.CompletedProcess[str]]:
    """Start `python args... RANK N PORT` as n processes by hand (no launcher; they meet
    through gpuring.distributed's rendezvous on a free loopback port); wait for all."""
    port = free_port()
    full_env = dict(os.environ, GPURING_JITTER="1")
    full_env.update(env or {})
    procs = [subprocess.Popen([sys.executable, args[0], str(r), str(n), str(port), *args[1:]],
                              env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in range(n)]
    return _wait_all(procs, timeout)


def _wait_all(procs: list[subprocess.Popen[str]], timeout: float
              ) -> list[subprocess.CompletedProcess[str]]:
    """Each process's end and output; all are killed if one outlives `timeout`."""
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_env(size: int, port: int, nodes: list[str] | None = None) -> list[dict[str, str]]:
    """torchrun's variables for each of `size` ranks on `nodes` (one name per rank; set as
    GPURING_HOSTNAME where they differ). MASTER_PORT is torchrun's own store: gpuring serves
    on the next port, `port`."""
    nodes = nodes or ["n"] * size
    envs = []
    for rank, node in enumerate(nodes):
        env = {"RANK": str(rank), "WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port - 1), "LOCAL_RANK": str(nodes[:rank].count(node)),
               "LOCAL_WORLD_SIZE": str(nodes.count(node))}
        if len(set(nodes)) > 1:
            env["GPURING_HOSTNAME"] = node
        envs.append(env)
    return envs


def start_as(envs: list[dict[str, str]], args: list[str], timeout: float = 300,
             base: dict[str, str] | None = None) -> list[subprocess.CompletedProcess[str]]:
    """Start `python args...` once per entry of `envs` (a launcher's variables for that
    process, over this environment, or `base`, without another launcher's), by hand; wait
    for all."""
    base = dict(os.environ if base is None else base, GPURING_JITTER="1", GPURING_TIMEOUT="60")
    for name in ("GPURING_STORE", "PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE",
                 "PMIX_RANK"):
        base.pop(name, None)
    procs = [subprocess.Popen([sys.executable, *args], env={**base, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for env in envs]
    return _wait_all(procs, timeout)


def run_worker(worker: Path, launcher: str, n: int, case: str, tmp_path: Path,
               env: dict[str, str] | None = None, nodes: list[str] | None = None,
               device: str | None = None) -> list[str]:
    """Run `worker case tmp_path [device]` on n ranks; check it succeeded and that every rank
    wrote the same digests (bitwise identical results); return rank 0's digest lines."""
    proc = launch(launcher, n, [str(worker), case, str(tmp_path), *([device] if device else [])],
                  env=env, nodes=nodes)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    digests = [(tmp_path / f"{case}-{r}.txt").read_text() for r in range(n)]
    for r in range(1, n):
        assert digests[r] == digests[0], f"rank {r}'s results differ bitwise from rank 0's"
    return digests[0].splitlines()


@pytest.fixture(scope="session")
def host_build_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the kernels' host build (tests/cudasim/kernels_host_build) is made: one
    directory for the whole run, shared by pytest-xdist's workers (their base temp dirs share
    a parent), so the kernels are compiled once."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return shared / "cudasim-build"



@pytest.fixture(scope="session")
def named_launches(request: pytest.FixtureRequest,
                   tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """Every group of named items launched once for the session, its results shared by
    pytest-xdist's workers (tests/multiproc/named.py)."""
    from .multiproc.named import Launches

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return Launches(request.session, shared)
