"""The run journal: a crash-safe record of one tuning run, kept in ``DIR/private/journal.sqlite``.

It holds the config the run was started with, the selection's random plan, the root entropy, every
candidate's seed, hyperparameters, status and score. The plan and all seeds are written *before* any
private computation, so a resume after ``kill -9`` can never re-draw them: re-rolling a plan until
one likes the result would break the selection theorems (they hold for one draw of K or of the coin
flips).

Everything here is private to the data curator (it holds K and every candidate's score); nothing in
this file is copied to the release folder.

Each write is its own SQLite transaction (sqlite3 commits are durable against a killed process), and
candidate payloads are written to a temporary file and renamed into place before their row says
``done``, so a candidate is either finished with its payload on disk or is trained again, with the
same seed, on resume."""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dptune.owner_only import create_file, open_new, private_folder

JOURNAL_FILE = "journal.sqlite"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS candidates (
    idx INTEGER PRIMARY KEY,
    seed TEXT NOT NULL,
    hparams TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('planned', 'running', 'done')),
    score REAL,
    failed INTEGER NOT NULL DEFAULT 0,
    attempts INTEGER NOT NULL DEFAULT 0,
    seconds REAL,
    updated REAL NOT NULL
);
"""


class ConfigChangedError(RuntimeError):
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


class Journal:
    """SQLite journal of one tuning run in the ``private/`` folder (created if missing)."""

    def __init__(self, private_dir: str | os.PathLike) -> None:
        # Owner-only (0700, files 0600): it holds K and every score (dptune.owner_only).
        self.dir = private_folder(private_dir)
        self.path = create_file(self.dir / JOURNAL_FILE)
        # isolation_level=None: we issue BEGIN/COMMIT ourselves so every write is one explicit
        # transaction.
        self._db = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        for stmt in filter(None, (s.strip() for s in _SCHEMA.split(";"))):
            self._db.execute(stmt)

    # --- transactions
    # ----------------------------------------------------------------------------------------
    def _tx(self) -> _Tx:
        return _Tx(self._db)

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> Journal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- meta -------------------------------------------------------------------------------------
    # -------------
    def get(self, key: str, default: Any = None) -> Any:
        row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return default if row is None else json.loads(row[0])

    def set(self, key: str, value: Any) -> None:
        with self._tx():
            self._db.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?) "
                "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                (key, json.dumps(value, sort_keys=True)),
            )

    def set_once(self, key: str, value: Any) -> Any:
        """Stores ``value`` unless the key exists; returns the stored value (never overwrites a plan
        or seed)."""
        with self._tx():
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
            if row is not None:
                return json.loads(row[0])
            self._db.execute(
                "INSERT INTO meta (key, value) VALUES (?, ?)",
                (key, json.dumps(value, sort_keys=True)),
            )
            return value

    def bind_config(self, config: dict[str, Any]) -> bool:
        """Records the run's config, or checks it against the recorded one.

        Returns True if this is a resume (a config was already recorded and equals ``config``).
        Raises ConfigChangedError naming the differing keys if the workdir belongs to another
        config."""
        canonical = json.loads(json.dumps(config, sort_keys=True))
        stored = self.set_once("config", canonical)
        if stored != canonical:
            diff = sorted(_diff_keys(stored, canonical))
            raise ConfigChangedError(
                f"{self.dir.parent} already holds a run with a different config (differs at: "
                f"{', '.join(diff[:10]) or '?'}). Resuming it with another config would mix two "
                "runs: "
                "use a new --workdir, or rerun with the original config to resume."
            )
        return self.get("started_at") is not None

    # --- candidates
    # --------------------------------------------------------------------------------------------
    def add_candidates(self, rows: Iterable[tuple[int, int, dict[str, Any]]]) -> None:
        """Records planned candidates (index, seed, hparams); existing indices are kept."""
        now = time.time()
        with self._tx():
            self._db.executemany(
                "INSERT OR IGNORE INTO candidates (idx, seed, hparams, status, updated) "
                "VALUES (?, ?, ?, 'planned', ?)",
                [(i, str(seed), json.dumps(hp, sort_keys=True), now) for i, seed, hp in rows],
            )

    def mark_running(self, index: int) -> None:
        with self._tx():
            self._db.execute(
                "UPDATE candidates SET status = 'running', attempts = attempts + 1, updated = ? "
                "WHERE idx = ? AND status != 'done'",
                (time.time(), index),
            )

    def mark_done(
        self, index: int, score: float, failed: bool, seconds: float | None = None
    ) -> None:
        with self._tx():
            self._db.execute(
                "UPDATE candidates SET status = 'done', score = ?, failed = ?, seconds = ?, "
                "updated = ? "
                "WHERE idx = ?",
                (float(score), int(bool(failed)), seconds, time.time(), index),
            )

    def candidates(self) -> list[CandidateRecord]:
        rows = self._db.execute(
            "SELECT idx, seed, hparams, status, score, failed, attempts FROM candidates ORDER BY "
            "idx"
        ).fetchall()
        return [
            CandidateRecord(
                index=r[0],
                seed=int(r[1]),
                hparams=json.loads(r[2]),
                status=r[3],
                score=r[4],
                failed=bool(r[5]),
                attempts=r[6],
            )
            for r in rows
        ]

    def payload_path(self, index: int) -> Path:
        return self.dir / "candidates" / f"{index:06d}.msgpack"

    def write_payload(self, index: int, data: bytes) -> Path:
        """Writes a candidate's payload atomically (temp file + rename) and returns its path."""
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
        import pickle

        with open(self.payload_path(index), "rb") as f:
            return pickle.load(f)


class _Tx:
    """``with``-block running BEGIN IMMEDIATE ... COMMIT (ROLLBACK on error)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *rest: object) -> None:
        self._db.execute("ROLLBACK" if exc_type else "COMMIT")


def _diff_keys(a: Any, b: Any, prefix: str = "") -> set[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: set[str] = set()
        for k in set(a) | set(b):
            out |= _diff_keys(a.get(k, _MISSING), b.get(k, _MISSING), f"{prefix}{k}.")
        return out
    return set() if a == b else {prefix.rstrip(".")}


_MISSING = object()


class MemoryJournal:
    """The journal's interface kept in memory (``workdir=None``): no resume, nothing on disk."""

    def __init__(self) -> None:
        self._meta: dict[str, Any] = {}
        self._rows: dict[int, Any] = {}
        self._payloads: dict[int, bytes] = {}

    def bind_config(self, config: dict[str, Any]) -> bool:
        self._meta["config"] = config
        return False

    def get(self, key: str, default: Any = None) -> Any:
        return self._meta.get(key, default)

    def set(self, key: str, value: Any) -> None:
        self._meta[key] = value

    def set_once(self, key: str, value: Any) -> Any:
        return self._meta.setdefault(key, value)

    def add_candidates(self, rows: Any) -> None:
        for i, seed, hp in rows:
            self._rows.setdefault(i, CandidateRecord(i, seed, hp, "planned", None, False, 0))

    def candidates(self) -> list[Any]:
        return [self._rows[i] for i in sorted(self._rows)]

    def mark_running(self, index: int) -> None:
        pass

    def mark_done(
        self, index: int, score: float, failed: bool, seconds: float | None = None
    ) -> None:
        pass

    def write_payload(self, index: int, data: bytes) -> None:
        pass  # payloads stay in the tuner's memory

    def read_payload(self, index: int) -> Any:
        raise KeyError(index)

    def close(self) -> None:
        pass
