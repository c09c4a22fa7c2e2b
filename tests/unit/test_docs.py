"""What the front page (README.md), the reference (docs/) and the bench's pages state that can
be checked: links and paths that exist, the API they name, the variables and commands they
give, the extras and the test commands, and the measured figures against the file they came
from. (The settings table is checked in test_settings.py, installing without a registry in
test_packaging.py.)"""

from __future__ import annotations

import json
import re
import shlex
import statistics
from pathlib import Path

import pytest

import gpuring
from gpuring import settings
from gpuring._cli import build_parser
from gpuring._communicator import Communicator

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS, ROOT / "bench" / "README.md",
         ROOT / "bench" / "results" / "README.md"]
#: the docs the README's "Read on" must list, one file per subject
SUBJECTS = {"api", "training", "launching", "settings", "faults", "gpu", "design", "bench",
            "development"}


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _slug(heading: str) -> str:
    """The anchor a Markdown renderer (GitHub's rule) gives a heading."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", _text(path), re.M)}


def test_there_is_one_doc_per_subject_and_the_readme_leads_to_each() -> None:
    assert {p.stem for p in DOCS} == SUBJECTS
    readme = _text(ROOT / "README.md")
    for subject in SUBJECTS:
        assert f"(docs/{subject}.md)" in readme, subject
    assert len(readme.splitlines()) <= 250, "the front page should stay short"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_links_lead_somewhere(page: Path) -> None:
    """Every relative link names a file of the repository, and its anchor a heading there."""
    for target in re.findall(r"\]\(([^)\s]+)\)", _text(page)):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        found = (page.parent / file).resolve() if file else page
        assert found.exists(), f"{_name(page)} links to {target}: no such file"
        if anchor:
            assert anchor in _anchors(found), f"{_name(page)} links to {target}: no heading"


#: repository paths as the pages write them, in backticks
PATH = re.compile(r"`((?:gpuring|tests|bench|examples|kernels|tools|docs|\.ci)/[^`\s]*)`")


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_paths_exist(page: Path) -> None:
    for path in PATH.findall(_text(page)):
        if any(c in path for c in "*{"):  # a family of files
            continue
        assert (ROOT / path.rstrip("/")).exists(), f"{_name(page)} names {path}: no such path"


def _source_text() -> str:
    return "\n".join(_text(p) for folder in ("gpuring", "tests", "bench", "tools")
                     for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".sh"))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_variable_named_is_read_somewhere(page: Path) -> None:
    """A GPURING_ variable the pages name is a declared setting, or one the code (the
    launcher, the tests, the bench, the device check) reads by that name."""
    source = _source_text()
    for name in sorted(set(re.findall(r"\bGPURING_[A-Z0-9_]*[A-Z0-9]\b", _text(page)))):
        assert name in settings.SETTINGS or f'"{name}"' in source or f"{name}=" in source, (
            f"{_name(page)} names {name}, which nothing reads")


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_defaults_stated_are_the_declared_ones(page: Path) -> None:
    """"`GPURING_X` ... N (s) by default" says what gpuring/settings.py declares."""
    text = " ".join(_text(page).split())
    for name, value in re.findall(r"`(GPURING_\w+)`[^.;`]{0,40}?\b(\d+)(?: s)? by default", text):
        assert settings.SETTINGS[name].shown == value, (_name(page), name, value)


def _public(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def test_the_api_doc_names_every_public_call_of_the_communicator() -> None:
    api = _text(ROOT / "docs" / "api.md")
    missing = sorted(n for n in _public(Communicator)
                     if not re.search(rf"`comm\.{n}\b|`{n}\b|\b{n}`", api))
    assert not missing, f"docs/api.md does not name {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_comm_call_named_exists(page: Path) -> None:
    for name in re.findall(r"\bcomm\.([a-z_]+)", _text(page)):
        if "*" in name:
            continue
        assert hasattr(Communicator, name), f"{_name(page)} names comm.{name}"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_error_named_is_gpurings(page: Path) -> None:
    for name in set(re.findall(r"\b([A-Z][A-Za-z]*Error)\b", _text(page))):
        if name in ("TypeError", "ValueError", "TimeoutError", "ImportError",
                    "ModuleNotFoundError", "RuntimeError"):
            continue
        if name in ("DistBackendError", "DistError"):  # torch.distributed's (c10d's)
            continue
        assert hasattr(gpuring, name), f"{_name(page)} names {name}, which gpuring lacks"


def _commands(text: str, word: str) -> list[list[str]]:
    """The `gpuring WORD ...` command lines of the pages' code blocks (as mpiexec or a
    shell would pass them to gpuring, from WORD on), continuation lines joined."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0]
            for part in line.split("&&"):
                words = shlex.split(part)
                for i in range(len(words) - 1):
                    if words[i] == "gpuring" and words[i + 1] == word:
                        found.append(words[i + 1:])
    return found


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_command_given_is_one_gpuring_takes(page: Path) -> None:
    """Every `gpuring bench`, `gpuring tune`, `gpuring kernels` and `gpuring run` command
    in the pages' code blocks parses (and the bench's settings are valid)."""
    from gpuring.bench.cli import settings_from_args

    parser = build_parser()
    for word in ("bench", "tune", "kernels", "run"):
        for argv in _commands(_text(page), word):
            args = parser.parse_args(argv)
            if word == "bench":
                settings_from_args(args)


