"""The privacy ledger: every tuning run's spend, per dataset, in one SQLite file shared by all runs.

A dataset is identified by its fingerprint (``Dataset.fingerprint()``: sha256 of the training and
validation arrays), so the same data under another name or folder is the same dataset. The first
charge against a dataset registers its total budget (epsilon, delta); each run's (epsilon, delta) is
then added and a run that would exceed the budget is refused *before* any private computation.

Runs compose by basic sequential composition: total epsilon = sum of epsilons, total delta = sum of
deltas (Dwork & Roth 2014, "The Algorithmic Foundations of Differential Privacy", Thm 3.16). It is
loose but needs no assumption about how the runs were done, so it holds for any mix of methods and
accountants.

Two runs started at once cannot overspend: the check and the insert run in one ``BEGIN IMMEDIATE``
transaction, which takes SQLite's write lock before reading, so concurrent charges are serialised. A
charge is keyed by the run's id, so a resumed run is charged once, not again."""

from __future__ import annotations

import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

from dptune.owner_only import create_file, private_folder

#: Relative slack for float sums when comparing against a budget (1e-9 of the budget).
_REL_TOL = 1e-9

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS datasets ( fingerprint TEXT PRIMARY KEY, name TEXT, epsilon REAL
    NOT NULL, delta REAL NOT NULL, created REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS charges ( run_id TEXT PRIMARY KEY, fingerprint TEXT NOT NULL
    REFERENCES datasets(fingerprint), epsilon REAL NOT NULL, delta REAL NOT NULL, workdir TEXT, note
    TEXT, created REAL NOT NULL)""",
)


def default_ledger_path() -> Path:
    """``$DPTUNE_LEDGER`` if set, else ``~/.dptune/ledger.sqlite`` (one per curator account)."""
    env = os.environ.get("DPTUNE_LEDGER")
    return Path(env) if env else Path.home() / ".dptune" / "ledger.sqlite"


class BudgetExceededError(RuntimeError):
    """The run would push the dataset's total spend over its budget; nothing private has run."""


class LedgerBudgetMismatchError(ValueError):
    """The config states a dataset budget that differs from the one registered in the ledger."""


@dataclass(frozen=True)
class Spend:
    """A dataset's budget and what has been charged to it (basic composition of all runs)."""

    fingerprint: str
    budget_epsilon: float
    budget_delta: float
    spent_epsilon: float
    spent_delta: float
    runs: int

    @property
    def remaining_epsilon(self) -> float:
        return self.budget_epsilon - self.spent_epsilon

    @property
    def remaining_delta(self) -> float:
        return self.budget_delta - self.spent_delta


class Ledger:
    """Per-dataset budget ledger in one SQLite file (created with its folder if missing)."""

    def __init__(self, path: str | os.PathLike | None = None) -> None:
        self.path = Path(path) if path is not None else default_ledger_path()
        # The curator's file (fingerprints and spends): a new folder is 0700, the file 0600.
        if not self.path.parent.is_dir():
            private_folder(self.path.parent, "the ledger's folder")
        create_file(self.path)
        self._db = sqlite3.connect(self.path, timeout=60.0, isolation_level=None)
        self._db.execute("PRAGMA busy_timeout = 60000")
        for stmt in _SCHEMA:
            self._db.execute(stmt)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spend(self, fingerprint: str) -> Spend | None:
        """The dataset's budget and spend so far, or None if the ledger has never seen it."""
        return _spend(self._db, fingerprint)

    def is_charged(self, run_id: str) -> bool:
        return (
            self._db.execute("SELECT 1 FROM charges WHERE run_id = ?", (run_id,)).fetchone()
            is not None
        )

    def charge(
        self,
        fingerprint: str,
        run_id: str,
        epsilon: float,
        delta: float,
        *,
        budget_epsilon: float,
        budget_delta: float,
        name: str = "",
        workdir: str = "",
        note: str = "",
    ) -> Spend:
        """Atomically checks the budget and records a run's spend; idempotent in ``run_id``.

        Args: fingerprint: the dataset's fingerprint. run_id: unique id of the run (a resumed run
        passes the same id and is not charged twice). epsilon, delta: the run's total (epsilon,
        delta), tuning included. budget_epsilon, budget_delta: the dataset's total budget; registers
        it on the first charge, and must equal the registered budget afterwards. Raises:
        BudgetExceededError: the charge would exceed the budget (nothing is recorded).
        LedgerBudgetMismatchError: the stated budget differs from the registered one."""
        for label, x in (("epsilon", epsilon), ("budget_epsilon", budget_epsilon)):
            if not x > 0:
                raise ValueError(f"ledger: {label} must be > 0, got {x}")
        for label, x in (("delta", delta), ("budget_delta", budget_delta)):
            if not 0 <= x < 1:
                raise ValueError(f"ledger: {label} must be in [0, 1), got {x}")
        db = self._db
        db.execute(
            "BEGIN IMMEDIATE"
        )  # takes the write lock before reading: concurrent charges serialise
        try:
            row = db.execute(
                "SELECT epsilon, delta FROM datasets WHERE fingerprint = ?", (fingerprint,)
            ).fetchone()
            if row is None:
                db.execute(
                    "INSERT INTO datasets (fingerprint, name, epsilon, delta, created) VALUES (?, "
                    "?, ?, ?, ?)",
                    (fingerprint, name, float(budget_epsilon), float(budget_delta), time.time()),
                )
            elif not (_close(row[0], budget_epsilon) and _close(row[1], budget_delta)):
                raise LedgerBudgetMismatchError(
                    f"the ledger {self.path} registered a budget of (epsilon={row[0]}, "
                    f"delta={row[1]}) for "
                    f"dataset {name or fingerprint[:12]}, but this run states "
                    f"(epsilon={budget_epsilon}, "
                    f"delta={budget_delta}). A dataset's budget is fixed once registered; state "
                    "the same one "
                    "(config.ledger.budget_epsilon / budget_delta)."
                )
            if db.execute("SELECT 1 FROM charges WHERE run_id = ?", (run_id,)).fetchone() is None:
                before = _spend(db, fingerprint)
                assert before is not None
                new_eps = before.spent_epsilon + epsilon
                new_delta = before.spent_delta + delta
                if new_eps > before.budget_epsilon * (
                    1 + _REL_TOL
                ) or new_delta > before.budget_delta * (1 + _REL_TOL):
                    raise BudgetExceededError(
                        "refused before any private computation: this run costs "
                        f"(epsilon={epsilon:.4g}, "
                        f"delta={delta:.3g}) but dataset {name or fingerprint[:12]} has spent "
                        f"(epsilon={before.spent_epsilon:.4g}, delta={before.spent_delta:.3g}) of "
                        "its budget "
                        f"(epsilon={before.budget_epsilon:.4g}, delta={before.budget_delta:.3g}) "
                        "in "
                        f"{before.runs} run(s); ledger: {self.path}"
                    )
                db.execute(
                    "INSERT INTO charges (run_id, fingerprint, epsilon, delta, workdir, note, "
                    "created) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (run_id, fingerprint, float(epsilon), float(delta), workdir, note, time.time()),
                )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        result = _spend(db, fingerprint)
        assert result is not None
        return result


def _spend(db: sqlite3.Connection, fingerprint: str) -> Spend | None:
    row = db.execute(
        "SELECT epsilon, delta FROM datasets WHERE fingerprint = ?", (fingerprint,)
    ).fetchone()
    if row is None:
        return None
    eps, delta, n = db.execute(
        "SELECT COALESCE(SUM(epsilon), 0), COALESCE(SUM(delta), 0), COUNT(*) FROM charges "
        "WHERE fingerprint = ?",
        (fingerprint,),
    ).fetchone()
    return Spend(fingerprint, row[0], row[1], float(eps), float(delta), int(n))


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _REL_TOL * max(abs(a), abs(b), 1e-300)
