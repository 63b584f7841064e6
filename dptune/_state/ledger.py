"""The privacy ledger: every tuning run's spend, per dataset, in one SQLite file shared by all runs.

A dataset is its fingerprint (``Dataset.fingerprint()``: sha256 of the training and validation
arrays), whatever its name or folder. Its lifetime budget (epsilon, delta) is stated with ``dptune
ledger``, :meth:`Ledger.set_budget` or a run's ``dataset_budget=``; a first run on a dataset with
none registers :data:`DEFAULT_LIFETIME_RUNS` times its own, with a warning. A run that would
exceed the budget is refused *before* any private computation.

Runs compose by basic sequential composition (Dwork & Roth 2014, Thm 3.16): total epsilon = sum of
epsilons, total delta = sum of deltas; loose, but it holds for any mix of methods and accountants.

Two runs started at once cannot overspend: the check and the insert are one ``BEGIN IMMEDIATE``
transaction. A charge is keyed by the run's id, so a resumed run is charged once. A new ledger is
written to a temporary file and linked to its name (``os.link``: never over an existing file), so
another process sees no file or a complete ledger; a warning names the new file."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from dptune._state.state_files import StateDb, private_folder
from dptune.errors import Refused, TuningConfigError

log = logging.getLogger("dptune")

#: A dataset with no stated lifetime budget gets this many times its first run's (epsilon, delta).
DEFAULT_LIFETIME_RUNS = 10

#: Relative slack for float sums when comparing against a budget (1e-9 of the budget).
_REL_TOL = 1e-9

_SCHEMA = """BEGIN;
CREATE TABLE IF NOT EXISTS datasets (fingerprint TEXT PRIMARY KEY, name TEXT, epsilon REAL NOT NULL,
    delta REAL NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS charges (run_id TEXT PRIMARY KEY, fingerprint TEXT NOT NULL
    REFERENCES datasets(fingerprint), epsilon REAL NOT NULL, delta REAL NOT NULL, workdir TEXT,
    note TEXT, created REAL NOT NULL);
COMMIT;"""


def default_ledger_path() -> Path:
    """``$DPTUNE_LEDGER`` if set, else ``~/.dptune/ledger.sqlite`` (one per curator account)."""
    env = os.environ.get("DPTUNE_LEDGER")
    return Path(env) if env else Path.home() / ".dptune" / "ledger.sqlite"


class BudgetExceededError(Refused):
    """The run would push the dataset's total spend over its budget; nothing private has run."""


class LedgerBudgetMismatchError(Refused):
    """The run states a dataset budget that differs from the one registered in the ledger."""


@dataclass(frozen=True)
class Spend:
    """A dataset's budget and what has been charged to it (basic composition of all runs)."""

    fingerprint: str
    budget_epsilon: float
    budget_delta: float
    spent_epsilon: float
    spent_delta: float
    runs: int
    #: the dataset's budget was registered by this charge (the first run on it)
    registered: bool = False
    name: str = ""

    @property
    def remaining_epsilon(self) -> float:
        return self.budget_epsilon - self.spent_epsilon


class Ledger(StateDb):
    """Per-dataset budget ledger in one SQLite file (created whole, with its folder, if missing;
    an existing one is checked first, ``StateDb``). ``readonly=True`` never writes (``--dry_run``,
    listing): a missing ledger then reads as the empty ledger it would be."""

    kind, schema = "ledger", _SCHEMA

    def __init__(self, path: str | os.PathLike | None = None, *, readonly: bool = False) -> None:
        self.path = Path(path) if path is not None else default_ledger_path()
        missing = not self.path.exists()
        if missing and readonly:
            log.warning(
                "there is no budget ledger at %s: the run will create one (check the path if you "
                "meant an existing ledger: a new one knows no earlier spend)", self.path,
            )  # fmt: skip
        elif missing:
            _create(self.path)
        where = None if missing and readonly else self.path  # None: the empty ledger, in memory
        fix = (f"Restore {self.path} from a backup (it holds every dataset's spend), or point "
               "dptune at another ledger (ledger= in Python, --config.ledger.path, "
               "$DPTUNE_LEDGER); deleting it forgets every spend")  # fmt: skip
        self._open(where, fix, readonly, timeout=60.0)

    def spend(self, fingerprint: str) -> Spend | None:
        """The dataset's budget and spend so far, or None if the ledger has never seen it."""
        row = self._db.execute(
            "SELECT d.epsilon, d.delta, COALESCE(SUM(c.epsilon), 0), COALESCE(SUM(c.delta), 0), "
            "COUNT(c.run_id) FROM datasets d LEFT JOIN charges c ON c.fingerprint = d.fingerprint "
            "WHERE d.fingerprint = ? GROUP BY d.fingerprint",
            (fingerprint,),
        ).fetchone()
        return None if row is None else Spend(fingerprint, *row[:2], *map(float, row[2:4]), row[4])

    def is_charged(self, run_id: str) -> bool:
        row = self._db.execute("SELECT 1 FROM charges WHERE run_id = ?", (run_id,)).fetchone()
        return row is not None

    def check(
        self, fingerprint: str, run_id: str | None, epsilon: float, delta: float, *,
        budget_epsilon: float | None = None, budget_delta: float | None = None, name: str = "",
    ) -> Spend:  # fmt: skip
        """What :meth:`charge` would do, without writing: the dataset's spend after this run.
        ``budget_epsilon`` / ``budget_delta``: the dataset's lifetime budget as the run states it
        (None: the registered one; a new dataset: :data:`DEFAULT_LIFETIME_RUNS` times this run's,
        and ``registered`` says so). BudgetExceededError, or LedgerBudgetMismatchError when the
        stated budget differs from the registered one."""
        _check_numbers(epsilon, delta, budget_epsilon, budget_delta)
        label = name or fingerprint[:12]
        before = self.spend(fingerprint)
        if before is None:
            # none stated: DEFAULT_LIFETIME_RUNS runs like this one, delta capped below 1
            b_eps = DEFAULT_LIFETIME_RUNS * epsilon if budget_epsilon is None else budget_epsilon
            b_delta = (
                min(DEFAULT_LIFETIME_RUNS * delta, 0.5) if budget_delta is None else budget_delta
            )
            before = Spend(fingerprint, float(b_eps), float(b_delta), 0.0, 0.0, 0, True, name)
        else:
            held_eps, held_delta = before.budget_epsilon, before.budget_delta
            stated_eps = held_eps if budget_epsilon is None else budget_epsilon
            stated_delta = held_delta if budget_delta is None else budget_delta
            if not (_close(held_eps, stated_eps) and _close(held_delta, stated_delta)):
                raise _refused(
                    LedgerBudgetMismatchError,
                    f"the ledger {self.path} holds a lifetime budget of (epsilon={held_eps:g}, "
                    f"delta={held_delta:g}) for dataset {label}, but this run states "
                    f"(epsilon={stated_eps:g}, delta={stated_delta:g}): state the registered one "
                    "or none (<dataset_budget>), or change it with "
                    f"`dptune ledger --dataset={fingerprint[:12]} --budget_epsilon=... "
                    "--budget_delta=...`",
                )
        if run_id is not None and self.is_charged(run_id):
            return before
        new_eps = before.spent_epsilon + epsilon
        new_delta = before.spent_delta + delta
        if _over(new_eps, before.budget_epsilon) or _over(new_delta, before.budget_delta):
            raise _refused(
                BudgetExceededError,
                "refused before any private computation: this run costs "
                f"(epsilon={epsilon:.4g}, delta={delta:.3g}) but dataset {label} "
                f"has spent (epsilon={before.spent_epsilon:.4g}, delta={before.spent_delta:.3g})"
                f" of its lifetime budget (epsilon={before.budget_epsilon:.4g}, delta="
                f"{before.budget_delta:.3g}) in {before.runs} run(s); ledger: {self.path}. Lower "
                "this run's budget (<budget>), or raise the dataset's (<dataset_budget> or "
                f"`dptune ledger --dataset={fingerprint[:12]} --budget_epsilon=E "
                "--budget_delta=D`)",
            )
        return Spend(
            fingerprint, before.budget_epsilon, before.budget_delta, new_eps, new_delta,
            before.runs + 1, before.registered, name,
        )  # fmt: skip

    def charge(
        self, fingerprint: str, run_id: str, epsilon: float, delta: float, *,
        budget_epsilon: float | None = None, budget_delta: float | None = None, name: str = "",
        workdir: str = "", note: str = "",
    ) -> Spend:  # fmt: skip
        """Atomically checks the budget (:meth:`check`: same arguments, same refusals, nothing
        recorded then) and records the run's total (epsilon, delta), tuning included; idempotent
        in ``run_id`` (a resumed run is charged once)."""
        with self._tx() as db:
            after = self.check(
                fingerprint, run_id, epsilon, delta, name=name,
                budget_epsilon=budget_epsilon, budget_delta=budget_delta,
            )  # fmt: skip
            if after.registered:
                self._register(fingerprint, name, after.budget_epsilon, after.budget_delta)
            if not self.is_charged(run_id):
                db.execute(
                    "INSERT INTO charges (run_id, fingerprint, epsilon, delta, workdir, note, "
                    "created) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (run_id, fingerprint, float(epsilon), float(delta), workdir, note, time.time()),
                )
        return replace(self.spend(fingerprint), registered=after.registered, name=name)

    def datasets(self) -> list[Spend]:
        """Every registered dataset's spend (with its name), oldest first."""
        rows = self._db.execute("SELECT fingerprint, name FROM datasets ORDER BY created")
        return [replace(self.spend(fp), name=name or "") for fp, name in rows]

    def charges(self, fingerprint: str) -> list[dict]:
        """The runs charged to a dataset (run id, epsilon, delta, workdir, time), oldest first."""
        keys = ("run_id", "epsilon", "delta", "workdir", "created")
        sql = f"SELECT {', '.join(keys)} FROM charges WHERE fingerprint = ? ORDER BY created"
        return [dict(zip(keys, r, strict=True)) for r in self._db.execute(sql, (fingerprint,))]

    def resolve(self, prefix: str) -> str | None:
        """The registered fingerprint starting with ``prefix`` (None if none; ValueError if
        several)."""
        sql = "SELECT fingerprint FROM datasets WHERE substr(fingerprint, 1, ?) = ?"
        rows = self._db.execute(sql, (len(prefix), prefix)).fetchall()
        if len(rows) > 1:
            raise ValueError(f"{prefix!r} matches {len(rows)} datasets; give more characters")
        return rows[0][0] if rows else None

    def set_budget(self, fingerprint: str, epsilon: float, delta: float, name: str = "") -> Spend:
        """Sets a dataset's lifetime budget explicitly (registers the dataset if new). Refused
        (ValueError) below what its runs have already spent."""
        _check_numbers(epsilon, delta, epsilon, delta)
        with self._tx() as db:
            if (before := self.spend(fingerprint)) is None:
                self._register(fingerprint, name, epsilon, delta)
            elif _over(before.spent_epsilon, epsilon) or _over(before.spent_delta, delta):
                raise TuningConfigError(
                    f"dataset {fingerprint[:12]} has already spent (epsilon="
                    f"{before.spent_epsilon:.4g}, delta={before.spent_delta:.3g}): its budget "
                    "cannot be set below that"
                )
            else:
                db.execute(
                    "UPDATE datasets SET epsilon = ?, delta = ?, name = COALESCE(NULLIF(?, ''), "
                    "name) WHERE fingerprint = ?",
                    (float(epsilon), float(delta), name, fingerprint),
                )
        return self.spend(fingerprint)

    def _register(self, fingerprint: str, name: str, eps: float, delta: float) -> None:
        """Registers a dataset the ledger has not seen, with its lifetime budget (eps, delta)."""
        self._db.execute(
            "INSERT INTO datasets (fingerprint, name, epsilon, delta, created) "
            "VALUES (?, ?, ?, ?, ?)",
            (fingerprint, name, float(eps), float(delta), time.time()),
        )


def _create(path: Path) -> None:
    """A new ledger at ``path``, created whole (module docstring); if another process created one
    meanwhile, theirs is kept. Warns, naming the file."""
    if not path.parent.is_dir():
        # The curator's file (fingerprints and spends): a new folder is 0700, the file 0600.
        private_folder(path.parent, "the ledger's folder")
    tmp_name: str | None
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".new", dir=path.parent)
    os.close(fd)  # mkstemp's file is the owner's alone (mode 0600)
    try:
        with contextlib.closing(sqlite3.connect(tmp_name, isolation_level=None)) as db:
            db.executescript(_SCHEMA)
        try:
            os.link(tmp_name, path)
        except FileExistsError:
            return  # another process created it first: theirs is the ledger
        except OSError:  # a file system without hard links: a rename, which cannot refuse
            if path.exists():
                return
            os.replace(tmp_name, path)
            tmp_name = None
    finally:
        if tmp_name is not None:
            os.unlink(tmp_name)
    log.warning(
        "created a new budget ledger %s (no file was there). If you meant an existing ledger, "
        "check the path (ledger= in Python, --config.ledger.path, $DPTUNE_LEDGER): a new ledger "
        "knows no earlier spend",
        path,
    )


