"""The exit codes and the one-line messages every ``dptune`` command uses (docs/errors.md).

A user's mistake ends in ONE line on stderr that starts with ``dptune:``, names the field (or file)
and the fix, and exit code 2 with nothing charged; never a traceback.
"""

from __future__ import annotations

import sys

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
