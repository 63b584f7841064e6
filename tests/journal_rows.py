"""Reading a run's private journal from a test while the run may still be writing it."""

from __future__ import annotations

import sqlite3
from pathlib import Path


def journal_rows(workdir: Path | str, columns: str = "idx, status, attempts") -> list[tuple]:
    """``columns`` of every candidate row of ``WORKDIR/private/journal.sqlite``, by index; [] if
    the journal does not exist yet or is locked by the writer at this instant."""
    path = Path(workdir) / "private" / "journal.sqlite"
    if not path.exists():
        return []
    try:
        with sqlite3.connect(path, timeout=1) as db:
            return db.execute(f"SELECT {columns} FROM candidates ORDER BY idx").fetchall()
    except sqlite3.OperationalError:
        return []
