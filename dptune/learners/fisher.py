"""DP feature selection + Fisher (linear discriminant) classifier, as a dptune trainer.

The appendix of a paper on DP feature selection with a Fisher classifier (its Algorithm 1, "DP
Feature Release Algorithm with k classes", feeding a Fisher classifier) ranks the features by the
largest distance between class means, ``D_j = max_{k,k'} |mu_kj - mu_k'j|``, keeps the first m and
adds Gaussian noise scaled to the largest record norm. As written it is not differentially private:
the ranking uses the exact private class means, and the noise scale ``N_max`` is the data's own
largest norm (a data-dependent sensitivity). This module keeps the algorithm's shape and makes every
step that touches the private data a Gaussian mechanism with a data-independent sensitivity:

Stage 1 (feature selection). Each training record ``(x, y)`` (x: the p = 784 pixels, clipped to L2
norm ``clip_norm`` = C) adds ``[x, 1]`` to row y of a (K, p + 1) table: per-class sums and counts.
One record changes the table by a vector of L2 norm <= sqrt(C^2 + 1). Gaussian noise of std
``sigma_1 * sqrt(C^2 + 1)`` on every entry; the noisy class means rank the features by the paper's
``D_j`` (post-processing) and the top ``num_features`` = m are kept.

Stage 2 (Fisher classifier). On the m selected features (re-clipped to norm C), per-class sums
(a (K, m) table, sensitivity C) and the second-moment matrix ``sum_i x_i x_i^T`` (sensitivity
``||x x^T||_F = ||x||^2 <= C^2``; noise on the upper triangle, mirrored) each get Gaussian noise of
std ``sigma_2 * sensitivity``. The pooled within-class covariance and the class means give the
linear discriminant ``argmax_k x^T S^{-1} mu_k - mu_k^T S^{-1} mu_k / 2 + log pi_k``
(post-processing of the noisy statistics and stage 1's noisy counts).

Privacy (one place: :func:`fisher_event`). The three releases are Gaussian mechanisms with noise
multipliers sigma_1, sigma_2, sigma_2; their adaptive composition is one ``dp_accounting``
``ComposedDpEvent`` (accounted by PLD or RDP like every dptune candidate). The hyperparameters
``noise_multiplier`` (s, calibrated by dptune's ``"auto"``) and ``selection_fraction`` (f) set
``sigma_1 = s / sqrt(f)``, ``sigma_2 = s / sqrt((1 - f) / 2)``: since a composition of Gaussian
mechanisms with multipliers sigma_i is exactly the Gaussian mechanism with multiplier ``(sum_i
sigma_i^-2)^-1/2`` (Dong, Roth & Su 2019, "Gaussian Differential Privacy", Cor. 3.3: mu_i-GDP
compose to sqrt(sum mu_i^2)-GDP, mu_i = 1 / sigma_i), the whole candidate costs exactly one Gaussian
mechanism of multiplier s, whatever the split f. ``tests/dptune/learners/test_fisher.py`` checks
dptune's accounting of the composed event against that closed form (the analytic Gaussian mechanism,
Balle & Wang 2018, Thm 8, solved with scipy) and checks every released statistic's sensitivity on
real data.

The validation score is a noisy count on the per-record validation split (Gaussian, sensitivity 1),
in parallel with training (McSherry 2009, Thm 4), exactly as for DP-SGD candidates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
from dp_accounting import dp_event

from dptune.accounting.events import EventCandidate
from dptune.errors import TuningConfigError
from dptune.trainer_protocol import DatasetTrainer, ReleaseView

__all__ = [
    "FISHER_PRIVACY_FIELDS",
    "FisherHyperparams",
    "FisherTrainer",
    "clip_rows",
    "fisher_candidate",
    "fisher_event",
    "fisher_statistics",
    "fit_private_fisher",
    "flat_rows",
    "predict",
    "selection_statistics",
    "stage_noise_multipliers",
]

#: Hyperparameters that change a candidate's declared privacy (dptune accounts their worst case).
FISHER_PRIVACY_FIELDS = ("noise_multiplier", "selection_fraction", "score_noise_std")


@dataclasses.dataclass(frozen=True)
class FisherHyperparams:
    """One candidate's settings.

    Attributes:
      num_features: m, features kept by stage 1 (capped at the number of pixels).
      selection_fraction: f in (0, 1), stage 1's share of the Gaussian budget (in 1/sigma^2).
      noise_multiplier: s > 0, the candidate's overall Gaussian noise multiplier.
      clip_norm: C > 0, every record's feature vector is clipped to this L2 norm (pixels in [0, 1];
        MNIST digits have norms of about 9).
      ridge: added to the diagonal of the noisy covariance (after projecting it onto the PSD cone).
      score_noise_std: std (in counts) of the Gaussian noise on the number of correct validation
        predictions; ``None`` only for a validation set declared public.
    """

    num_features: int = 100
    selection_fraction: float = 0.3
    noise_multiplier: float = 1.0
    clip_norm: float = 8.0
    ridge: float = 0.05
    score_noise_std: float | None = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.num_features, bool) or int(self.num_features) != self.num_features:
            raise ValueError(f"num_features={self.num_features!r} must be an integer >= 1")
        if self.num_features < 1:
            raise ValueError(f"num_features={self.num_features!r} must be >= 1")
        if not 0.0 < float(self.selection_fraction) < 1.0:
            raise ValueError(f"selection_fraction={self.selection_fraction!r} must be in (0, 1)")
        for name in ("noise_multiplier", "clip_norm"):
            v = float(getattr(self, name))
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name}={v!r} must be a finite number > 0")
        if not (math.isfinite(float(self.ridge)) and self.ridge >= 0):
            raise ValueError(f"ridge={self.ridge!r} must be >= 0")
        if self.score_noise_std is not None and not 0 < float(self.score_noise_std) < math.inf:
            raise ValueError(
                f"score_noise_std={self.score_noise_std!r} must be a finite number > 0, or None"
            )


def stage_noise_multipliers(
    noise_multiplier: float, selection_fraction: float
) -> tuple[float, float, float]:
    """(sigma_1, sigma_2, sigma_2): the noise multipliers of stage 1's table, stage 2's class sums
    and stage 2's second moment, so that ``sum sigma_i^-2 = noise_multiplier^-2`` and stage 1 gets
    the fraction ``selection_fraction`` of it."""
    s, f = float(noise_multiplier), float(selection_fraction)
    return (s / math.sqrt(f), s / math.sqrt((1 - f) / 2), s / math.sqrt((1 - f) / 2))


def fisher_event(noise_multiplier: float, selection_fraction: float) -> dp_event.DpEvent:
    """THE privacy of one DP-Fisher run on the training split (add/remove one record).

    Each stage is the Gaussian mechanism on a statistic of L2 sensitivity Delta with noise std
    ``sigma_i * Delta`` (Dwork & Roth 2014, Thm A.1; exactly, Balle & Wang 2018, Thm 8), the three
    compose adaptively (dp_accounting ``ComposedDpEvent``); equal, by Dong, Roth & Su 2019 Cor. 3.3,
    to ``GaussianDpEvent(noise_multiplier)`` (tested, not assumed, in the tests).
    """
    sigmas = stage_noise_multipliers(noise_multiplier, selection_fraction)
    # a tuple: candidates are hashed (de-duplicated) by the accountant
    return dp_event.ComposedDpEvent(tuple(dp_event.GaussianDpEvent(s) for s in sigmas))


def fisher_candidate(hp: FisherHyperparams) -> EventCandidate:
    """The candidate dptune accounts: training (:func:`fisher_event`) and, in parallel on the
    disjoint per-record validation split, the noisy validation count (Gaussian, sensitivity 1)."""
    parallel = () if hp.score_noise_std is None else (dp_event.GaussianDpEvent(hp.score_noise_std),)
    return EventCandidate(
        fisher_event(hp.noise_multiplier, hp.selection_fraction), parallel, label="dp-fisher"
    )


# ---------------------------------------------------------------------------------------------
# The mechanism: statistics (with their sensitivities) and their noisy release.


def flat_rows(x: Any, dtype: Any = np.float64) -> np.ndarray:
    """``x`` (n, ...) as an (n, features) array of ``dtype``, also for n = 0 (an empty split is a
    legitimate private dataset: it must train like any other, not fail)."""
    x = np.asarray(x, dtype=dtype)
    return x.reshape(len(x), math.prod(x.shape[1:]))


def clip_rows(x: np.ndarray, clip_norm: float) -> np.ndarray:
    """Rows of ``x`` (n, d) scaled down to L2 norm <= clip_norm (float64)."""
    x = np.asarray(x, dtype=np.float64)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x * np.minimum(1.0, clip_norm / np.maximum(norms, 1e-12))


def selection_statistics(x: np.ndarray, y: np.ndarray, num_classes: int, clip_norm: float):
    """Stage 1's table (K, p + 1): row k = sum over class-k records of ``[clip(x), 1]``.
    L2 sensitivity (add/remove one record): sqrt(clip_norm^2 + 1)."""
    xc = clip_rows(x, clip_norm)
    ext = np.concatenate([xc, np.ones((len(xc), 1))], axis=1)
    table = np.zeros((num_classes, ext.shape[1]))
    np.add.at(table, np.asarray(y, dtype=np.int64), ext)
    return table


def fisher_statistics(x_sel: np.ndarray, y: np.ndarray, num_classes: int, clip_norm: float):
    """Stage 2's ``(class sums (K, m), second moment (m, m))`` of the selected features clipped to
    clip_norm. Sensitivities: clip_norm (sums), clip_norm^2 (second moment, Frobenius)."""
    xc = clip_rows(x_sel, clip_norm)
    sums = np.zeros((num_classes, xc.shape[1]))
    np.add.at(sums, np.asarray(y, dtype=np.int64), xc)
    return sums, xc.T @ xc


def _symmetric_noise(m: int, std: float, rng: np.random.Generator) -> np.ndarray:
    """Gaussian noise on the upper triangle (diagonal included), mirrored: a symmetric matrix whose
    m (m + 1) / 2 free entries are i.i.d. N(0, std^2)."""
    z = np.triu(rng.normal(scale=std, size=(m, m)))
    return z + np.triu(z, 1).T


def fit_private_fisher(
    x: np.ndarray, y: np.ndarray, num_classes: int, hp: FisherHyperparams, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """Runs both stages on the private training split; returns the released model.

    Args:
      x: (n, p) features (pixels in [0, 1]); y: (n,) labels in [0, K).
    Returns:
      ``{"features": (m,) selected indices, "weights": (m, K), "bias": (K,)}``: everything in it is
      post-processing of the three noisy releases of :func:`fisher_event`.
    """
    x = flat_rows(x)
    p, c = x.shape[1], float(hp.clip_norm)
    s1, s2, s3 = stage_noise_multipliers(hp.noise_multiplier, hp.selection_fraction)
    # Stage 1: noisy per-class sums and counts of all p features; rank by the paper's D_j.
    table = selection_statistics(x, y, num_classes, c)
    table = table + rng.normal(scale=s1 * math.sqrt(c * c + 1), size=table.shape)
    counts = np.maximum(table[:, -1], 1.0)
    means = table[:, :-1] / counts[:, None]
    distance = means.max(axis=0) - means.min(axis=0)  # D_j = max_{k,k'} |mu_kj - mu_k'j|
    m = min(int(hp.num_features), p)
    features = np.sort(np.argsort(-distance, kind="stable")[:m])
    # Stage 2: noisy class sums and second moment of the selected features.
    sums, moment = fisher_statistics(x[:, features], y, num_classes, c)
    sums = sums + rng.normal(scale=s2 * c, size=sums.shape)
    moment = moment + _symmetric_noise(m, s3 * c * c, rng)
    # Post-processing: pooled within-class covariance, projected onto the PSD cone, plus ridge.
    n = counts.sum()
    mu = sums / counts[:, None]
    cov = (moment - (sums.T / counts) @ sums) / n
    evals, evecs = np.linalg.eigh((cov + cov.T) / 2)
    cov_inv = (evecs / (np.maximum(evals, 0.0) + hp.ridge + 1e-9)) @ evecs.T
    weights = cov_inv @ mu.T  # (m, K)
    bias = -0.5 * np.einsum("km,mk->k", mu, weights) + np.log(counts / n)
    return {"features": features, "weights": weights, "bias": bias}


def predict(model: Mapping[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Class predictions (n,) of a released model on features x (n, p)."""
    x = flat_rows(x)[:, model["features"]]
    return np.argmax(x @ model["weights"] + model["bias"], axis=1)