def test_the_usage_of_gpuring_run_is_the_launchers() -> None:
    usage = re.search(r"^gpuring run (.*)$", _text(ROOT / "docs" / "launching.md"), re.M)
    assert usage is not None
    run = build_parser()._subparsers._group_actions[0].choices["run"]  # type: ignore[union-attr]
    options = {o for action in run._actions for o in action.option_strings}
    assert set(re.findall(r"(?<![\w-])(-{1,2}[a-z][a-z-]*)", usage.group(1))) <= options


def _extras() -> dict[str, list[str]]:
    project = tomllib.loads(_text(ROOT / "pyproject.toml"))
    return project["project"]["optional-dependencies"]


def test_the_readme_names_every_extra_and_what_it_brings() -> None:
    readme = _text(ROOT / "README.md")
    rows = dict(re.findall(r"^\| `([a-z0-9]+)`(?:, `[a-z0-9]+`)* \| (.*)$", readme, re.M))
    named = set(re.findall(r"^\| `([a-z0-9]+)`(?:, `([a-z0-9]+)`)?", readme, re.M))
    extras = {n for pair in named for n in pair if n}
    assert extras == set(_extras()), "the README's extras are pyproject's"
    for extra, requirements in _extras().items():
        row = next(text for name, text in rows.items()
                   if name == extra or (extra in ("cuda12", "cuda13") and name == "cuda13"))
        for requirement in requirements:
            name = re.split(r"[<>=!;\[ ]", requirement, maxsplit=1)[0].lower()
            stem = name.replace("_", "-").split("-")[0]
            assert name in row.lower().replace("_", "-").replace(" ", "-") or \
                stem in row.lower(), f"the README's row of {extra} does not say {name}"


def test_the_readme_gives_the_tests_ci_runs() -> None:
    """CI installs .ci/run's extras and runs its pytest command: the README gives both, and
    says what its shorter first command leaves out."""
    ci = _text(ROOT / ".ci" / "run")
    readme = _text(ROOT / "README.md")
    (extras,) = re.findall(r'pip install --quiet -e "(\.\[[a-z,]+\])"', ci)
    assert f'pip install -e "{extras}"' in readme
    (pytest_line,) = [line for line in ci.splitlines() if "python -m pytest" in line]
    command = re.sub(r"\s*--durations=\d+", "", pytest_line).strip()
    assert command in readme
    assert "leaves out" in readme and "[development](docs/development.md)" in readme


def _figures(text: str) -> dict[str, list[str]]:
    table = text.split("| size | gpuring | MPICH |", 1)[1].split("\n\n", 1)[0]
    rows = [line.strip("|").split("|") for line in table.splitlines()[2:]]
    return {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in rows}


def _shown(value: float) -> str:
    return f"{value:.1f}" if value < 10 else f"{round(value)}"


@pytest.mark.parametrize("page", [ROOT / "README.md", ROOT / "docs" / "bench.md"], ids=_name)
def test_the_figures_are_the_measured_ones(page: Path) -> None:
    """The table of all_reduce beside MPICH and gloo is what its JSON holds: the fastest of
    the sweeps and their median, for each system and placement, and the commit named."""
    doc = json.loads(_text(ROOT / "bench" / "results" / "cpu-allreduce-2ranks-peers.json"))
    times: dict[tuple[int, str, str], list[float]] = {}
    for row in doc["results"]:
        times.setdefault((row["size"], row["system"], row["placement"]), []).append(
            row["time_us"])
    columns = [("gpuring", "out-of-place"), ("mpi", "out-of-place"), ("gpuring", "in-place"),
               ("mpi", "in-place"), ("gloo", "in-place")]
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}
    text = _text(page)
    assert f"commit {doc['machine']['commit']}" in text
    table = _figures(text)
    assert table
    for size, cells in table.items():
        number, unit = size.split()
        for cell, key in zip(cells, columns, strict=True):
            measured = times[(int(number) * units[unit], *key)]
            assert cell == f"{_shown(min(measured))} ({_shown(statistics.median(measured))})", (
                size, key, cell)
    assert doc["wrong_total"] == 0
