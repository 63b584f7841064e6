"""Errors the tuner raises before anything private runs (each message says what to change)."""

from __future__ import annotations


class TuningConfigError(ValueError):
    """An input to the tuner is invalid; nothing private has run."""


class ImpossibleBudgetError(TuningConfigError):
    """The total budget cannot be met by any candidate the space can draw; nothing private ran."""
