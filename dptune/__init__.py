"""dptune: private hyperparameter tuning for differentially private deep learning.

``dptune.tune(trainer, space, selection, budget)`` trains a random number of private candidates,
releases the best one and states one (epsilon, delta) for everything released. Imports are lazy so
that ``import dptune`` stays light (no JAX until a trainer needs it).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: Public name -> the module that defines it (imported on first use).
_EXPORTS = {
    "tune": "dptune.tuner", "TuneOptions": "dptune.tuner",
    "tune_subsampled": "dptune.subsampled", "plan_subsampled": "dptune.subsampled",
    "audit": "dptune.auditing.run", "AuditResult": "dptune.auditing.run",
    "plan_privacy": "dptune.plan", "make_privacy_plan": "dptune.plan", "PrivacyPlan": "dptune.plan",
    "Budget": "dptune.plan",
    "Trainer": "dptune.trainer_protocol", "FunctionTrainer": "dptune.trainer_protocol",
    "trainer": "dptune.trainer_protocol",
    "DpSgdTrainer": "dptune.learners.dpsgd", "Dataset": "dptune.learners.dpsgd",
    "Metric": "dptune.learners.dpsgd", "DpSgdSchedule": "dptune.learners.dpsgd",
    "clipped_grad_sum": "dptune.learners.dpsgd", "add_noise": "dptune.learners.dpsgd",
    "dpsgd_privacy": "dptune.learners.dpsgd", "with_lora": "dptune.learners.dpsgd",
    "shipped_with_lora": "dptune.learners.dpsgd", "fix_model": "dptune.learners.dpsgd",
    "NnxModel": "dptune.learners.dpsgd",
    "load_release": "dptune.release", "Release": "dptune.release", "read_release": "dptune.release",
    "load_params": "dptune.release",
    "Refused": "dptune.errors", "TuningConfigError": "dptune.errors",
    "ImpossibleBudgetError": "dptune.errors", "StateError": "dptune.errors",
    "CandidateFailure": "dptune.errors",
    "Space": "dptune.space",
    "Ledger": "dptune._state.ledger", "BudgetExceededError": "dptune._state.ledger",
    "Journal": "dptune._state.journal", "ConfigChangedError": "dptune._state.journal",
}  # fmt: skip

__all__ = sorted(_EXPORTS) + ["space"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name == "space":
        return importlib.import_module("dptune.space")
    raise AttributeError(f"module 'dptune' has no attribute {name!r}")
