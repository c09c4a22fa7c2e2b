"""tools/device_check/, the harness of bench/device_check.sh, runs from the source tree and is
not part of the installed library: gpuring never imports it, and its modules import and run
with the repository root on the path (as the script runs them)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ["probe", "probe_faults", "probe_gpu", "probe_parts", "probe_registry",
           "summary_probe", "summary_units", "check_summary", "smoke"]


def test_the_library_never_imports_tools() -> None:
    found = []
    for path in sorted((ROOT / "gpuring").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names
                      if n == "tools" or n.startswith("tools.")]
    assert not found, found


@pytest.mark.parametrize("name", HARNESS)
def test_the_harness_modules_import(name: str) -> None:
    """Without CUDA: the probe process itself never touches it, the parts import it lazily."""
    importlib.import_module(f"tools.device_check.{name}")


def test_the_probe_runs_from_the_tree() -> None:
    done = subprocess.run([sys.executable, "-m", "tools.device_check.probe"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "python -m tools.device_check.probe OUT.json" in done.stderr
