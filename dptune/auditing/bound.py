"""From the guesses of a one-run audit to a lower bound on epsilon (numpy/scipy only).

The audit (Steinke, Nasr & Jagielski 2023, "Privacy Auditing with One (1) Training Run", NeurIPS
2023, arXiv:2305.08846): m canaries, each included in the training data independently with
probability 1/2; one run; an auditor guesses "in" or "out" for r of them (abstaining on the rest)
and v guesses are right. If the run is (epsilon, delta)-DP, then (their Corollary 5.4, the
(epsilon, delta) form of the main theorem, as computed by their Appendix D)

    P[v correct or more] <= f(v) + 2 m delta * max_{i = 1..v} (f(v - i) - f(v)) / i,
    f(k) = P[Binomial(r, e^eps / (1 + e^eps)) >= k].

With delta = 0 it is the tail of r guesses of eps-DP randomized response. This p-value increases
with epsilon, so every epsilon whose p-value is <= beta is rejected at confidence 1 - beta: the
largest such epsilon is the lower bound (0 when even epsilon = 0 is not rejected). It is a lower
bound on the epsilon of the run *as implemented*, at the stated delta; it never certifies privacy.

Tested against the paper's printed values (App. D: m=1000, r=100, v=75, delta=1e-4 gives 0.673;
§7, Fig. 11: m=1e5, r=1510, v=1439, delta=1e-5 gives 2.675) and against jax_privacy 2.0's
independent implementation (``tests/dptune/auditing/test_bound.py``).
"""

from __future__ import annotations

import numpy as np
from scipy import special, stats


def _check(m: int, r: int, v: int, delta: float) -> None:
    for name, x in (("m", m), ("r", r), ("v", v)):
        if isinstance(x, bool) or int(x) != x:
            raise ValueError(f"{name}={x!r} must be an integer")
    if not 0 <= v <= r <= m or m < 1:
        raise ValueError(f"need 0 <= v <= r <= m and m >= 1, got m={m}, r={r}, v={v}")
    if not 0 <= delta < 1:
        raise ValueError(f"delta={delta!r} must be in [0, 1)")


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P[at least v of r guesses correct] if the run is (epsilon, delta)-DP with respect to the m
    canaries' inclusion (Steinke, Nasr & Jagielski 2023, Cor. 5.4; App. D ``p_value_DP_audit``).

    Args:
      m: canaries, each included independently with probability 1/2.
      r: guesses made (abstentions excluded); v: correct guesses.
      epsilon: >= 0; delta: in [0, 1).
    Returns:
      The p-value in [0, 1].
    """
    _check(m, r, v, delta)
    if not epsilon >= 0:
        raise ValueError(f"epsilon={epsilon!r} must be >= 0")
    q = float(special.expit(epsilon))  # accuracy of epsilon-DP randomized response
    tail = float(stats.binom.sf(v - 1, r, q))  # f(v) = P[Binomial(r, q) >= v]
    if delta == 0 or v == 0:
        return min(tail, 1.0)
    i = np.arange(1, v + 1)
    # f(v - i) - f(v) = P[v - i <= Binomial(r, q) < v]
    gaps = stats.binom.sf(v - i - 1, r, q) - tail
    alpha = float(np.max(gaps / i))
    return min(tail + alpha * delta * 2 * m, 1.0)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, beta: float = 0.05) -> float:
    """The largest epsilon that v correct guesses out of r reject at significance ``beta``: if the
    run is (epsilon*, delta)-DP, this bound exceeds epsilon* with probability at most ``beta``.

    Bisection on the p-value (increasing in epsilon) to 1e-9, returning the end whose p-value is
    <= beta (conservative, as App. D's ``get_eps_audit``); 0 when epsilon = 0 is not rejected."""
    if not 0 < beta < 1:
        raise ValueError(f"beta={beta!r} must be in (0, 1)")
    if p_value(m, r, v, 0.0, delta) > beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while p_value(m, r, v, hi, delta) <= beta:
        lo, hi = hi, 2 * hi
        if hi > 1e4:  # pragma: no cover - the p-value tends to 1 as epsilon grows
            raise ArithmeticError("the p-value did not exceed beta below epsilon = 1e4")
    while hi - lo > 1e-9 * max(1.0, hi):
        mid = 0.5 * (lo + hi)
        if p_value(m, r, v, mid, delta) <= beta:
            lo = mid
        else:
            hi = mid
    return lo


def ceiling(m: int, r: int, delta: float, beta: float = 0.05) -> float:
    """The highest bound r guesses can show among m canaries: all r correct. No audit with these
    (m, r, delta, beta) can report more, however broken the run."""
    return epsilon_lower_bound(m, r, r, delta, beta)
