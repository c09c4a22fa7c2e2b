"""No module of gpuring reads another module's private names: an attribute access
`obj._name` is allowed only where `_name` is defined in the same module (a method, a class
attribute, a slot, or an attribute the module assigns), besides the NamedTuple API and a few
private names of other libraries, each listed with why."""

from __future__ import annotations

import ast
from pathlib import Path

import gpuring

PACKAGE = Path(gpuring.__file__).parent

#: the NamedTuple API (public, despite the underscore)
NAMEDTUPLE = frozenset({"_replace", "_asdict", "_fields", "_make", "_field_defaults"})

#: private names of other libraries that gpuring reads, by module: what and why
FOREIGN = {
    ("algorithms/collectives.py", "_getframe"):
        "sys._getframe: the caller's frame for a DeprecationWarning's stacklevel",
    ("_recorder.py", "_getframe"):
        "sys._getframe: the user's frame that made a call, for the flight recorder (walked once "
        "per checked call; `inspect.stack` would read every frame's source lines)",
    ("torch.py", "_plugins"):
        "torch.distributed.Backend._plugins: whether the backend is registered already "
        "(torch has no public query)",
}


def _defined(tree: ast.Module) -> set[str]:
    """The private names a module defines: functions, classes, class attributes, slots, and
    attributes it assigns (`x._name = ...`)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for sub in ast.walk(target):
                    if isinstance(sub, ast.Attribute):
                        names.add(sub.attr)
                    elif isinstance(sub, ast.Name):
                        names.add(sub.id)
            value = getattr(node, "value", None)
            if any(isinstance(t, ast.Name) and t.id == "__slots__" for t in targets) \
                    and value is not None:
                names.update(e.value for e in ast.walk(value)
                             if isinstance(e, ast.Constant) and isinstance(e.value, str))
        elif isinstance(node, ast.arg):
            names.add(node.arg)
    return {n for n in names if n.startswith("_")}


def _violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        own = _defined(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute):
                name = node.attr
                if not name.startswith("_") or name.startswith("__") or name in NAMEDTUPLE:
                    continue
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                if name in own or (rel, name) in FOREIGN:
                    continue
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom) and node.level:
                where = path.parent.joinpath(*[".."] * (node.level - 1),
                                             *(node.module or "").split(".")).resolve()
                found += [f"{rel}:{node.lineno}: imports {alias.name}" for alias in node.names
                          if alias.name.startswith("_") and not alias.name.startswith("__")
                          and not (where / f"{alias.name}.py").exists()]  # (a module)
    return found


def test_no_module_reads_another_modules_private_names() -> None:
    violations = _violations()
    assert not violations, "private names read across modules:\n" + "\n".join(violations)


def test_the_walk_finds_a_private_read(tmp_path: Path) -> None:
    """The check itself can fail: a read of a name the module does not define is found."""
    tree = ast.parse("def f(comm):\n    return comm._path\n")
    assert "_path" not in _defined(tree)
