"""gpuring's modules import each other without a cycle, lazy imports inside functions
included (imports only for type checkers are not counted, except in gpuring.bench, which has
no cycle even with them)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "gpuring"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _runtime_nodes(tree: ast.Module, *, typing_too: bool = False) -> list[ast.AST]:
    """Every node but those under `if TYPE_CHECKING:` (with `typing_too`, every node)."""
    if typing_too:
        return list(ast.walk(tree))
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            skip.update(id(n) for child in node.body for n in ast.walk(child))
    return [n for n in ast.walk(tree) if id(n) not in skip]


def _graph(*, typing_too: bool = False) -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in _runtime_nodes(tree, typing_too=typing_too):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in modules else module
                           for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            graph[name].update(t for t in targets if t in modules and t != name)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_import_graph_has_no_cycle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, " -> ".join(cycle or [])


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A cycle that passes through `start`, as `start -> ... -> start`; None when none does."""
    parents: dict[str, str] = {}
    todo = [start]
    while todo:
        node = todo.pop()
        for nxt in sorted(graph[node]):
            if nxt == start:
                path = [node]
                while path[-1] != start:
                    path.append(parents[path[-1]])
                return [*reversed(path), start]
            if nxt not in parents:
                parents[nxt] = node
                todo.append(nxt)
    return None


def test_the_bench_has_no_cycle_even_through_imports_for_type_checkers() -> None:
    """A module that imports another only for its annotations still depends on it (the
    annotation names it): the bench's modules share such types through modules of their
    own (e.g. `gpuring.bench.options`) instead of importing each other."""
    graph = _graph(typing_too=True)
    found = [c for m in sorted(graph) if m.startswith("gpuring.bench")
             if (c := _cycle_through(graph, m))]
    assert not found, " -> ".join(found[0])


def test_a_cycle_would_be_found() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    ring = {"a": {"b"}, "b": {"c", "d"}, "c": {"a"}, "d": set()}
    assert _cycle_through(ring, "a") == ["a", "b", "c", "a"]
    assert _cycle_through(ring, "d") is None


#: the public modules and packages at the top of gpuring (with the package itself); every
#: other top-level module is internal and its name starts with an underscore
PUBLIC = {"settings", "interop", "torch", "distributed", "devices", "bench"}
INTERNAL_LAYERS = {"algorithms", "rendezvous", "transports"}


def test_one_privacy_rule_for_modules() -> None:
    names = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
             if (p.suffix == ".py" or (p / "__init__.py").exists()) and p.name != "__init__.py"}
    misnamed = sorted(n for n in names - PUBLIC - INTERNAL_LAYERS
                      if not n.startswith("_"))
    assert not misnamed, f"internal modules without a leading underscore: {misnamed}"
    assert PUBLIC | INTERNAL_LAYERS <= names
