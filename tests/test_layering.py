"""Imports run downward: experiments -> memtrain -> (parallel, eval), and no module reaches back up inside a
package either. Read from the source (every import statement, lazy ones inside functions included), so a
cycle dodged by a function-level import is still a cycle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("parallel", "eval", "memtrain", "experiments")
MAY_IMPORT = {"parallel": set(), "eval": {"parallel"}, "memtrain": {"parallel", "eval"},
              "experiments": {"parallel", "eval", "memtrain"}}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules `name` imports (a package import is an import of its __init__)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[:len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            # `from pkg import sub` imports the submodule (pkg is initializing already); any other name, pkg
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        for t in targets:
            while t and t not in known:  # `import a.b.c` runs a, a.b and a.b.c: the deepest known counts
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the modules along it, or None (iterative DFS, three colours)."""
    state: dict[str, int] = {}
    for start in graph:
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                state[node] = 2
                stack.pop()
            elif state.get(child) == 1:
                path = [n for n, _ in stack]
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                stack.append((child, iter(sorted(graph[child]))))
    return None


def test_the_checker_finds_a_cycle_and_a_clean_graph():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_imports_only_the_layers_below_it(package):
    graph = _graph()
    upward = sorted(f"{m} -> {t}" for m, ts in graph.items() if m.split(".")[0] == package for t in ts
                    if t.split(".")[0] != package and t.split(".")[0] not in MAY_IMPORT[package])
    assert not upward, f"imports that run up or sideways: {upward}"


def test_no_import_cycle_between_modules():
    graph = _graph()
    assert len(graph) > 60  # every package was read
    assert _cycle(graph) is None, f"import cycle: {' -> '.join(_cycle(graph))}"
