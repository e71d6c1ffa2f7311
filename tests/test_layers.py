"""Imports flow down one way: entry -> commands -> libraries -> io (README "Layout").

Every module of ``mlxbun/`` is read with ``ast``; every ``mlxbun`` import counts, at the top of
the module or inside a function. A module imports only modules of its own layer or of a layer
below, and no chain of imports comes back to where it started.
"""

from __future__ import annotations

import ast
from pathlib import Path

from mlxbun.commands import COMMANDS

PACKAGE = Path(__file__).resolve().parent.parent / "mlxbun"
ENTRY = {"mlxbun.__main__", "mlxbun.cli"}
IO = {"mlxbun", "mlxbun.errors"}  # the package (its version) and the error types sit with io
LAYERS = ("io", "libraries", "commands", "entry")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
COMMAND_MODULES = {c.module for c in COMMANDS.values()}


def layer(module: str) -> str:
    if module in ENTRY:
        return "entry"
    if module in COMMAND_MODULES:
        return "commands"
    if module in IO or module.startswith("mlxbun.io"):
        return "io"
    return "libraries"


def _known(name: str) -> str:
    """The module ``name`` is or lives in (``mlxbun.io.atomic.TMP_MARK`` -> ``mlxbun.io.atomic``)."""
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def imports(module: str) -> set[str]:
    """The mlxbun modules ``module`` imports anywhere in its source (a package import counts as
    its ``__init__``; ``from mlxbun.kv import store`` as ``mlxbun.kv.store``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {_known(a.name) for a in node.names if a.name.split(".")[0] == "mlxbun"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "mlxbun":
                continue
            for alias in node.names:
                whole = f"{source}.{alias.name}"
                found.add(whole if whole in MODULES else _known(source))
    return found - {module}


GRAPH = {m: imports(m) for m in MODULES}


def test_the_walk_sees_imports_at_the_top_and_inside_functions() -> None:
    assert "mlxbun.commands" in GRAPH["mlxbun.cli"]
    assert "mlxbun.registry" in GRAPH["mlxbun.runs.record"]  # imported inside a function
    assert "mlxbun.io.atomic" in GRAPH["mlxbun.io.shards"]  # from mlxbun.io.atomic import ...
    assert {
        "mlxbun.help",
        "mlxbun.runs.command",
        "mlxbun.runs.verify",
        "mlxbun.synth.command",
    } <= COMMAND_MODULES


def test_no_import_climbs_a_layer() -> None:
    climbs = [
        f"{m} ({layer(m)}) imports {t} ({layer(t)})"
        for m, targets in GRAPH.items()
        for t in sorted(targets)
        if LAYERS.index(layer(t)) > LAYERS.index(layer(m))
    ]
    assert climbs == []


def test_no_import_circle() -> None:
    circles = [sorted(c) for c in _strongly_connected(GRAPH) if len(c) > 1]
    assert circles == []


def _strongly_connected(edges: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components of the import graph (iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
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
                    work.append((child, iter(sorted(edges.get(child, ())))))
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
                found.append(component)
    return found
