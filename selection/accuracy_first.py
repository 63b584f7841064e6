"""Accuracy First (Ligett, Neel, Roth, Waggoner & Wu, NeurIPS 2017, arXiv:1705.10829): state an
accuracy target instead of epsilon, release the most private hypothesis that meets it, and pay an
*ex-post* privacy loss that depends on where the search stopped.

* `noise_reduction`: their Algorithm 1 (Koufogiannis et al.'s Laplace noise reduction): noisy copies
  v_1, ..., v_T of a private vector v with increasing epsilons, such that any prefix (v_1..v_t) is
  eps_t-DP (their Thm 2.7).
* `interactive_above_threshold` (their Algorithm 2, IAT) over the hypotheses built from those
  copies: by their Lemma 2.8 the outcome "stopped at t" with prefix (f_1..f_t) has ex-post
  privacy loss eps_A + eps_t (Def. 2.2-2.3).
* `doubling_method` (their Algorithm 4, App. A.2): the baseline; ex-post loss of stopping at k is
  2 k Delta log(T/gamma)/alpha + (2^k - 1) eps_1 (their Thm A.2).

Deviation from the paper, on the safe side: when no hypothesis passes, the paper outputs the exact
minimiser theta* (ex-post loss infinite); here NOTHING is released, and the loss of that outcome is
the worst case (eps_A + eps_T, resp. the doubling method's loss at k = T), since every test was run.

What a ledger may charge: ex-post privacy (Def. 2.3) is NOT differential privacy at the realised
level; the only eps-DP statement of the procedure is the maximum of the ex-post loss over all
outcomes (their remark after Def. 2.3), i.e. eps_A + eps_T for noise reduction. dptune charges that
worst case and reports the realised ex-post loss next to it (`AccuracyFirstResult`).

All functions are NumPy only. Randomness: ``rng`` as in `selection.method.make_rng` (OS entropy by
default).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from selection.checks import check_count, check_positive
from selection.method import FirstPassing, make_rng
from selection.plan import NoisyThresholdPlan
from selection.privacy import AccuracyFirstPrivacy, PrivacyTransform

__all__ = [
    "AccuracyFirst",
    "AccuracyFirstPlan",
    "AccuracyFirstResult",
    "accuracy_first",
    "doubling_ex_post_epsilon",
    "doubling_method",
    "interactive_above_threshold",
    "noise_reduction",
]


def _check_levels(epsilons: Sequence[float]) -> np.ndarray:
    e = np.asarray(epsilons, dtype=np.float64)
    if e.ndim != 1 or e.size == 0:
        raise ValueError("epsilons must be a non-empty 1-D list")
    if not np.all(np.isfinite(e) & (e > 0)):
        raise ValueError(f"every epsilon level must be a finite number > 0, got {list(e)}")
    if np.any(np.diff(e) <= 0):
        raise ValueError(f"epsilon levels must be strictly increasing, got {list(e)}")
    return e


def noise_reduction(
    v: np.ndarray | float,
    sensitivity: float,
    epsilons: Sequence[float],
    rng: np.random.Generator | int | None = None,
) -> list[np.ndarray]:
    """Ligett et al. 2017, Algorithm 1 (noise reduction of Koufogiannis et al.).

    v_T = v + Lap(Delta/eps_T) per coordinate; for t = T-1..1: with probability (eps_t/eps_{t+1})^2
    v_t = v_{t+1}, else v_t = v_{t+1} + Lap(Delta/eps_t). Each v_t is marginally
    v + Lap(Delta/eps_t) and any prefix (v_1..v_t) is eps_t-DP for an l1-sensitivity-Delta v
    (their Thm 2.7).

    Returns: [v_1, ..., v_T], arrays of v's shape.
    """
    e = _check_levels(epsilons)
    sensitivity = check_positive(sensitivity, "sensitivity")
    gen = make_rng(rng)
    v = np.asarray(v, dtype=np.float64)
    out = [np.empty_like(v)] * e.size
    out[-1] = v + gen.laplace(0.0, sensitivity / e[-1], size=v.shape)
    for t in range(e.size - 2, -1, -1):
        if gen.random() < (e[t] / e[t + 1]) ** 2:
            out[t] = out[t + 1].copy()
        else:
            out[t] = out[t + 1] + gen.laplace(0.0, sensitivity / e[t], size=v.shape)
    return out


def interactive_above_threshold(
    queries: Callable[[int], float],
    num_queries: int,
    threshold: float,
    sensitivity: float,
    epsilon: float,
    rng: np.random.Generator | int | None = None,
) -> int | None:
    """Ligett et al. 2017, Algorithm 2 (IAT): W_hat = W + Lap(2 Delta/eps); the first t (0-based)
    with f_t(D) + Lap(4 Delta/eps) >= W_hat, or None. ``queries(t)`` evaluates f_t on the data
    (sensitivity ``sensitivity``); it is called only up to the stopping point."""
    epsilon = check_positive(epsilon, "epsilon (IAT)")
    # a zero sensitivity would make the test exact (no noise): refused, like a negative one
    sensitivity = check_positive(sensitivity, "sensitivity (of the scores)")
    gen = make_rng(rng)
    w_hat = threshold + gen.laplace(0.0, 2.0 * sensitivity / epsilon)
    for t in range(num_queries):
        f = float(queries(t))
        if f + gen.laplace(0.0, 4.0 * sensitivity / epsilon) >= w_hat:  # NaN never passes
            return t
    return None


@dataclass(frozen=True)
class AccuracyFirstResult:
    """What an Accuracy-First search releases, and its privacy.

    Attributes:
      released: whether a hypothesis passed.
      hypothesis: the released hypothesis (None when nothing passed).
      index: 0-based level t of the released hypothesis (None when nothing passed); releasing it is
        part of the output (the ex-post loss depends on it).
      epsilon: its privacy level eps_t (None when nothing passed).
      ex_post_epsilon: the realised ex-post privacy loss of this outcome (Def. 2.2-2.3).
      worst_case_epsilon: the maximum over all outcomes: the procedure's eps-DP guarantee.
      charged_epsilon: what a ledger charges: the worst case (see the module docstring).
      theorem: where the numbers come from.
    """

    released: bool
    hypothesis: Any
    index: int | None
    epsilon: float | None
    ex_post_epsilon: float
    worst_case_epsilon: float
    theorem: str
    charged_epsilon: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "charged_epsilon", self.worst_case_epsilon)

    def to_dict(self) -> dict[str, Any]:
        """The statement, JSON-safe (without the hypothesis)."""
        return {
            "released": self.released,
            "index": self.index,
            "epsilon": self.epsilon,
            "ex_post_epsilon": self.ex_post_epsilon,
            "worst_case_epsilon": self.worst_case_epsilon,
            "charged_epsilon": self.charged_epsilon,
            "delta": 0.0,
            "theorem": self.theorem,
        }

    def to_text(self) -> str:
        """Two lines: the realised ex-post loss next to the worst case that is charged."""
        what = f"level {self.index} (eps_t = {self.epsilon:.4g})" if self.released else "nothing"
        return (
            f"Released {what}: ex-post privacy loss {self.ex_post_epsilon:.4g} "
            f"(pure, delta = 0; {self.theorem}).\n"
            f"Charged to the budget: the worst case over all outcomes, {self.charged_epsilon:.4g} "
            "(ex-post privacy is not DP at the realised level)."
        )


NR_THEOREM = (
    "Ligett et al. 2017, Lemma 2.8 (IAT over prefix-private queries) with Thm 2.7 (noise "
    "reduction): ex-post eps_A + eps_t"
)


def accuracy_first(
    v: np.ndarray | float,
    sensitivity: float,
    epsilons: Sequence[float],
    make_hypothesis: Callable[[np.ndarray], Any],
    score: Callable[[Any], float],
    threshold: float,
    score_sensitivity: float,
    iat_epsilon: float,
    rng: np.random.Generator | int | None = None,
) -> AccuracyFirstResult:
    """Noise reduction + InteractiveAboveThreshold (Ligett et al. 2017, Alg. 3 structure).

    Args:
      v: the private statistic (e.g. X^T X and X^T y flattened, or theta*), l1 sensitivity
        ``sensitivity``.
      epsilons: increasing privacy levels eps_1 < ... < eps_T.
      make_hypothesis: data-independent map from a noisy copy v_t to a hypothesis (post-processing).
      score: f_t(D) = score(hypothesis_t), evaluated on the private data, l1 sensitivity
        ``score_sensitivity`` (e.g. minus the excess empirical risk, times n).
      threshold: W, the accuracy target on the score scale (pass when score + noise >= W + noise).
      iat_epsilon: eps_A of IAT.

    Returns: `AccuracyFirstResult`; ex-post eps_A + eps_t (Lemma 2.8), worst case eps_A + eps_T.
    """
    e = _check_levels(epsilons)
    # checked before noise_reduction touches v: nothing private runs on a bad argument
    score_sensitivity = check_positive(score_sensitivity, "score_sensitivity")
    iat_epsilon = check_positive(iat_epsilon, "iat_epsilon")
    sensitivity = check_positive(sensitivity, "sensitivity")
    gen = make_rng(rng)
    copies = noise_reduction(v, sensitivity, e, gen)
    hypotheses: dict[int, Any] = {}

    def query(t: int) -> float:
        hypotheses[t] = make_hypothesis(copies[t])
        return score(hypotheses[t])

    t = interactive_above_threshold(query, e.size, threshold, score_sensitivity, iat_epsilon, gen)
    privacy = AccuracyFirstPrivacy(iat_epsilon, e.size, "noise_reduction")
    worst = privacy.pure_dp(float(e[-1]))  # eps_A + eps_T
    if t is None:
        return AccuracyFirstResult(False, None, None, None, worst, worst, NR_THEOREM)
    ex_post = privacy.ex_post(float(e[t]), t)  # eps_A + eps_t
    return AccuracyFirstResult(True, hypotheses[t], t, float(e[t]), ex_post, worst, NR_THEOREM)


DOUBLING_THEOREM = (
    "Ligett et al. 2017, Thm A.2 (doubling method): ex-post 2 k Delta log(T/gamma)/alpha + "
    "(2^k - 1) eps_1"
)


def doubling_ex_post_epsilon(
    k: int, epsilon_1: float, sensitivity: float, alpha: float, gamma: float, num_levels: int
) -> float:
    """Ligett et al. 2017, Thm A.2: 2 k Delta log(T/gamma)/alpha + (2^k - 1) eps_1 (k 1-based)."""
    return 2.0 * k * sensitivity * math.log(num_levels / gamma) / alpha + (2.0**k - 1.0) * epsilon_1


def doubling_method(
    epsilon_1: float,
    num_levels: int,
    train: Callable[[float, np.random.Generator], Any],
    score: Callable[[Any], float],
    alpha: float,
    gamma: float,
    sensitivity: float,
    rng: np.random.Generator | int | None = None,
) -> AccuracyFirstResult:
    """Ligett et al. 2017, Algorithm 4: eps_k = 2^(k-1) eps_1, fresh eps_k-DP hypothesis
    ``train(eps_k, rng)`` each round, stop when ``score`` (f^k(D) = L(theta*) - L(theta_k), l1
    sensitivity Delta) plus Lap(alpha / (2 log(T/gamma))) is >= -alpha/2. Releases nothing after T
    misses (the paper releases theta*, ex-post loss infinite)."""
    # each checked before any private computation; a negative sensitivity made the stated
    # ex-post loss negative, an infinite epsilon_1 released an eps = inf "guarantee"
    alpha = check_positive(alpha, "alpha")
    epsilon_1 = check_positive(epsilon_1, "epsilon_1")
    sensitivity = check_positive(sensitivity, "sensitivity")
    num_levels = check_count(num_levels, "num_levels")
    if not 0 < float(gamma) < 1:
        raise ValueError(f"gamma must be in (0, 1), got {gamma}")
    gen = make_rng(rng)
    b = alpha / (2.0 * math.log(num_levels / gamma))

    def loss(k: int) -> float:  # Thm A.2 at level k
        return doubling_ex_post_epsilon(k, epsilon_1, sensitivity, alpha, gamma, num_levels)

    worst = loss(num_levels)
    for k in range(1, num_levels + 1):
        eps_k = epsilon_1 * 2.0 ** (k - 1)
        theta = train(eps_k, gen)
        if float(score(theta)) + gen.laplace(0.0, b) >= -alpha / 2.0:
            return AccuracyFirstResult(True, theta, k - 1, eps_k, loss(k), worst, DOUBLING_THEOREM)
    return AccuracyFirstResult(False, None, None, None, worst, worst, DOUBLING_THEOREM)


@dataclass(frozen=True, repr=False)  # keeps NoisyThresholdPlan's private repr
class AccuracyFirstPlan(NoisyThresholdPlan):
    """The plan plus IAT's noise (PRIVATE, like every plan: hidden from ``repr``).

    Attributes:
      threshold_noise: Lap(2 Delta/eps_A), added to the accuracy target W.
      query_noise: Lap(4 Delta/eps_A), one per level.
    """


class AccuracyFirst(FirstPassing):
    """Accuracy First as a `SelectionMethod` (Ligett et al. 2017, Alg. 2 over T candidates): the
    first candidate whose score passes InteractiveAboveThreshold against an accuracy target.

    Candidate t (0-based, t < ``max_trials``) returns ``(f_t(D), hypothesis_t)``: its EXACT score
    on the private data, of l1 sensitivity ``score_sensitivity`` given the hypothesis (e.g. the
    validation accuracy count / n_val: 1/n_val), and its private hypothesis. The test is
    ``f_t(D) + Lap(4 Delta/eps_A) >= W + Lap(2 Delta/eps_A)``; all noise is data-independent and
    drawn up front in the plan; nothing is released after T misses. Order candidates by growing
    privacy cost (e.g. DP-SGD at growing epsilon) so that the first pass is the most private one
    that meets the target.

    Privacy (`AccuracyFirstPrivacy`, ``sequence="independent"``): for T independent eps-DP
    candidates, ex-post eps_A + (t + 1) eps when level t is released (Lemma 2.8 with basic
    composition of the prefix); the worst case eps_A + T eps is the DP guarantee, and the charge.

    Args:
      threshold: W, the accuracy target on the score scale.
      score_sensitivity: Delta > 0, the l1 sensitivity of each score.
      iat_epsilon: eps_A > 0, the test's budget.
      max_trials: T >= 1 levels.
    """

    method_name = "accuracy_first"
    plan_class = AccuracyFirstPlan
    #: IAT takes exact scores of known sensitivity (covered ones are post-processing of the
    #: composed candidates); the charge covers the hypotheses and the stopping index, not scores
    takes = ("exact", "covered")
    publishes = ("payload", "index")
    repr_fields = ("threshold", "score_sensitivity", "iat_epsilon", "max_trials")

    def __init__(
        self, threshold: float, score_sensitivity: float, iat_epsilon: float, max_trials: int
    ) -> None:
        given = threshold
        try:
            threshold = float(threshold)
        except (TypeError, ValueError):
            threshold = math.nan
        if math.isnan(threshold):
            raise ValueError(f"threshold must be a number (the accuracy target), got {given!r}")
        sens = check_positive(score_sensitivity, "score_sensitivity")
        self.threshold = threshold
        self.score_sensitivity = sens
        self._privacy = AccuracyFirstPrivacy(iat_epsilon, max_trials, "independent")
        self.iat_epsilon = self._privacy.iat_epsilon
        self.max_trials = self._privacy.num_levels

    def plan(self, rng: np.random.Generator | int | None = None) -> AccuracyFirstPlan:
        # Alg. 2: W_hat = W + Lap(2 Delta/eps_A); Lap(4 Delta/eps_A) per query
        scale = self.score_sensitivity / self.iat_epsilon
        return AccuracyFirstPlan.draw_laplace(
            make_rng(rng), self.max_trials, self.method_name, 2.0 * scale, 4.0 * scale
        )

    def _first_pass(self, plan: AccuracyFirstPlan, scores: Sequence[float]) -> int | None:
        """First level whose noisy score passes the noisy target."""
        bar = self.threshold + plan.threshold_noise
        for t in range(min(len(scores), plan.num_trials)):
            if float(scores[t]) + plan.query_noise[t] >= bar:  # NaN never passes
                return t
        return None

    def ex_post_epsilon(self, epsilon: float, index: int | None) -> float:
        """Realised ex-post loss (Lemma 2.8) of releasing level ``index`` (None: nothing) when
        every candidate is ``epsilon``-DP; the ledger is charged ``privacy.pure_dp(epsilon)``."""
        return self._privacy.ex_post(epsilon, index)

    @property
    def privacy(self) -> PrivacyTransform:
        return self._privacy
