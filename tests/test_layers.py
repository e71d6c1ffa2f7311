"""The shape of the code, read with ``ast`` (README "Layout"): imports flow down one way,
entry -> commands -> libraries -> io, with no circle; modules, functions and folders stay small;
a family of modules is a package; the config sits below the domain; mlx is imported at the top.

Every module of ``mlxbun/`` is read; every ``mlxbun`` import counts, at the top of the module or
inside a function. A module imports only modules of its own layer or of a layer below, and no
chain of imports comes back to where it started.
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


# ------------------------------------------------------------------------------- house rules

MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80
MAX_FOLDER_MODULES = 15
MAX_DEFERRED_MLX = 25
LONG_FUNCTIONS: set[str] = set()
LONG_MODULES: set[str] = set()
MLX = ("mlx", "mlx_lm")
TREES = {m: ast.parse(p.read_text()) for m, p in MODULES.items()}


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def imported(node: ast.AST) -> list[str]:
    """The modules an import statement names (``from x import y``: ``x``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and not node.level:
        return [node.module or ""]
    return []


def deferred_mlx_imports() -> list[str]:
    """``module:function imports x`` for every mlx or mlx_lm import inside a function."""
    found, seen = [], set()
    for module, tree in TREES.items():
        for fn in functions(tree):
            for node in ast.walk(fn):
                if id(node) in seen:
                    continue
                seen.add(id(node))
                found += [f"{module}:{fn.name} imports {m}" for m in imported(node) if m.split(".")[0] in MLX]
    return found


def top_level_imports(module: str) -> set[str]:
    """What ``module`` imports when it is imported (its body's imports, no function's)."""
    return {m for node in TREES[module].body for m in imported(node)}


def test_no_module_is_over_600_lines() -> None:
    lines = {m: len(p.read_text().splitlines()) for m, p in MODULES.items()}
    assert {m: n for m, n in lines.items() if n > MAX_MODULE_LINES and m not in LONG_MODULES} == {}
    assert all(lines[m] > MAX_MODULE_LINES for m in LONG_MODULES), "an exception is no longer long: remove it"


def test_no_function_is_over_80_lines() -> None:
    long = {
        f"{m}:{fn.name}": fn.end_lineno - fn.lineno + 1
        for m, tree in TREES.items()
        for fn in functions(tree)
        if fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert {k: n for k, n in long.items() if k not in LONG_FUNCTIONS} == {}
    assert LONG_FUNCTIONS <= set(long), "an exception is no longer over 80 lines: remove it from the list"


def test_no_folder_holds_over_15_modules() -> None:
    folders: dict[Path, int] = {}
    for p in MODULES.values():
        folders[p.parent] = folders.get(p.parent, 0) + 1
    assert {str(f.relative_to(PACKAGE.parent)): n for f, n in folders.items() if n > MAX_FOLDER_MODULES} == {}


def test_a_family_of_modules_is_a_package() -> None:
    """No ``a_b.py`` beside an ``a.py`` or an ``a/`` package: the family is a package ``a/``."""
    beside = []
    for m, p in MODULES.items():
        stem = p.stem.strip("_")  # __init__, and kv/import_.py named around a keyword: no family
        head, sep, _ = stem.partition("_")
        if sep and ((p.parent / f"{head}.py").exists() or (p.parent / head).is_dir()):
            beside.append(m)
    assert beside == []


def test_the_config_imports_nothing_of_the_domain_but_the_spec() -> None:
    config = {m for m in MODULES if m.startswith("mlxbun.config")}
    domain = [
        f"{m} imports {t}"
        for m in sorted(config)
        for t in sorted(GRAPH[m])
        if t.startswith(("mlxbun.quant", "mlxbun.kv")) and t not in ("mlxbun.quant", "mlxbun.quant.spec")
    ]
    assert domain == []


def test_mlx_is_imported_at_the_top_but_for_a_few_deferred_imports() -> None:
    deferred = deferred_mlx_imports()
    assert len(deferred) <= MAX_DEFERRED_MLX, deferred


def test_the_command_line_loads_no_mlx_numpy_or_transformers_before_a_command_runs() -> None:
    """What ``python -m mlxbun`` imports before it dispatches (help, config errors): no mlx (the BLAS
    must load first), no numpy and no transformers (start-up time)."""
    seen, todo, heavy = set(), ["mlxbun.cli"], set()
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        heavy |= {
            f"{module} imports {m}"
            for m in top_level_imports(module)
            if m.split(".")[0] in (*MLX, "numpy", "transformers")
        }
        parents = [".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)]
        todo += [*top_level_targets(module), *parents]
    assert "mlxbun.config.schema" in seen and "mlxbun.quant.spec" in seen
    assert heavy == set()


def top_level_targets(module: str) -> set[str]:
    """The mlxbun modules ``module`` imports at its top (``from mlxbun.quant import spec`` counts
    as ``mlxbun.quant.spec``)."""
    out = set()
    for node in TREES[module].body:
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("mlxbun"):
            for a in node.names:
                whole = f"{node.module}.{a.name}"
                out.add(whole if whole in MODULES else _known(node.module))
        elif isinstance(node, ast.Import):
            out |= {_known(a.name) for a in node.names if a.name.startswith("mlxbun")}
    return out
