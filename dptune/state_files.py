"""Opening the SQLite files dptune keeps (a run's journal, the budget ledger) with their checks.

A journal or ledger that is empty, truncated, corrupt or another program's file must never be
taken for a new one: an empty journal would silently restart a run (a second draw of its plan and a
second charge), and an empty ledger would forget every dataset's spend. Such a file is refused
with a :class:`~dptune.errors.StateError` naming its path and what to do; the file is left as it is.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Callable, Mapping
from pathlib import Path

from dptune.errors import StateError

#: The first 16 bytes of every SQLite 3 database file.
SQLITE_HEADER = b"SQLite format 3\x00"


def open_state_db(
    path: str | os.PathLike,
    *,
    kind: str,
    tables: Mapping[str, set[str]],
    fix: str,
    optional: Mapping[str, set[str]] | None = None,
    create: bool = True,
    readonly: bool = False,
    timeout: float = 30.0,
    make_file: Callable[[Path], object] | None = None,
) -> sqlite3.Connection:
    """A connection to the ``kind`` file at ``path`` after checking it is one dptune wrote.

    Args:
      path: the file.
      kind: what it is, for messages ("journal", "ledger").
      tables: the tables (and their columns) a file of this kind has; a file holding other tables
        or lacking these columns is foreign.
      fix: what the user can do about a bad file (one sentence, appended to the message).
      optional: tables a file written by an earlier dptune may lack (created when it is opened
        for writing).
      create: create the file if missing (else a missing file is a StateError).
      readonly: open it read-only (``dptune inspect``, ``--dry_run``): nothing is ever written.
      timeout: SQLite's busy timeout, in seconds.
      make_file: called with the path before SQLite opens it (unless ``readonly``), once the
        existing file, if any, passed the checks: e.g. ``dptune.owner_only.create_file``, which
        creates a missing file with mode 0600 (an empty file SQLite then fills) and reports an
        existing one that others can read.
    Raises:
      StateError: the path is a folder, or the file is empty, not SQLite, corrupt or foreign.
    """
    path = Path(path)
    if path.is_dir():
        raise StateError(f"the {kind} {path} is a folder, not a file. {fix}")
    if path.exists():
        _check_header(path, kind, fix)
    elif not create or readonly:
        raise StateError(f"there is no {kind} at {path}. {fix}")
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
    if make_file is not None and not readonly:
        make_file(path)  # creates a missing file; may report an existing one's mode
    try:
        if readonly:
            db = sqlite3.connect(
                f"{path.absolute().as_uri()}?mode=ro", uri=True, timeout=timeout,
                isolation_level=None,
            )  # fmt: skip
        else:
            db = sqlite3.connect(path, timeout=timeout, isolation_level=None)
    except sqlite3.Error as e:
        raise StateError(f"the {kind} {path} cannot be opened ({e}). {fix}") from None
    try:
        _check_tables(db, path, kind, tables, dict(optional or {}), fix)
    except BaseException:
        db.close()
        raise
    return db


def _check_header(path: Path, kind: str, fix: str) -> None:
    try:
        with open(path, "rb") as f:
            head = f.read(len(SQLITE_HEADER))
    except OSError as e:
        raise StateError(f"the {kind} {path} cannot be read ({e.strerror}). {fix}") from None
    if not head:
        raise StateError(
            f"the {kind} {path} is empty (0 bytes): it is not a {kind} dptune wrote (a copy or a "
            f"disk that was cut short?). {fix}"
        )
    if head != SQLITE_HEADER:
        raise StateError(
            f"the {kind} {path} is not an SQLite file (corrupt, or another program's file). {fix}"
        )


def _check_tables(
    db: sqlite3.Connection,
    path: Path,
    kind: str,
    tables: Mapping[str, set[str]],
    optional: Mapping[str, set[str]],
    fix: str,
) -> None:
    try:
        found = {
            r[0]
            for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall()
        }
        ok = db.execute("PRAGMA quick_check").fetchone()
    except sqlite3.DatabaseError as e:
        raise StateError(f"the {kind} {path} is corrupt ({e}). {fix}") from None
    if ok is None or ok[0] != "ok":
        raise StateError(f"the {kind} {path} is corrupt (SQLite: {ok[0] if ok else '?'}). {fix}")
    if not found:
        return  # a new file (just created, or killed before its tables were written)
    foreign = sorted(found - set(tables) - set(optional) - {"sqlite_sequence"})
    missing = sorted(set(tables) - found)
    if foreign or missing:
        raise StateError(
            f"the file {path} is not a dptune {kind} (tables {sorted(found)}; a {kind} has "
            f"{sorted(tables)}). {fix}"
        )
    for table, columns in {**tables, **optional}.items():
        if table not in found:
            continue
        have = {r[1] for r in db.execute(f"PRAGMA table_info({table})").fetchall()}
        if not columns <= have:
            raise StateError(
                f"the {kind} {path} lacks the columns {sorted(columns - have)} of table {table!r} "
                f"(written by another program or an incompatible dptune version). {fix}"
            )
