"""Tests of `selection.privacy`: every theorem against dp_accounting or against exact divergences.

Independent references used here:
* dp_accounting 0.6.0 (`_compute_rdp_repeat_and_select`, `RepeatAndSelectDpEvent`) for PS Thm 2 and
  Thm 6;
* exact Rényi divergences of the selection's output distribution for binary-score candidates (closed
  forms below, computed from the probability generating function of K), which every upper bound must
  dominate.
"""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant as rdp_lib

from selection import privacy as sp
from selection.checks import monotone_envelope
from selection.counts import TruncatedNegativeBinomial

ORDERS = np.asarray(rdp_lib.DEFAULT_RDP_ORDERS, dtype=np.float64)


def _inner_curve(event: dp_accounting.DpEvent, orders=ORDERS) -> np.ndarray:
    accountant = rdp_lib.RdpAccountant(list(orders))
    accountant.compose(event)
    return np.asarray(accountant._rdp, dtype=np.float64)  # the single candidate's RDP curve


INNER_EVENTS = {
    "dpsgd": dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.1)), 1000
    ),
    "gaussian": dp_event.GaussianDpEvent(2.0),
    "laplace": dp_event.LaplaceDpEvent(1.0),
}


# --------------------------------------------------------------------------------------------------
# Papernot-Steinke Thm 2 (truncated negative binomial) against dp_accounting


@pytest.mark.parametrize("inner", sorted(INNER_EVENTS))
@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 2.0])
@pytest.mark.parametrize("mean", [2.0, 10.0, 150.0])
def test_tnb_rdp_equals_dp_accounting(inner, shape, mean, monkeypatch):
    curve = _inner_curve(INNER_EVENTS[inner])
    ours = sp.RandomStoppingPrivacy.from_mean(mean, shape)
    assert ours.mean == pytest.approx(mean, rel=1e-12)
    # dp_accounting's own gamma comes from a bisection stopped at relative tolerance 1e-9, and it
    # then uses the requested mean in log(E[K]); ours solves gamma to ~1e-13, so the curves differ
    # by ~1e-10.
    expected_own_gamma = np.asarray(
        rdp_lib._compute_rdp_repeat_and_select(ORDERS, curve, mean, shape)
    )
    np.testing.assert_allclose(ours.rdp(ORDERS, curve), expected_own_gamma, rtol=1e-8, atol=1e-8)
    # Given the same gamma, the two implementations of PS Thm 2 agree to rounding.
    monkeypatch.setattr(rdp_lib, "_gamma_truncated_negative_binomial", lambda s, m: ours.gamma)
    expected = np.asarray(rdp_lib._compute_rdp_repeat_and_select(ORDERS, curve, mean, shape))
    np.testing.assert_allclose(ours.rdp(ORDERS, curve), expected, rtol=1e-12, atol=1e-12)


def test_tnb_rdp_equals_dp_accounting_end_to_end_event(monkeypatch):
    """Public accountant API: RepeatAndSelectDpEvent vs our transform of the inner curve."""
    inner = INNER_EVENTS["dpsgd"]
    mean, shape = 10.0, 0.0
    ours = sp.RandomStoppingPrivacy.from_mean(mean, shape)
    monkeypatch.setattr(rdp_lib, "_gamma_truncated_negative_binomial", lambda s, m: ours.gamma)
    accountant = rdp_lib.RdpAccountant(list(ORDERS))
    accountant.compose(dp_event.RepeatAndSelectDpEvent(inner, mean, shape))
    curve = ours.rdp(ORDERS, _inner_curve(inner))
    np.testing.assert_allclose(curve, accountant._rdp, rtol=1e-12, atol=1e-12)
    eps_dp = accountant.get_epsilon(1e-5)
    eps_ours, _ = rdp_lib.compute_epsilon(ORDERS, curve, 1e-5)
    assert eps_ours == pytest.approx(eps_dp, rel=1e-12)


