"""The package's dependency rules (docs/architecture.md): no import cycle anywhere, lower layers
never import higher ones, and an in-process run never imports Flower."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import fedbed

PACKAGE_ROOT = Path(fedbed.__file__).resolve().parent

LAYERS = [
    {"fedbed.seeding", "fedbed.jsonlog", "fedbed.run_directory"},
    {"fedbed.data", "fedbed.models"},
    {"fedbed.federation"},
    {"fedbed.algorithms"},
    {"fedbed.config", "fedbed.build", "fedbed.experiment", "fedbed.provenance", "fedbed.run_result"},
    {"fedbed.backends", "fedbed.flower"},
    {"fedbed.sweep", "fedbed.results", "fedbed.reporting", "fedbed.plots"},
    {"fedbed.cli", "fedbed.__main__", "fedbed.doc_tables"},
]
"""docs/architecture.md's layers, top to bottom: a module may import its own layer and those above."""


def module_name(path: Path) -> str:
    parts = ("fedbed",) + path.relative_to(PACKAGE_ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the FedBed modules it imports anywhere in its file (also inside functions)."""
    modules = {module_name(path): path for path in PACKAGE_ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module is not None:
                base = node.module if node.level == 0 else ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [node.module])
                imported |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
        graph[name] = {other for other in imported if other in modules and other != name}
    return graph


def layer_of(module: str) -> int:
    for index, layer in enumerate(LAYERS):
        if any(module == top or module.startswith(top + ".") for top in layer):
            return index
    raise AssertionError(f"{module} is in no layer of docs/architecture.md; add it there and to LAYERS")


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_lower_layers_never_import_higher_ones():
    upward = sorted(f"{module} -> {other}" for module, imported in import_graph().items() for other in imported
                    if layer_of(other) > layer_of(module))
    assert upward == []


def test_an_in_process_run_does_not_import_flower():
    code = ("import sys; from fedbed.cli import main; from fedbed.backends import run_on_backend; "
            "from fedbed.experiment import run_experiment; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'flwr' or m.startswith('fedbed.flower')))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
