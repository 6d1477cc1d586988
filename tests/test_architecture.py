"""The package's structure: no import cycles, and the server reaches the engine only through
AsyncLLMEngine's public interface (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import tokenloom

ROOT = Path(tokenloom.__file__).parent


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    return name.removesuffix(".__init__")


def import_graph() -> dict[str, set[str]]:
    """module -> tokenloom modules it imports (at any depth of its code; TYPE_CHECKING blocks aside)."""
    modules = {module_name(p): p for p in ROOT.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                node.body = []
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets.update(resolve(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets.update(resolve(f"{node.module}.{a.name}") for a in node.names)
        graph[name] = {t for t in targets if t and t != name and t.startswith("tokenloom")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_in_the_package():
    graph = import_graph()
    assert "tokenloom.engine.core" in graph and "tokenloom.scheduler" in graph["tokenloom.engine.core"]
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_lower_layers_do_not_import_the_layers_above():
    graph = import_graph()
    below = ["tokenloom.scheduler", "tokenloom.runner", "tokenloom.engine.core", "tokenloom.spec_decode.proposer"]
    above = {"tokenloom.engine.output_processor", "tokenloom.engine.llm_engine", "tokenloom.llm",
             "tokenloom.async_engine", "tokenloom.server"}
    for module in below:
        assert not graph[module] & above, module


def test_the_server_uses_only_the_async_engines_public_interface():
    for path in (ROOT / "server").glob("*.py"):
        source = path.read_text()
        assert "engine.engine" not in source and "._engine" not in source, path.name
