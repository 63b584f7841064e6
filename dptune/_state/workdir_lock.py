"""One tuning run per workdir: an exclusive kernel file lock held for the whole run.

Two processes on one ``--workdir`` would share one journal: both would train the same candidates
(private computation the journal records once) and race to write one release. So
:func:`dptune.tune` holds ``flock(LOCK_EX | LOCK_NB)`` on ``DIR/.dptune.lock`` for its whole
duration and a second process is refused at once (:class:`WorkdirLockedError`). The kernel drops
the lock when the holder's descriptor closes, however the process dies, so a stale lock is
impossible. The file is never deleted (two processes could then lock two inodes); it holds who
has it, for the refusal. Limits: on network file systems flock is as good as the server's locks;
a child *forked* (not exec'd) by the run inherits the descriptor and holds the lock until it exits.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from dptune.errors import Refused

#: The lock file, inside the workdir (next to ``private/`` and ``release/``).
LOCK_FILE = ".dptune.lock"


class WorkdirLockedError(Refused):
    """Another live process holds the workdir's lock; nothing was read, trained or written."""


@contextlib.contextmanager
def workdir_lock(workdir: str | os.PathLike | None) -> Iterator[Path | None]:
    """Holds the exclusive lock of ``workdir`` (created if missing) for the ``with`` block and
    yields the lock file's path; ``workdir=None`` (an in-memory run) locks nothing and yields None.
    WorkdirLockedError if another process holds the lock (a live one: the kernel releases the lock
    of a dead process)."""
    if workdir is None:
        yield None
        return
    path = Path(workdir) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            raise WorkdirLockedError(
                f"workdir {Path(workdir)} is in use by another dptune run"
                f"{f' ({holder})' if holder else ''}; two runs on one workdir would share its "
                "journal. Wait for it to finish (or stop it; a killed run's lock is released by "
                "the OS), or use another --workdir"
            ) from None
        # Who holds it, for the message a second process prints (informational only).
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, started {since}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # closing the descriptor releases the flock