_WORDS = {  # a refusal's placeholders: (the library's keyword, the command's flags)
    "<budget>": ("budget=", "--config.privacy.epsilon / delta"),
    "<dataset_budget>": ("dataset_budget=", "--config.ledger.budget_epsilon / budget_delta"),
}


def _refused(cls: type[Refused], text: str) -> Refused:
    """``cls(text)`` in the library's words, with the command's wording (``--config.`` flags)."""
    library, command = text, text
    for key, (keyword, flags) in _WORDS.items():
        library, command = library.replace(key, keyword), command.replace(key, flags)
    return cls(library, command=command)


def _check_numbers(epsilon, delta, budget_epsilon, budget_delta) -> None:
    for label, x in (("epsilon", epsilon), ("budget_epsilon", budget_epsilon)):
        if x is not None and not x > 0:
            raise TuningConfigError(f"ledger: {label} must be > 0, got {x}")
    for label, x in (("delta", delta), ("budget_delta", budget_delta)):
        if x is not None and not 0 <= x < 1:
            raise TuningConfigError(f"ledger: {label} must be in [0, 1), got {x}")


def _over(x: float, budget: float) -> bool:
    """Whether ``x`` exceeds ``budget`` by more than float slack (:data:`_REL_TOL`)."""
    return x > budget * (1 + _REL_TOL)


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= _REL_TOL * max(abs(a), abs(b), 1e-300)
