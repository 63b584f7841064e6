"""trainers: DP-SGD in JAX/Flax/Optax (data, models, per-example clipping + noise, Poisson sampling,
candidates).

Never imports ``dptune`` or ``selection``. The contract with ``dptune`` is in
``docs/architecture.md``.
"""

from trainers.data import Dataset, DatasetNotFoundError, load_dataset, make_synthetic
from trainers.train import (
    FAILURE_SCORE,
    CandidateResult,
    DpSgdPrivacy,
    Hyperparams,
    dpsgd_privacy,
    evaluate,
    train_candidate,
    train_candidates,
)

__all__ = [
    "FAILURE_SCORE",
    "CandidateResult",
    "Dataset",
    "DatasetNotFoundError",
    "DpSgdPrivacy",
    "Hyperparams",
    "dpsgd_privacy",
    "evaluate",
    "load_dataset",
    "make_synthetic",
    "train_candidate",
    "train_candidates",
]
