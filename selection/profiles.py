"""Privacy profiles (delta(eps)) of random stopping: one candidate's profile -> the selection's,
after Koskela, Redberg & Wang 2024 ("Privacy Profiles for Private Selection", ICML 2024,
arXiv:2402.06701, [KRW]).

* ``CandidateProfile``: one candidate's delta(eps) on a grid (e.g. from its PLD).
* ``ProfileSelectionBound`` and its counts: ``RandomStoppingProfile`` (truncated negative binomial,
  geometric, logarithmic), ``PoissonStoppingProfile``, ``HardCappedRandomStoppingProfile`` (the
  pgf of min(K, T)).
* ``profile_pure_dp`` / ``profile_approx_dp``: the weight-bonus bounds for pure and (eps, delta)
  candidates (ours; checked against exact enumeration, docs/selection.md).

The theorem classes of ``selection.privacy`` hand their profile bound out through
``profile_bound()``; ``dptune.accounting`` feeds it one run's PLD (the "profile" route).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from selection.checks import (
    check_cap,
    check_delta,
    check_epsilon,
    check_poisson_mean,
    set_frozen,
)
from selection.counts import TnbParameters

__all__ = [
    "CandidateProfile",
    "ProfileSelectionBound",
    "RandomStoppingProfile",
    "PoissonStoppingProfile",
    "HardCappedRandomStoppingProfile",
    "profile_pure_dp",
    "profile_approx_dp",
]


@dataclass(frozen=True, eq=False)
class CandidateProfile:
    """One candidate's privacy profile on a grid: ``deltas[i]`` bounds BOTH hockey-stick
    divergences ``H_{e^eps}(Q(X)||Q(Y))`` and ``H_{e^eps}(Q(Y)||Q(X))`` at ``eps = epsilons[i]``,
    for every pair of neighbours (X, Y).

    A pessimistic PLD's ``get_delta_for_epsilon`` (the max over the add and the remove direction) is
    such a bound; so is an exact enumeration. Between grid points the profile is read at the grid
    point below (delta is non-increasing in eps, so that is an upper bound); beyond the last point
    the last value is used (again an upper bound). On construction the deltas are replaced by their
    running maximum from the right (an upper bound that is non-increasing) and clipped to [0, 1].

    Attributes:
      epsilons: 1-d float64, strictly increasing, ``epsilons[0] == 0``.
      deltas: 1-d float64, same length.
    """

    epsilons: np.ndarray
    deltas: np.ndarray

    def __post_init__(self) -> None:
        e = np.asarray(self.epsilons, dtype=np.float64)
        d = np.asarray(self.deltas, dtype=np.float64)
        if e.ndim != 1 or d.shape != e.shape or e.size < 2:
            raise ValueError(
                f"epsilons and deltas must be 1-d of the same length >= 2, got {e.shape}, {d.shape}"
            )
        if e[0] != 0.0 or not np.all(np.diff(e) > 0) or not np.all(np.isfinite(e)):
            raise ValueError("epsilons must be finite, strictly increasing and start at 0")
        if np.any(np.isnan(d)):
            raise ValueError("deltas must not be NaN")
        d = np.clip(np.maximum.accumulate(d[::-1])[::-1], 0.0, 1.0)
        e.setflags(write=False)
        d.setflags(write=False)
        set_frozen(self, epsilons=e, deltas=d)

    def delta(self, epsilon: np.ndarray | float) -> np.ndarray:
        """An upper bound on the profile at any real ``epsilon`` (elementwise).

        For eps < 0: ``H_{e^eps}(P||Q) = 1 - e^eps + e^eps H_{e^-eps}(Q||P)`` (take complements of
        the optimal set), and both directions are bounded by the grid.
        """
        eps = np.atleast_1d(np.asarray(epsilon, dtype=np.float64))
        mag = np.abs(eps)
        idx = np.searchsorted(self.epsilons, mag, side="right") - 1  # grid point <= |eps|
        at = self.deltas[idx]
        out = np.where(eps >= 0.0, at, 1.0 - np.exp(eps) * (1.0 - at))
        return np.clip(out, 0.0, 1.0)

    def survival_lower_bound(self, s: np.ndarray) -> np.ndarray:
        """L(s): the smallest Q(X)(B) for an event B with Q(Y)(B) = s, given the profile.

        From Q(Y)(B) <= e^eps Q(X)(B) + delta(eps) and, for the complement, 1 - Q(X)(B) <= e^eps
        (1 - Q(Y)(B)) + delta(eps), at every grid eps: L(s) = max(0, max_eps e^-eps (s -
        delta(eps)), max_eps 1 - e^eps (1 - s) - delta(eps)). Non-decreasing in s; a valid lower
        bound because every grid delta is an upper bound.
        """
        s = np.asarray(s, dtype=np.float64)[:, None]
        e, d = self.epsilons[None, :], self.deltas[None, :]
        direct = np.max(np.exp(-e) * (s - d), axis=1)
        complement = np.max(1.0 - np.exp(e) * (1.0 - s) - d, axis=1)
        return np.maximum(0.0, np.maximum(direct, complement))


#: Grid of survival probabilities s = P[score >= x] on which the profile bound is evaluated:
#: 0, then log-spaced from 1e-14 to 1 (the best candidates, s near 0, carry the largest weights).
_SURVIVAL_GRID = np.unique(np.concatenate([[0.0], np.logspace(-14.0, 0.0, 3000)]))

#: Number of bins of the log-weight ratio ("bonus") in `ProfileSelectionBound`.
_BONUS_BINS = 1000


class ProfileSelectionBound:
    """Privacy profile of "best of K candidates", K ~ a count with pgf phi (interface).

    The argument follows Koskela, Redberg & Wang 2024 ("Privacy Profiles for Private Selection",
    ICML 2024, arXiv:2402.06701, [KRW]): the tuned mechanism's output density is ``phi'(F_X(x))
    q_X(x)`` with ``F_X(x) = P[Q(X) < x]`` (the pgf representation of best-of-K that [KRW] build
    on), and its hockey-stick divergence is bounded from the candidate's privacy profile alone.
    The bound itself (the bonus binning below) is OUR derivation: the paper's text was not
    available to us when this was written (only its abstract), so no theorem number of [KRW] is
    claimed for it; it is proved here and tested against exact enumeration
    (``tests/selection/test_profiles.py``).

    **Bound (ours).** Break ties by an independent uniform (post-processing), so scores are
    atomless. Write S_X(x) = P[Q(X) >= x], w(s) = phi'(1 - s), and for one output x the bonus b(x)
    = log w(S_X(x)) - log w(S_Y(x)). Then the hockey-stick integrand is exactly ``w(S_X) [q_X -
    e^{eps - b} q_Y]_+``. Every event {Q >= x} obeys the profile, so S_X >= L(S_Y)
    (`CandidateProfile.survival_lower_bound`); w is non-increasing in s, so an output whose bonus
    exceeds b has S_X >= t_min(b) := inf{t : log w(t) - log w(s_max(t)) > b}, s_max(t) = sup{s :
    L(s) <= t}, and weight w(S_X) <= c(b) := w(t_min(b)). Bin the bonus at 0 = b_0 < b_1 < ... <
    b_n = b_max (the largest feasible bonus) and put c_0 = E[K] = w(0), c_j = c(b_{j-1}). With A_j
    the mass of ``[q_X - e^{eps - b_j} q_Y]_+`` over outputs in bins 0..j (at most delta_Q(eps -
    b_j), since thresholds only fall with j), Abel summation gives

        delta_A(eps) <= sum_j (c_j - c_{j+1}) delta_Q(eps - b_j),   c_{n+1} = 0.     (*)

    K = 0 releases a data-independent "nothing", which adds nothing for eps >= 0. Every grid
    quantity is rounded in the safe direction (see `_bonus_table`). Checks: K = 1 always (w = 1)
    gives delta_A = delta_Q exactly; eps-DP candidates give ((2 + eta) eps, 0) at most for the
    truncated negative binomial, the pure-DP multiple of Papernot & Steinke 2022, Cor. 3.

    Subclasses give ``log_weight(s) = log phi'(1 - s)`` and ``mean``.
    """

    name: str
    theorem: str
    mean: float

    def log_weight(self, s: np.ndarray) -> np.ndarray:
        """log phi'(1 - s) for survival probabilities s in [0, 1] (non-increasing in s)."""
        raise NotImplementedError

    def _bonus_table(self, profile: CandidateProfile) -> tuple[np.ndarray, np.ndarray]:
        """(b, c): bonus bin edges b_0..b_n and weights c_0..c_n of (*) (independent of eps).

        On the grid t_0 < t_1 < ...: s_max(t_k) is over-estimated by the first grid s with L(s) >
        t_k (L is continuous and non-decreasing), and the bonus of any output with S_X in [t_{k-1},
        t_k] is at most log w(t_{k-1}) - log w(s_max(t_k)); hence t_min(b) >= t_{k-1} for the
        first k whose running maximum of these bounds exceeds b, and c(b) <= w(t_{k-1}).
        """
        t = _SURVIVAL_GRID
        lower = profile.survival_lower_bound(t)
        k = np.searchsorted(lower, t, side="right")  # first grid s with L(s) > t
        s_max = t[np.minimum(k, t.size - 1)]
        lw_t = self.log_weight(t)
        bound = np.full(t.shape, -np.inf)
        bound[1:] = lw_t[:-1] - self.log_weight(s_max[1:])
        running = np.maximum.accumulate(bound)
        b_max = max(float(running[-1]), 0.0)
        b = np.linspace(0.0, b_max, _BONUS_BINS + 1)
        first = np.searchsorted(running, b[:-1], side="right")  # first k with running > b
        c = np.empty(b.shape)
        c[0] = math.exp(float(self.log_weight(np.zeros(1))[0]))  # w(0) = phi'(1) = E[K]
        c[1:] = np.exp(lw_t[np.maximum(first - 1, 0)])
        # c is non-increasing by construction (t_min grows with b); the running minimum only
        # guards against rounding in exp/log, and lowering no c_j below a true weight bound
        # would be invalid, so assert instead of silently fixing.
        if np.any(np.diff(c) > 1e-12 * c[0]):
            raise AssertionError("bonus weights are not non-increasing")
        return b, np.minimum.accumulate(c)

    def delta(self, epsilon: float, profile: CandidateProfile) -> float:
        """Upper bound (*) on delta of the whole selection at ``epsilon`` >= 0."""
        return float(self.deltas(np.atleast_1d(epsilon), profile)[0])

    def deltas(self, epsilons: np.ndarray, profile: CandidateProfile) -> np.ndarray:
        """(*) at each of ``epsilons`` (1-d, each >= 0), sharing one bonus table."""
        eps = np.asarray(epsilons, dtype=np.float64)
        if np.any(eps < 0) or np.any(np.isnan(eps)):
            raise ValueError("epsilon must be >= 0")
        b, c = self._bonus_table(profile)
        dc = c - np.append(c[1:], 0.0)
        dq = profile.delta((eps[:, None] - b[None, :]).ravel()).reshape(eps.size, b.size)
        return np.minimum(1.0, dq @ dc)

    def epsilon(self, delta: float, profile: CandidateProfile, *, rtol: float = 1e-4) -> float:
        """Smallest eps (within ``rtol``, rounded up) with (*) <= ``delta``; inf if none <= 1e3."""
        delta = check_delta(delta)
        b, c = self._bonus_table(profile)
        dc = c - np.append(c[1:], 0.0)

        def bound(e: float) -> float:
            return float(profile.delta(e - b) @ dc)

        lo, hi = 0.0, max(1.0, float(profile.epsilons[-1]) + float(b[-1]))
        if bound(lo) <= delta:
            return 0.0
        while bound(hi) > delta:
            lo, hi = hi, 2.0 * hi
            if hi > 1e3:
                return math.inf
        while hi - lo > rtol * hi:
            mid = 0.5 * (lo + hi)
            if bound(mid) <= delta:
                hi = mid
            else:
                lo = mid
        return hi