# ---------------------------------------------------------------------------------------------
# The trainer dptune tunes.


def check_dataset(data: Any, who: str) -> None:
    """Refuses (one TuningConfigError) a dataset whose labels are not class ids (the learner
    builds one row of statistics per class) or that has no validation split (nothing to score
    candidates on). Reads public facts only: ``num_classes``, the labels' shape and the public
    expected validation size."""
    ndim, k = np.ndim(data.train_y), int(getattr(data, "num_classes", 0) or 0)
    if k < 1 or ndim != 1:
        raise TuningConfigError(
            f"{who} needs class labels, integer ids of shape (n,) in [0, num_classes), got labels "
            f"with {ndim} dimension(s) and num_classes={k}: pass integer labels and num_classes= "
            "(public) to Dataset.from_arrays"
        )
    if not data.public_num_val > 0:
        raise TuningConfigError(
            f"{who}: the dataset has no validation split (validation_fraction=0): candidates "
            "cannot be scored; give Dataset.from_arrays validation_fraction > 0 or "
            "public_validation=(x, y)"
        )


class FisherTrainer(DatasetTrainer):
    """DP feature selection + Fisher classifier on a ``trainers.data.Dataset``, for ``dptune.tune``.

    Searchable fields: ``num_features``, ``selection_fraction``, ``clip_norm``, ``ridge``;
    ``noise_multiplier="auto"`` is calibrated by dptune to the total budget. The score is the noisy
    validation accuracy (count + N(0, score_noise_std^2), divided by the PUBLIC expected size).
    """

    hyperparams_class = FisherHyperparams
    kind = "DP-Fisher"

    privacy_fields = FISHER_PRIVACY_FIELDS
    calibrated_field = "noise_multiplier"
    #: noisy validation count accounted in its privacy (or exact on public validation data)
    score_kind = "covered"

    def __init__(self, data: Any, base: Mapping[str, Any] | None = None) -> None:
        check_dataset(data, "FisherTrainer")
        self.data = data
        self.base = dict(base or {})
        self.num_examples = int(data.public_num_train)  # public size (delta < 1/n check)

    def privacy(self, hparams: Mapping[str, Any]) -> EventCandidate:
        hp = self.hyperparams(hparams)
        if hp.score_noise_std is None and not self.data.validation_public:
            raise TuningConfigError(
                "score_noise_std=None (an exact validation score) needs a validation set declared "
                "public; this dataset's validation split is private"
            )
        return fisher_candidate(hp)

    def __call__(self, hparams: Mapping[str, Any], rng: np.random.Generator) -> tuple[float, Any]:
        hp = self.hyperparams(hparams)
        d = self.data
        try:
            model = fit_private_fisher(d.train_x, d.train_y, d.num_classes, hp, rng)
        except np.linalg.LinAlgError:
            return float("nan"), None  # dptune's one failure encoding
        correct = float(np.sum(predict(model, d.val_x) == d.val_y))
        if hp.score_noise_std is None:  # a public validation set (checked in privacy())
            return correct / max(len(d.val_y), 1), model
        noisy = correct + hp.score_noise_std * rng.standard_normal()
        return noisy / d.public_num_val, model

    def release_view(self, hparams: Mapping[str, Any], payload: Any) -> ReleaseView:
        """The model and its accuracy on the public test split."""
        if payload is None:
            return ReleaseView(None)
        test = None
        if len(self.data.test_y):
            test = float(np.mean(predict(payload, self.data.test_x) == self.data.test_y))
        return ReleaseView(payload, test)

    def privacy_notes(self) -> list[str]:
        return [
            self.data.describe_split() + ".",
            "DP-Fisher: stage 1 (feature ranking) and stage 2 (class sums, second moment) are "
            "Gaussian mechanisms on clipped records; together one Gaussian mechanism of the "
            "calibrated noise multiplier (Dong, Roth & Su 2019, Cor. 3.3).",
        ]

    def privacy_checks(self) -> list[str]:
        """What dptune's own code guarantees (the statement's "Checked by dptune")."""
        return [
            "DP-Fisher is dptune's own code (dptune/learners/fisher.py): Gaussian mechanisms on "
            "clipped records with data-independent sensitivities (checked on real data in "
            "tests/dptune/learners), and the noisy validation count on the per-record split"
        ]

    def check_adjacency(self, adjacency: str) -> None:
        if adjacency != "add_remove":
            raise TuningConfigError(
                "DP-Fisher's sensitivities are stated for add/remove adjacency only"
            )

    def describe(self) -> dict[str, Any]:
        return {"kind": "dp-fisher", "dataset": self.data.name, "base": self.base}
