"""The auditor's guesses: from per-canary statistics to "in" / "out" / abstain, and the bound.

A guessing rule is fixed before the run (it depends only on m and the statistics' names). Several
rules may be tried on one run; each is tested at significance beta / (number of rules), so that
the largest of their bounds still exceeds the true epsilon with probability <= beta (a union
bound over the rules: each rule's p-value is valid on its own, Steinke, Nasr & Jagielski 2023,
Cor. 5.4, whatever function of the run's output the guesses are).

Rank rules guess "in" for the ``k_in`` highest values (higher = more likely included) and "out" for
the ``k_out`` lowest, ties broken by canary index (independent of the coins), ``k_in + k_out`` in
{m/8, m/4, m/2}, one-sided (all "in") or two-sided (half each); sign rules (``decoded``) guess by
the sign of each value."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from dptune.auditing.bound import ceiling, epsilon_lower_bound

#: Statistics guessed from their high values only (exactly 0 for every excluded canary of a broken
#: run, but also for some included ones), and those already decoded into in/out/abstain (by sign).
#: Every other statistic gets one- and two-sided rank rules.
ONE_SIDED, SIGN = {"dispersion"}, {"decoded"}


@dataclasses.dataclass(frozen=True)
class Rule:
    """A rank rule on ``statistic`` (``k_in`` highest "in", ``k_out`` lowest "out"), or by sign."""

    statistic: str
    k_in: int = 0
    k_out: int = 0
    sign: bool = False

    @property
    def name(self) -> str:
        how = "sign" if self.sign else f"top {self.k_in} in, bottom {self.k_out} out"
        return f"{self.statistic}: {how}"

    def max_guesses(self, m: int) -> int:
        return m if self.sign else self.k_in + self.k_out

    def guesses(self, values: np.ndarray) -> np.ndarray:
        """+1 ("in"), -1 ("out") or 0 (abstain) for each canary; NaN values abstain."""
        values = np.asarray(values, dtype=np.float64)
        out = np.zeros(len(values), np.int8)
        ok = np.flatnonzero(np.isfinite(values))
        if self.sign:
            out[ok] = np.sign(values[ok]).astype(np.int8)
            return out
        # lexsort: last key first; ties go to the lower canary index.
        high = ok[np.lexsort((ok, -values[ok]))]
        low = ok[np.lexsort((ok, values[ok]))]
        out[high[: self.k_in]] = 1
        out[low[: self.k_out]] = -1
        return out


def rules_for(statistics: Sequence[str], m: int) -> list[Rule]:
    """The rules tried on statistics with these names and m canaries (fixed before the run)."""
    sizes = sorted({max(1, m // 8), max(1, m // 4), max(1, m // 2)})
    rules: list[Rule] = []
    for stat in statistics:
        if stat in SIGN:
            rules.append(Rule(stat, sign=True))
            continue
        for k in sizes:
            rules.append(Rule(stat, k, 0))
            if stat not in ONE_SIDED and k >= 2:
                rules.append(Rule(stat, k - k // 2, k // 2))
    return rules


@dataclasses.dataclass(frozen=True)
class Outcome:
    """The best rule's bound. ``ceiling``: the largest bound any of the rules could have shown
    (every guess right) at the same significance."""

    epsilon_lower_bound: float
    rule: str
    guesses: int
    correct: int
    ceiling: float
    rules: int
    significance: float


def evaluate(
    statistics: Mapping[str, np.ndarray], included: np.ndarray, delta: float,
    confidence: float = 0.95,
) -> Outcome:  # fmt: skip
    """The audit's lower bound from per-canary ``statistics`` and the true inclusion coins.

    Args:
      statistics: name -> (m,) values, higher = more likely included.
      included: (m,) bool, which canaries were in the training data.
      delta: the stated delta.
      confidence: 1 - beta; every rule of :func:`rules_for` on the statistics' names is tested at
        beta / (number of rules).
    """
    included = np.asarray(included, bool)
    m = len(included)
    rules = rules_for(list(statistics), m)
    if not rules:
        raise ValueError("no guessing rule: the trainer returned no canary statistic")
    beta = (1.0 - confidence) / len(rules)
    best, top = (-1.0, "", 0, 0), 0.0  # every bound is >= 0: the first rule replaces it
    for rule in rules:
        values = np.asarray(statistics[rule.statistic], dtype=np.float64)
        if values.shape != (m,):
            raise ValueError(f"statistic {rule.statistic!r} has shape {values.shape}, not ({m},)")
        g = rule.guesses(values)
        r = int(np.count_nonzero(g))
        v = int(np.sum((g == 1) & included) + np.sum((g == -1) & ~included))
        eps = epsilon_lower_bound(m, r, v, delta, beta) if r else 0.0
        if eps > best[0]:
            best = (eps, rule.name, r, v)
        top = max(top, ceiling(m, rule.max_guesses(m), delta, beta))
    return Outcome(*best, top, len(rules), beta)
