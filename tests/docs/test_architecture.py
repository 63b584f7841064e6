"""docs/architecture.md names only what exists: every file of its "rooms" listing, every path it
cites, and every dotted name (``dptune.tuner.preflight``: the module, and the name in it)."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "architecture.md"
PACKAGES = ("dptune", "trainers", "selection")


def _rooms() -> list[Path]:
    """The files and folders the page's listing names (the code block after "The rooms")."""
    text = PAGE.read_text().split("## The rooms", 1)[1]
    block = text.split("```text", 1)[1].split("```", 1)[0]
    out, folder = [], None
    for line in block.splitlines():
        if line and not line.startswith(" "):
            folder = REPO / line.split()[0]
            out.append(folder)
            continue
        # the names that start an entry ("a.py, b.py   what they do"); a continued description
        # starts with none
        head = re.match(r"(?:[\w.]+\.py|\w+/)(?:, (?:[\w.]+\.py|\w+/))*", line.strip())
        for name in re.findall(r"[\w.]+\.py|\w+/", head.group(0) if head else ""):
            out.append(folder / name)
    return out


def _paths() -> set[str]:
    """Every path the page cites under the repository's folders."""
    found = re.findall(
        r"\b((?:dptune|trainers|selection|tests|scripts|results)/[\w/.-]*\w)", PAGE.read_text()
    )
    return {p for p in found if "*" not in p and "NAME" not in p}


@cache
def _top_names(module: Path) -> set[str]:
    tree = ast.parse(module.read_text())
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):  # lazy exports
            names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def _module_file(dotted: str) -> Path | None:
    base = REPO.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _missing_dotted() -> list[str]:
    """Dotted names ``pkg.module[.name]`` whose module, or whose first name in it, is missing."""
    missing = []
    for ref in set(re.findall(r"`((?:dptune|trainers|selection)(?:\.\w+)+)", PAGE.read_text())):
        parts = ref.split(".")
        k = max(
            (i for i in range(1, len(parts) + 1) if _module_file(".".join(parts[:i]))), default=0
        )
        if k == 0 or (
            k < len(parts) and parts[k] not in _top_names(_module_file(".".join(parts[:k])))
        ):
            missing.append(ref)
    return sorted(missing)


def test_every_room_exists():
    rooms = _rooms()
    assert len(rooms) > 60
    assert [str(p.relative_to(REPO)) for p in rooms if not p.exists()] == []


def test_every_cited_path_exists():
    # a test is named by its path below tests/ (the page's table of slow tests)
    missing = [p for p in _paths() if not ((REPO / p).exists() or (REPO / "tests" / p).exists())]
    assert sorted(missing) == []


def test_every_dotted_name_exists():
    assert _missing_dotted() == []


def test_the_checks_can_fail(tmp_path, monkeypatch):
    page = tmp_path / "architecture.md"
    page.write_text(
        "`dptune.tuner.no_such_step`, `dptune.sidecar`\n## The rooms\n```text\n"
        "dptune/      the core\n  tuner.py, sidecar.py   gone\n```\n"
    )
    monkeypatch.setattr(__import__(__name__, fromlist=["PAGE"]), "PAGE", page)
    assert [p.name for p in _rooms() if not p.exists()] == ["sidecar.py"]
    assert _missing_dotted() == ["dptune.sidecar", "dptune.tuner.no_such_step"]
