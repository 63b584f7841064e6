"""Errors raised before anything private runs, and the record of a candidate that failed.

The refusal rule (docs/errors.md): everything checkable without the private records is checked
first; every refusal is a :class:`Refused` naming the field (or file) and the fix, which the command
prints as one ``dptune:`` line, exit code 2, nothing charged.
"""

from __future__ import annotations

import traceback as traceback_mod
from dataclasses import dataclass


class Refused(ValueError):
    """A user's mistake or a file on disk that dptune will not use, found before any private
    computation: nothing ran, nothing was charged.

    ``str(e)`` is the library's wording (keyword names: ``budget=``, ``dataset_budget=``);
    :meth:`for_command` the command line's (``--config.`` fields) where the two differ.
    """

    def __init__(self, message: object = "", *, command: str | None = None) -> None:
        super().__init__(message)
        self.command = command

    def for_command(self) -> str:
        """The message as the ``dptune`` command words it."""
        return self.command or str(self)


class TuningConfigError(Refused):
    """An input to the tuner is invalid; nothing private has run."""


class ImpossibleBudgetError(TuningConfigError):
    """The total budget cannot be met by any candidate the space can draw; nothing private ran."""


class StateError(TuningConfigError):
    """A file dptune keeps on disk (a run's journal, the budget ledger, a workdir) is missing,
    corrupt, foreign or inconsistent; the message names the file and what to do. Nothing private
    has run and nothing was charged."""


class CodeChangedError(StateError):
    """The workdir's run was started by other code (another dptune version or an edited trainer):
    resuming it, or returning its release, would mix two trainers."""


#: Longest failure message kept in the journal (the traceback is kept whole).
_MAX_MESSAGE = 2000


@dataclass(frozen=True)
class CandidateFailure:
    """Why one candidate failed: the curator's view, kept in ``DIR/private/`` (journal) and shown
    by ``dptune inspect``; never released (whether a candidate fails can depend on the data).

    The payload of a failed candidate (score NaN), journaled by the tuner.

    Attributes:
      type: the exception's class name, or ``"NonFiniteScore"`` / ``"NonFiniteParameters"``.
      message: its message (one line first; truncated to 2000 characters).
      traceback: the formatted traceback ("" when there was no exception).
    """

    type: str
    message: str
    traceback: str = ""

    @classmethod
    def from_exception(cls, e: BaseException) -> CandidateFailure:
        """The failure of exception ``e`` with its traceback (call inside the ``except``)."""
        tb = "".join(traceback_mod.format_exception(type(e), e, e.__traceback__))
        return cls(type(e).__name__, str(e)[:_MAX_MESSAGE], tb)

    def summary(self, width: int = 200) -> str:
        """``Type: first line of the message``, at most ``width`` characters."""
        first = (self.message.splitlines() or [""])[0]
        text = f"{self.type}: {first}" if first else self.type
        return text if len(text) <= width else text[: width - 3] + "..."
