"""Owner-only files for what the curator keeps: ``DIR/private/`` and the budget ledger.

``DIR/private/`` holds what the selection theorems assume stays hidden (every candidate's score,
seed and checkpoint, hence the number of candidates); the ledger holds each dataset's fingerprint
(a hash of its records) and spends. On a shared filesystem the default umask (``022``) would make
them readable by every account, so they are created owner-only: folders ``0700``, files ``0600``
(SQLite gives its ``-wal``, ``-shm`` and ``-journal`` files the database file's mode). An existing
private folder that others can read is refused before anything runs; an existing ledger file that
others can read is reported loudly (a ledger may be shared on purpose by a team of curators).
``release/`` is for publishing and keeps the user's umask.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

from dptune.errors import TuningConfigError

__all__ = ["FILE_MODE", "FOLDER_MODE", "create_file", "open_new", "private_folder"]

log = logging.getLogger("dptune")

#: Mode of the curator's folders and files.
FOLDER_MODE, FILE_MODE = 0o700, 0o600


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


def create_file(path: str | os.PathLike) -> Path:
    """Creates ``path`` empty with mode 0600 if it does not exist (before SQLite opens it, so its
    side files get the same mode); an existing file that others can read is reported loudly."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
    except FileExistsError:
        if _others_can_access(path):
            log.warning(
                "%s can be read by other accounts (mode %o); it is the curator's: "
                "chmod 600 %s unless it is shared on purpose",
                path,
                stat.S_IMODE(path.stat().st_mode),
                path,
            )
        return path
    os.close(fd)
    os.chmod(path, FILE_MODE)
    return path


def open_new(path: str | os.PathLike):
    """``open(path, "wb")`` of a new or truncated file with mode 0600 (a candidate's payload)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    os.fchmod(fd, FILE_MODE)
    return os.fdopen(fd, "wb")
