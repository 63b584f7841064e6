"""The budget ledger across processes: two interpreters charge the last remaining budget of one
dataset at the same moment; exactly one may win, and the dataset is never overspent.

``test_tuner_ledger.py`` races threads of one process; SQLite locking between processes (the
``BEGIN IMMEDIATE`` transaction in ``_state/ledger.py``) is what protects two real runs, so the
racers here are separate ``spawn``-ed interpreters released together by a barrier. The same code
(``scripts/soak.py``'s ``ledger_races``) ran 50 races for docs/reliability.md.
"""

import importlib

import pytest

from dptune._state.ledger import Ledger
from tests.paths import REPO

ROOT = REPO


def _soak(monkeypatch):
    # imported by name from scripts/ (on sys.path, which spawned children inherit), so the racers
    # can unpickle their target function
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    return importlib.import_module("soak")


def test_two_processes_racing_for_the_last_budget(tmp_path, monkeypatch):
    soak = _soak(monkeypatch)
    out = soak.ledger_races(6, tmp_path)
    assert out == {"races": 6, "overspends": 0, "exactly_one_winner": 6, "errors": []}
    # and what is on disk says the same: budget 1.0, the first charge 0.5, one more 0.5
    for i in range(6):
        with Ledger(tmp_path / f"race-{i}.sqlite") as led:
            spend = led.spend("race")
        assert spend.spent_epsilon == pytest.approx(soak._BUDGET)
