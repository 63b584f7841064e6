"""Calibration: the noise multiplier that meets a *total* budget, and what simpler plans need."""

from __future__ import annotations

import pytest

from dptune import accounting
from selection import privacy as sp

Q, STEPS, DELTA = 256 / 60000, 7032, 1e-5


def test_rdp_calibration_is_tight_and_within_budget():
    tr = sp.RandomStoppingPrivacy.from_mean(10.0, 0.0)
    cal = accounting.calibrate_noise(Q, STEPS, tr, 3.0, DELTA, "rdp", rtol=1e-3)
    sigma = cal.noise_multiplier
    assert cal.statement.total_epsilon <= 3.0
    assert cal.statement.accountant == "rdp"
    assert cal.statement.candidates[0]["noise_multiplier"] == sigma
    # tight: 0.3% less noise breaks the budget (eps falls as sigma grows)
    less = accounting.DpSgdCandidate(Q, STEPS, sigma * (1 - 3e-3))
    assert accounting.total_privacy(less, tr, DELTA, "rdp").total_epsilon > 3.0
    # independent check: dp_accounting's own RDP repeat-and-select at that sigma
    ref = accounting.repeat_and_select_epsilon(
        accounting.DpSgdCandidate(Q, STEPS, sigma), 10.0, 0.0, DELTA
    )
    assert ref == pytest.approx(cal.statement.total_epsilon, rel=1e-9)
    # tuning needs more noise than one untuned run, less than naive best-of-10
    assert cal.naive_trials == 10
    assert cal.untuned_noise_multiplier < sigma < cal.naive_noise_multiplier
    single = accounting.DpSgdCandidate(Q, STEPS, cal.untuned_noise_multiplier)
    assert accounting.total_privacy(single, None, DELTA, "rdp").total_epsilon <= 3.0


def test_pld_calibration_poisson_meets_budget_with_less_noise_than_rdp():
    tr = sp.PoissonStoppingPrivacy(10.0)
    cal = accounting.calibrate_noise(Q, 2000, tr, 2.0, DELTA, "auto", compare=False)
    rdp = accounting.calibrate_noise(Q, 2000, tr, 2.0, DELTA, "rdp", compare=False)
    assert cal.statement.total_epsilon <= 2.0
    assert cal.statement.total_epsilon >= 2.0 * (1 - 5e-3)
    assert cal.statement.accountant == "pld"
    assert cal.noise_multiplier < rdp.noise_multiplier
    assert cal.untuned_noise_multiplier is None  # compare=False


def test_calibrate_generic_candidates_worst_case_over_a_space():
    tr = sp.RandomStoppingPrivacy.from_mean(5.0, 1.0)

    def space(sigma):
        return [
            accounting.DpSgdCandidate(0.01, 500, sigma),
            accounting.DpSgdCandidate(0.02, 200, sigma),
        ]

    cal = accounting.calibrate(space, tr, 2.0, DELTA, "rdp", compare=False)
    assert cal.statement.total_epsilon <= 2.0
    for c in space(cal.noise_multiplier):
        assert accounting.total_privacy(c, tr, DELTA, "rdp").total_epsilon <= 2.0
    one = accounting.calibrate(lambda s: space(s)[0], tr, 2.0, DELTA, "rdp", compare=False)
    assert one.noise_multiplier < cal.noise_multiplier


def test_fixed_score_noise_that_alone_exceeds_the_target_is_unreachable():
    tr = sp.RandomStoppingPrivacy.from_mean(10.0, 0.0)
    with pytest.raises(ValueError, match="unreachable"):
        accounting.calibrate_noise(0.01, 100, tr, 0.5, DELTA, "rdp", score_noise_std=1.0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(target_epsilon=0.0), "target_epsilon=0.0"),
        (dict(target_epsilon=float("inf")), "target_epsilon=inf"),
        (dict(delta=2.0), "delta=2.0"),
        (dict(sampling_rate=0.0), "sampling_rate=0.0"),
        (dict(steps=0), "steps=0"),
        (dict(accountant="gdp"), "accountant='gdp'"),
        (dict(transform=sp.NotPrivate()), "not private"),
    ],
)
def test_invalid_calibration_inputs(kwargs, match):
    args = dict(sampling_rate=0.01, steps=100, transform=None, target_epsilon=1.0, delta=DELTA)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        accounting.calibrate_noise(**args)
