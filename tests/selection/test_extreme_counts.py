"""Counts at extreme parameters (tiny gamma, negative eta, huge K) stay exact; run() errors do not
reveal the number of trials."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from scipy import stats

from selection import RandomStopping
from selection import counts as sc


def _binned_chi_square_pvalue(draws: np.ndarray, dist: sc.TruncatedNegativeBinomial) -> float:
    """Chi-square p-value of ``draws`` against ``dist`` on bins 1..19 and a log-spaced tail."""
    k = np.arange(1, 10**6)
    pmf = dist.pmf(k)
    edges = [*range(1, 21), 100, 10**4, 10**6]
    obs, exp = [], []
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        obs.append(np.sum((draws >= lo) & (draws < hi)))
        exp.append(pmf[(k >= lo) & (k < hi)].sum() * draws.size)
    obs.append(np.sum(draws >= edges[-1]))
    exp.append((1.0 - pmf.sum()) * draws.size)
    obs, exp = np.asarray(obs, float), np.asarray(exp)
    keep = exp > 5
    chi = float(np.sum((obs[keep] - exp[keep]) ** 2 / exp[keep]))
    return float(stats.chi2.sf(chi, keep.sum() - 1))


@pytest.mark.parametrize("shape,mean", [(-0.9, 100.0), (-0.9, 20.0), (-0.5, 1e6)])
def test_negative_shape_sampler_is_exact_for_tiny_gamma(shape, mean):
    """eta in (-1, 0) needs tiny gamma for moderate means (eta = -0.9, E[K] = 100: gamma 3.5e-21).

    Before the fix numpy's ``logseries(1 - gamma)`` raised once 1 - gamma rounded to 1, and the
    acceptance ratio gammaln(k + eta) - gammaln(k) was 0 instead of eta log k for k >~ 1e16.
    """
    dist = sc.truncated_negative_binomial(mean, shape)
    draws = dist.sample(np.random.default_rng(11), 40_000)
    assert draws.dtype == np.int64 and draws.min() >= 1
    assert _binned_chi_square_pvalue(draws, dist) > 1e-3


def test_logarithmic_sampler_survives_tiny_gamma():
    dist = sc.TruncatedNegativeBinomial(0.0, 1e-17)  # 1 - gamma == 1.0 in float64
    draws = dist.sample(np.random.default_rng(5), 40_000)
    assert _binned_chi_square_pvalue(draws, dist) > 1e-3


def test_log_gamma_ratio_is_accurate_for_large_k():
    """log(Gamma(k + eta)/Gamma(k)) = eta log k + eta (eta - 1)/(2k) + O(k^-2) (Stirling)."""
    for eta in (-0.9, -0.5, -0.01):
        k = np.array([1e6, 1e8, 1e16, 1e30])
        asymptotic = eta * np.log(k) + eta * (eta - 1) / (2 * k)
        np.testing.assert_allclose(sc._log_gamma_ratio(k, eta), asymptotic, rtol=0, atol=1e-9)
        small = np.array([1.0, 2.0, 50.0])
        exact = [math.lgamma(x + eta) - math.lgamma(x) for x in small]
        np.testing.assert_allclose(sc._log_gamma_ratio(small, eta), exact, rtol=0, atol=1e-13)


def test_run_errors_do_not_reveal_the_number_of_trials():
    """An exception message is public: it must not carry K (or an index, a lower bound on K)."""
    method = RandomStopping.geometric(10.0)
    plan_k = method.plan(np.random.default_rng(3)).num_trials
    assert plan_k > 1

    def dropping_map(fn, args):
        return list(map(fn, args))[:-1]  # a broken executor that loses one result

    with pytest.raises(RuntimeError) as err:
        method.run(lambda i, rng: (1.0, None), rng=3, batch_size=1000, map_fn=dropping_map)
    assert not re.search(rf"\b{plan_k}\b", str(err.value))
    assert not re.search(rf"\b{plan_k - 1}\b", str(err.value))

    def bad_after_first(i, rng):
        return (1.0, None) if i < plan_k - 1 else 1.0  # last candidate returns a bare float

    with pytest.raises(TypeError, match="score, payload") as err:
        method.run(bad_after_first, rng=3)
    assert not re.search(rf"\b{plan_k - 1}\b", str(err.value))
