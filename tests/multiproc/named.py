"""The test side of named items (tests/multiproc/harness.py is the ranks' side).

A `Group` is one launch: the families of items it runs (of the case modules), the rank
count, the launcher, the device and the settings. `params` makes one pytest parameter per id
of the group's items, whose pytest id says what it checks and where:
`all_reduce-float16-sum-in_place-3ranks`, `gather-int8-1-root1-out_of_place-2ranks-mpiexec`.

The ranks run a group's items in one launch: `Launches` (the session's `named_launches`
fixture) launches each group once, for every id of it that the session selected, the first
time a test of it runs, and keeps the ranks' results on disk where every pytest-xdist worker
finds them (a lock file makes the other workers wait for that launch instead of launching it
again; tests/conftest.py has pytest-xdist send a launch's tests to one worker). Each test
then reads its own id's results: it fails with what every rank found wrong there (the first
wrong element: index, value, expected), an exception a rank raised in it, what a rank wrote
to stderr while it ran, or results that differ bitwise across ranks; and with the launch's
problem if the launch exited non-zero, a rank did not finish, or a rank wrote to stderr
outside every item.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import hashlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent

#: what a rank may write to stderr without failing anything: a notice that a wait at start-up
#: is taking long (its timing depends on the machine's load)
EXPECTED_STDERR = (r"gpuring: rank \d+ is waiting (for all \d+ ranks to meet|to reach the "
                   r"control server) .*",)


def cases_module(name: str) -> ModuleType:
    """A module of tests/multiproc the ranks import as a top-level one (harness.py, the case
    modules), imported so here too."""
    if str(HERE) not in sys.path:
        sys.path.append(str(HERE))
    return importlib.import_module(name)


@dataclasses.dataclass(frozen=True)
class Group:
    """One launch of `n` ranks running the items of `families` ("module:family", in the
    case modules tests/multiproc/cases_*.py).

    launcher: "gpuring" (`gpuring run`), "mpiexec" (with `nodes`: one simulated node per
    rank), "torchrun" (each process started by hand with torchrun's variables, on `nodes`)
    or "slurm" (srun's variables). env: settings for the ranks. options: what the families
    read from their Plan (a subset of dtypes, say). tag: what the ids add after the rank
    count to tell this group from another of the same items (`mpiexec`, `buffer8K`).
    context: what the test needs to launch it, not sent to the ranks (a GPU form)."""

    families: tuple[str, ...]
    n: int
    launcher: str = "gpuring"
    device: str = "cpu"
    env: tuple[tuple[str, str], ...] = ()
    options: tuple[tuple[str, Any], ...] = ()
    nodes: tuple[str, ...] | None = None
    tag: str = ""
    slow: bool = False
    timeout: float = 600
    context: Any = None

    @property
    def label(self) -> str:
        return f"{self.n}ranks" + (f"-{self.tag}" if self.tag else "")

    @property
    def key(self) -> str:
        """A short name of the group (the same in every process)."""
        digest = hashlib.sha256(repr(dataclasses.replace(self, context=None)).encode())
        return f"{self.label}-{digest.hexdigest()[:8]}"

    def ids(self, families: Iterable[str] | None = None) -> list[str]:
        """The ids of the group's items, or of those of `families` (names without their
        module) only."""
        wanted = None if families is None else set(families)
        return [name for family in self.families
                if wanted is None or family.partition(":")[2] in wanted
                for name in _catalog(self, family)]


@functools.cache
def _catalog(group: Group, family: str) -> list[str]:
    harness = cases_module("harness")
    plan = harness.Plan(group.n, group.device, dict(group.options), dict(group.env))
    return list(harness.catalog([family], plan))


def params(*groups: Group, families: Iterable[str] | None = None,
           marks: Iterable[pytest.MarkDecorator] = ()) -> list[Any]:
    """(group, id) parameters: one per id of each group's items (of `families` only, if
    given: a group may serve several tests, each taking its own families' ids)."""
    out = []
    for group in groups:
        extra = list(marks)
        if group.launcher == "mpiexec":
            extra.append(pytest.mark.mpi)
        if group.slow:
            extra.append(pytest.mark.slow)
        extra.append(pytest.mark.xdist_group(group.key))
        out += [pytest.param(group, name, id=f"{name}-{group.label}", marks=extra)
                for name in group.ids(None if families is None else tuple(families))]
    assert out, f"no items of the families {families} in {groups}"
    return out


def _unexpected(text: str, allowed: Iterable[str] = ()) -> str:
    """What is left of `text` once every match of EXPECTED_STDERR's and `allowed`'s patterns
    (each matching whole lines) is taken out; blank lines aside."""
    for pattern in (*EXPECTED_STDERR, *allowed):
        text = re.sub(rf"^(?:{pattern})$\n?", "", text, flags=re.MULTILINE)
    return "\n".join(line for line in text.splitlines() if line.strip())


def _tail(text: str, limit: int = 3000) -> str:
    text = text.strip()
    return textwrap.indent(text if len(text) <= limit else "..." + text[-limit:], "    ")


@dataclasses.dataclass
class Launch:
    """How one launch of a group went, as the test reads it back."""

    group: Group
    outdir: Path
    returncode: int | None  # None: stopped after its time ran out
    stdout: str
    stderr: str
    seconds: float

    @functools.cached_property
    def records(self) -> list[dict[str, dict[str, Any]]]:
        out = []
        for r in range(self.group.n):
            path = self.outdir / f"results-{r}.jsonl"
            lines = path.read_text().splitlines() if path.is_file() else []
            out.append({rec["id"]: rec for rec in map(json.loads, lines)})
        return out

    def _rank_stderr(self, r: int) -> str:
        path = self.outdir / f"stderr-{r}.txt"
        return path.read_text(errors="replace") if path.is_file() else ""

    def _where(self, r: int) -> str | None:
        """The item rank r was running last (None if it started none)."""
        path = self.outdir / f"marks-{r}.txt"
        marks = path.read_text().split() if path.is_file() else []
        return marks[-1] if marks else None

    def _missing(self, r: int, name: str) -> str:
        where = self._where(r)
        if where == name:
            why = "it ended while running this item"
        elif where is None:
            why = "it ran no item"
        else:
            why = f"it ended while running {where}"
        return f"rank {r} has no result for it: {why}"

    def problems(self, name: str) -> list[str]:
        """What is wrong with id `name` on every rank; [] if nothing."""
        found: list[str] = []
        recs = [self.records[r].get(name) for r in range(self.group.n)]
        for r, rec in enumerate(recs):
            if rec is None:
                found.append(self._missing(r, name))
                continue
            if rec["not_run"]:
                found.append(f"rank {r}: {rec['not_run']}")
                continue
            if rec["error"]:
                found.append(f"rank {r} raised:\n{_tail(rec['error'])}")
            found += [f"rank {r}: {failure}" for failure in rec["failures"]]
            unexpected = _unexpected(rec["stderr"], rec["stderr_allowed"])
            if unexpected:
                found.append(f"rank {r} wrote to stderr while it ran:\n{_tail(unexpected)}")
        if found:
            return found
        done = [rec for rec in recs if rec is not None]
        if not any(rec["checked"] for rec in done):
            found.append("no rank checked a result in it")
        for r, rec in enumerate(done[1:], 1):
            if rec["digests"] != done[0]["digests"]:
                mine, theirs = rec["digests"], done[0]["digests"]
                first = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=False))
                              if a != b), min(len(mine), len(theirs)))
                what = (mine[first].rsplit(" ", 1)[0] if first < len(mine)
                        else theirs[first].rsplit(" ", 1)[0])
                found.append(f"rank {r}'s results differ bitwise from rank 0's, the first at "
                             f"{what!r}")
        return found

    @functools.cached_property
    def failure(self) -> str | None:
        """What went wrong with the launch as a whole (None if nothing): it timed out or
        exited non-zero, a rank did not finish, or wrote to stderr outside every item."""
        where = "; ".join(f"rank {r} was in {self._where(r)}" for r in range(self.group.n)
                          if self._where(r) is not None)
        output = (f"\n  its output:\n{_tail(self.stdout, 2000)}\n  its stderr:\n"
                  f"{_tail(self.stderr)}") + "".join(  # ranks that never learnt their rank
            f"\n  {path.name}:\n{_tail(path.read_text(errors='replace'))}"
            for path in sorted(self.outdir.glob("stderr-pid*.txt")))
        if self.returncode is None:
            return f"the launch ran out of its {self.group.timeout:g} s ({where}){output}"
        if self.returncode != 0:
            return f"the launch exited {self.returncode} ({where}){output}" + "".join(
                f"\n  rank {r}'s stderr:\n{_tail(self._rank_stderr(r))}"
                for r in range(self.group.n) if self._rank_stderr(r).strip())
        unexpected = _unexpected(self.stderr)
        if unexpected:
            return f"the launcher wrote to stderr:\n{_tail(unexpected)}"
        for r in range(self.group.n):
            done = self.outdir / f"done-{r}.json"
            if not done.is_file():
                return (f"rank {r} did not finish (its last item: {self._where(r)}); its "
                        f"stderr:\n{_tail(self._rank_stderr(r))}{output}")
            raw = (self.outdir / f"stderr-{r}.txt").read_bytes()
            outside, at = b"", 0
            for start, end in json.loads(done.read_text())["items"]:
                outside += raw[at:start]
                at = end
            unexpected = _unexpected((outside + raw[at:]).decode(errors="replace"))
            if unexpected:
                return f"rank {r} wrote to stderr outside every item:\n{_tail(unexpected)}"
        return None

    def check(self, name: str) -> None:
        found = self.problems(name)
        if self.failure is not None:
            found.append(self.failure)
        if found:
            pytest.fail(f"{name} on {self.group.label}:\n" + "\n".join(found), pytrace=False)