@dataclass(frozen=True)
class RandomStoppingProfile(TnbParameters, ProfileSelectionBound):
    """Profile bound (*) of `ProfileSelectionBound` for K ~ D_{eta,gamma} (PS Def. 1).

    phi'(1 - s) = E[K] (1 + s (1 - gamma)/gamma)^-(eta + 1): the pgf of D_{eta,gamma} is phi(z) =
    ((1 - (1 - gamma) z)^-eta - 1)/(gamma^-eta - 1) (eta != 0) or log(1 - (1 - gamma) z)/log(gamma)
    (eta = 0), so phi'(z) is proportional to (1 - (1 - gamma) z)^-(eta + 1) = (gamma + (1 - gamma)
    s)^-(eta + 1), normalised by phi'(1) = E[K].
    """

    @property
    def mean(self) -> float:  # type: ignore[override]
        return self.count.mean

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"random_stopping/{self.count.name}/profile"

    @property
    def theorem(self) -> str:  # type: ignore[override]
        return (
            "privacy-profile bound for best-of-K (pgf representation of Koskela, Redberg & Wang "
            f"2024, arXiv:2402.06701; bound (*) derived in selection.privacy), truncated negative "
            f"binomial eta={self.shape:g}"
        )

    def log_weight(self, s: np.ndarray) -> np.ndarray:
        s = np.asarray(s, dtype=np.float64)
        ratio = (1.0 - self.gamma) / self.gamma
        return math.log(self.mean) - (1.0 + self.shape) * np.log1p(s * ratio)


