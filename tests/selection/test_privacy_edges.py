"""The capped procedure's pure-DP constant, re-derived by exact enumeration, and
the weight bonus b_max rounded up (never down).

* A three-level candidate pair attains eps + b_max in the limit: Y puts mass s above a level x,
  p at x and the rest below; X puts L(s) = max(e^-eps s, 1 - e^eps (1 - s)) above, e^eps p at x
  (every event's ratio stays within e^+-eps). The exact law of "best of min(K, T)" at x, summed
  over k = 1..T here with p = 1e-9, gives the loss of releasing x; its sup over s is the exact
  worst case the docs must state (4.4935 eps at gamma 0.02, T 5, not 4.25).
* ``selection.profiles._max_bonus`` is a branch and bound: an interval dropped early must still
  count towards the bound it returns. A step-shaped weight whose largest bonus sits in an interval
  dropped in the first round shows the difference.
"""

from __future__ import annotations

import math

import numpy as np

from selection import profiles
from tests.paths import REPO


def _exact_worst_loss(eps: float, gamma: float, cap: int) -> float:
    """sup over s of log P_X[best = x] / P_Y[best = x] for the three-level pair (module
    docstring), computed from P[min(K, T) = k] directly (no pgf, no selection code)."""
    k = np.arange(1, cap + 1, dtype=np.float64)
    pk = np.where(k < cap, gamma * (1.0 - gamma) ** (k - 1), (1.0 - gamma) ** (cap - 1))
    s = np.linspace(1e-6, 1.0 - 1e-6, 20001)[:, None]
    a = np.maximum(math.exp(-eps) * s, 1.0 - math.exp(eps) * (1.0 - s))
    p = 1e-9

    def at_x(above: np.ndarray, mass: float) -> np.ndarray:
        # P[best of k = x] = P[all <= x] - P[all < x] = (1 - above)^k - (1 - above - mass)^k
        hi = k * np.log1p(-above)
        lo = k * np.log1p(-above - mass)
        return np.sum(pk * np.exp(hi) * -np.expm1(lo - hi), axis=1)

    ratio = np.log(at_x(a, math.exp(eps) * p) / at_x(s, p))
    # refine around the grid's best point
    i = int(np.argmax(ratio))
    s2 = np.linspace(s[max(i - 1, 0), 0], s[min(i + 1, len(s) - 1), 0], 20001)[:, None]
    a2 = np.maximum(math.exp(-eps) * s2, 1.0 - math.exp(eps) * (1.0 - s2))
    return float(max(ratio.max(), np.log(at_x(a2, math.exp(eps) * p) / at_x(s2, p)).max()))


def test_docs_state_the_exact_worst_case_of_the_capped_procedure():
    eps, gamma, cap = 0.1, 0.02, 5
    exact = _exact_worst_loss(eps, gamma, cap) / eps
    assert f"{exact:.4f}" == "4.4935"
    bound = profiles.profile_pure_dp(profiles.HardCappedRandomStoppingProfile(gamma, cap), eps)
    assert exact <= bound / eps <= exact + 2e-4  # the bound is attained (to the grid)
    text = (REPO / "docs" / "selection.md").read_text()
    assert "4.4935" in text and "vs 4.25" not in text


class _Steps:
    """A non-increasing weight w (log w a step function): log w(s) = -sum of the drops at or below
    s. The bonus log w(L(s)) - log w(s) is the sum of the drops in (L(s), s]."""

    def __init__(self, drops: dict[float, float]) -> None:
        self.at = np.array(sorted(drops))
        self.size = np.array([drops[s] for s in sorted(drops)])

    def log_weight(self, s: np.ndarray) -> np.ndarray:
        s = np.asarray(s, dtype=np.float64)
        return -np.sum(self.size * (s[..., None] >= self.at), axis=-1)


def test_bonus_is_never_rounded_down():
    """_max_bonus's own grid is logspace(-16, 0, 4097) (ratio 1.009 between points); eps = 0.002
    makes each drop's bonus window [s_i, s_i e^eps) 0.2 % wide. Drop A (0.010) sits on a grid point
    (found at once); drop B (0.015, the true b_max) between two grid points (its interval's bound
    0.015 <= 0.010 + tol: dropped in round 1); two drops C (0.011 each) share one grid interval
    (bound 0.022: kept, then split into two intervals of bound 0.011). Today's code returns the
    last round's 0.011; the bound must be >= 0.015."""
    eps, rtol = 0.002, 5.0  # tol = rtol * eps = 0.01
    grid = np.logspace(-16.0, 0.0, 4097)
    g_a, g_b, g_c = grid[3800], grid[3840], grid[3880]
    drops = {
        g_a / 1.001: 0.010,
        g_b * 1.003: 0.015,
        g_c * 1.001: 0.011,
        g_c * 1.005: 0.011,
    }
    bound = _Steps(drops)
    # independent check of the construction: the largest bonus on a fine grid is B's 0.015
    s = np.linspace(0.01, 0.2, 2_000_001)
    fine = np.max(bound.log_weight(math.exp(-eps) * s) - bound.log_weight(s))
    assert abs(fine - 0.015) < 1e-12
    assert profiles._max_bonus(bound, eps, 0.0, rtol) >= fine
    # the default tolerance is unaffected here (B is found), and never below the fine grid
    assert profiles._max_bonus(bound, eps, 0.0, 1e-4) >= fine
