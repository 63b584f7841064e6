"""Every list of names dptune accepts, read from the registry that holds each (it lives with what
it names): what ``dptune --help`` prints and what the docs test checks the docs against."""

from __future__ import annotations

from dptune import configs, learners, strategies
from dptune.accounting import ACCOUNTANTS
from dptune.accounting.events import ADJACENCIES
from dptune.executors import KINDS
from dptune.learners.dpsgd import DATASETS, MODEL_NAMES
from selection import registry


def vocabulary() -> dict[str, tuple[str, ...]]:
    """``{kind: names}`` for configs, datasets, models, trainers (learners), selection methods,
    accountants, adjacencies, executors and tuning strategies."""
    return {
        "configs": configs.NAMES,
        "datasets": tuple(DATASETS),
        "models": tuple(MODEL_NAMES),
        "trainers": learners.names(),
        "selection methods": tuple(registry.names()),
        "accountants": tuple(ACCOUNTANTS),
        "adjacencies": tuple(ADJACENCIES),
        "executors": tuple(KINDS),
        "strategies": strategies.names(),
    }
