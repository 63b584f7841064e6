"""The import graph of ``selection``, ``trainers`` and ``dptune``, read with ``ast`` (nothing is
imported): no circle, counting function-local imports too, and no import against the layers
that docs/architecture.md states (its section "The import rule"). Imports by name at run time
(``importlib.import_module``: ``dptune``'s lazy exports, the subcommands, the learner registry)
are not edges: they run after every module involved has loaded."""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("selection", "trainers", "dptune")
#: dptune's wings: they use the core; the core never imports them. ``python -m dptune``
#: (``dptune.__main__``) is the command's entry, in the ``cli`` wing.
WINGS = ("dptune.cli", "dptune.learners", "dptune.executors", "dptune.auditing", "dptune.__main__")
#: The modules of dptune that may import ``trainers`` (the engine).
ENGINE_USERS = ("dptune.learners.dpsgd", "dptune.auditing.dpsgd")


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The project module ``name`` loads (itself, or its nearest project ancestor), else None."""
    while name:
        if name in modules():
            return name
        name = name.rpartition(".")[0]
    return None


@cache
def imports(module: str) -> dict[str, bool]:
    """Project modules ``module`` imports -> whether only inside a function."""
    path = modules()[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: dict[str, bool] = {}

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in child.names] or [base]
            for name in names:
                target = _resolve(name)
                if target is not None and target != module:
                    out[target] = out.get(target, True) and inner
            visit(child, inner)

    visit(tree, False)
    return out


def _cycles(edges=imports) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan) of ``edges``."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges(v):
            if w not in index:
                strong(w)
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
                found.append(sorted(component))

    for v in modules():
        if v not in index:
            strong(v)
    return found


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_graph_is_read():
    assert len(modules()) > 80
    assert "dptune.accounting.epsilon" in imports("dptune.accounting.calibration")
    assert imports("dptune.executors")["dptune.executors.ray"] is True  # function-local: an edge
    assert "trainers.loop" in imports("dptune.learners.dpsgd")


def test_no_import_circle():
    assert _cycles() == []


def test_a_circle_is_found():
    """The check can fail: one edge back from the accountant to the tuner closes a circle."""

    def with_back_edge(module: str) -> dict[str, bool]:
        back = {"dptune.tuner": True} if module == "dptune.accounting.epsilon" else {}
        return {**imports(module), **back}

    assert any(
        {"dptune.tuner", "dptune.accounting.epsilon"} <= set(c) for c in _cycles(with_back_edge)
    )


def test_no_import_against_the_layers():
    wrong = []
    for module in modules():
        for target in imports(module):
            top, wing = target.split(".")[0], next((w for w in WINGS if _in(target, w)), None)
            if _in(module, "selection") or _in(module, "trainers"):
                if top != module.split(".")[0]:
                    wrong.append((module, target))  # selection, trainers: self-contained
            elif wing is not None and not any(_in(module, w) for w in WINGS):
                wrong.append((module, target))  # the core imports a wing
            elif top == "trainers" and module not in ENGINE_USERS:
                wrong.append((module, target))  # the engine through its one or two users
    assert wrong == []


def _all_imports(module: str) -> set[str]:
    """Every module name ``module`` imports (project or not), at any depth of its code."""
    tree = ast.parse(modules()[module].read_text())
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_the_accountant_is_pure():
    """``dptune.accounting`` imports only itself, ``selection`` and numerical libraries: nothing
    that starts processes or threads, and no other part of dptune (its one file is the
    calibration memo, ``FileMemo``)."""
    process = {"subprocess", "threading", "multiprocessing", "selectors", "signal", "atexit"}
    wrong = {}
    for module in modules():
        if not _in(module, "dptune.accounting"):
            continue
        names = _all_imports(module)
        bad = {n for n in names if n.split(".")[0] in process}
        bad |= {t for t in imports(module) if _in(t, "dptune") and not _in(t, "dptune.accounting")}
        if bad:
            wrong[module] = sorted(bad)
    assert wrong == {}
