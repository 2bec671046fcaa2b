"""The package's shape, read from its source: the import graph and the size of its classes.

A maintainer holds a module by what it imports: the only import circle allowed is
``dataset`` <-> ``wrappers`` (a dataset's fluent methods build wrappers, which are datasets),
counting imports made inside functions and under ``TYPE_CHECKING``. A class holds one job:
no class is over 350 lines from its ``class`` line to its end, docstrings left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx

PACKAGE = Path(__file__).resolve().parent.parent / "energy_loader"
CLASS_LINES = 350


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported(node: ast.AST, name: str, path: Path, modules: dict[str, Path]) -> list[str]:
    """The package's modules an import statement names (``from . import x`` names ``x``, not
    the package; ``from .x import y`` names ``x``, or ``x.y`` where that is a module)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in modules]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        parts = package.split(".")
        base = ".".join(
            parts[: len(parts) - node.level + 1] + ([node.module] if node.module else [])
        )
    else:
        base = node.module or ""
    submodules = [f"{base}.{alias.name}" for alias in node.names]
    if all(module in modules for module in submodules):
        return submodules
    return [base] if base in modules else []


def import_graph() -> nx.DiGraph:
    modules = _modules()
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _imported(node, name, path, modules):
                if target != name:
                    graph.add_edge(name, target)
    return graph


def _allowed(module: str) -> bool:
    return module == "energy_loader.dataset" or module.startswith("energy_loader.wrappers")


def test_the_only_import_circle_is_dataset_and_wrappers() -> None:
    graph = import_graph()
    assert graph.number_of_edges() > 100  # the imports were read
    circles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    outside = [circle for circle in circles if not all(_allowed(m) for m in circle)]
    described = [f"{circle}: {nx.find_cycle(graph.subgraph(circle))}" for circle in outside]
    assert not outside, "import circles besides dataset <-> wrappers:\n" + "\n".join(described)


def _docstring_lines(node: ast.AST) -> int:
    lines = 0
    for sub in ast.walk(node):
        if isinstance(sub, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and sub.body:
            first = sub.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines += first.end_lineno - first.lineno + 1  # type: ignore[operator]
    return lines


def class_sizes() -> dict[str, int]:
    """Every class's lines from its ``class`` line (or first decorator) to its end, without
    its docstrings and its methods' (comments and blank lines count)."""
    sizes = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                lines = node.end_lineno - start + 1 - _docstring_lines(node)  # type: ignore[operator]
                sizes[f"{path.relative_to(PACKAGE.parent)}:{node.name}"] = lines
    return sizes


def test_no_class_is_over_350_lines() -> None:
    sizes = class_sizes()
    assert len(sizes) > 50  # the package was read
    over = {name: lines for name, lines in sizes.items() if lines > CLASS_LINES}
    assert not over, f"classes over {CLASS_LINES} lines (docstrings left out): {over}"
