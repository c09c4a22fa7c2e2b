"""Every GPURING_* setting is declared once (gpuring/settings.py), read only through it, and
documented by the table docs/settings.md shows."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from gpuring import settings
from gpuring.devices.cuda import CudaDevice
from gpuring.devices.host import HostDevice

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_table_is_the_declared_one() -> None:
    doc = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    block = re.search(r"<!-- settings: generated from gpuring/settings.py.*?-->\n(.*?)\n"
                      r"<!-- end of settings -->", doc, re.S)
    assert block is not None, "docs/settings.md lost its settings table markers"
    assert block.group(1) == settings.markdown_table()
    rows = re.findall(r"^\| `(GPURING_\w+)` \|", doc, re.M)
    assert sorted(rows) == sorted(settings.SETTINGS), "a setting is documented twice or not"


def _mib(n: int) -> str:
    return f"{n >> 20}M"


@pytest.mark.parametrize(("name", "attribute"), [
    ("GPURING_CHUNK_BYTES", "default_chunk_bytes"), ("GPURING_CHANNELS", "default_channels"),
    ("GPURING_BUFFER_BYTES", "default_buffer_bytes")])
def test_per_device_defaults_are_what_the_devices_use(name: str, attribute: str) -> None:
    def show(value: int) -> str:
        return str(value) if attribute == "default_channels" else _mib(value)

    want = (f"{show(getattr(HostDevice, attribute))} (CPU), "
            f"{show(getattr(CudaDevice, attribute))} (GPU)")
    assert settings.SETTINGS[name].shown == want


def _constants(tree: ast.Module) -> dict[str, str]:
    return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for t in node.targets if isinstance(t, ast.Name)}


def _environment_reads(path: Path) -> list[tuple[int, str]]:
    """(line, variable) of every os.environ[...] / .get(...) / os.getenv(...) whose variable is
    a literal or a module constant."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = _constants(tree)

    def value(node: ast.AST) -> str | None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        return names.get(node.id) if isinstance(node, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ"):
            key = value(node.slice)
        elif isinstance(node, ast.Call) and node.args and (
                ast.unparse(node.func).endswith(("environ.get", "getenv"))):
            key = value(node.args[0])
        else:
            continue
        if key is not None:
            found.append((node.lineno, key))
    return found


def test_settings_are_read_nowhere_else() -> None:
    offenders = [f"{path.relative_to(ROOT)}:{line} reads {name}"
                 for path in sorted((ROOT / "gpuring").rglob("*.py"))
                 if path.name != "settings.py"
                 for line, name in _environment_reads(path) if name in settings.SETTINGS]
    assert not offenders, offenders


def test_a_value_that_cannot_be_read_names_its_variable(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    monkeypatch.setenv("GPURING_CUDA_FLAGS", "sometimes")
    with pytest.raises(ValueError, match="GPURING_CUDA_FLAGS='sometimes'"):
        settings.get("GPURING_CUDA_FLAGS")
    monkeypatch.setenv("GPURING_FUSION_BYTES", "16M")
    assert settings.get("GPURING_FUSION_BYTES") == 16 << 20
    monkeypatch.setenv("GPURING_FUSION_BYTES", "")
    assert settings.get("GPURING_FUSION_BYTES") == 64 << 20
