"""Stability-based private validation (Chaudhuri & Vinterbo, NeurIPS 2013, Alg. 1-2).

Train one alpha1-DP candidate per hyperparameter value theta_1..theta_k (all of them: k is public
here, unlike random stopping), score each EXACTLY on the validation set, and release

    i* = argmax_i  q(h_i, V) + Z_i,    Z_i ~ Exponential(scale 2 beta / alpha2) i.i.d.,

together with h_{i*}. When the score q is (beta1, beta2, delta)-stable for the training procedure
(a change of one training record moves a candidate's score by <= beta1/n, one validation record by
<= beta2/m, for all but a delta/k fraction of the training randomness), beta = max(beta1/n,
beta2/m) and the release is (alpha1 + alpha2, delta)-DP (their Thm 2): the privacy does not grow
with k. See `selection.privacy.StabilityValidationPrivacy` (and its note on what was reconstructed
from the appendix's proofs).

The stability constants are a property of the (training procedure, score) pair, not of DP: their
App. 6.1 shows a DP trainer without it. `output_perturbation_stability` and
`histogram_stability` give them for the paper's two case studies (their Thm 4 and Thm 6).

``num_train`` and ``num_val`` must be PUBLIC (nominal) sizes: they set the noise scale.
NumPy only; randomness as in `selection.method.make_rng` (OS entropy by default).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from selection.method import SelectionMethod, make_rng
from selection.plan import Plan
from selection.privacy import PrivacyTransform, StabilityValidationPrivacy

__all__ = [
    "StabilityPlan",
    "StabilityValidation",
    "gamma_norm_radius",
    "histogram_stability",
    "output_perturbation_stability",
]


@dataclass(frozen=True)
class StabilityPlan(Plan):
    """The plan plus the k exponential noises (PRIVATE, like every plan: hidden from ``repr``)."""

    noise: tuple[float, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "noise", tuple(float(v) for v in self.noise))
        if len(self.noise) != self.num_trials:
            raise ValueError("a stability-validation plan needs one noise per candidate")

    def __repr__(self) -> str:
        return f"StabilityPlan(method={self.method!r}, <private noise>)"

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "noise": list(self.noise)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StabilityPlan:
        return cls(
            num_trials=d["num_trials"], method=str(d.get("method", "")), noise=tuple(d["noise"])
        )


class StabilityValidation(SelectionMethod):
    """Chaudhuri & Vinterbo 2013, Alg. 1 (selection) inside Alg. 2 (release of h_{i*}).

    Candidate i (i < k) is trained with hyperparameter theta_i and returns ``(q(h_i, V), h_i)``:
    its exact validation score (higher is better) and its model. A NaN score (a failed candidate)
    ranks below every other; the stability constants must hold for it too (a failure that depends
    on one record breaks them).

    Args:
      k: number of candidates.
      validation_epsilon: alpha2 > 0.
      training_stability: beta1 (a training record moves a score by <= beta1 / num_train).
      validation_stability: beta2 (a validation record moves a score by <= beta2 / num_val).
      num_train, num_val: public sizes n and m.
      stability_delta: per-candidate probability that the stability bounds fail (0 when they
        always hold); the total delta is k times it.
    """

    method_name = "stability_validation"
    plan_class = StabilityPlan
    #: Thm 2 takes exact stable scores (the user's beta vouches for their stability) and covers
    #: i* and h_{i*}, not the scores
    takes = ("exact", "covered")
    publishes = ("payload", "index")
    repr_fields = ("k", "validation_epsilon", "beta")

    def __init__(
        self,
        k: int,
        validation_epsilon: float,
        training_stability: float,
        validation_stability: float,
        num_train: int,
        num_val: int,
        stability_delta: float = 0.0,
    ) -> None:
        self._privacy = StabilityValidationPrivacy(validation_epsilon, k, stability_delta)
        for name, v in (
            ("training_stability", training_stability),
            ("validation_stability", validation_stability),
        ):
            if isinstance(v, (str, bytes)) or not (math.isfinite(float(v)) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
        for name, v in (("num_train", num_train), ("num_val", num_val)):
            if isinstance(v, bool) or int(v) != v or v < 1:
                raise ValueError(f"{name} must be an integer >= 1 (a public size), got {v}")
        self.k = self._privacy.k
        self.validation_epsilon = self._privacy.validation_epsilon
        self.beta = max(training_stability / num_train, validation_stability / num_val)
        if not self.beta > 0:
            raise ValueError("training_stability and validation_stability must not both be 0")
        #: Scale 2 beta / alpha2 of the exponential noise (Thm 1; see the privacy class).
        self.noise_scale = 2.0 * self.beta / self.validation_epsilon

    @classmethod
    def from_beta(
        cls, k: int, validation_epsilon: float, beta: float, stability_delta: float = 0.0
    ) -> StabilityValidation:
        """The method from beta = max(beta1/n, beta2/m) directly (the config's
        ``stability_beta``): the most one training or one validation record moves a candidate's
        score, in score units. Equivalent to ``cls(k, alpha2, beta, beta, 1, 1, delta)``."""
        beta = float(beta)
        if not (math.isfinite(beta) and beta > 0):
            raise ValueError(f"stability_beta must be a finite number > 0, got {beta}")
        return cls(k, validation_epsilon, beta, beta, 1, 1, stability_delta)

    @property
    def expected_trials(self) -> float:
        return float(self.k)

    def plan(self, rng: np.random.Generator | int | None = None) -> StabilityPlan:
        z = make_rng(rng).exponential(self.noise_scale, size=self.k)
        return StabilityPlan(num_trials=self.k, method=self.method_name, noise=tuple(z))

    def done(self, plan: Plan, scores: Sequence[float]) -> bool:
        return len(scores) >= self._check_plan(plan).num_trials

    def select(self, plan: Plan, scores: Sequence[float]) -> int | None:
        """argmax_i scores[i] + noise[i] (NaN scores lowest; ties to the lower index)."""
        plan = self._check_plan(plan)
        if len(scores) < plan.num_trials:
            raise ValueError("stability_validation needs all k scores before selecting")
        noisy = [
            -math.inf if math.isnan(float(s)) else float(s) + z
            for s, z in zip(scores[: plan.num_trials], plan.noise, strict=True)
        ]
        return int(np.argmax(noisy))

    def utility_gap(self, failure_probability: float) -> float:
        """Thm 3: with probability >= 1 - failure_probability the released score is within this
        of the best score (given stability)."""
        return self._privacy.utility_gap(self.beta, failure_probability)

    @property
    def privacy(self) -> PrivacyTransform:
        return self._privacy


def gamma_norm_radius(scale: float, dim: int, failure_probability: float) -> float:
    """``scale x d log(d / failure_probability)``: a bound that a noise vector's norm exceeds with
    probability <= failure_probability, when the norm is at most scale x Gamma(d, 1) (CMS 2011's
    noise, whose l2 norm is Gamma(d, scale) distributed; or i.i.d. Laplace(scale) coordinates,
    whose l2 norm is <= their l1 norm ~ Gamma(d, scale)). The tail bound is CMS 2011's Lemma 4 as
    Chaudhuri & Vinterbo 2013, App. 6.5 use it ("||R|| <= d log(dk/delta) with probability
    >= 1 - delta/k"); the tests check it against scipy's Gamma tail."""
    if not (scale > 0 and dim >= 1 and 0 < failure_probability < 1):
        raise ValueError("need scale > 0, dim >= 1, failure_probability in (0, 1)")
    return scale * dim * math.log(dim / failure_probability)


def output_perturbation_stability(
    regularization: float,
    noise_radius: float,
    score_lipschitz: float,
    score_at_zero: float = 0.0,
    score_max: float = math.inf,
) -> tuple[float, float]:
    """(beta1, beta2) of Chaudhuri & Vinterbo 2013, Thm 4 (output perturbation, their Alg. 4) for
    a validation score q(w, V) = -(1/m) sum_j g(w, x_j, y_j), g >= 0 and L-Lipschitz in w, data
    with ||x|| <= 1, a 1-Lipschitz training loss and objective lambda/2 ||w||^2 + (1/n) sum loss,
    as in their proof (App. 6.5, Eq. 14-15):

    * beta1 = 2 L / lambda: for a fixed noise draw the released w moves with the minimiser, by <=
      2/(n lambda) (CMS 2011's sensitivity bound);
    * beta2 = min(g*, g(0) + L w_max), w_max = 1/lambda + ``noise_radius`` (||w*|| <= 1/lambda;
      the noise norm stays below `gamma_norm_radius` except with the per-candidate probability
      delta/k). Their text bounds g by L ||w||, i.e. g(0) = 0; ``score_at_zero`` adds g(0) for
      losses such as the logistic loss (g(0) = log 2).
    """
    if not (regularization > 0 and noise_radius >= 0 and score_lipschitz >= 0):
        raise ValueError("need regularization > 0, noise_radius >= 0, score_lipschitz >= 0")
    w_max = 1.0 / regularization + noise_radius
    beta2 = min(score_max, score_at_zero + score_lipschitz * w_max)
    return 2.0 * score_lipschitz / regularization, beta2


def histogram_stability(
    min_bin_width: float, epsilon: float, num_train: int, k: int, stability_delta: float
) -> tuple[float, float]:
    """(beta1, beta2) for Chaudhuri & Vinterbo 2013, Thm 6 (private histogram density, their
    Alg. 5, score q(f, V) = -int f^2 + (2/m) sum_j f(z_j)), following their proof (App. 6.6):

    * nu = 2 log(4 / stability_delta) / (n alpha sqrt(h_min)) (their Eq. 19 with Lemma 3: the
      noisy total n_tilde stays >= n (1 - nu) except with probability delta/k =
      ``stability_delta``);
    * beta1 = 4 / ((1 - nu) h_min), OUR constant, twice the 2 / ((1 - nu) h_min) this function
      used to return from our reading of Thm 6 / Eq. 21 (whose numerator the project's text
      extraction does not show). Derivation: one training sample added to bin b (fixed noise)
      raises that bin's clipped noisy count by d in [0, 1], so with t = d / (n_tilde + d) <=
      1 / n_tilde the bin masses move to p' = (1 - t) p + t e_b. Then the validation term
      (2/m) sum_j f(z_j) moves by at most 2 t / h and int f^2 = sum_i p_i^2 / h by at most 2 t / h
      (sum p'^2 - sum p^2 = (t^2 - 2t) sum p^2 + 2 t (1 - t) p_b + t^2), together 4 / (h n_tilde);
      moving a sample between bins (the paper's replace-one case 1) is the same. Attained in the
      limit (all noisy mass in one bin, every validation point in the bin that gains the sample;
      ``tests/selection/test_stability_validation.py`` computes it: 3.99 / (h n_tilde));
    * beta2 = 2 / h_min (Eq. 18: one validation point moves (2/m) f(z), f <= 1 / h).

    Needs nu < 1 (their condition on n). ``num_train`` must be a PUBLIC LOWER BOUND on the number
    of training records: the score moves by up to 4 / (h n_tilde) with n_tilde the noisy total,
    so beta1 holds for datasets of at least ``num_train`` records only. ``epsilon`` is Alg. 5's
    alpha, whose noise is Laplace(2 / alpha) per bin; `dptune.learners.classical
    .histogram_density` at ``noise_multiplier = 1 / epsilon`` adds Laplace(1 / epsilon), half
    that, so nu computed here is then twice its true value (safe: beta1 grows with nu).
    """
    if not (0 < min_bin_width <= 1 and epsilon > 0 and 0 < stability_delta < 1):
        raise ValueError("need min_bin_width in (0, 1], epsilon > 0, stability_delta in (0, 1)")
    if isinstance(num_train, bool) or int(num_train) != num_train or num_train < 1:
        raise ValueError(f"num_train must be an integer >= 1 (a public size), got {num_train!r}")
    del k  # enters through stability_delta = delta / k
    nu = 2.0 * math.log(4.0 / stability_delta) / (num_train * epsilon * math.sqrt(min_bin_width))
    if not nu < 1:
        raise ValueError(
            f"num_train={num_train} is too small for Thm 6 at this epsilon and bin width (nu = "
            f"{nu:.3g} >= 1)"
        )
    return 4.0 / ((1.0 - nu) * min_bin_width), 2.0 / min_bin_width
