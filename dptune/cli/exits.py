"""The exit codes and the one-line messages every ``dptune`` command uses (docs/errors.md).

A user's mistake ends in ONE line on stderr that starts with ``dptune:``, names the field (or file)
and the fix, and exit code 2 with nothing charged; never a traceback.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn

#: The run finished: a candidate was released, or none was selected (a legitimate private outcome).
OK = 0
#: An unexpected error (a bug in dptune or in a trainer): one line, the traceback in a file.
INTERNAL = 1
#: Refused before any private computation (the input, a file on disk, the budget): nothing charged.
REFUSED = 2
#: The run finished but no candidate succeeded: nothing released, the run's spend stays charged.
NO_CANDIDATE_SUCCEEDED = 3
#: Stopped by Ctrl-C (SIGINT) or SIGTERM: what was saved and how to resume is printed.
INTERRUPTED = 130
TERMINATED = 143


def one_line(text: object) -> str:
    """``text`` on one line (newlines and runs of spaces collapsed)."""
    return " ".join(str(text).split())


def refuse(message: object, *, prefix: str = "dptune: refused: ") -> int:
    """Prints the refusal line on stderr and returns :data:`REFUSED`."""
    print(prefix + one_line(message), file=sys.stderr)
    return REFUSED


def leave(code: int) -> NoReturn:
    """Ends the process with exit status ``code`` once a command has returned, without the
    interpreter's teardown.

    Everything a normal exit does that can matter runs first, in the same order: the process's
    other (non-daemon) threads are waited for, the exit handlers run (logging's flush, JAX's and
    orbax's shutdown hooks) and the standard streams are flushed. What is skipped is freeing every
    module and XLA's objects one by one, 0.3-0.6 s after a tuning run (a warm run takes ~5 s) that
    writes nothing: the command's own files are closed before it returns (the journal and the
    ledger explicitly, the release fsynced and renamed into place).
    """
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # what the interpreter runs at exit, in its order
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more to say
            pass
    os._exit(code)
