"""The floor plan, enforced: which process each package runs in, and which way imports may point.

Every import statement of the project's sources counts (module level, inside functions and under
``if TYPE_CHECKING:``): a reader and a refactoring tool see the arrow either way. ``from P import
name`` points at the submodule ``P.name`` where one exists, else at the package ``P`` itself.
Importing ``a.b.c`` also runs ``a`` and ``a.b``; those implicit arrows are not counted, so a
package's ``__init__`` may re-export its submodules.

The layers (docs/design.md, "Packages"):

    protocol     kvtier_protocol                          imports nothing of the project
    engine side  kvtier.client, kvtier.connector,         protocol and the engine side only:
                 kvtier_vllm, kvtier_sglang, kvtier_hf    it runs inside an inference engine
    daemon       kvtier.daemon                            protocol and the daemon only
    tools        kvtier.engine (reference engine)         protocol and the engine side
                 kvtier.bench, kvtier.commands,           anything
                 kvtier.cli, kvtier.__main__

The root package ``kvtier`` (``__version__`` only) may be imported by every layer but the protocol.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE_ROOTS = {"kvtier": ROOT, "kvtier_protocol": ROOT / "protocol", "kvtier_vllm": ROOT / "connectors",
                "kvtier_sglang": ROOT / "connectors", "kvtier_hf": ROOT / "connectors"}

ENGINE_SIDE = ("kvtier.client", "kvtier.connector", "kvtier_vllm", "kvtier_sglang", "kvtier_hf")
LAYERS: dict[str, tuple[str, ...]] = {
    # layer: the module prefixes that belong to it
    "protocol": ("kvtier_protocol",),
    "engine side": ENGINE_SIDE,
    "daemon": ("kvtier.daemon",),
    "reference engine": ("kvtier.engine",),
    "tools": ("kvtier.bench", "kvtier.commands", "kvtier.cli", "kvtier.__main__"),
    "root": ("kvtier",),
}
ALLOWED: dict[str, tuple[str, ...]] = {
    # layer: the layers it may import (besides itself)
    "protocol": (),
    "engine side": ("protocol", "root"),
    "daemon": ("protocol", "root"),
    "reference engine": ("protocol", "engine side", "root"),
    "tools": ("protocol", "engine side", "daemon", "reference engine", "root"),
    "root": (),
}


def _modules() -> dict[str, Path]:
    """Every module of the project by dotted name (a package by its own name; a C extension by
    its source file, which imports nothing of the project)."""
    found: dict[str, Path] = {}
    for top, base in SOURCE_ROOTS.items():
        for path in [*(base / top).rglob("*.py"), *(base / top).rglob("*.c")]:
            parts = path.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _targets(module: str, path: Path) -> Iterator[tuple[int, str]]:
    """(line, imported project module) for every import statement in ``path``."""
    if path.suffix != ".py":
        return
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:  # `import kvtier.client.sync` -> the module itself
                name = name.rpartition(".")[0]
            if name and name != module:
                yield node.lineno, name


GRAPH: dict[str, set[str]] = {m: {t for _, t in _targets(m, p)} for m, p in MODULES.items()}


def layer_of(module: str) -> str:
    """The layer a module belongs to (the longest matching prefix wins)."""
    best, best_len = "", -1
    for layer, prefixes in LAYERS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = layer, len(prefix)
    assert best, f"{module} belongs to no layer: add it to LAYERS"
    return best


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        layer_of(module)


def test_no_import_cycles() -> None:
    cycles = _cycles(GRAPH)
    described = ["\n".join(f"  {m} -> {sorted(GRAPH[m] & set(c))}" for m in c) for c in cycles]
    assert not cycles, "import cycles:\n" + "\n\n".join(described)


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_imports_point_only_at_allowed_layers(layer: str) -> None:
    wrong = []
    for module, path in sorted(MODULES.items()):
        if layer_of(module) != layer:
            continue
        for line, target in _targets(module, path):
            other = layer_of(target)
            if other != layer and other not in ALLOWED[layer]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {module} ({layer}) imports {target} ({other})")
    assert not wrong, "\n".join(wrong)


def test_the_checker_sees_a_cycle_and_a_wrong_arrow() -> None:
    """The checks above are only as good as the graph: a planted cycle and arrow are caught."""
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(planted) == [["a", "b", "c"]]
    assert layer_of("kvtier.client.sync") == "engine side"
    assert layer_of("kvtier.daemon.store.index") == "daemon"
    assert "daemon" not in ALLOWED["engine side"]
    assert "kvtier_protocol.frames" in GRAPH["kvtier.client.transport"]
