"""The run journal: a crash-safe record of one tuning run, kept in ``DIR/private/journal.sqlite``.

It holds the run's config, the selection's random plan, the root entropy, and every candidate's
seed, hyperparameters, status and score. The plan and all seeds are written *before* any private
computation, so a resume after ``kill -9`` never re-draws them (re-rolling a plan until one likes
the result would break the selection theorems, which hold for one draw). It is the curator's
alone (it holds K and every score): nothing here is copied to the release folder.

Each write is one ``BEGIN IMMEDIATE`` transaction; a candidate's payload is written to a temporary
file and renamed into place before its row says ``done``, so a candidate is either finished with
its payload on disk or trained again, with the same seed, on resume."""

from __future__ import annotations

import json
import os
import pickle
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dptune._state.state_files import StateDb, open_new, private_folder
from dptune.errors import CandidateFailure, CodeChangedError, Refused, StateError

JOURNAL_FILE = "journal.sqlite"

# One script: the tables are created in one transaction, so a kill never leaves half of them.
_SCHEMA = """PRAGMA journal_mode=WAL;
PRAGMA synchronous=FULL;
BEGIN;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS candidates (idx INTEGER PRIMARY KEY, seed TEXT NOT NULL,
    hparams TEXT NOT NULL, status TEXT NOT NULL CHECK (status IN ('planned', 'running', 'done')),
    score REAL, failed INTEGER NOT NULL DEFAULT 0, attempts INTEGER NOT NULL DEFAULT 0,
    seconds REAL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS failures (idx INTEGER PRIMARY KEY, type TEXT NOT NULL,
    message TEXT NOT NULL, traceback TEXT NOT NULL);
COMMIT;"""


def _fix(private_dir: Path | None) -> str:
    return (
        f"Use a new --workdir for a new run (any ledger charge of this one stays), or restore "
        f"{private_dir} from a backup to resume it"
    )


class ConfigChangedError(Refused):
    """The workdir holds a journal for a different config; resuming it would mix two runs."""


@dataclass(frozen=True)
class CandidateRecord:
    """One journal row. ``score`` is None until the candidate is done; NaN scores are stored as
    failures."""

    index: int
    seed: int
    hparams: dict[str, Any]
    status: str
    score: float | None
    failed: bool
    attempts: int
    seconds: float | None = None  # training time of a finished candidate


