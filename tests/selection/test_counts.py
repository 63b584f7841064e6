"""Tests of `selection.counts`: exact pmfs (against scipy.stats), means, gamma solving, and
chi-square goodness of fit of every sampler (>= 1e5 draws, fixed seeds)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from selection import counts as sc

N_DRAWS = 200_000

# (shape, mean): eta near -1 has heavy tails (gamma ~ 1e-4 at mean 10), so keep its means small.
TNB_CASES = [
    (1.0, 1.5),
    (1.0, 10.0),
    (1.0, 100.0),
    (0.0, 2.0),
    (0.0, 10.0),
    (0.0, 100.0),
    (0.5, 10.0),
    (2.0, 3.0),
    (2.0, 30.0),
    (-0.3, 3.0),
    (-0.3, 10.0),
    (-0.7, 3.0),
]
POISSON_MEANS = [0.5, 3.0, 40.0]


def _support_moments(dist: sc.CountDistribution) -> tuple[np.ndarray, np.ndarray]:
    """Support values k and pmf(k) out to where the remaining tail is negligible (< 1e-14)."""
    if isinstance(dist, sc.Poisson):
        kmax = int(dist.mean + 40 * math.sqrt(dist.mean) + 50)
    else:
        kmax = int(40.0 / dist.gamma) + 50
    k = np.arange(dist.min_count, kmax)
    return k, dist.pmf(k)


def _chi_square_pvalue(draws: np.ndarray, k: np.ndarray, pmf: np.ndarray) -> float:
    """Pearson chi-square on bins with expected count >= 5; the rest pooled into tail bins."""
    n = draws.size
    expected = n * pmf
    big = expected >= 5
    cut = int(np.nonzero(big)[0].max()) + 1  # bins k[0..cut-1] individually, then the upper tail
    lo_small = ~big[:cut]
    counts = np.bincount(draws - k[0], minlength=k.size)[: k.size]
    obs = list(counts[:cut][~lo_small])
    exp = list(expected[:cut][~lo_small])
    # pooled: small bins below the cut, and everything >= cut (including beyond kmax)
    obs.append(counts[:cut][lo_small].sum() + (n - counts[:cut].sum()))
    exp.append(expected[:cut][lo_small].sum() + (n - expected[:cut].sum()))
    obs, exp = np.array(obs, float), np.array(exp, float)
    if exp[-1] < 5:  # fold a tiny tail bin into the last regular bin
        obs[-2] += obs[-1]
        exp[-2] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


@pytest.mark.parametrize("shape,mean", TNB_CASES)
def test_tnb_pmf_mean_and_sampler(shape, mean):
    dist = sc.truncated_negative_binomial(mean, shape)
    assert dist.mean == pytest.approx(mean, rel=1e-12)  # gamma solved from the mean
    k, pmf = _support_moments(dist)
    assert pmf.sum() == pytest.approx(1.0, abs=1e-10)
    assert np.sum(k * pmf) == pytest.approx(mean, rel=1e-9)  # closed-form mean == pmf mean
    var = float(np.sum(k**2 * pmf) - mean**2)
    draws = dist.sample(np.random.default_rng(1234), N_DRAWS)
    assert draws.dtype == np.int64 and draws.min() >= 1
    # sample mean within 5 standard errors (fixed seed: deterministic)
    assert abs(draws.mean() - mean) < 5 * math.sqrt(var / N_DRAWS)
    assert _chi_square_pvalue(draws, k, pmf) > 1e-3


@pytest.mark.parametrize("mean", POISSON_MEANS)
def test_poisson_pmf_mean_and_sampler(mean):
    dist = sc.poisson(mean)
    k, pmf = _support_moments(dist)
    np.testing.assert_allclose(pmf, stats.poisson(mean).pmf(k), rtol=1e-10, atol=1e-300)
    draws = dist.sample(np.random.default_rng(99), N_DRAWS)
    assert draws.min() >= 0 and (mean > 2 or (draws == 0).any())  # K = 0 happens
    assert abs(draws.mean() - mean) < 5 * math.sqrt(mean / N_DRAWS)
    assert _chi_square_pvalue(draws, k, pmf) > 1e-3


def test_pmfs_match_scipy_stats():
    """Independent pmfs: geometric, log-series, and the zero-truncated negative binomial."""
    k = np.arange(1, 400)
    geo = sc.geometric(7.0)
    np.testing.assert_allclose(geo.pmf(k), stats.geom(1 / 7.0).pmf(k), rtol=1e-11)
    log = sc.logarithmic(7.0)
    np.testing.assert_allclose(log.pmf(k), stats.logser(1 - log.gamma).pmf(k), rtol=1e-11)
    for eta in (0.5, 2.0, 3.7):
        tnb = sc.truncated_negative_binomial(7.0, eta)
        nb = stats.nbinom(eta, tnb.gamma)
        np.testing.assert_allclose(tnb.pmf(k), nb.pmf(k) / nb.sf(0), rtol=1e-10)


def test_negative_shape_pmf_is_the_definition():
    """eta in (-1, 0): direct product formula of PS Def. 1 for small k."""
    dist = sc.TruncatedNegativeBinomial(-0.4, 0.2)
    for k in range(1, 8):
        prod = np.prod([(ell - 0.4) / (ell + 1) for ell in range(k)])
        direct = (1 - 0.2) ** k / (0.2**0.4 - 1) * prod
        assert dist.pmf(k) == pytest.approx(direct, rel=1e-12)


def test_gamma_solving_is_precise_and_consistent():
    for shape in (-0.9, -0.5, 0.0, 0.25, 1.0, 5.0):
        for mean in (1.0001, 1.7, 10.0, 1e4):
            dist = sc.truncated_negative_binomial(mean, shape)
            assert dist.mean == pytest.approx(mean, rel=1e-12), (shape, mean)
    assert sc.geometric(1.0).gamma == 1.0
    assert sc.logarithmic(1.0).sample(np.random.default_rng(0), 5).tolist() == [1] * 5
    # mean is decreasing in gamma
    means = [sc.TruncatedNegativeBinomial(0.5, g).mean for g in (0.01, 0.1, 0.5, 0.9)]
    assert means == sorted(means, reverse=True)


def test_names_shapes_and_params():
    assert sc.geometric(3).name == "geometric" and sc.geometric(3).shape == 1.0
    assert sc.logarithmic(3).name == "logarithmic" and sc.logarithmic(3).shape == 0.0
    assert sc.truncated_negative_binomial(3, 0.5).name == "truncated_negative_binomial"
    assert sc.poisson(3).shape == math.inf and sc.poisson(3).min_count == 0
    assert sc.geometric(4).params() == {
        "name": "geometric",
        "shape": 1.0,
        "gamma": 0.25,
        "mean": 4.0,
    }
    assert isinstance(sc.geometric(4).sample(np.random.default_rng(0)), int)


def test_invalid_parameters_are_rejected_with_the_value():
    with pytest.raises(ValueError, match="shape"):
        sc.TruncatedNegativeBinomial(-1.0, 0.5)
    with pytest.raises(ValueError, match="gamma"):
        sc.TruncatedNegativeBinomial(1.0, 0.0)
    with pytest.raises(ValueError, match="mean"):
        sc.geometric(0.9)
    with pytest.raises(ValueError, match="mean"):
        sc.poisson(-1.0)
    with pytest.raises(TypeError, match="Generator"):
        sc.geometric(3).sample(np.random.RandomState(0))


def test_chi_square_has_teeth():
    """The goodness-of-fit check rejects a sampler whose mean is 3% off."""
    wrong = sc.geometric(10.3).sample(np.random.default_rng(5), N_DRAWS)
    k, pmf = _support_moments(sc.geometric(10.0))
    assert _chi_square_pvalue(wrong, k, pmf) < 1e-6
    wrong_shape = sc.truncated_negative_binomial(10.0, 0.7).sample(
        np.random.default_rng(5), N_DRAWS
    )
    k, pmf = _support_moments(sc.truncated_negative_binomial(10.0, 0.5))
    assert _chi_square_pvalue(wrong_shape, k, pmf) < 1e-6