@pytest.mark.parametrize("shape", [0.0, 0.5, 1.0, 2.0])
def test_pure_dp_matches_dp_accounting_large_order_limit(shape):
    """PS Cor. 3: (2 + eta) eps; dp_accounting (Laplace base, order 1e10) gives that multiple."""
    eps = 0.7
    orders = [1e10]
    accountant = rdp_lib.RdpAccountant(orders)
    event = dp_event.RepeatAndSelectDpEvent(dp_event.LaplaceDpEvent(1.0 / eps), 1000.0, shape)
    accountant.compose(event)
    multiple_dp = accountant._rdp[0] / eps
    transform = sp.RandomStoppingPrivacy.from_mean(1000.0, shape)
    assert transform.pure_dp(eps) / eps == pytest.approx(2.0 + shape, rel=1e-12)
    assert multiple_dp == pytest.approx(2.0 + shape, rel=1e-6)


@pytest.mark.parametrize("shape", [-0.9, -0.5, -0.1, 0.0, 0.5, 1.0, 3.0])
def test_tnb_rdp_tends_to_pure_dp_multiple(shape):
    """Thm 2 with a constant (eps-DP) curve tends to Cor. 3's (2 + eta) eps at large orders."""
    eps = 0.3
    orders = np.array([2.0, 1e3, 1e6, 1e9, 1e12])
    transform = sp.RandomStoppingPrivacy.from_mean(20.0, shape)
    out = transform.rdp(orders, np.full(orders.shape, eps))
    assert out[-1] == pytest.approx((2.0 + shape) * eps, rel=1e-6)
    assert np.all(np.diff(out) >= 0)  # the monotone envelope: non-decreasing in the order
    assert transform.pure_dp(eps) == pytest.approx((2.0 + shape) * eps, rel=1e-15)


def test_negative_shape_is_accepted_and_continuous_at_zero():
    """eta in (-1, 0) (which dp_accounting rejects) joins continuously with the logarithmic case."""
    curve = _inner_curve(INNER_EVENTS["dpsgd"])
    with pytest.raises(ValueError):
        rdp_lib._compute_rdp_repeat_and_select(ORDERS, curve, 10.0, -0.5)
    near = sp.RandomStoppingPrivacy.from_mean(10.0, -1e-9).rdp(ORDERS, curve)
    zero = sp.RandomStoppingPrivacy.from_mean(10.0, 0.0).rdp(ORDERS, curve)
    np.testing.assert_allclose(near, zero, rtol=1e-6)
    neg = sp.RandomStoppingPrivacy.from_mean(10.0, -0.5)
    assert neg.name == "random_stopping/truncated_negative_binomial"
    assert np.all(np.isfinite(neg.rdp(ORDERS, curve)))


def test_published_gammas_for_mean_ten():
    """Papernot & Steinke (authors' numbers, see notes): mean 10 gives gamma 0.0269183 (eta=0),
    0.0625 (eta=0.5) and 0.1 (eta=1)."""
    assert sp.RandomStoppingPrivacy.from_mean(10, 0.0).gamma == pytest.approx(0.0269183, abs=5e-8)
    assert sp.RandomStoppingPrivacy.from_mean(10, 0.5).gamma == pytest.approx(0.0625, rel=1e-12)
    assert sp.RandomStoppingPrivacy.from_mean(10, 1.0).gamma == pytest.approx(0.1, rel=1e-15)


def test_names_and_theorems():
    assert sp.RandomStoppingPrivacy.from_mean(10, 1.0).name == "random_stopping/geometric"
    assert "Thm 3.2" in sp.RandomStoppingPrivacy.from_mean(10, 1.0).theorem
    assert sp.RandomStoppingPrivacy.from_mean(10, 0.0).name == "random_stopping/logarithmic"
    assert "Thm 2" in sp.RandomStoppingPrivacy.from_mean(10, 0.0).theorem
    assert sp.PoissonStoppingPrivacy(10).name == "random_stopping/poisson"
    assert "Thm 6" in sp.PoissonStoppingPrivacy(10).theorem
    assert "Thm 3.1" in sp.ThresholdingPrivacy(0.1).theorem


# --------------------------------------------------------------------------------------------------
# Papernot-Steinke Thm 6 (Poisson) against dp_accounting


@pytest.mark.parametrize("inner", sorted(INNER_EVENTS))
@pytest.mark.parametrize("mean", [1.0, 10.0, 200.0])
def test_poisson_rdp_equals_dp_accounting(inner, mean):
    curve = _inner_curve(INNER_EVENTS[inner])
    expected = np.asarray(rdp_lib._compute_rdp_repeat_and_select(ORDERS, curve, mean, math.inf))

    def delta_for_epsilon(eps_hat: float) -> float:
        return rdp_lib.compute_delta(ORDERS, curve, eps_hat)[0]

    got = sp.PoissonStoppingPrivacy(mean).rdp(ORDERS, curve, delta_for_epsilon=delta_for_epsilon)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


