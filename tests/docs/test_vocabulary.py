"""Every name the docs mention resolves: configs, datasets, models, trainers, selection methods,
accountants, adjacencies and executors are each one registry (``dptune.cli.vocabulary``), and a
doc that names something the registry does not know (a config whose file is missing, a renamed
method) fails here."""

from __future__ import annotations

import re

import pytest

from dptune.cli.vocabulary import vocabulary
from tests.paths import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]

#: (kind in the vocabulary, pattern whose group 1 is a name), as the docs spell settings.
PATTERNS = [
    ("configs", r"--config[= ]([A-Za-z_]\w*)(?![\w./])"),
    ("datasets", r"--config\.data\.name=(\w+)"),
    ("datasets", r"load_dataset\(\s*\"(\w+)\""),
    ("models", r"--config\.train\.model=(\w+)"),
    ("models", r"\bmodel=\"(\w+)\""),
    ("trainers", r"--config\.trainer=(\w+)"),
    ("selection methods", r"--config\.selection\.method=(\w+)"),
    ("selection methods", r"dptune account [^\n`]*--selection=(\w+)"),
    ("selection methods", r"\bmethod=\"(\w+)\""),
    ("accountants", r"--(?:config\.privacy\.)?accountant=(\w+)"),
    ("accountants", r"\baccountant=\"(\w+)\""),
    ("adjacencies", r"--config\.privacy\.adjacency=(\w+)"),
    ("adjacencies", r"\badjacency=\"(\w+)\""),
    ("executors", r"--config\.executor\.kind=(\w+)"),
    ("executors", r"\bkind=\"(\w+)\""),
    ("strategies", r"--config\.strategy\.name=(\w+)"),
]

#: Names the docs may use that are not registry entries (``--selection=none``: one run, no tuning).
EXTRA = {"selection methods": {"none"}}


def mentions() -> list[tuple[str, str, str]]:
    out = []
    for page in PAGES:
        text = page.read_text().replace("\\\n", " ")
        for kind, pattern in PATTERNS:
            for m in re.finditer(pattern, text):
                out.append((page.relative_to(REPO).as_posix(), kind, m.group(1)))
    return sorted(set(out))


MENTIONS = mentions()


def test_the_docs_name_something_of_every_kind():
    kinds = {k for _, k, _ in MENTIONS}
    assert {"configs", "selection methods", "executors", "models"} <= kinds


@pytest.mark.parametrize("page, kind, name", MENTIONS, ids=[f"{p}:{n}" for p, _, n in MENTIONS])
def test_every_name_in_the_docs_resolves(page, kind, name):
    known = set(vocabulary()[kind]) | EXTRA.get(kind, set())
    assert name in known, f"{page} names {kind[:-1]} {name!r}; the registry has {sorted(known)}"