class Journal(StateDb):
    """SQLite journal of one tuning run in the ``private/`` folder (created owner-only if missing:
    it holds K and every score), or in memory for ``private_dir=None`` (``workdir=None``: nothing
    to resume, payloads stay in the tuner's memory). An existing file is checked first, and
    ``readonly=True`` opens it without writing anything (``StateDb``)."""

    kind, schema = "journal", _SCHEMA

    def __init__(self, private_dir: str | os.PathLike | None, *, readonly: bool = False) -> None:
        self.dir = None if private_dir is None else Path(private_dir)
        self.path = None if self.dir is None else self.dir / JOURNAL_FILE
        if self.dir is not None and not readonly:
            private_folder(self.dir)
        self._open(self.path, _fix(self.dir), readonly)

    def get(self, key: str, default: Any = None) -> Any:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def set(self, key: str, value: Any, _on_conflict: str = "REPLACE") -> Any:
        with self._tx() as db:
            row = (key, json.dumps(value, sort_keys=True))
            db.execute(f"INSERT OR {_on_conflict} INTO meta (key, value) VALUES (?, ?)", row)
            return self.get(key)

    def set_once(self, key: str, value: Any) -> Any:
        """Stores ``value`` unless the key exists; returns the stored value, as JSON reads it back
        (never overwrites a plan or seed; a fresh run and a resume see the same form)."""
        return self.set(key, value, "IGNORE")

    def _bind(self, key: str, value: dict[str, Any]) -> list[str]:
        """Records ``value`` under ``key`` once (as JSON) or compares it with the recorded one:
        the keys where they differ (none in memory, where nothing is resumed)."""
        if self.dir is None:
            return []
        canonical = json.loads(json.dumps(value, sort_keys=True))
        stored = self.get(key) if self.readonly else self.set_once(key, value)
        return [] if stored is None else sorted(_diff_keys(stored, canonical))

    def bind_config(self, config: dict[str, Any]) -> bool:
        """Records the run's config, or checks it against the recorded one: True for a resume;
        ConfigChangedError naming the differing keys if the workdir belongs to another config."""
        if diff := self._bind("config", config):
            raise ConfigChangedError(
                f"{self.dir.parent} already holds a run with a different config (differs at: "
                f"{', '.join(diff[:10])}). Resuming it with another config would mix two runs: "
                "use a new --workdir, or rerun with the original config to resume."
            )
        return self.get("started_at") is not None

    def bind_code(self, code: dict[str, Any]) -> None:
        """Records which code runs this workdir (dptune's version, the trainer's code digest), or
        checks it against the recorded one: CodeChangedError if a resume (or a rerun of a finished
        run) would mix the candidates, or the release, of two trainers."""
        if diff := self._bind("code", code):
            finished = self.get("released_at") is not None
            raise CodeChangedError(
                f"{self.dir.parent} holds a run {'finished' if finished else 'started'} by other "
                f"code (changed: {', '.join(diff)}), e.g. a trainer edited since: "
                + ("its release belongs to the old code. " if finished
                   else "resuming it would mix candidates of two trainers. ")
                + "Use a new --workdir to run this code (a new run, charged anew), or restore "
                "the old code to resume this one"
            )  # fmt: skip

    def meta(self) -> dict[str, Any]:
        """Every meta key and value (the curator's view: ``dptune inspect``)."""
        rows = self._db.execute("SELECT key, value FROM meta ORDER BY key").fetchall()
        return {k: json.loads(v) for k, v in rows}

    def add_candidates(self, rows: Iterable[tuple[int, int, dict[str, Any]]]) -> None:
        """Records planned candidates (index, seed, hparams); existing indices are kept."""
        now = time.time()
        with self._tx() as db:
            db.executemany(
                "INSERT OR IGNORE INTO candidates (idx, seed, hparams, status, updated) "
                "VALUES (?, ?, ?, 'planned', ?)",
                [(i, str(seed), json.dumps(hp, sort_keys=True), now) for i, seed, hp in rows],
            )

    def mark_running(self, index: int) -> None:
        with self._tx() as db:
            db.execute(
                "UPDATE candidates SET status = 'running', attempts = attempts + 1, updated = ? "
                "WHERE idx = ? AND status != 'done'",
                (time.time(), index),
            )

    def mark_done(
        self, index: int, score: float, failed: bool, seconds: float | None = None,
        failure: CandidateFailure | None = None,
    ) -> None:  # fmt: skip
        """Marks a candidate done (with its failure's record, in the same transaction)."""
        with self._tx() as db:
            db.execute(
                "UPDATE candidates SET status = 'done', score = ?, failed = ?, seconds = ?, "
                "updated = ? WHERE idx = ?",
                (float(score), int(bool(failed)), seconds, time.time(), index),
            )
            if failure is not None:
                db.execute(
                    "INSERT OR REPLACE INTO failures (idx, type, message, traceback) "
                    "VALUES (?, ?, ?, ?)",
                    (index, failure.type, failure.message, failure.traceback),
                )

    def failures(self) -> dict[int, CandidateFailure]:
        """Each failed candidate's recorded failure, by index."""
        rows = self._db.execute("SELECT idx, type, message, traceback FROM failures ORDER BY idx")
        return {r[0]: CandidateFailure(*r[1:]) for r in rows}

    def candidates(self) -> list[CandidateRecord]:
        rows = self._db.execute(
            "SELECT idx, seed, hparams, status, score, failed, attempts, seconds FROM candidates "
            "ORDER BY idx"
        )
        return [
            CandidateRecord(i, int(seed), json.loads(hp), status, score, bool(failed), n, secs)
            for i, seed, hp, status, score, failed, n, secs in rows
        ]

    def payload_path(self, index: int) -> Path:
        return self.dir / "candidates" / f"{index:06d}.msgpack"

    def write_payload(self, index: int, data: bytes) -> Path | None:
        """Writes a candidate's payload atomically (temp file + rename) and returns its path (in
        memory: nothing, the tuner keeps the payload)."""
        if self.dir is None:
            return None
        path = self.payload_path(index)
        if not path.parent.is_dir():
            private_folder(path.parent)
        tmp = path.with_suffix(".tmp")
        with open_new(tmp) as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def read_payload(self, index: int) -> Any:
        """Reads back a payload written by the tuner (a pickle this run wrote itself)."""
        with open(self.payload_path(index), "rb") as f:
            return pickle.load(f)

    def check_complete(self) -> None:
        """Refuses a partial journal (StateError naming what is missing): a plan without its
        candidates, or a finished candidate whose payload file is gone (a workdir copied without
        ``private/candidates/``). A resume of such a journal would crash or re-draw."""
        plan = self.get("plan")
        rows = self.candidates()
        fix = _fix(self.dir)
        if plan is not None and len(rows) < int(plan.get("num_trials", 0)):
            raise StateError(
                f"the journal {self.path} is partial: its plan's candidates are missing. {fix}"
            )
        if plan is None and rows:
            raise StateError(f"the journal {self.path} is partial: it has no plan. {fix}")
        for r in rows:
            if r.status == "done" and not r.failed and not self.payload_path(r.index).exists():
                raise StateError(
                    f"{self.payload_path(r.index)} is missing: a finished candidate's result is "
                    f"gone (was the workdir copied without {self.dir / 'candidates'}?). {fix}"
                )


def _diff_keys(a: Any, b: Any, prefix: str = "") -> set[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        keys = set(a) | set(b)
        return set().union(*(_diff_keys(a.get(k, _MISSING), b.get(k, _MISSING), f"{prefix}{k}.")
                             for k in keys))  # fmt: skip
    return set() if a == b else {prefix.rstrip(".")}


_MISSING = object()
