"""Accounting of subsampled tuning (dptune.accounting.subsampled), against independent numbers:
exact enumeration of a Poisson-subsampled four-point mechanism for the amplification, and
dp_accounting's PLDs composed here (not through dptune) for the total."""

import math

import numpy as np
import pytest
from dp_accounting.pld import common, privacy_loss_distribution

from dptune import accounting
from dptune.accounting import subsampled as ss
from selection import privacy as sp


def _hockey(p: np.ndarray, q: np.ndarray, eps: float) -> float:
    return float(np.maximum(p - math.exp(eps) * q, 0.0).sum())


def _kov_pair(eps: float, delta: float) -> tuple[np.ndarray, np.ndarray]:
    """The four-point pair that every (eps, delta)-DP mechanism is a post-processing of."""
    a, b = math.exp(eps) / (1 + math.exp(eps)), 1 / (1 + math.exp(eps))
    p1 = np.array([delta, (1 - delta) * a, (1 - delta) * b, 0.0])
    p0 = np.array([0.0, (1 - delta) * b, (1 - delta) * a, delta])
    return p1, p0


@pytest.mark.parametrize("eps,delta,f", [(1.0, 0.0, 0.2), (2.0, 1e-3, 0.1), (0.3, 1e-2, 0.5)])
def test_amplification_matches_exact_enumeration(eps, delta, f):
    # x in the subsample (prob f): the mechanism sees it (p1); else not (p0). Both directions.
    p1, p0 = _kov_pair(eps, delta)
    with_x, without_x = f * p1 + (1 - f) * p0, p0
    eps_a, delta_a = ss.amplify(eps, delta, f)
    exact = max(_hockey(with_x, without_x, eps_a), _hockey(without_x, with_x, eps_a))
    assert exact <= delta_a * (1 + 1e-12) + 1e-15
    assert exact == pytest.approx(delta_a, rel=1e-9, abs=1e-15)  # tight for this pair
    # A smaller epsilon at the same delta fails: the bound is not loose.
    assert _hockey(with_x, without_x, eps_a * 0.98) > delta_a


def test_subset_epsilon_inverts_amplification():
    for f in (0.05, 0.3, 0.9):
        for e in (0.1, 1.0, 3.0):
            assert ss.amplify(ss.subset_epsilon(e, f), 0.0, f)[0] == pytest.approx(e, rel=1e-12)
    with pytest.raises(ValueError, match="fraction"):
        ss.amplify(1.0, 0.0, 1.0)


def _dpsgd_pld(q, steps, sigma):
    return privacy_loss_distribution.from_gaussian_mechanism(
        sigma, sampling_prob=q, value_discretization_interval=1e-4
    ).self_compose(steps)


@pytest.mark.parametrize("score_std", [None, 10.0])
def test_total_equals_independent_dp_accounting_composition(score_std):
    f, delta = 0.2, 1e-5
    n, batch, epochs = 20000, 400, 4
    steps = epochs * math.ceil(n / batch)
    sub = accounting.DpSgdCandidate(batch / n, steps, 3.0, score_std)  # candidates on the subset
    transform = sp.RandomStoppingPrivacy.from_mean(3.0, 0.0)
    tuning = accounting.total_privacy(sub, transform, ss.TUNING_DELTA_SHARE * delta / f)
    final = accounting.DpSgdCandidate(batch / n, steps, 1.2, score_std)
    st = ss.subsampled_statement([final], tuning, f, delta)

    # Independently: amplification by hand, the four-point PLD, the DP-SGD PLD, composed here.
    eps_a = math.log(1 + f * (math.exp(tuning.total_epsilon) - 1))
    delta_a = f * tuning.delta
    four = privacy_loss_distribution.from_privacy_parameters(
        common.DifferentialPrivacyParameters(eps_a, delta_a), value_discretization_interval=1e-4
    )
    branches = [_dpsgd_pld(batch / n, steps, 1.2)]
    if score_std is not None:  # the noisy count: a Gaussian of std score_std, sensitivity 1
        branches.append(
            privacy_loss_distribution.from_gaussian_mechanism(
                score_std, value_discretization_interval=1e-4
            )
        )
    expected = max(b.compose(four).get_epsilon_for_delta(delta) for b in branches)
    assert st.total_epsilon == pytest.approx(expected, rel=1e-9)
    assert st.selection["tuning_epsilon"] == pytest.approx(eps_a)
    # Sanity: more than the final run alone, less than basic composition.
    alone = branches[0].get_epsilon_for_delta(delta)
    assert alone < st.total_epsilon < eps_a + branches[0].get_epsilon_for_delta(delta - delta_a)
    assert st.single_run_epsilon == pytest.approx(alone, rel=1e-6)
    assert st.accountant == "pld" and "Balle, Barthe & Gaboardi 2018, Thm 8" in st.theorem


def test_final_run_needs_one_dominating_pld():
    cands = [accounting.DpSgdCandidate(0.01, 100, 1.0), accounting.DpSgdCandidate(0.02, 50, 1.2)]
    dom = ss.final_candidate(cands)
    assert (dom.sampling_rate, dom.steps, dom.noise_multiplier) == (0.02, 100, 1.0)
    # The dominating run costs at least as much as each setting, composed with the same tuning.
    one = ss.composed_epsilon(cands[:1], 0.3, 1e-7, 1e-5)
    assert ss.composed_epsilon(cands, 0.3, 1e-7, 1e-5) >= one


def test_calibrate_final_is_smallest_sigma_within_tolerance():
    def cands(sigma):
        return accounting.DpSgdCandidate(0.02, 500, sigma)

    sigma = ss.calibrate_final(cands, 0.3, 1e-6, 2.0, 1e-5)
    assert ss.composed_epsilon(cands(sigma), 0.3, 1e-6, 1e-5) <= 2.0
    assert ss.composed_epsilon(cands(sigma * 0.99), 0.3, 1e-6, 1e-5) > 2.0


def test_budget_split():
    t = ss.SubsampledTuning.from_budget(0.25, 0.4, 1e-5)
    assert t.tuning_delta == pytest.approx(ss.TUNING_DELTA_SHARE * 1e-5)
    assert t.subset_delta == pytest.approx(t.tuning_delta / 0.25)
    assert ss.amplify(t.subset_epsilon, t.subset_delta, 0.25) == pytest.approx(
        (0.4, t.tuning_delta)
    )
