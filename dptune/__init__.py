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
    name: module
    for module, names in {
        "dptune.tuner": "tune TuneOptions",
        "dptune.subsampled": "tune_subsampled plan_subsampled",
        "dptune.auditing.run": "audit AuditResult",
        "dptune.plan": "plan_privacy make_privacy_plan PrivacyPlan Budget",
        "dptune.trainer_protocol": "Trainer FunctionTrainer trainer",
        "dptune.learners.dpsgd": "DpSgdTrainer Dataset Metric DpSgdSchedule clipped_grad_sum "
        "add_noise dpsgd_privacy with_lora shipped_with_lora fix_model NnxModel",
        "dptune.release": "load_release Release read_release load_params",
        "dptune.errors": "Refused TuningConfigError ImpossibleBudgetError StateError "
        "CandidateFailure",
        "dptune.space": "Space",
        "dptune.ledger": "Ledger BudgetExceededError",
        "dptune.journal": "Journal ConfigChangedError",
    }.items()
    for name in names.split()
}

__all__ = sorted(_EXPORTS) + ["space"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name == "space":
        return importlib.import_module("dptune.space")
    raise AttributeError(f"module 'dptune' has no attribute {name!r}")
