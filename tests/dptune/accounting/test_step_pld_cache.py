"""Runs of different lengths (a candidate after each epoch: the released curve) share one cached
PLD of a DP-SGD step, and each still equals dp_accounting's PLDAccountant."""

import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant

from dptune.accounting import epsilon
from dptune.accounting.events import DpSgdCandidate


def test_runs_of_different_lengths_share_one_step_pld():
    epsilon.clear_caches()
    q, sigma, steps = 0.05, 1.2, (10, 20, 30)
    eps = [epsilon.pld_epsilon(DpSgdCandidate(q, s, sigma), 1e-5) for s in steps]
    assert epsilon._step_pld.cache_info().misses == 1  # built once, composed three times
    assert eps == sorted(eps) and eps[0] < eps[-1]
    for s, e in zip(steps, eps, strict=True):
        acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
        step = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
        acc.compose(dp_event.SelfComposedDpEvent(step, s))
        assert e == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)