@dataclass(frozen=True)
class PoissonStoppingProfile(ProfileSelectionBound):
    """Profile bound (*) of `ProfileSelectionBound` for K ~ Poisson(mean), K = 0 releasing nothing.

    phi(z) = exp(mean (z - 1)), so phi'(1 - s) = mean exp(-mean s).
    """

    mean: float

    name = "random_stopping/poisson/profile"
    theorem = (
        "privacy-profile bound for best-of-K (pgf representation of Koskela, Redberg & Wang "
        "2024, arXiv:2402.06701; bound (*) derived in selection.privacy), Poisson count"
    )

    def __post_init__(self) -> None:
        set_frozen(self, mean=check_poisson_mean(self.mean))

    def log_weight(self, s: np.ndarray) -> np.ndarray:
        return math.log(self.mean) - self.mean * np.asarray(s, dtype=np.float64)


#: Number of terms of phi'(z) summed at once in `HardCappedRandomStoppingProfile.log_weight`.
_CAP_CHUNK = 2048
#: Caps up to this are summed term by term; above it the closed form is used if gamma is at least
#: `_CAP_CLOSED_MIN_GAMMA` (its cancellation error is then below ~2e-12 relative).
_CAP_DIRECT_MAX = 64
_CAP_CLOSED_MIN_GAMMA = 1e-3


