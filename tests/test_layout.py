"""The package's shape, read with ``ast``: few top-level modules, short modules, and no code outside
``specgen.models`` that names a backend class or branches on a backend's name (consumers see the
``Target`` protocol and its ``Capabilities`` only)."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "specgen"
MAX_TOP_LEVEL = 12
MAX_LINES = 400
#: The backend classes (``specgen.models``) and the names a target reports in ``Target.backend``.
BACKEND_CLASSES = frozenset({"CausalLM", "LlamaCppLM", "QuantizedLM", "LlamaBatch", "LlamaPool", "LlamaContext",
                             "BatchKV", "QuantBatch"})
BACKEND_NAMES = frozenset({"torch", "torch_quant", "llama_cpp"})


def _mentions_backend(node: ast.AST) -> bool:
    """Whether an expression reads something called ``backend`` (a name, an attribute, a key)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and "backend" in sub.id:
            return True
        if isinstance(sub, ast.Attribute) and "backend" in sub.attr:
            return True
        if isinstance(sub, ast.Constant) and sub.value == "backend":
            return True
    return False


def _names_a_backend(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in BACKEND_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_backend(e) for e in node.elts)
    return False


def backend_reach_ins(source: str) -> list[str]:
    """``line: what`` for each use of a backend class and each comparison of a backend against its name."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in BACKEND_CLASSES:
            found.append(f"{node.lineno}: names {node.id}")
        elif isinstance(node, ast.Attribute) and node.attr in BACKEND_CLASSES:
            found.append(f"{node.lineno}: names {node.attr}")
        elif isinstance(node, ast.ImportFrom):
            found += [f"{node.lineno}: imports {a.name}" for a in node.names if a.name in BACKEND_CLASSES]
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_names_a_backend(s) for s in sides) and any(_mentions_backend(s) for s in sides):
                found.append(f"{node.lineno}: branches on a backend's name")
    return sorted(found, key=lambda item: int(item.split(":")[0]))


def test_at_most_twelve_top_level_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL, top


def test_no_module_over_the_line_bound():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long


def test_no_module_outside_models_names_a_backend():
    bad = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.relative_to(PACKAGE).parts[0] == "models":
            continue
        found = backend_reach_ins(path.read_text(encoding="utf-8"))
        if found:
            bad[str(path.relative_to(PACKAGE))] = found
    assert not bad


def test_negative_control_the_check_finds_reach_ins():
    source = ("from specgen.models.llama_cpp import LlamaCppLM\n"
              "if target.backend == 'llama_cpp':\n    pass\n"
              "ok = cfg.get('backend') in ('torch', 'auto')\n"
              "fine = options.chat == 'auto'\n"
              "isinstance(lm, models.QuantizedLM)\n")
    assert backend_reach_ins(source) == ["1: imports LlamaCppLM", "2: branches on a backend's name",
                                         "4: branches on a backend's name", "6: names QuantizedLM"]
    assert sum(1 for p in PACKAGE.rglob("*.py") if backend_reach_ins(p.read_text(encoding="utf-8"))) > 0
