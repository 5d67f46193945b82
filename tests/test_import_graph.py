"""The package's import graph: no circle between modules (function-local imports included: a
circle hidden inside functions still ties two modules together), and no private name imported from
another module (share it under a public name, or move it)."""

from __future__ import annotations

import ast
from pathlib import Path

import tr_serve

PACKAGE = Path(tr_serve.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("tr_serve",) + path.relative_to(PACKAGE).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(modules: dict[str, Path]) -> tuple[dict[str, set[str]], list[str]]:
    """module -> the modules it imports (a package's own submodules left out), and the private
    names imported across modules."""

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in modules}
    private = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                private += [f"{module}: from {node.module} import {a.name}" for a in node.names
                            if a.name.startswith("_") and node.module.startswith("tr_serve")]
            else:
                continue
            for target in targets:
                found = owner(target) if target.startswith("tr_serve") else None
                if found and found != module and not found.startswith(module + "."):
                    edges[module].add(found)
    return edges, private


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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
                out.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_and_no_private_import():
    modules = _modules()
    assert "tr_serve.cli" in modules and "tr_serve.bench.spec_bench" in modules
    edges, private = _imports(modules)
    assert _circles(edges) == []
    assert private == []


def test_the_circle_check_sees_a_circle():
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