def test_poisson_requires_delta_function_and_has_no_pure_dp():
    transform = sp.PoissonStoppingPrivacy(10.0)
    with pytest.raises(ValueError, match="delta_for_epsilon"):
        transform.rdp(ORDERS, np.ones_like(ORDERS))
    with pytest.raises(NotImplementedError, match="pure-DP"):
        transform.pure_dp(1.0)
    with pytest.raises(NotImplementedError):
        transform.approx_dp(1.0, 1e-6)
    with pytest.raises(ValueError, match="mean"):
        sp.PoissonStoppingPrivacy(0.5)
    with pytest.raises(ValueError, match="not a delta"):
        transform.rdp([2.0], [0.1], delta_for_epsilon=lambda e: 2.0)


# --------------------------------------------------------------------------------------------------
# Upper bounds vs exact divergences for binary-score candidates


def _renyi(p: np.ndarray, q: np.ndarray, order: float) -> float:
    """Exact Rényi divergence D_order(p||q) of two discrete distributions (order 1 = KL)."""
    p, q = np.asarray(p, float), np.asarray(q, float)
    mask = p > 0
    if order == 1.0:
        return float(np.sum(p[mask] * np.log(p[mask] / q[mask])))
    log_terms = order * np.log(p[mask]) + (1.0 - order) * np.log(q[mask])
    m = np.max(log_terms)
    return float((m + np.log(np.sum(np.exp(log_terms - m)))) / (order - 1.0))


def _sym_renyi(p, q, orders) -> np.ndarray:
    return np.array([max(_renyi(p, q, a), _renyi(q, p, a)) for a in orders])


def _max_log_ratio(p, q) -> float:
    p, q = np.asarray(p, float), np.asarray(q, float)
    return float(np.max(np.abs(np.log(p) - np.log(q))))


def _tnb_pgf(count: TruncatedNegativeBinomial, z: float) -> float:
    """E[z^K] = ((1 - (1-gamma) z)^(-eta) - 1) / (gamma^(-eta) - 1); log form at eta = 0."""
    eta, gamma = count.shape, count.gamma
    if eta == 0.0:
        return math.log1p(-(1 - gamma) * z) / math.log(gamma)
    return math.expm1(-eta * math.log1p(-(1 - gamma) * z)) / math.expm1(-eta * math.log(gamma))


# Candidate pairs (P[score = 1] on D, on D'): small success probabilities are where selection
# amplifies.
BINARY_PAIRS = [(0.01, 0.01 * math.exp(0.5)), (0.2, 0.3), (0.5, 0.5 * math.exp(-1.0)), (0.9, 0.95)]
SMALL_ORDERS = np.concatenate([np.linspace(1.5, 10.0, 18), [12.0, 16.0, 24.0, 32.0, 64.0, 256.0]])


