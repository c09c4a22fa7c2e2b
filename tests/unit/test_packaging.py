"""pyproject.toml asks for a build backend that can read it; the README says how to install
without a package registry."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]

#: the first setuptools release on the package index that reads `project.license` as an
#: SPDX expression (PEP 639); 77.0.0 added it but is not on the index this was checked
#: against, and 76.1.0 rejects the string
SPDX_SETUPTOOLS = (77, 0, 1)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _setuptools_floor() -> tuple[int, ...]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    found = [re.fullmatch(r"setuptools\s*>=\s*([0-9.]+)", r.strip())
             for r in project["build-system"]["requires"]]
    floors = [_version(m.group(1)) for m in found if m]
    assert len(floors) == 1, "build-system.requires should name setuptools>=X once"
    return floors[0]


def test_the_setuptools_floor_reads_the_spdx_license():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    if isinstance(project["project"].get("license"), str):
        assert _setuptools_floor() >= SPDX_SETUPTOOLS


def test_readme_says_how_to_install_without_a_registry():
    readme = (ROOT / "README.md").read_text()
    install = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    assert "pip install --no-build-isolation -e ." in install
    floor = ".".join(str(part) for part in _setuptools_floor())
    assert f"setuptools>={floor}" in install
