"""Numbers the README states, checked against the code that produces them.

The "What tuning costs" table (README.md and docs/accounting.md) comes from
``scripts/accounting_table.py``; this test recomputes its epsilon columns (the sigma column needs
nine calibrations: run the script) and compares them with the text at its printed precision.
"""

import importlib

import pytest

from tests.paths import REPO

ROOT = REPO


def _table(text: str) -> list[list[str]]:
    start = text.index("| method | E[trainings] | total ε (auto) |")
    lines = text[start:].splitlines()[2:]
    out = []
    for ln in lines:
        if not ln.startswith("|"):
            break
        out.append([c.strip().replace("**", "") for c in ln.strip("|").split("|")])
    return out


@pytest.fixture(scope="module")
def computed(monkeypatch_module):
    monkeypatch_module.syspath_prepend(str(ROOT / "scripts"))
    return importlib.import_module("accounting_table").rows(sigma_column=False)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.parametrize("doc", ["README.md", "docs/accounting.md"])
def test_tuning_cost_table_matches_the_accountant(doc, computed):
    fmt = importlib.import_module("accounting_table")._eps
    table = _table((ROOT / doc).read_text())
    assert [r[0] for r in table] == [r["label"] for r in computed]
    for printed, row in zip(table, computed, strict=True):
        label, trainings, auto, route, rdp, times, _sigma = printed
        assert trainings == row["trainings"], label
        # as the script prints them: 3 decimals, 4 significant digits from 10 on
        assert auto == fmt(row["auto"]) and rdp == fmt(row["rdp"]), label
        assert route.split()[0].upper() == row["route"].upper(), label
        assert times == f"×{row['times']:.2f}", label
