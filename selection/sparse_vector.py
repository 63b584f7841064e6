"""Generalized sparse vector (Liu & Talwar 2019, §4.1, Alg. "gensparse0"): the first private
candidate whose percentile clears a target, found with AboveThreshold on the log-odds scale.

Each candidate i is an eps-DP mechanism Q_i whose percentile p_i(D) = P[Q_i(D) scores >= tau] is
known exactly (LT's percentile oracle; e.g. a score that is a count plus Laplace or Gaussian noise
of known scale, or any candidate whose output distribution can be evaluated). The candidate callable
returns ``(p_i, payload)``: the percentile as its score, and as payload ONE sample of Q_i(D) (or
data-independent information such as its hyperparameters). The method tests

    logit(p_i) + nu_i >= logit(target_percentile) + rho,   rho ~ Lap(beta), nu_i ~ Lap(2 beta),

in index order, releases the first passing candidate's payload (nothing after ``max_trials``
misses), and never releases a percentile, a noisy value or the number of misses beyond the released
index. All noise is data-independent and drawn up front in the plan.

Privacy: ``(4/beta + 1) eps`` pure DP for eps-DP candidates (see
`selection.privacy.PercentileSparseVectorPrivacy` for the derivation and its sources).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from selection.method import FirstPassing, make_rng
from selection.plan import NoisyThresholdPlan
from selection.privacy import PercentileSparseVectorPrivacy, PrivacyTransform

__all__ = ["PercentileSparseVector", "SparseVectorPlan", "logit"]


def logit(p: float) -> float:
    """log(p) - log(1 - p) in [-inf, inf]; NaN for p outside [0, 1] or NaN."""
    p = float(p)
    if not (0.0 <= p <= 1.0):
        return math.nan
    if p == 0.0:
        return -math.inf
    if p == 1.0:
        return math.inf
    return math.log(p) - math.log1p(-p)


@dataclass(frozen=True, repr=False)  # keeps NoisyThresholdPlan's private repr
class SparseVectorPlan(NoisyThresholdPlan):
    """The plan plus the AboveThreshold noise (PRIVATE, like every plan: hidden from ``repr``).

    Attributes:
      threshold_noise: rho ~ Lap(beta), added to the target's logit.
      query_noise: nu_0..nu_{T-1} ~ Lap(2 beta), one per candidate.
    """


class PercentileSparseVector(FirstPassing):
    """Liu & Talwar 2019, §4.1: the first candidate whose percentile p_i(D) (its score) passes a
    noisy test against ``target_percentile`` on the log-odds scale.

    Args:
      target_percentile: in (0, 1): stop at the first candidate with P[score >= tau] above this
        (up to the noise).
      noise_scale: beta > 0 (logit units): threshold noise Lap(beta), query noise Lap(2 beta).
        Larger beta: more private (4 eps / beta for the test) and a less exact stopping point.
      max_trials: T >= 1, the number of candidates in the stream.
    """

    method_name = "sparse_vector"
    plan_class = SparseVectorPlan
    #: the analysis needs the exact percentile of a pure eps-DP candidate, and covers the index
    #: and the payload (one sample of Q_i), never the percentile itself
    takes = ("percentile",)
    publishes = ("payload", "index")
    repr_fields = ("target_percentile", "noise_scale", "max_trials")

    def __init__(self, target_percentile: float, noise_scale: float, max_trials: int) -> None:
        target = float(target_percentile)
        if not (0.0 < target < 1.0):
            raise ValueError(f"target_percentile must be in (0, 1), got {target_percentile}")
        self.target_percentile = target
        self._privacy = PercentileSparseVectorPrivacy(noise_scale, max_trials)
        self.noise_scale = self._privacy.noise_scale
        self.max_trials = self._privacy.max_trials

    def plan(self, rng: np.random.Generator | int | None = None) -> SparseVectorPlan:
        # rho ~ Lap(beta) on the target's logit, nu_i ~ Lap(2 beta) per candidate
        beta = self.noise_scale
        return SparseVectorPlan.draw_laplace(
            make_rng(rng), self.max_trials, self.method_name, beta, 2.0 * beta
        )

    def _first_pass(self, plan: SparseVectorPlan, scores: Sequence[float]) -> int | None:
        """First index whose noisy logit-percentile passes the noisy threshold."""
        bar = logit(self.target_percentile) + plan.threshold_noise
        for i in range(min(len(scores), plan.num_trials)):
            g = logit(scores[i])  # NaN (a failed candidate or a score outside [0, 1]) never passes
            if g + plan.query_noise[i] >= bar:
                return i
        return None

    @property
    def privacy(self) -> PrivacyTransform:
        return self._privacy
