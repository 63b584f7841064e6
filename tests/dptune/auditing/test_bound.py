"""The one-run conversion (Steinke, Nasr & Jagielski 2023, Cor. 5.4) against the paper's printed
numbers, its closed form at delta = 0, an independent transcription of its Appendix D, jax_privacy
2.0's implementation, and its validity (exactly, for randomized response); the guessing rules and
the subset-sum decoder."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dptune.auditing import bound
from dptune.auditing.decode import decode_subset_sum
from dptune.auditing.guesses import Rule, evaluate, rules_for


@pytest.mark.parametrize(
    "m, r, v, delta, printed",
    [
        (1000, 100, 75, 1e-4, 0.673),  # arXiv:2305.08846v1, App. D (p. 46), printed rounded
        (100_000, 1510, 1439, 1e-5, 2.675),  # §7 (p. 28, Fig. 11), printed truncated
    ],
)
def test_the_papers_printed_numbers(m, r, v, delta, printed):
    eps = bound.epsilon_lower_bound(m, r, v, delta, 0.05)
    assert printed - 1e-3 < eps < printed + 1e-3
    assert f"{eps:.3f}"[:5] in (f"{printed:.3f}", f"{printed + 0.001:.3f}")


@pytest.mark.parametrize("r", [1, 5, 16, 100, 1000])
@pytest.mark.parametrize("beta", [0.05, 0.01])
def test_delta_zero_all_correct_is_randomized_response(r, beta):
    """delta = 0, r of r right: rejected iff q^r <= beta, q = e^eps / (1 + e^eps), so the bound
    is logit(beta^(1/r)) (the closed form of the ceiling)."""
    q = beta ** (1.0 / r)
    expected = max(0.0, math.log(q / (1.0 - q)))
    assert bound.ceiling(10 * r, r, 0.0, beta) == pytest.approx(expected, abs=1e-7)


def _appendix_d_p_value(m, r, v, eps, delta):
    """The paper's App. D ``p_value_DP_audit``, transcribed independently (pmf running sums)."""
    q = 1 / (1 + math.exp(-eps))
    beta = stats.binom.sf(v - 1, r, q)
    alpha, total = 0.0, 0.0
    for i in range(1, v + 1):
        total += stats.binom.pmf(v - i, r, q)
        if total > i * alpha:
            alpha = total / i
    return min(beta + alpha * delta * 2 * m, 1)


GRID = [(100, 50, 45), (1000, 100, 75), (1000, 500, 400), (64, 16, 16), (256, 64, 60), (20, 20, 20)]


@pytest.mark.parametrize("m, r, v", GRID)
@pytest.mark.parametrize("delta", [0.0, 1e-5, 1e-3])
def test_p_value_matches_appendix_d(m, r, v, delta):
    for eps in (0.0, 0.3, 1.0, 2.5, 6.0):
        assert bound.p_value(m, r, v, eps, delta) == pytest.approx(
            _appendix_d_p_value(m, r, v, eps, delta), rel=1e-9, abs=1e-15
        )


@pytest.mark.parametrize("m, r, v", GRID)
@pytest.mark.parametrize("delta", [1e-5, 1e-3])
def test_bound_matches_jax_privacy(m, r, v, delta):
    """jax_privacy 2.0 (``jax_privacy.auditing``, Google DeepMind) implements the same theorem."""
    auditing = pytest.importorskip("jax_privacy.auditing")
    theirs = auditing._epsilon_one_run(0.0, m, r, v, 0.05, delta)
    assert bound.epsilon_lower_bound(m, r, v, delta, 0.05) == pytest.approx(theirs, abs=1e-5)


@pytest.mark.parametrize("eps, r", [(0.5, 40), (1.0, 200), (2.0, 500)])
def test_the_bound_is_valid_for_randomized_response(eps, r):
    """r guesses on eps-DP randomized response: P[p-value(eps) <= beta] <= beta, computed exactly
    over v ~ Binomial(r, e^eps / (1 + e^eps)) (the worst case the theorem is tight for)."""
    beta = 0.05
    q = 1 / (1 + math.exp(-eps))
    rejected = [v for v in range(r + 1) if bound.p_value(r, r, v, eps, 0.0) <= beta]
    assert rejected  # the test can fail: some outcomes do reject
    assert stats.binom.pmf(rejected, r, q).sum() <= beta
    # and then the bound exceeds eps only on those outcomes
    v = rejected[0]
    assert bound.epsilon_lower_bound(r, r, v, 0.0, beta) >= eps
    assert bound.epsilon_lower_bound(r, r, v - 1, 0.0, beta) < eps


def test_bound_monotone_and_checked():
    bs = [bound.epsilon_lower_bound(1000, 200, v, 1e-5) for v in range(100, 201, 20)]
    assert bs == sorted(bs) and bs[0] == 0.0
    assert bound.epsilon_lower_bound(1000, 0, 0, 1e-5) == 0.0
    for bad in [(10, 11, 1), (10, 5, 6), (0, 0, 0)]:
        with pytest.raises(ValueError):
            bound.p_value(*bad, 1.0, 1e-5)
    with pytest.raises(ValueError):
        bound.p_value(10, 5, 5, 1.0, 1.0)


# --- guessing rules ------------------------------------------------------------------------------


def test_rules_rank_with_ties_broken_by_index():
    values = np.array([0.0, 3.0, 0.0, 2.0, np.nan, 0.0])
    g = Rule("s", k_in=2, k_out=2).guesses(values)
    assert g.tolist() == [-1, 1, -1, 1, 0, 0]
    assert Rule("d", sign=True).guesses(np.array([1, -1, 0])).tolist() == [1, -1, 0]


def test_rules_for_is_fixed_by_names_and_m():
    rules = rules_for(["displacement", "dispersion", "decoded"], 64)
    names = [r.name for r in rules]
    assert len(names) == len(set(names)) == 3 * 2 + 3 + 1
    assert max(r.max_guesses(64) for r in rules) == 64  # the sign rule may guess every canary


def test_evaluate_splits_confidence_over_rules():
    rng = np.random.default_rng(0)
    included = rng.integers(0, 2, 256).astype(bool)
    perfect = {"displacement": np.where(included, 1.0, 0.0) + 1e-3 * np.arange(256)}
    out = evaluate(perfect, included, 1e-5)
    assert out.rules == 6  # sizes 32, 64, 128; one- and two-sided
    assert out.significance == pytest.approx(0.05 / 6)
    assert out.correct == out.guesses >= 64
    assert out.epsilon_lower_bound == pytest.approx(
        bound.epsilon_lower_bound(256, out.guesses, out.guesses, 1e-5, 0.05 / 6)
    )
    assert out.ceiling >= out.epsilon_lower_bound
    noise = {"displacement": rng.normal(size=256)}
    assert evaluate(noise, included, 1e-5).epsilon_lower_bound < 0.5


# --- exact-score decoder -------------------------------------------------------------------------


def test_decoder_reads_an_exact_sum_and_abstains_on_a_noisy_one():
    rng = np.random.default_rng(1)
    values = rng.random(20).astype(np.float32).astype(np.float64)
    b = rng.integers(0, 2, 20).astype(bool)
    exact = math.fsum(values[b])
    assert decode_subset_sum(exact, values).tolist() == np.where(b, 1, -1).tolist()
    assert not decode_subset_sum(exact + 1e-4, values).any()
    with pytest.raises(ValueError):
        decode_subset_sum(0.0, np.ones(25))
