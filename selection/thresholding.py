"""Thresholding (Liu & Talwar 2019, Alg. 1): release the first candidate whose score reaches a
known threshold; after each miss, stop and release nothing with probability gamma.

The coin flips do not depend on the data, so they are drawn up front: the plan's ``num_trials``
is the index of the first "stop" coin, G ~ Geometric(gamma) on {1, 2, ...}, capped at
``max_trials``. Candidates are consumed in index order; the first one with score >= threshold
among the first ``num_trials`` is released, otherwise nothing. Evaluating a batch of candidates
speculatively in parallel keeps these semantics: scores after the first hit are ignored.

Privacy: eps-DP candidates give (2 eps + eps0)-DP, eps0 = 2 exp(-gamma T) with a cap T and 0
without (Liu & Talwar 2019, Thm 3.1(b)); RDP without a cap via Papernot & Steinke 2022, App. C,
Cor. 16 (see `selection.privacy.ThresholdingPrivacy`). Expected number of trainings <= 1/gamma.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from selection.method import FirstPassing, make_rng
from selection.plan import Plan
from selection.privacy import PrivacyTransform, ThresholdingPrivacy

__all__ = ["Thresholding"]


class Thresholding(FirstPassing):
    """Liu & Talwar 2019, Alg. 1.

    Args:
      threshold: release the first candidate with ``score >= threshold`` (NaN never qualifies).
      stop_probability: gamma in (0, 1]: probability of stopping after each miss.
      max_trials: optional hard cap T (Thm 3.1 needs T >= 1 + 1/(e gamma)); nothing is released
        after T misses, at the privacy price eps0 = 2 exp(-gamma T).
    """

    method_name = "thresholding"
    #: LT Thm 3.1 covers the released candidate's output, its score included
    publishes = ("payload", "score")
    repr_fields = ("threshold", "stop_probability", "max_trials")

    def __init__(
        self, threshold: float, stop_probability: float, max_trials: int | None = None
    ) -> None:
        threshold = float(threshold)
        if math.isnan(threshold):
            raise ValueError("threshold must be a number, got NaN")
        self.threshold = threshold
        try:  # ThresholdingPrivacy validates gamma and the cap (Thm 3.1's condition on T)
            self._privacy = ThresholdingPrivacy(stop_probability, max_trials)
        except ValueError as e:  # in the theorem's words (gamma): name this class's keyword
            raise ValueError(
                str(e).replace("gamma (stop probability)", "stop_probability")
            ) from None
        self.stop_probability = self._privacy.gamma
        self.max_trials = self._privacy.max_trials

    @property
    def expected_trials(self) -> float:
        """Upper bound on E[number of candidates trained]: E[min(G, T)] (1/gamma without a cap)."""
        gamma = self.stop_probability
        if self.max_trials is None:
            return 1.0 / gamma
        return (
            float(-math.expm1(self.max_trials * math.log1p(-gamma)) / gamma) if gamma < 1 else 1.0
        )

    def plan(self, rng: np.random.Generator | int | None = None) -> Plan:
        stop = int(make_rng(rng).geometric(self.stop_probability))  # index of the first stop coin
        if self.max_trials is not None:
            stop = min(stop, self.max_trials)
        return Plan(num_trials=stop, method=self.method_name)

    def _first_pass(self, plan: Plan, scores: Sequence[float]) -> int | None:
        """First index with score >= threshold (the stopping coins end the plan's trials)."""
        for i in range(min(len(scores), plan.num_trials)):
            if float(scores[i]) >= self.threshold:  # False for NaN
                return i
        return None

    @property
    def privacy(self) -> PrivacyTransform:
        return self._privacy
