"""The files dptune keeps for the curator: owner-only, and (journal, ledger) checked before use.

``DIR/private/`` holds what the selection theorems assume stays hidden (every candidate's score,
seed and checkpoint, hence K); the ledger holds each dataset's fingerprint and spends. Under the
default umask they would be readable by every account, so folders are created ``0700`` and files
``0600``. An existing private folder that others can read is refused; an existing ledger that
others can read is reported loudly (a team may share one). ``release/`` keeps the user's umask.

A journal or ledger that is empty, truncated, corrupt or another program's is never taken for a
new one (that would restart a run, or forget every spend): it is refused with a
:class:`~dptune.errors.StateError` naming its path and what to do, and left as it is.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from dptune.errors import StateError, TuningConfigError

log = logging.getLogger("dptune")

#: Mode of the curator's folders and files.
FOLDER_MODE, FILE_MODE = 0o700, 0o600

#: The first 16 bytes of every SQLite 3 database file.
SQLITE_HEADER = b"SQLite format 3\x00"

_S = TypeVar("_S", bound="StateDb")


def _others_can_access(path: Path) -> bool:
    return bool(stat.S_IMODE(path.stat().st_mode) & 0o077)


def private_folder(path: str | os.PathLike, what: str = "the run's private folder") -> Path:
    """``path`` as an owner-only folder: created with mode 0700 (its parents as the umask makes
    them); an existing one that group or others can access is refused (TuningConfigError, naming
    the fix), since whatever it already holds may have been read."""
    path = Path(path)
    if path.is_dir():
        if _others_can_access(path):
            mode = stat.S_IMODE(path.stat().st_mode)
            raise TuningConfigError(
                f"{what} {path} can be accessed by other accounts (mode {mode:o}); it holds what "
                "the privacy statement assumes stays hidden (every candidate's score, seed and "
                f"model). Check who read it, then: chmod 700 {path} && chmod -R go-rwx {path}"
            )
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.mkdir(mode=FOLDER_MODE, exist_ok=True)
    os.chmod(path, FOLDER_MODE)  # mkdir's mode is masked by the umask: set it exactly
    return path


def open_new(path: str | os.PathLike):
    """``open(path, "wb")`` of a new or truncated file with mode 0600 (a candidate's payload)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return os.fdopen(fd, "wb")


class StateDb:
    """One SQLite file of ``kind`` holding the tables and columns of ``schema``, checked as above;
    ``path=None`` keeps it in memory. ``readonly`` never writes; otherwise a missing file is
    created (0600) and ``schema`` (``CREATE TABLE IF NOT EXISTS`` and pragmas) is run. StateError
    (naming the path and ``fix``) for a folder, a missing file (read-only), or a file that is
    empty, not SQLite, corrupt or foreign."""

    kind: str
    schema: str

    def _open(self, path: Path | None, fix: str, readonly: bool, timeout: float = 30.0) -> None:
        self.readonly = readonly
        if path is None:
            self._db = sqlite3.connect(":memory:", isolation_level=None)
        else:
            self._db = self._connect(path, fix, readonly, timeout)
        if path is None or not readonly:
            self._db.executescript(self.schema)

    def _connect(self, path: Path, fix: str, readonly: bool, timeout: float) -> sqlite3.Connection:
        def bad(why: str) -> StateError:
            return StateError(f"the {self.kind} {path} {why}. {fix}")

        if path.is_dir():
            raise bad("is a folder, not a file")
        if path.exists():
            try:
                with open(path, "rb") as f:
                    head = f.read(len(SQLITE_HEADER))
            except OSError as e:
                raise bad(f"cannot be read ({e.strerror})") from None
            if not head:
                raise bad(f"is empty (0 bytes): it is not a {self.kind} dptune wrote (a copy or a "
                          "disk that was cut short?)")  # fmt: skip
            if head != SQLITE_HEADER:
                raise bad("is not an SQLite file (corrupt, or another program's file)")
            if not readonly and _others_can_access(path):
                log.warning(
                    "%s can be read by other accounts (mode %o); it is the curator's: "
                    "chmod 600 %s unless it is shared on purpose",
                    path, stat.S_IMODE(path.stat().st_mode), path,
                )  # fmt: skip
        elif readonly:
            raise StateError(f"there is no {self.kind} at {path}. {fix}")
        else:
            # created empty with mode 0600 before SQLite opens it, so its side files get that mode
            path.parent.mkdir(parents=True, exist_ok=True)
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE))
            os.chmod(path, FILE_MODE)
        target = f"{path.absolute().as_uri()}?mode=ro" if readonly else path
        try:
            db = sqlite3.connect(target, uri=readonly, timeout=timeout, isolation_level=None)
        except sqlite3.Error as e:
            raise bad(f"cannot be opened ({e})") from None
        try:
            tables = _tables(self.schema)
            found = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            ok = db.execute("PRAGMA quick_check").fetchone()
            if ok is None or ok[0] != "ok":
                raise bad(f"is corrupt (SQLite: {ok[0] if ok else '?'})")
            if found and found - {"sqlite_sequence"} != set(tables):  # none: a new file
                raise bad(f"is not a dptune {self.kind} (tables {sorted(found)}; a {self.kind} "
                          f"has {sorted(tables)})")  # fmt: skip
            for table, columns in tables.items() if found else ():
                have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
                if not columns <= have:
                    missing = sorted(columns - have)
                    raise bad(f"lacks the columns {missing} of table {table!r} (written by "
                              "another program or an incompatible dptune version)")  # fmt: skip
        except sqlite3.DatabaseError as e:
            db.close()
            raise bad(f"is corrupt ({e})") from None
        except BaseException:
            db.close()
            raise
        return db

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One transaction that takes the write lock before it reads (``BEGIN IMMEDIATE``), so that
        concurrent writers serialise; committed on success, rolled back on any exception."""
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:  # a signal may land after COMMIT: nothing to roll back
                self._db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self._db.close()

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _tables(schema: str) -> dict[str, set[str]]:
    """The tables ``schema`` creates and their columns (what an existing file must hold)."""
    with contextlib.closing(sqlite3.connect(":memory:", isolation_level=None)) as db:
        db.executescript(schema)
        names = [r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")]
        return {t: {r[1] for r in db.execute(f"PRAGMA table_info({t})")} for t in names}