def _binary_candidates(p: float, q: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Score distributions (P[1], P[0]) of a binary-score candidate on D and D', and its exact
    RDP curve at SMALL_ORDERS."""
    cand_p, cand_q = np.array([p, 1 - p]), np.array([q, 1 - q])
    return cand_p, cand_q, _sym_renyi(cand_p, cand_q, SMALL_ORDERS)


def _assert_rdp_dominates(transform, out_p, out_q, curve, **rdp_kwargs) -> None:
    """The transform's RDP bound is >= the exact divergence of the selection's outputs."""
    exact = _sym_renyi(out_p, out_q, SMALL_ORDERS)
    bound = transform.rdp(SMALL_ORDERS, curve, **rdp_kwargs)
    assert np.all(exact <= bound + 1e-12)


@pytest.mark.parametrize("shape", [-0.5, 0.0, 1.0, 2.0])
@pytest.mark.parametrize("pair", BINARY_PAIRS)
def test_tnb_bounds_dominate_exact_divergence(shape, pair):
    p, q = pair
    cand_p, cand_q, curve = _binary_candidates(p, q)
    transform = sp.RandomStoppingPrivacy.from_mean(8.0, shape)
    count = transform.count
    # P[best score = 0] = E[(1-p)^K]; check the closed-form PGF against the pmf first.
    k = np.arange(1, 200_000)
    assert _tnb_pgf(count, 1 - p) == pytest.approx(np.sum(count.pmf(k) * (1 - p) ** k), rel=1e-9)
    out_p = np.array([1 - _tnb_pgf(count, 1 - p), _tnb_pgf(count, 1 - p)])
    out_q = np.array([1 - _tnb_pgf(count, 1 - q), _tnb_pgf(count, 1 - q)])
    _assert_rdp_dominates(transform, out_p, out_q, curve)
    assert _max_log_ratio(out_p, out_q) <= transform.pure_dp(_max_log_ratio(cand_p, cand_q))


@pytest.mark.parametrize("pair", BINARY_PAIRS)
@pytest.mark.parametrize("mean", [1.0, 8.0])
def test_poisson_bound_dominates_exact_divergence(pair, mean):
    p, q = pair
    cand_p, cand_q, curve = _binary_candidates(p, q)

    def delta_for_epsilon(eps: float) -> float:  # exact hockey-stick divergence, both directions
        return max(
            float(np.sum(np.maximum(0, cand_p - math.exp(eps) * cand_q))),
            float(np.sum(np.maximum(0, cand_q - math.exp(eps) * cand_p))),
        )

    def output(prob: float) -> np.ndarray:  # (best = 1, best = 0, nothing released)
        return np.array(
            [-math.expm1(-mean * prob), math.exp(-mean * prob) - math.exp(-mean), math.exp(-mean)]
        )

    poisson = sp.PoissonStoppingPrivacy(mean)
    _assert_rdp_dominates(poisson, output(p), output(q), curve, delta_for_epsilon=delta_for_epsilon)


@pytest.mark.parametrize("pair", BINARY_PAIRS)
@pytest.mark.parametrize("gamma", [0.02, 0.3])
def test_thresholding_bounds_dominate_exact_divergence(pair, gamma):
    p, q = pair
    cand_p, cand_q, curve = _binary_candidates(p, q)

    def output(prob: float) -> np.ndarray:  # threshold 1: (released, nothing)
        released = prob / (prob + gamma * (1 - prob))
        return np.array([released, 1 - released])

    transform = sp.ThresholdingPrivacy(gamma)
    _assert_rdp_dominates(transform, output(p), output(q), curve)
    assert _max_log_ratio(output(p), output(q)) <= transform.pure_dp(_max_log_ratio(cand_p, cand_q))


# --------------------------------------------------------------------------------------------------
# Liu-Talwar thresholding (Thm 3.1) and its RDP form


def test_thresholding_pure_dp_and_cap():
    assert sp.ThresholdingPrivacy(0.1).pure_dp(0.5) == 1.0  # LT Thm 3.1(b), no cap: 2 eps
    capped = sp.ThresholdingPrivacy(0.1, max_trials=100)
    eps0 = 2 * math.exp(-0.1 * 100)
    assert capped.eps0 == pytest.approx(eps0, rel=1e-15)
    assert capped.pure_dp(0.5) == pytest.approx(1.0 + eps0, rel=1e-15)
    # The cap condition holds with equality for the eps0 we charge.
    assert math.log(2 / capped.eps0) / 0.1 == pytest.approx(100, rel=1e-12)
    # T must also be >= 1 + 1/(e gamma) = 4.68 for gamma = 0.1.
    with pytest.raises(ValueError, match="1/\\(e\\*gamma\\)"):
        sp.ThresholdingPrivacy(0.1, max_trials=4)
    assert sp.ThresholdingPrivacy(0.1, max_trials=5).eps0 == pytest.approx(2 * math.exp(-0.5))
    with pytest.raises(NotImplementedError, match="cap"):
        capped.rdp(ORDERS, np.ones_like(ORDERS))
    with pytest.raises(NotImplementedError):
        capped.approx_dp(0.5, 1e-6)


def test_thresholding_rdp_formula_and_limit():
    gamma = 0.05
    orders = np.array([1.5, 2.0, 3.0, 4.5, 11.0, 1e9])
    curve = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    out = sp.ThresholdingPrivacy(gamma).rdp(orders, curve)
    lg = math.log(1 / gamma)
    by_hand = {
        2.0: 0.2 + 0.0 + 2 * lg / 1.0,  # D_1 term has coefficient 0
        3.0: 0.3 + 0.5 * 0.2 + 2 * lg / 2.0,  # D_2 exactly on the grid
        4.5: 0.4 + (2.5 / 3.5) * 0.4 + 2 * lg / 3.5,  # D_3.5 bounded by the next grid order 4.5
        11.0: 0.5 + (9 / 10) * 0.5 + 2 * lg / 10,  # D_10 bounded by order 11
    }
    for a, v in by_hand.items():
        i = int(np.nonzero(orders == a)[0][0])
        assert out[i] == pytest.approx(min(v, *out[i + 1 :]) if i + 1 < len(out) else v, rel=1e-13)
    assert out[0] == out[1] or out[0] == min(out[1:])  # a < 2: from the envelope
    # Large orders with a pure eps-DP curve: 2 eps (LT Thm 3.1(b)).
    eps = 0.4
    big = np.array([1e6, 1e9, 1e12])
    assert sp.ThresholdingPrivacy(gamma).rdp(big, np.full(3, eps))[-1] == pytest.approx(
        2 * eps, rel=1e-9
    )
    # A single order a bounds D_{a-1} by itself (monotonicity): 0.1 + (3/4) 0.1 + 2 log(1/gamma)/4.
    single = sp.ThresholdingPrivacy(gamma).rdp([5.0], [0.1])[0]
    assert single == pytest.approx(0.1 + 0.75 * 0.1 + 2 * lg / 4, rel=1e-13)


# --------------------------------------------------------------------------------------------------
# hard cap, baselines, identity, not private


def test_hard_capped_random_stopping_statements():
    """Our bounds (selection.profiles.profile_pure_dp / profile_approx_dp), not LT Thm 3.4/3.5:
    the exact enumeration they are checked against is tests/selection/test_capped_enumeration.py."""
    transform = sp.HardCappedRandomStoppingPrivacy(gamma=0.1, max_trials=120)
    assert "UNVERIFIED" not in transform.theorem and "3.4" not in transform.theorem
    assert transform.params() == {"gamma": 0.1, "max_trials": 120}
    pure = transform.pure_dp(0.5)
    assert 2.0 * 0.5 < pure <= 3.0 * 0.5
    # delta1 = 0 is the pure statement; a small delta1 costs E[K] delta1 and a little epsilon.
    eps0, d0 = transform.approx_dp(0.5, 0.0)
    assert eps0 == pytest.approx(pure, rel=1e-9) and d0 == 0.0
    eps, delta = transform.approx_dp(0.5, 1e-9)
    mean = (1 - 0.9**120) / 0.1
    assert delta == pytest.approx(mean * 1e-9, rel=1e-12)
    assert pure <= eps <= pure * 1.01
    # A cap of 2: never worse than composition of 2 runs (1.0, 2e-6); E[K] = 1.9 here.
    assert sp.HardCappedRandomStoppingPrivacy(0.1, 2).pure_dp(0.5) <= 2 * 0.5
    eps2, delta2 = sp.HardCappedRandomStoppingPrivacy(0.1, 2).approx_dp(0.5, 1e-6)
    assert eps2 <= 1.0 and delta2 == pytest.approx(1.9e-6, rel=1e-12)
    # A cap of 1 is one run: composition gives exactly (eps, delta).
    assert sp.HardCappedRandomStoppingPrivacy(0.1, 1).approx_dp(0.5, 1e-6) == pytest.approx(
        (0.5, 1e-6)
    )
    with pytest.raises(NotImplementedError):
        transform.rdp(ORDERS, np.ones_like(ORDERS))
    with pytest.raises(ValueError, match="max_trials"):
        sp.HardCappedRandomStoppingPrivacy(0.1, 0)


def test_best_of_k_is_composition():
    transform = sp.BestOfKPrivacy(7)
    assert transform.pure_dp(0.3) == pytest.approx(2.1)
    assert transform.approx_dp(0.3, 1e-6) == pytest.approx((2.1, 7e-6))
    curve = _inner_curve(INNER_EVENTS["dpsgd"])
    # RDP composition, computed independently by dp_accounting composing the event k times.
    accountant = rdp_lib.RdpAccountant(list(ORDERS))
    accountant.compose(INNER_EVENTS["dpsgd"], 7)
    np.testing.assert_allclose(transform.rdp(ORDERS, curve), accountant._rdp, rtol=1e-12)
    for bad in (0, 2.5, -1):
        with pytest.raises(ValueError, match="k must be"):
            sp.BestOfKPrivacy(bad)


def test_single_run_is_identity():
    transform = sp.SingleRunPrivacy()
    curve = _inner_curve(INNER_EVENTS["gaussian"])
    np.testing.assert_array_equal(transform.rdp(ORDERS, curve), curve)
    assert transform.pure_dp(0.9) == 0.9
    assert transform.approx_dp(0.9, 1e-5) == (0.9, 1e-5)


def test_not_private_never_yields_a_finite_number():
    transform = sp.NotPrivate()
    assert transform.is_private is False
    assert transform.pure_dp(0.1) == math.inf
    assert np.all(np.isinf(transform.rdp(ORDERS, np.ones_like(ORDERS))))
    assert transform.approx_dp(0.1, 1e-6) == (math.inf, 1.0)
    with pytest.raises(ValueError):
        sp.NotPrivate(is_private=True)
    for t in (
        sp.RandomStoppingPrivacy.from_mean(5, 1),
        sp.ThresholdingPrivacy(0.2),
        sp.SingleRunPrivacy(),
    ):
        assert t.is_private is True


ALL_TRANSFORMS = [
    sp.RandomStoppingPrivacy.from_mean(10, 0.0),
    sp.RandomStoppingPrivacy.from_mean(10, -0.5),
    sp.PoissonStoppingPrivacy(10),
    sp.ThresholdingPrivacy(0.1),
    sp.ThresholdingPrivacy(0.1, max_trials=50),
    sp.HardCappedRandomStoppingPrivacy(0.1, 50),
    sp.BestOfKPrivacy(3),
    sp.SingleRunPrivacy(),
    sp.NotPrivate(),
]


@pytest.mark.parametrize("transform", ALL_TRANSFORMS, ids=lambda t: t.name)
def test_descriptions_are_json_safe_and_frozen(transform):
    text = json.dumps(transform.describe(), allow_nan=False)
    assert json.loads(text)["name"] == transform.name
    assert transform.theorem
    with pytest.raises(AttributeError):
        transform.name = "other"  # properties and frozen fields cannot be overwritten
    if transform.params():
        field = next(iter(transform.__dataclass_fields__))
        with pytest.raises(AttributeError):
            setattr(transform, field, 1)


def test_invalid_inputs_say_what_is_wrong():
    t = sp.RandomStoppingPrivacy.from_mean(10, 1.0)
    with pytest.raises(ValueError, match="epsilon"):
        t.pure_dp(-1.0)
    with pytest.raises(ValueError, match="same length"):
        t.rdp([2.0, 3.0], [0.1])
    with pytest.raises(ValueError, match="order"):
        t.rdp([0.5], [0.1])
    with pytest.raises(ValueError, match="RDP value"):
        t.rdp([2.0], [-0.1])
    with pytest.raises(ValueError, match="shape"):
        sp.RandomStoppingPrivacy.from_mean(10, -1.0)
    with pytest.raises(ValueError, match="mean"):
        sp.RandomStoppingPrivacy.from_mean(0.5, 1.0)
    with pytest.raises(ValueError, match="gamma"):
        sp.ThresholdingPrivacy(0.0)
    with pytest.raises(ValueError, match="delta"):
        sp.BestOfKPrivacy(2).approx_dp(0.1, 1.5)


def test_monotone_envelope_handles_unsorted_orders_and_ties():
    """The vectorised envelope equals the definition min{v_j : order_j >= order_i}."""
    rng = np.random.default_rng(0)
    for _ in range(500):
        n = int(rng.integers(1, 12))
        orders = rng.choice([1.0, 1.5, 2.0, 3.0, 5.0, 7.0], n)
        values = rng.random(n)
        values[rng.random(n) < 0.2] = np.inf
        expected = [min(values[j] for j in range(n) if orders[i] <= orders[j]) for i in range(n)]
        np.testing.assert_array_equal(monotone_envelope(orders, values), expected)
