"""Candidates: DP-SGD events, the private score in parallel, heterogeneous sets, user DpEvents."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dptune import accounting
from selection import privacy as sp

DELTA = 1e-5


def rdp_eps(event) -> float:
    acc = rdp_privacy_accountant.RdpAccountant()
    acc.compose(event)
    return acc.get_epsilon(DELTA)


def pld_eps(event) -> float:
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(event)
    return acc.get_epsilon(DELTA)


def test_dpsgd_event_is_self_composed_poisson_gaussian():
    c = accounting.DpSgdCandidate(0.01, 500, 1.3)
    assert c.branches() == (
        dp_event.SelfComposedDpEvent(
            dp_event.PoissonSampledDpEvent(0.01, dp_event.GaussianDpEvent(1.3)), 500
        ),
    )
    # trainers.spec.dpsgd_privacy(...) returns an object with these three attributes
    p = SimpleNamespace(sampling_rate=0.01, steps=500, noise_multiplier=1.3)
    assert accounting.DpSgdCandidate.from_dpsgd_privacy(p) == c
    assert accounting.as_candidates(p) == (c,)


@pytest.mark.parametrize("score_std, score_dominates", [(2.0, True), (200.0, False)])
def test_private_score_composes_in_parallel(score_std, score_dominates):
    """Training and the noisy validation count see disjoint splits: the worse of the two counts."""
    c = accounting.DpSgdCandidate(0.01, 500, 1.3, score_noise_std=score_std)
    train, score = c.training_event(), dp_event.GaussianDpEvent(score_std)
    assert c.branches() == (train, score)
    # RDP: the same dp_accounting arithmetic, so equal to rounding. PLD: ours builds one run's PLD
    # by self-composition while PLDAccountant composes event by event; FFT convolutions in another
    # order agree to ~1e-10, not to the last bit (5e-11 seen on a fresh venv).
    for mine, ref, rel in [
        (accounting.rdp_epsilon(c, DELTA)[0], max(rdp_eps(train), rdp_eps(score)), 1e-9),
        (accounting.pld_epsilon(c, DELTA), max(pld_eps(train), pld_eps(score)), 1e-6),
    ]:
        assert mine == pytest.approx(ref, rel=rel)
    sequential = rdp_eps(dp_event.ComposedDpEvent([train, score]))
    assert accounting.rdp_epsilon(c, DELTA)[0] < sequential
    assert (pld_eps(score) > pld_eps(train)) == score_dominates


def test_private_score_enters_the_selection_total():
    tr = sp.RandomStoppingPrivacy.from_mean(10.0, 0.0)
    base = accounting.DpSgdCandidate(0.01, 500, 1.3)
    noisy = accounting.DpSgdCandidate(0.01, 500, 1.3, score_noise_std=2.0)
    assert (
        accounting.total_privacy(noisy, tr, DELTA).total_epsilon
        > accounting.total_privacy(base, tr, DELTA).total_epsilon
    )


def test_heterogeneous_candidates_take_the_pointwise_max():
    a = accounting.DpSgdCandidate(0.02, 200, 1.0)  # few steps, large batches
    b = accounting.DpSgdCandidate(0.005, 2000, 1.0)  # many steps, small batches
    assert accounting.as_candidates([a, b, a, b]) == (a, b)  # a grid repeats settings
    curve = accounting.rdp_curve([a, b])
    np.testing.assert_array_equal(
        curve, np.maximum(accounting.rdp_curve(a), accounting.rdp_curve(b))
    )
    assert accounting.pld_epsilon([a, b], DELTA) == max(
        accounting.pld_epsilon(a, DELTA), accounting.pld_epsilon(b, DELTA)
    )
    # neither dominates the other: the max curve is strictly above each somewhere
    assert np.any(curve > accounting.rdp_curve(a)) and np.any(curve > accounting.rdp_curve(b))
    tr = sp.RandomStoppingPrivacy.from_mean(10.0, 1.0)
    both = accounting.total_privacy([a, b], tr, DELTA).total_epsilon
    assert both >= max(
        accounting.total_privacy(a, tr, DELTA).total_epsilon,
        accounting.total_privacy(b, tr, DELTA).total_epsilon,
    )


def test_dominated_candidates_are_dropped_without_changing_the_bound():
    grid = [
        accounting.DpSgdCandidate(q, steps, sigma)
        for q in (0.005, 0.01)
        for steps in (100, 300)
        for sigma in (1.0, 2.0)
    ]
    front = accounting.pareto_candidates(grid)
    assert front == (accounting.DpSgdCandidate(0.01, 300, 1.0),)
    every_curve = np.stack([accounting.rdp_curve(c) for c in grid])
    np.testing.assert_array_equal(accounting.rdp_curve(grid), every_curve.max(axis=0))
    worst = max(accounting.rdp_epsilon(c, DELTA)[0] for c in grid)
    assert accounting.rdp_epsilon(grid, DELTA)[0] == worst


def test_naive_composition_of_heterogeneous_runs_uses_a_dominating_run():
    a = accounting.DpSgdCandidate(0.02, 200, 1.0, score_noise_std=50.0)
    b = accounting.DpSgdCandidate(0.005, 300, 1.5)
    dom = accounting.dominating_dpsgd_candidate([a, b])
    assert dom == accounting.DpSgdCandidate(0.02, 300, 1.0, score_noise_std=50.0)
    eps = accounting.composed_pld_epsilon([a, b], 3, DELTA)
    assert eps == pytest.approx(pld_eps(dp_event.SelfComposedDpEvent(dom.training_event(), 3)))
    assert eps >= accounting.composed_pld_epsilon(a, 3, DELTA)
    assert eps >= accounting.composed_pld_epsilon(b, 3, DELTA)


def test_user_dp_event_candidate():
    event = dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(5.0), 4)
    geometric = sp.RandomStoppingPrivacy.from_mean(5.0, 1.0)
    st = accounting.total_privacy(event, geometric, DELTA, "rdp")
    assert st.candidates[0]["kind"] == "event"
    ref = accounting.repeat_and_select_epsilon(event, 5.0, 1.0, DELTA)  # dp_accounting's route
    assert st.total_epsilon == pytest.approx(ref, rel=1e-9)
    assert accounting.as_candidates(event) == (accounting.EventCandidate(event),)
    # heterogeneous user events: PLD composition has no worst case, RDP still applies
    other = dp_event.LaplaceDpEvent(3.0)
    with pytest.raises(ValueError, match="dominates"):
        accounting.composed_pld_epsilon([event, other], 2, DELTA)
    st2 = accounting.total_privacy([event, other], sp.BestOfKPrivacy(2), DELTA)
    assert st2.accountant in ("rdp", "pure") and math.isfinite(st2.total_epsilon)


def test_pure_epsilon_of_events():
    lap = dp_event.LaplaceDpEvent(0.5)
    assert accounting.pure_epsilon(lap) == 2.0
    assert accounting.pure_epsilon(dp_event.SelfComposedDpEvent(lap, 3)) == 6.0
    assert accounting.pure_epsilon(dp_event.ComposedDpEvent([lap, lap])) == 4.0
    assert accounting.pure_epsilon(dp_event.GaussianDpEvent(1.0)) is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sampling_rate=0.0, steps=10, noise_multiplier=1.0), "sampling_rate=0.0"),
        (dict(sampling_rate=1.5, steps=10, noise_multiplier=1.0), "sampling_rate=1.5"),
        (dict(sampling_rate=0.1, steps=0, noise_multiplier=1.0), "steps=0"),
        (dict(sampling_rate=0.1, steps=2.5, noise_multiplier=1.0), "steps=2.5"),
        (dict(sampling_rate=0.1, steps=10, noise_multiplier=0.0), "noise_multiplier=0.0"),
        (dict(sampling_rate=0.1, steps=10, noise_multiplier=-1.0), "noise_multiplier=-1.0"),
        (
            dict(sampling_rate=0.1, steps=10, noise_multiplier=1.0, score_noise_std=0.0),
            "score_noise_std=0.0",
        ),
    ],
)
def test_invalid_candidates_name_the_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        accounting.DpSgdCandidate(**kwargs)


def test_empty_or_unknown_candidates_are_refused():
    with pytest.raises(ValueError, match="empty"):
        accounting.as_candidates([])
    with pytest.raises(ValueError, match="not a DpSgdCandidate"):
        accounting.as_candidates([object()])
