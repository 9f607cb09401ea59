"""specgen's import graph, read with ``ast`` (nothing is imported): no cycles, no upward imports.

Every ``import`` counts, also one inside a function (a lazy import hides a cycle, it
does not remove it). A module is named by its dotted path; a package by its
``__init__``. The layers, bottom up: ``errors``; ``sampling``; ``models``,
``processors``, ``grammar``, ``heads``; ``drafters``; the engine and its
helpers; the entry points (``cli``, ``serve``, ``tui``, ``bench``, ``train``).
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "specgen"

#: Cycles that exist on purpose, each as the set of its modules (none: every import is one-way).
ALLOWED_CYCLES: set[frozenset[str]] = set()

#: The entry points: nothing outside them imports them.
TOP = ("specgen.cli", "specgen.serve", "specgen.tui", "specgen.bench", "specgen.train")


def _modules() -> dict[str, pathlib.Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        modules[name.removesuffix(".__init__")] = path
    return modules


def _targets(name: str, path: pathlib.Path, node: ast.Import | ast.ImportFrom, modules) -> set[str]:
    """The specgen modules one import statement of module ``name`` reads."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in modules}
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    found = set()
    for alias in node.names:
        if f"{base}.{alias.name}" in modules:
            found.add(f"{base}.{alias.name}")
        elif base in modules:
            found.add(base)
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the specgen modules it imports (itself excluded)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        imported: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imported |= _targets(name, path, node, modules)
        imported.discard(name)
        graph[name] = {m for m in imported if m.startswith("specgen")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
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
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _violations(graph, sources: tuple[str, ...], allowed=None, forbidden=None) -> list[str]:
    """``importer -> imported`` for each import from ``sources`` outside ``allowed`` (or into ``forbidden``)."""
    bad = []
    for importer, imported in sorted(graph.items()):
        if not _within(importer, sources):
            continue
        for target in sorted(imported):
            if allowed is not None and not _within(target, allowed):
                bad.append(f"{importer} -> {target}")
            if forbidden is not None and _within(target, forbidden):
                bad.append(f"{importer} -> {target}")
    return bad


def test_walker_sees_plain_relative_and_lazy_imports():
    graph = import_graph()
    assert "specgen.errors" in graph["specgen.sampling.rejection"] or "specgen.errors" in graph["specgen.sampling"]
    assert "specgen.heads.eagle3" in graph["specgen.heads.kinds"]
    assert "specgen.engine.assemble" in graph["specgen.cli.main"]  # imported inside a function
    assert {frozenset({"a", "b"})} == set(cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}))
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycles():
    found = set(cycles(import_graph()))
    unexpected = [sorted(c) for c in found - ALLOWED_CYCLES]
    assert not unexpected, f"import cycles: {unexpected}"
    stale = [sorted(c) for c in ALLOWED_CYCLES - found]
    assert not stale, f"these allowed cycles are gone: remove them from ALLOWED_CYCLES: {stale}"


def test_sampling_imports_only_itself_and_errors():
    bad = _violations(import_graph(), ("specgen.sampling",), allowed=("specgen.sampling", "specgen.errors"))
    assert not bad, f"specgen.sampling imports from above it: {bad}"


def test_models_do_not_import_the_layers_above():
    above = ("specgen.engine", "specgen.drafters", "specgen.batch", *TOP)
    bad = _violations(import_graph(), ("specgen.models",), forbidden=above)
    assert not bad, f"specgen.models imports from above it: {bad}"


def test_drafters_do_not_import_the_engine_or_entry_points():
    above = ("specgen.engine", "specgen.batch", *TOP)
    bad = _violations(import_graph(), ("specgen.drafters",), forbidden=above)
    assert not bad, f"specgen.drafters imports from above it: {bad}"


def test_entry_points_are_imported_by_no_lower_module():
    graph = import_graph()
    lower = tuple(sorted({m for m in graph if not _within(m, TOP)} - {"specgen"}))
    bad = _violations(graph, lower, forbidden=TOP)
    assert not bad, f"modules below the entry points import them: {bad}"


def test_server_does_not_import_the_tui():
    bad = _violations(import_graph(), ("specgen.serve",), forbidden=("specgen.tui", "specgen.cli", "specgen.bench"))
    assert not bad, f"the server imports another entry point: {bad}"
