"""gpuring's modules import each other one way: no circle of imports among the modules in
`SCOPE`. Every `import` and `from ... import` of a module counts, wherever it stands (inside
`if TYPE_CHECKING:` and inside functions too): a reader who follows one module's imports
should never come back to it. A circle through modules outside the scope counts where one of
its modules is inside it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import gpuring

#: the modules whose import circles are refused: this package and the modules under it
SCOPE = "gpuring"

PACKAGE_DIR = Path(gpuring.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    """Every module of the gpuring package: dotted name -> source file."""
    found = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(name: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The gpuring modules that module `name` (at `path`) imports. `from a import b` imports
    a.b where that is a module, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules
                       else source for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name in a.b
                target = target.rpartition(".")[0]
            if target:
                yield target


def import_graph() -> dict[str, set[str]]:
    """Module -> the gpuring modules it imports."""
    modules = _modules()
    return {name: set(_imported(name, path, modules)) for name, path in modules.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of `graph` that hold a circle (two modules or more,
    or one that imports itself), by Tarjan's algorithm (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return found


def _in_scope(module: str) -> bool:
    return module == SCOPE or module.startswith(SCOPE + ".")


def test_the_checker_finds_circles() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}, "f": {"d"}}
    assert sorted(circles(graph)) == [["a", "b", "c"], ["e"]]


def test_the_graph_follows_every_kind_of_import() -> None:
    graph = import_graph()
    assert "gpuring.devices.base" in graph["gpuring.devices.host"]  # from .base import ...
    assert "gpuring.devices._kernels" in graph["gpuring.devices.cuda"]  # from . import _kernels
    assert "gpuring.devices.cuda" in graph["gpuring.devices"]  # inside a function
    # under `if TYPE_CHECKING:`
    assert "gpuring.rendezvous.base" in graph["gpuring.devices.base"]


def test_no_import_circle_in_scope() -> None:
    graph = import_graph()
    assert any(_in_scope(name) for name in graph), f"no module in {SCOPE}"
    found = [c for c in circles(graph) if any(_in_scope(m) for m in c)]
    assert not found, "modules that import each other: " + "; ".join(
        " <-> ".join(c) for c in found)