@dataclass(frozen=True)
class HardCappedRandomStoppingProfile(ProfileSelectionBound):
    """Profile bound (*) of `ProfileSelectionBound` for K = min(G, T), G ~ Geometric(gamma) on
    {1, 2, ...} (LT Alg. 2 with a hard cap of T candidates).

    P[K = k] = gamma (1 - gamma)^(k - 1) for k < T and P[K = T] = (1 - gamma)^(T - 1), so with
    r = 1 - gamma and z = 1 - s:

        phi'(z) = sum_{k=1}^{T-1} k gamma r^(k-1) z^(k-1) + T r^(T-1) z^(T-1),

    a polynomial with positive coefficients, non-decreasing in z (the only property (*) uses).
    Small caps (or tiny gamma) are summed term by term in log space; larger ones use the closed
    form, whose cancellation is bounded there (`_log_weight_closed`). E[K] = phi'(1) = (1 -
    r^T)/gamma.
    """

    gamma: float
    max_trials: int

    name = "random_stopping/geometric_capped/profile"

    def __post_init__(self) -> None:
        gamma, cap = check_cap(self.gamma, self.max_trials)
        set_frozen(self, gamma=gamma, max_trials=cap)

    @property
    def mean(self) -> float:  # type: ignore[override]
        return -math.expm1(self.max_trials * math.log1p(-self.gamma)) / self.gamma

    @property
    def theorem(self) -> str:  # type: ignore[override]
        return (
            "privacy-profile bound for best-of-K (pgf representation of Koskela, Redberg & Wang "
            "2024, arXiv:2402.06701; bound (*) derived in selection.privacy), geometric count "
            f"capped at T={self.max_trials}"
        )

    def log_weight(self, s: np.ndarray) -> np.ndarray:
        s = np.asarray(s, dtype=np.float64)
        t, gamma = self.max_trials, self.gamma
        if t > _CAP_DIRECT_MAX and _CAP_CLOSED_MIN_GAMMA <= gamma < 1.0:
            return self._log_weight_closed(s)
        return self._log_weight_sum(s)

    def _log_weight_closed(self, s: np.ndarray) -> np.ndarray:
        """phi'(z) = gamma (1 - T u^(T-1) + (T-1) u^T)/(1 - u)^2 + T r^(T-1) z^(T-1), u = r z.

        1 - u = gamma + r s >= gamma, so the numerator (which cancels like T^2 (1 - u)^2 / 2 when
        T (1 - u) is small) loses at most ~1e-16 / (T gamma^2) relative: used only for T > 64 and
        gamma >= 1e-3 (at most ~2e-12), where summing T terms per point would be slow.
        """
        t, gamma = self.max_trials, self.gamma
        r = 1.0 - gamma
        z = 1.0 - np.clip(s, 0.0, 1.0)
        u = r * z
        one_minus_u = gamma + r * np.clip(s, 0.0, 1.0)
        with np.errstate(divide="ignore", under="ignore"):
            log_u = np.log(u)
            head = 1.0 - t * np.exp((t - 1) * log_u) + (t - 1) * np.exp(t * log_u)
            tail = t * np.exp((t - 1) * (math.log(r) + np.log(z)))
        return np.log(gamma * head / one_minus_u**2 + tail)

    def _log_weight_sum(self, s: np.ndarray) -> np.ndarray:
        """phi'(1 - s) summed term by term in log space (any T and gamma)."""
        t, gamma = self.max_trials, self.gamma
        with np.errstate(divide="ignore"):  # -inf at s = 1: only the k = 1 term remains
            log_z = np.log1p(-np.clip(s, 0.0, 1.0))
        log_r = math.log1p(-gamma) if gamma < 1.0 else -math.inf
        acc = np.full(s.shape, -np.inf)
        for start in range(1, t + 1, _CAP_CHUNK):
            k = np.arange(start, min(t, start + _CAP_CHUNK - 1) + 1, dtype=np.float64)
            # coefficient of z^(k-1): k gamma r^(k-1) for k < T, T r^(T-1) for k = T
            with np.errstate(invalid="ignore"):  # 0 * -inf in the branch np.where drops
                log_coef = np.log(k) + np.where(k < t, math.log(gamma), 0.0)
                log_coef = log_coef + np.where(k > 1, (k - 1) * log_r, 0.0)
                power = np.where(k[None, :] > 1, (k[None, :] - 1) * log_z[..., None], 0.0)
            acc = np.logaddexp(acc, _logsumexp_last(log_coef[None, :] + power))
        return acc.reshape(s.shape)