class Launches:
    """Each group's launch, once per session (see the module's docstring)."""

    def __init__(self, session: pytest.Session, shared: Path):
        self.session = session
        self.shared = shared
        self.done: dict[Group, Launch] = {}

    @functools.cached_property
    def _selected(self) -> dict[Group, list[str]]:
        out: dict[Group, list[str]] = {}
        for item in self.session.items:
            spec = getattr(item, "callspec", None)
            group = spec.params.get("group") if spec is not None else None
            if isinstance(group, Group):
                out.setdefault(group, []).append(spec.params["item"])
        return out

    def check(self, group: Group, name: str, env: Mapping[str, str] | None = None) -> None:
        """Fail unless id `name` of `group` passed on every rank, and the launch went
        well. `env`: the ranks' environment (else this process's)."""
        self.launch(group, env).check(name)

    def once(self, name: str, make: Callable[[Path], None], timeout: float = 600) -> Path:
        """A directory `make(directory)` filled once for the session, whichever worker asks
        first (the others wait for it, at most `timeout` s)."""
        home = self.shared / "named-once" / name
        home.mkdir(parents=True, exist_ok=True)
        with _locked(home.parent / f"{name}.lock", timeout + 60):
            if not (home / ".made").is_file():
                make(home)
                (home / ".made").touch()
        return home

    def launch(self, group: Group, env: Mapping[str, str] | None = None) -> Launch:
        if group in self.done:
            return self.done[group]
        selected = sorted(set(self._selected.get(group, [])))
        every = group.ids()
        key = hashlib.sha256(repr((group, selected)).encode()).hexdigest()[:20]
        home = self.shared / "named-launches" / key
        home.mkdir(parents=True, exist_ok=True)
        with _locked(home / "lock", group.timeout + 300):
            summary = home / "launch.json"
            if not summary.is_file():
                spec = {"families": list(group.families), "device": group.device,
                        "options": dict(group.options),
                        "select": None if not selected or set(selected) >= set(every)
                        else selected}
                ranks = home / "ranks"
                ranks.mkdir(exist_ok=True)
                spec["outdir"] = str(ranks)
                (home / "spec.json").write_text(json.dumps(spec))
                result = _run_group(group, home / "spec.json", env)
                partial = summary.with_suffix(".tmp")
                partial.write_text(json.dumps(result))
                partial.replace(summary)
            result = json.loads(summary.read_text())
        launch = Launch(group, home / "ranks", **result)
        self.done[group] = launch
        return launch


