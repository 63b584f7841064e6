"""Distributions of the number of trials K for random stopping.

Every distribution here is *data independent*: K is drawn before any private computation and never
depends on candidate scores. Each distribution knows its Papernot-Steinke shape parameter ``eta``
(``shape``), which is what `selection.privacy` needs to pick the theorem:

* ``TruncatedNegativeBinomial(shape=eta, gamma)``: Papernot & Steinke 2022 (arXiv:2110.03620), Def.
  1, support {1, 2, ...}, eta in (-1, inf), gamma in (0, 1]. ``eta = 1`` is the geometric
  distribution of Liu & Talwar 2019 Alg. 2 (mean 1/gamma) and ``eta = 0`` the logarithmic
  distribution.
* ``Poisson(mean)``: support {0, 1, ...}; K = 0 means "nothing is released" (Papernot & Steinke
  2022, Thm 6).

All pmfs are computed in log space (exact up to floating point) and every sampler takes a
``numpy.random.Generator``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special

from selection.checks import check_poisson_mean, set_frozen

__all__ = [
    "CountDistribution",
    "TruncatedNegativeBinomial",
    "Poisson",
    "geometric",
    "logarithmic",
    "truncated_negative_binomial",
    "poisson",
]

# Largest number of candidates drawn per vectorised rejection round; bounds memory, not correctness.
_MAX_BATCH = 1 << 22

# Below this gamma, numpy's ``logseries(1 - gamma)`` is not used: it recomputes log(gamma) as
# log1p(-(1 - gamma)) from the rounded 1 - gamma (relative error ~1e-16/gamma in the gamma it
# samples with), and raises once 1 - gamma rounds to 1 (gamma < ~1.1e-16, e.g. eta = -0.9 with
# E[K] = 100). Above it numpy's sampler is kept (same draws for a given seed).
_SMALL_GAMMA = 1e-8

# Largest K the exact logarithmic sampler returns as an int64; larger draws raise (never trainable).
_MAX_COUNT = float(1 << 62)


class CountDistribution:
    """Interface shared by the distributions of K (all subclasses are frozen dataclasses)."""

    #: Papernot-Steinke shape parameter eta; ``math.inf`` for Poisson.
    shape: float

    @property
    def name(self) -> str:
        raise NotImplementedError

    @property
    def min_count(self) -> int:
        """Smallest value in the support (0 for Poisson, 1 otherwise)."""
        raise NotImplementedError

    # ``mean`` (E[K], the expected number of candidates evaluated) is a field or a property of each
    # subclass.
    mean: float

    def log_pmf(self, k: np.ndarray | int) -> np.ndarray:
        """log P[K = k] elementwise; ``-inf`` outside the support."""
        raise NotImplementedError

    def pmf(self, k: np.ndarray | int) -> np.ndarray:
        """P[K = k] elementwise."""
        return np.exp(self.log_pmf(k))

    def sample(self, rng: np.random.Generator, size: int | None = None) -> int | np.ndarray:
        """Draw K (an ``int`` if ``size`` is None, else an int64 array of shape ``(size,)``)."""
        raise NotImplementedError

    def params(self) -> dict:
        """JSON-safe description (name, shape and parameters)."""
        raise NotImplementedError


def _check_rng(rng: np.random.Generator) -> None:
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng must be a numpy.random.Generator, got {type(rng).__name__}")


def _logarithmic_exact(rng: np.random.Generator, log_gamma: float, n: int) -> np.ndarray:
    """n draws of the logarithmic distribution P[K = k] = (1 - gamma)^k / (k log(1/gamma)).

    Exact for every gamma in (0, 1) because only log(gamma) enters: K is geometric on {1, 2, ...}
    with P[K > k | Q] = Q^k given Q = 1 - gamma^U, U ~ U(0, 1) (Kemp 1981, "Efficient generation
    of logarithmically distributed pseudo-random variables", algorithm LS; integrating over U gives
    the pmf above). Returns float64 integers (possibly beyond int64; see `_to_counts`).
    """
    u = rng.random(n)
    v = 1.0 - rng.random(n)  # in (0, 1]
    log_q = np.log1p(-np.exp(log_gamma * u))  # log(1 - gamma^U) < 0, accurate for tiny gamma
    with np.errstate(divide="ignore", invalid="ignore"):
        return 1.0 + np.floor(np.log(v) / log_q)


def _log_gamma_ratio(k: np.ndarray, eta: float) -> np.ndarray:
    """log(Gamma(k + eta) / Gamma(k)) for k >= 1, accurate to ~1e-14 for every k (float64 array).

    ``gammaln(k + eta) - gammaln(k)`` cancels catastrophically for large k (wrong by 1e-7 at k =
    1e8 and 0 instead of eta log k from k ~ 1e16), so from k = 100 on the difference of Stirling
    series (log Gamma(z) = (z - 1/2) log z - z + log(2 pi)/2 + 1/(12 z) - 1/(360 z^3) + O(z^-5))
    is taken, with the large terms cancelled analytically via log1p(eta / k).
    """
    k = np.asarray(k, dtype=np.float64)
    small = k < 100.0
    out = np.empty_like(k)
    ks = k[small]
    out[small] = special.gammaln(ks + eta) - special.gammaln(ks)
    kl = k[~small]
    with np.errstate(over="ignore"):
        out[~small] = (
            eta * np.log(kl)
            + (kl + eta - 0.5) * np.log1p(eta / kl)
            - eta
            + 1.0 / (12.0 * (kl + eta))
            - 1.0 / (12.0 * kl)
            - 1.0 / (360.0 * (kl + eta) ** 3)
            + 1.0 / (360.0 * kl**3)
        )
    return out


def _to_counts(k: np.ndarray) -> np.ndarray:
    """float64 counts -> int64; ValueError for a draw of 2^62 or more (never trainable)."""
    if np.any(~(k < _MAX_COUNT)):
        raise ValueError(
            "a draw of K exceeded 2^62 candidates: choose a smaller mean or a larger shape"
        )
    return k.astype(np.int64)


def _tnb_mean_from_log_gamma(log_gamma: float, shape: float) -> float:
    """E[K] of Papernot-Steinke Def. 1 as a function of log(gamma) (< 0), numerically stable.

    eta != 0: E[K] = eta (1 - gamma) / (gamma (1 - gamma^eta));  eta = 0: E[K] = (1/gamma - 1) /
    log(1/gamma). Written as ((1 - gamma)/gamma) / g(eta) with g(eta) = -expm1(eta log gamma)/eta
    (-> -log gamma at eta = 0).
    """
    one_minus_gamma = -math.expm1(log_gamma)
    odds = one_minus_gamma / math.exp(log_gamma)
    if shape == 0.0:
        denominator = -log_gamma
    else:
        denominator = -math.expm1(shape * log_gamma) / shape
    return odds / denominator


@dataclass(frozen=True)
class TruncatedNegativeBinomial(CountDistribution):
    """Truncated negative binomial D_{eta,gamma} (Papernot & Steinke 2022, Def. 1) on {1, 2, ...}.

    P[K = k] = (1 - gamma)^k / (gamma^(-eta) - 1) * prod_{l=0}^{k-1} (l + eta) / (l + 1)   for eta
    != 0, P[K = k] = (1 - gamma)^k / (k log(1/gamma))                                           for
    eta = 0.

    Args:
      shape: eta in (-1, inf). 1 = geometric (Liu & Talwar 2019, Alg. 2), 0 = logarithmic.
      gamma: in (0, 1]; gamma = 1 is the point mass K = 1 (the limit of the pmf).
    """

    shape: float
    gamma: float

    min_count = 1

    def __post_init__(self) -> None:
        shape, gamma = float(self.shape), float(self.gamma)
        if not (math.isfinite(shape) and shape > -1.0):
            raise ValueError(
                f"shape (eta) must be a finite number > -1 (Papernot-Steinke Def. 1), "
                f"got {self.shape}; "
                "use Poisson for eta = inf"
            )
        if not (0.0 < gamma <= 1.0):
            raise ValueError(f"gamma must be in (0, 1], got {self.gamma}")
        set_frozen(self, shape=shape, gamma=gamma)

    @classmethod
    def from_mean(cls, mean: float, shape: float) -> TruncatedNegativeBinomial:
        """The distribution with shape ``shape`` and E[K] = ``mean`` (>= 1).

        gamma is solved to ~1e-13 relative accuracy.

        The mean is strictly decreasing in gamma, so the root in log(gamma) is unique (Brent's
        method).
        """
        mean = float(mean)
        if not (math.isfinite(mean) and mean >= 1.0):
            raise ValueError(f"mean must be a finite number >= 1 (K >= 1 always), got {mean}")
        if shape == 1.0:
            return cls(shape, 1.0 / mean)  # geometric: E[K] = 1/gamma exactly
        tmp = cls(shape, 1.0)  # validates shape
        if mean == 1.0:
            return tmp
        target = math.log(mean)

        def excess(log_gamma: float) -> float:
            return math.log(_tnb_mean_from_log_gamma(log_gamma, shape)) - target

        hi = -1e-300
        while excess(hi) > 0:  # pragma: no cover - only for means within ~1e-300 of 1
            hi *= 0.5
        lo = -1.0
        while excess(lo) < 0:
            lo *= 2.0
            if lo < -745.0:
                raise ValueError(f"mean {mean} too large for shape {shape}: gamma underflows")
        log_gamma = optimize.brentq(excess, lo, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps)
        return cls(shape, math.exp(log_gamma))

    @property
    def name(self) -> str:
        if self.shape == 1.0:
            return "geometric"
        if self.shape == 0.0:
            return "logarithmic"
        return "truncated_negative_binomial"

    @property
    def mean(self) -> float:
        if self.gamma == 1.0:
            return 1.0
        return _tnb_mean_from_log_gamma(math.log(self.gamma), self.shape)

    def log_pmf(self, k: np.ndarray | int) -> np.ndarray:
        k = np.asarray(k, dtype=np.float64)
        valid = (k >= 1) & (k == np.floor(k))
        kk = np.where(valid, k, 1.0)
        if self.gamma == 1.0:
            out = np.where(kk == 1.0, 0.0, -np.inf)
        elif self.shape == 0.0:
            out = kk * math.log1p(-self.gamma) - np.log(kk) - math.log(-math.log(self.gamma))
        else:
            eta = self.shape
            # gammaln is log|Gamma|; for eta in (-1, 0) both the product and gamma^(-eta) - 1 are
            # negative.
            log_norm = math.log(abs(math.expm1(-eta * math.log(self.gamma))))
            out = (
                kk * math.log1p(-self.gamma)
                + special.gammaln(kk + eta)
                - special.gammaln(eta)
                - special.gammaln(kk + 1.0)
                - log_norm
            )
        return np.where(valid, out, -np.inf)

    def sample(self, rng: np.random.Generator, size: int | None = None) -> int | np.ndarray:
        _check_rng(rng)
        n = 1 if size is None else int(size)
        if n < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        out = self._sample(rng, n)
        return int(out[0]) if size is None else out

    def _sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        gamma, eta = self.gamma, self.shape
        if gamma == 1.0:
            return np.ones(n, dtype=np.int64)
        if eta == 1.0:
            return rng.geometric(gamma, size=n).astype(np.int64)
        if eta == 0.0:
            if gamma < _SMALL_GAMMA:
                return _to_counts(_logarithmic_exact(rng, math.log(gamma), n))
            return rng.logseries(1.0 - gamma, size=n).astype(np.int64)
        out = np.empty(n, dtype=np.int64)
        filled = 0
        if eta > 0:
            # NB(eta, gamma) counts failures: P[X = k] ∝ (1-gamma)^k Gamma(k+eta)/(Gamma(eta) k!);
            # conditioned on X >= 1 this is exactly Def. 1 (the authors' sampler). Acceptance
            # probability 1 - gamma^eta.
            accept = -math.expm1(eta * math.log(gamma))
            while filled < n:
                m = min(_MAX_BATCH, int((n - filled) / accept * 1.1) + 16)
                x = rng.negative_binomial(eta, gamma, size=m)
                x = x[x >= 1][: n - filled]
                out[filled : filled + x.size] = x
                filled += x.size
            return out
        # eta in (-1, 0): no numpy sampler. Rejection from the logarithmic distribution L (p_L(k) ∝
        # (1-gamma)^k/k): p_eta(k) / p_L(k) ∝ Gamma(k + eta) / Gamma(k), which is decreasing in k
        # for eta < 0, so it is bounded by its value Gamma(1 + eta) at k = 1; accept with
        # probability Gamma(k+eta) / (Gamma(k) Gamma(1+eta)).
        log_bound = special.gammaln(1.0 + eta)
        while filled < n:
            m = min(_MAX_BATCH, 2 * (n - filled) + 16)
            if gamma < _SMALL_GAMMA:
                k = _logarithmic_exact(rng, math.log(gamma), m)
            else:
                k = rng.logseries(1.0 - gamma, size=m).astype(np.float64)
            with np.errstate(invalid="ignore"):  # k = inf (gamma ~ 1e-320): nan, rejected
                log_ratio = _log_gamma_ratio(k, eta) - log_bound
            keep = _to_counts(k[np.log(rng.random(m)) < log_ratio][: n - filled])
            out[filled : filled + keep.size] = keep
            filled += keep.size
        return out

    def params(self) -> dict:
        return {"name": self.name, "shape": self.shape, "gamma": self.gamma, "mean": self.mean}


@dataclass(frozen=True)
class TnbParameters:
    """Base of the theorems and bounds for a count D_{eta,gamma}: its ``shape`` and ``gamma``,
    validated (and stored as floats) as `TruncatedNegativeBinomial` validates them."""

    shape: float
    gamma: float

    def __post_init__(self) -> None:
        count = TruncatedNegativeBinomial(self.shape, self.gamma)  # validates
        set_frozen(self, shape=count.shape, gamma=count.gamma)

    @property
    def count(self) -> TruncatedNegativeBinomial:
        return TruncatedNegativeBinomial(self.shape, self.gamma)


@dataclass(frozen=True)
class Poisson(CountDistribution):
    """K ~ Poisson(mean) on {0, 1, ...}; K = 0 releases nothing (Papernot & Steinke 2022, Thm 6)."""

    mean: float

    shape = math.inf

    name = "poisson"
    min_count = 0

    def __post_init__(self) -> None:
        set_frozen(self, mean=check_poisson_mean(self.mean))

    def log_pmf(self, k: np.ndarray | int) -> np.ndarray:
        k = np.asarray(k, dtype=np.float64)
        valid = (k >= 0) & (k == np.floor(k))
        kk = np.where(valid, k, 0.0)
        out = kk * math.log(self.mean) - self.mean - special.gammaln(kk + 1.0)
        return np.where(valid, out, -np.inf)

    def sample(self, rng: np.random.Generator, size: int | None = None) -> int | np.ndarray:
        _check_rng(rng)
        if size is None:
            return int(rng.poisson(self.mean))
        return rng.poisson(self.mean, size=int(size)).astype(np.int64)

    def params(self) -> dict:
        return {"name": self.name, "shape": "inf", "mean": self.mean}


def geometric(mean: float) -> TruncatedNegativeBinomial:
    """Geometric K on {1, 2, ...} with E[K] = mean: gamma = 1/mean (Liu & Talwar 2019, Alg. 2)."""
    return TruncatedNegativeBinomial.from_mean(mean, 1.0)


def logarithmic(mean: float) -> TruncatedNegativeBinomial:
    """Logarithmic K (Papernot-Steinke Def. 1, eta = 0) with E[K] = mean."""
    return TruncatedNegativeBinomial.from_mean(mean, 0.0)


def truncated_negative_binomial(mean: float, shape: float) -> TruncatedNegativeBinomial:
    """Truncated negative binomial K (Papernot-Steinke Def. 1), eta in (-1, inf), E[K] = mean."""
    return TruncatedNegativeBinomial.from_mean(mean, shape)


def poisson(mean: float) -> Poisson:
    """Poisson K with E[K] = mean (K = 0 allowed: nothing released)."""
    return Poisson(mean)
