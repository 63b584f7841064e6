"""Private selection among private candidates (no JAX, no dptune): counts of trials, random
stopping, thresholding, baselines, and their privacy theorems (`selection.privacy`).

A candidate is any callable ``candidate(index, rng) -> (score, payload)`` that is differentially
private; a method draws its random plan first, evaluates candidates and releases at most one.
See ``docs/selection.md``.
"""

from selection.accuracy_first import AccuracyFirst
from selection.baselines import BestOfK, NonPrivateBest
from selection.counts import (
    CountDistribution,
    Poisson,
    TruncatedNegativeBinomial,
    geometric,
    logarithmic,
    poisson,
    truncated_negative_binomial,
)
from selection.method import SelectionMethod
from selection.plan import Plan, Selection, SelectionPrivate, best_index
from selection.privacy import PrivacyTransform
from selection.random_stopping import RandomStopping
from selection.sparse_vector import PercentileSparseVector
from selection.stability_validation import StabilityValidation
from selection.thresholding import Thresholding

__all__ = [
    "AccuracyFirst",
    "BestOfK",
    "CountDistribution",
    "NonPrivateBest",
    "PercentileSparseVector",
    "Plan",
    "Poisson",
    "PrivacyTransform",
    "RandomStopping",
    "Selection",
    "SelectionMethod",
    "SelectionPrivate",
    "StabilityValidation",
    "Thresholding",
    "TruncatedNegativeBinomial",
    "best_index",
    "geometric",
    "logarithmic",
    "poisson",
    "truncated_negative_binomial",
]