class _locked:
    """An exclusive lock on `path` across processes, waited for at most `timeout` s."""

    def __init__(self, path: Path, timeout: float):
        self.path, self.timeout = path, timeout

    def __enter__(self) -> None:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise TimeoutError(
                        f"{self.path} stayed locked for {self.timeout:g} s") from None
                time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _run_group(group: Group, spec: Path, env: Mapping[str, str] | None) -> dict[str, Any]:
    """Launch the group's ranks and wait for them (at most group.timeout s); how it went."""
    from ..conftest import free_port, mpiexec, on_nodes, torchrun_env

    script = str(HERE / "run_items.py")
    base = dict(env if env is not None else os.environ)
    base.update(GPURING_JITTER="1", GPURING_TIMEOUT="60")
    base.update(dict(group.env))
    start = time.monotonic()
    if group.launcher in ("gpuring", "mpiexec"):
        if group.launcher == "gpuring":
            cmd = [sys.executable, "-m", "gpuring", "run", "-n", str(group.n), "--",
                   sys.executable, script, str(spec)]
        else:
            exe = mpiexec()
            if exe is None:
                pytest.skip("mpiexec with mpi4py is not available")
            command = [sys.executable, script, str(spec)]
            cmd = [exe, "-n", str(group.n), *command] if group.nodes is None else \
                [exe, *on_nodes(list(group.nodes), command)]
        code, out, err = _bounded([cmd], [base], group.timeout)
    else:
        for name in ("GPURING_STORE", "PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE",
                     "PMIX_RANK"):
            base.pop(name, None)
        if group.launcher == "torchrun":
            envs = torchrun_env(group.n, free_port(), list(group.nodes or ()) or None)
        else:  # srun's variables
            port = str(free_port())
            envs = [{"SLURM_PROCID": str(r), "SLURM_NTASKS": str(group.n),
                     "SLURM_LOCALID": str(r), "SLURM_JOB_ID": "4242",
                     "SLURM_STEP_NODELIST": "localhost", "GPURING_PORT": port}
                    for r in range(group.n)]
        cmd = [sys.executable, script, str(spec)]
        code, out, err = _bounded([cmd] * group.n, [{**base, **e} for e in envs],
                                  group.timeout)
    return {"returncode": code, "stdout": out, "stderr": err,
            "seconds": time.monotonic() - start}


def _bounded(cmds: list[list[str]], envs: list[dict[str, str]], timeout: float
             ) -> tuple[int | None, str, str]:
    """Run the processes together, each in a session of its own; past `timeout` s they are
    sent SIGTERM (a launcher stops its ranks), then SIGKILL. Their highest exit status (None
    if they ran out of time) and their outputs."""
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, start_new_session=True)
             for cmd, env in zip(cmds, envs, strict=True)]
    deadline = time.monotonic() + timeout
    outs, errs, late = [], [], False
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            late = True
            out = err = "(no output: it was stopped)"
            for signum in (signal.SIGTERM, signal.SIGKILL):
                for p in procs:
                    if p.poll() is None:
                        try:
                            os.killpg(p.pid, signum)
                        except ProcessLookupError:
                            pass
                try:
                    out, err = proc.communicate(timeout=20)
                    break
                except subprocess.TimeoutExpired:
                    continue
        outs.append(out)
        errs.append(err)
    codes = [p.returncode for p in procs]
    code = None if late else max(codes, key=abs)
    return code, "".join(outs), "".join(errs)
