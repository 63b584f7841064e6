"""trainers: DP-SGD in JAX/Flax/Optax (data, models, per-example clipping + noise, Poisson sampling,
candidates).

Never imports ``dptune`` or ``selection``. The contract with ``dptune`` is in
``docs/architecture.md``. Names are imported lazily, so that ``trainers.spec`` (hyperparameters and
their privacy parameters) can be used without importing JAX.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "FAILURE_SCORE": "spec",
    "CandidateResult": "spec",
    "DpSgdPrivacy": "spec",
    "DpSgdSchedule": "spec",
    "Hyperparams": "spec",
    "dpsgd_privacy": "spec",
    "Dataset": "data",
    "DatasetNotFoundError": "data",
    "load_dataset": "data",
    "make_synthetic": "data",
    "BoundedMetric": "evaluate",
    "evaluate": "evaluate",
    "ModelSpec": "models",
    "user_model": "models",
    "add_noise": "userloop",
    "clipped_grad_sum": "userloop",
    "train_candidate": "loop",
    "train_candidates": "loop",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"trainers.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'trainers' has no attribute {name!r}")
