"""The package's structure (docs/ARCHITECTURE.md): no import cycles; layers import only downward
(entrypoints above the engine above the worker above models, layers, kernels and the rest); at most
8 modules directly under tokenloom/; the server reaches the engine only through AsyncLLMEngine's
public interface."""

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


# Layers from the top (0) down; a module takes the layer of its longest listed prefix, and
# everything unlisted (models, layers, attention, kv_cache, quant, kernels, sampling, ...) is the
# bottom layer. The draft proposer drives a draft model's runner for the engine core; a rank's
# worker process runs a model runner.
LAYERS = {
    "tokenloom.entrypoints": 0,
    "tokenloom.eval": 0,
    "tokenloom.engine": 1,
    "tokenloom.spec_decode.proposer": 1,
    "tokenloom.worker": 2,
    "tokenloom.distributed.worker": 2,
    "tokenloom.distributed.launch": 2,
    "tokenloom.distributed.rank_main": 2,
}
BOTTOM = 3
FACADES = {"tokenloom", "tokenloom.__main__"}  # the public API: `tokenloom.LLM`, `python -m tokenloom`


def layer_of(module: str, layers: dict[str, int] = LAYERS) -> int:
    matches = [prefix for prefix in layers if module == prefix or module.startswith(prefix + ".")]
    return layers[max(matches, key=len)] if matches else BOTTOM


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int] = LAYERS) -> list[str]:
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if module not in FACADES
        for target in targets
        if layer_of(target, layers) < layer_of(module, layers)
    )


def test_no_import_cycles_in_the_package():
    graph = import_graph()
    assert "tokenloom.engine.core" in graph and "tokenloom.engine.scheduler" in graph["tokenloom.engine.core"]
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_layers_import_only_the_layers_below():
    graph = import_graph()
    assert graph["tokenloom.engine.core"] and graph["tokenloom.worker.model_runner"]
    assert upward_imports(graph) == []


def test_the_layer_check_finds_an_upward_import():
    graph = {
        "tokenloom.worker.batch": {"tokenloom.engine.request"},
        "tokenloom.engine.core": {"tokenloom.worker.batch"},
        "tokenloom.models.llama": {"tokenloom.distributed.worker"},
    }
    assert upward_imports(graph) == [
        "tokenloom.models.llama -> tokenloom.distributed.worker",
        "tokenloom.worker.batch -> tokenloom.engine.request",
    ]


def test_the_top_level_holds_the_public_api_and_at_most_eight_modules():
    modules = sorted(p.name for p in ROOT.glob("*.py"))
    assert len(modules) <= 8, modules
    assert {"__init__.py", "sampling_params.py", "outputs.py"} <= set(modules)


def test_the_server_uses_only_the_async_engines_public_interface():
    for path in (ROOT / "entrypoints" / "server").glob("*.py"):
        source = path.read_text()
        assert "engine.engine" not in source and "._engine" not in source, path.name