def _logsumexp_last(a: np.ndarray) -> np.ndarray:
    """log(sum(exp(a), axis=-1)) with -inf entries allowed."""
    top = np.max(a, axis=-1)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return safe + np.log(np.sum(np.exp(a - safe[..., None]), axis=-1))


def _max_bonus(bound: ProfileSelectionBound, epsilon: float, delta: float, rtol: float) -> float:
    """An upper bound, within ``rtol * epsilon``, on b_max = sup_s log w(L(s)) - log w(s) for
    (epsilon, delta)-DP candidates, L(s) = max(0, e^-eps (s - delta), 1 - e^eps (1 - s) - delta).

    Branch and bound on s: on [lo, hi], log w(L(s)) - log w(s) <= log w(L(lo)) - log w(hi) (L
    non-decreasing, w non-increasing); intervals whose bound exceeds the best value seen by more
    than ``rtol * eps`` (at least 1e-9) are halved until none is left (or 60 rounds, or 1e5 of
    them). Returned: the largest bound of every interval ever dropped or still open, so the result
    is >= b_max (rounded up, never down) and <= best value seen + ``rtol * eps``.
    """
    with np.errstate(over="ignore"):
        e_lo, e_hi = np.exp(-epsilon), np.exp(epsilon)  # e_hi = inf for eps > ~709

    def lower(s: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore"):  # inf * 0 at s = 1 is replaced below
            complement = np.where(s >= 1.0, 1.0 - delta, 1.0 - e_hi * (1.0 - s) - delta)
        return np.clip(np.maximum(e_lo * (s - delta), complement), 0.0, 1.0)

    def lw(s: np.ndarray) -> np.ndarray:
        return np.asarray(bound.log_weight(np.asarray(s, dtype=np.float64)), dtype=np.float64)

    # log-spaced towards both ends, where w changes fastest relative to s
    near_one = 1.0 - np.logspace(-16.0, -0.5, 2049)
    edges = np.unique(np.concatenate([[0.0], np.logspace(-16.0, 0.0, 4097), near_one]))
    lo, hi = edges[:-1], edges[1:]
    best = float(np.max(lw(lower(edges)) - lw(edges)))
    tol = max(rtol * epsilon, 1e-9)
    upper = best
    dropped = -math.inf  # largest bound of the intervals dropped so far (rounded up)
    for _ in range(60):
        u = lw(lower(lo)) - lw(hi)
        keep = u > best + tol
        if not np.all(keep):
            dropped = max(dropped, float(np.max(u[~keep])))
        upper = max(best, dropped, float(np.max(u)))
        # Stop when nothing is left to refine, or before the intervals outgrow memory: `upper`
        # is a valid bound at every round, only less tight.
        if not np.any(keep) or np.count_nonzero(keep) > 100_000:
            break
        lo, hi = lo[keep], hi[keep]
        mid = np.where(lo > 0.0, np.sqrt(lo * hi), 0.5 * hi)
        best = max(best, float(np.max(lw(lower(mid)) - lw(mid))))
        lo, hi = np.concatenate([lo, mid]), np.concatenate([mid, hi])
    if not math.isfinite(upper):  # never a NaN total: an unknown bound is no bound
        return math.inf
    return max(upper, 0.0)


def profile_pure_dp(bound: ProfileSelectionBound, epsilon: float, *, rtol: float = 1e-4) -> float:
    """Total pure epsilon of ``bound``'s selection over ``epsilon``-DP candidates (ours).

    In the pgf representation of `ProfileSelectionBound` the tuned output density is ``w(S_X(x))
    q_X(x)``, so its ratio between neighbours X, Y is at most e^eps e^{b(x)} with bonus b(x) = log
    w(S_X(x)) - log w(S_Y(x)). For eps-DP candidates every event obeys e^-eps P_Y <= P_X, for it
    and its complement: S_X >= L(S_Y), L(s) = max(e^-eps s, 1 - e^eps (1 - s)); w is
    non-increasing, so the selection is (eps + b_max, 0)-DP with

        b_max = sup_{s in [0, 1]} log w(L(s)) - log w(s)

    (for the uncapped truncated negative binomial this gives at most (2 + eta) eps, PS Cor. 3),
    bounded rigorously by branch and bound (`_max_bonus`), within ``rtol * eps`` of b_max.
    """
    epsilon = check_epsilon(epsilon)
    if epsilon == 0.0:
        return 0.0
    return epsilon + _max_bonus(bound, epsilon, 0.0, rtol)


def profile_approx_dp(
    bound: ProfileSelectionBound, epsilon: float, delta: float, *, rtol: float = 1e-4
) -> tuple[float, float]:
    """(eps + b_max, E[K] delta): the selection over (``epsilon``, ``delta``)-DP candidates (ours).

    Every event B of an (eps, delta)-DP candidate obeys P_Y(B) <= e^eps P_X(B) + delta, for B and
    its complement, so S_X >= L(S_Y) with L(s) = max(0, e^-eps (s - delta), 1 - e^eps (1 - s) -
    delta), and every output's bonus b(x) = log w(S_X(x)) - log w(S_Y(x)) is at most b_max = sup_s
    log w(L(s)) - log w(s). At eps_A = eps + b_max, in the notation of `ProfileSelectionBound`:

        [w(S_X) q_X - e^{eps_A} w(S_Y) q_Y]_+ = w(S_X) [q_X - e^{eps_A - b(x)} q_Y]_+
                                             <= w(0) [q_X - e^{eps} q_Y]_+,

    (w <= w(0) = E[K]; eps_A - b(x) >= eps), and the candidate's hockey-stick divergence at eps is
    at most delta: the selection is (eps + b_max, E[K] delta)-DP. With delta = 0 this is
    `profile_pure_dp`.
    """
    epsilon, delta = check_epsilon(epsilon), float(delta)
    if not (0.0 <= delta <= 1.0):
        raise ValueError(f"delta must be in [0, 1], got {delta}")
    b = _max_bonus(bound, epsilon, delta, rtol)
    return epsilon + b, min(1.0, bound.mean * delta)
