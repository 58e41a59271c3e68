"""fp8state's import graph, read with ``ast``, and the rules docs/architecture.md states for it.

Every import counts: module level, inside functions, and under ``TYPE_CHECKING``. A module
``a.b`` that writes ``from a import b`` imports the module ``a.b`` (not the package ``a``).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: The layers, lowest first: a module may import its own layer or a lower one. Each entry is a
#: top-level name under ``fp8state`` (a module or a package with everything in it); the package
#: root (``fp8state/__init__.py``) is the top. docs/architecture.md lists the same table.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "pure",
        (
            "errors",
            "_version",
            "slots",
            "formats",
            "recipe",
            "scaling",
            "quantize",
            "_payload_checks",
            "_layout",
            "_atomic_file",
            "_walk",
            "_shown",
            "schema",
            "backends",
        ),
    ),
    ("kernels", ("_kernels",)),
    ("te-decoding", ("_te",)),
    ("runtime", ("_runtime",)),
    ("mixin", ("mixin", "autocast")),
    ("functional", ("functional",)),
    ("modules", ("modules",)),
    (
        "model-level",
        (
            "convert",
            "recalibration",
            "tuning",
            "checkpoint",
            "graphs",
            "export",
            "weights_ahead",
        ),
    ),
    ("migration", ("migrate",)),
    ("integrations", ("integrations",)),
    ("cli", ("cli",)),
    ("package", ("__init__", "__main__")),
)


def modules_of(root: Path) -> dict[str, Path]:
    """Dotted name -> file of every module of the package at ``root``."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (every import statement, anywhere)."""
    mods = modules_of(root)
    top = root.name
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                for alias in node.names:
                    child = f"{source}.{alias.name}"
                    targets.add(child if child in mods else source)
        graph[name] = {t for t in targets if t in mods and t != name and t.startswith(top)}
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (each one a cycle or more)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def unit_of(module: str) -> str:
    """The layer unit of a module: its top-level name under the package (``__init__`` for it)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def package_graph(graph: Mapping[str, set[str]]) -> dict[str, set[str]]:
    """The graph between layer units (top-level modules and packages)."""
    units: dict[str, set[str]] = {}
    for src, targets in graph.items():
        units.setdefault(unit_of(src), set()).update(
            unit_of(t) for t in targets if unit_of(t) != unit_of(src)
        )
    return units


@dataclass(frozen=True)
class Violation:
    """One broken rule: which kind, and the import (or cycle) at fault."""

    kind: str  # "cycle", "package cycle", "upward", "private", "unassigned"
    detail: str


def violations(root: Path, layers: Sequence[tuple[str, Sequence[str]]] = LAYERS) -> list[Violation]:
    """Every broken rule in the package at ``root``."""
    graph = import_graph(root)
    rank = {unit: i for i, (_, units) in enumerate(layers) for unit in units}
    found = [Violation("cycle", " <-> ".join(c)) for c in cycles(graph)]
    found += [Violation("package cycle", " <-> ".join(c)) for c in cycles(package_graph(graph))]
    for unit in sorted({unit_of(m) for m in graph} - rank.keys()):
        found.append(Violation("unassigned", unit))
    for src, targets in sorted(graph.items()):
        for dst in sorted(targets):
            a, b = rank.get(unit_of(src)), rank.get(unit_of(dst))
            if a is not None and b is not None and b > a:
                found.append(Violation("upward", f"{src} -> {dst}"))
            if _private_to_other(src, dst):
                found.append(Violation("private", f"{src} -> {dst}"))
    return found


def _private_to_other(src: str, dst: str) -> bool:
    """Whether ``dst`` is private to a package that ``src`` is not inside."""
    parts = dst.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_"):
            owner = ".".join(parts[:i])
            return not (src == owner or src.startswith(owner + "."))
    return False
