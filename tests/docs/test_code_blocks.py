"""Every Python block of README.md and docs/*.md runs, as a newcomer would paste it.

The blocks of one page run in order as one script (later blocks may use earlier names), in a fresh
interpreter, in an empty folder. Blocks fenced as ``text`` are output or interface sketches. The
``dptune account`` commands of bash blocks run too, and must succeed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(page: Path, lang: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(page.read_text()) if m.group(1) == lang]


def _run_python(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """``python ARGS`` in ``cwd`` with this checkout importable and a ledger of its own there."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env["DPTUNE_LEDGER"] = "ledger.sqlite"  # never the user's own ledger
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


PYTHON_PAGES = [p for p in PAGES if blocks(p, "python")]


@pytest.mark.parametrize("page", PYTHON_PAGES, ids=[p.name for p in PYTHON_PAGES])
def test_python_blocks_run(page, tmp_path):
    script = "\n\n".join(blocks(page, "python"))
    (tmp_path / "page.py").write_text(script)
    p = _run_python(["page.py"], tmp_path, timeout=600)
    assert p.returncode == 0, f"{page.name}:\n{p.stderr[-3000:]}"


def _account_commands() -> list[tuple[str, str]]:
    out = []
    for page in PAGES:
        for block in blocks(page, "bash"):
            joined = block.replace("\\\n", " ")
            for line in joined.splitlines():
                line = line.split(" #")[0].strip()
                if line.startswith("dptune account"):
                    out.append((page.name, line))
    return out


ACCOUNT = _account_commands()


def test_docs_show_account_commands():
    assert len(ACCOUNT) >= 2  # the README's two examples at least


@pytest.mark.parametrize("page, command", ACCOUNT, ids=[f"{p}:{c[25:70]}" for p, c in ACCOUNT])
def test_account_commands_in_docs_run(page, command, tmp_path):
    argv = shlex.split(command)
    p = _run_python(["-m", "dptune", *argv[1:]], tmp_path, timeout=300)
    assert p.returncode == 0, f"{page}: {command}\n{p.stderr[-2000:]}"
    assert "satisfies" in p.stdout or "total_epsilon" in p.stdout
