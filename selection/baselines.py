"""Baselines for comparison: best of a fixed k (priced by composition) and the leaky practice.

* `BestOfK(k)`: train k candidates, release the best; k eps pure DP by basic composition, which
  is tight for this algorithm (Liu & Talwar 2019, App. B.1).
* `NonPrivateBest(k)`: the same selection presented with the single candidate's epsilon, i.e. the
  common practice of tuning on private data and reporting only the final run. It is NOT private
  as stated: its privacy transform (`selection.privacy.NotPrivate`) returns infinity everywhere.
"""

from __future__ import annotations

import numpy as np

from selection.method import BestOfPlanned
from selection.plan import Plan
from selection.privacy import BestOfKPrivacy, NotPrivate, PrivacyTransform

__all__ = ["BestOfK", "NonPrivateBest"]


def _check_k(k: int) -> int:
    if isinstance(k, bool) or int(k) != k or k < 1:
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    return int(k)


class _FixedK(BestOfPlanned):
    repr_fields = ("k",)

    def __init__(self, k: int) -> None:
        self.k = _check_k(k)

    @property
    def expected_trials(self) -> float:
        return float(self.k)

    def plan(self, rng: np.random.Generator | int | None = None) -> Plan:
        del rng  # nothing random
        return Plan(num_trials=self.k, method=self.method_name)


class BestOfK(_FixedK):
    """Release the best of exactly k candidates; privacy by composition (k eps, k delta, k RDP)."""

    method_name = "best_of_k"
    #: composition of k runs covers every output, the position of the best included
    publishes = ("payload", "score", "index")

    @property
    def privacy(self) -> PrivacyTransform:
        return BestOfKPrivacy(self.k)


class NonPrivateBest(_FixedK):
    """NOT PRIVATE: best of k with no selection accounting (the leaky practice), for comparison.

    Args:
      k: number of candidates (default 10).
    """

    method_name = "not_private"
    is_private = False
    takes = ("covered", "exact", "percentile")  # no guarantee to keep
    publishes = ("payload", "score", "index")

    def __init__(self, k: int = 10) -> None:
        super().__init__(k)

    @property
    def privacy(self) -> PrivacyTransform:
        return NotPrivate()
