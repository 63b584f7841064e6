"""Random stopping: train a random number K of candidates, release only the best.

K is drawn from a data-independent distribution before any private computation, so all K
candidates can run at once, in any order. Only the best candidate (higher score first, ties to the
lower index, NaN last) is released; K, the other candidates and their scores stay private.

* Geometric K (Liu & Talwar 2019, Alg. 2 and Thm 3.2): eps-DP candidates give 3 eps-DP.
* Truncated negative binomial K with shape eta (Papernot & Steinke 2022, Def. 1, Thm 2, Cor. 3):
  (2 + eta) eps pure DP, and an RDP curve; eta = 0 (logarithmic) gives 2 eps.
* Poisson K (Papernot & Steinke 2022, Thm 6): RDP only; K = 0 releases nothing.
* Geometric K with a hard cap T (Liu & Talwar 2019, Alg. 2 with a cap): the best of min(K, T)
  candidates; its statements are our bounds (``selection.privacy.HardCappedRandomStoppingPrivacy``).
"""

from __future__ import annotations

import numpy as np

from selection.counts import CountDistribution, Poisson, TruncatedNegativeBinomial
from selection.method import BestOfPlanned, make_rng
from selection.plan import Plan
from selection.privacy import (
    HardCappedRandomStoppingPrivacy,
    PoissonStoppingPrivacy,
    PrivacyTransform,
    RandomStoppingPrivacy,
)

__all__ = ["RandomStopping"]


class RandomStopping(BestOfPlanned):
    """Release the best of K ~ ``count`` candidates.

    Args:
      count: distribution of K (`selection.counts`): geometric, logarithmic, truncated negative
        binomial or Poisson. Expected number of trainings: ``count.mean``.
      max_trials: optional hard cap T; the best of min(K, T) is released. Only for geometric K,
        the one case with a statement here (our bounds, ``HardCappedRandomStoppingPrivacy``).
    """

    method_name = "random_stopping"
    repr_fields = ("count", "max_trials")

    def __init__(self, count: CountDistribution, max_trials: int | None = None) -> None:
        if not isinstance(count, (TruncatedNegativeBinomial, Poisson)):
            raise TypeError(
                "count must be a selection.counts distribution (TruncatedNegativeBinomial or "
                f"Poisson), got {type(count).__name__}"
            )
        if max_trials is not None:
            if isinstance(max_trials, bool) or int(max_trials) != max_trials or max_trials < 1:
                raise ValueError(f"max_trials must be None or an integer >= 1, got {max_trials!r}")
            if count.shape != 1.0:
                raise ValueError(
                    f"max_trials is only supported for geometric counts; got a {count.name} "
                    "count: its capped version has no statement here"
                )
            max_trials = int(max_trials)
        self.count = count
        self.max_trials = max_trials
        self.privacy  # noqa: B018 - fail now, not after training, if no theorem covers this setting

    @classmethod
    def geometric(cls, mean: float, max_trials: int | None = None) -> RandomStopping:
        return cls(TruncatedNegativeBinomial.from_mean(mean, 1.0), max_trials)

    @classmethod
    def logarithmic(cls, mean: float) -> RandomStopping:
        return cls(TruncatedNegativeBinomial.from_mean(mean, 0.0))

    @classmethod
    def truncated_negative_binomial(cls, mean: float, shape: float) -> RandomStopping:
        return cls(TruncatedNegativeBinomial.from_mean(mean, shape))

    @classmethod
    def poisson(cls, mean: float) -> RandomStopping:
        return cls(Poisson(mean))

    @property
    def expected_trials(self) -> float:
        """E[number of candidates trained] (E[min(K, T)] with a cap)."""
        if self.max_trials is None:
            return float(self.count.mean)
        k = np.arange(1, self.max_trials)
        pmf = self.count.pmf(k)
        return float(np.sum(k * pmf) + self.max_trials * max(0.0, 1.0 - np.sum(pmf)))

    def plan(self, rng: np.random.Generator | int | None = None) -> Plan:
        k = int(self.count.sample(make_rng(rng)))
        if self.max_trials is not None:
            k = min(k, self.max_trials)
        return Plan(num_trials=k, method=self.method_name)

    @property
    def privacy(self) -> PrivacyTransform:
        if self.max_trials is not None:
            return HardCappedRandomStoppingPrivacy(self.count.gamma, self.max_trials)
        if isinstance(self.count, Poisson):
            return PoissonStoppingPrivacy(self.count.mean)
        return RandomStoppingPrivacy.from_count(self.count)
