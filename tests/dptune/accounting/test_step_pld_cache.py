"""Runs of different lengths (a candidate after each epoch: the released curve) share one cached
PLD and one cached RDP curve of a DP-SGD step, and each still equals dp_accounting's accountants;
the vectorised privacy profile equals dp_accounting's loop bitwise."""

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.pld import pld_privacy_accountant, privacy_loss_distribution
from dp_accounting.rdp import rdp_privacy_accountant

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


def test_runs_of_different_lengths_share_one_step_rdp_and_equal_rdp_accountant_bitwise():
    epsilon.clear_caches()
    orders = tuple(float(a) for a in epsilon.DEFAULT_ORDERS)
    q, sigma = 0.05, 1.2
    step = dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(sigma))
    for s in (1, 10, 280, 7032):
        got = epsilon._event_rdp(dp_event.SelfComposedDpEvent(step, s), orders)
        acc = rdp_privacy_accountant.RdpAccountant(list(orders))
        acc.compose(dp_event.SelfComposedDpEvent(step, s))
        np.testing.assert_array_equal(got, np.asarray(acc.rdp, dtype=np.float64))
    assert epsilon._step_rdp.cache_info().misses == 1


def test_pld_epsilon_is_computed_once_per_event_and_delta():
    epsilon.clear_caches()
    cand = DpSgdCandidate(0.05, 30, 1.2, score_noise_std=5.0)
    first = epsilon.pld_epsilon(cand, 1e-5)
    assert epsilon.pld_epsilon(cand, 1e-5) == first
    info = epsilon._event_pld_epsilon.cache_info()
    assert (info.misses, info.hits) == (2, 2)  # two branches (training, score), each once
    # The uncached computation, bitwise, and dp_accounting's accountant.
    assert first == max(
        float(epsilon._event_pld(b, 1e-4).get_epsilon_for_delta(1e-5)) for b in cand.branches()
    )
    acc = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(cand.training_event())  # the training branch dominates the score's
    assert first == pytest.approx(acc.get_epsilon(1e-5), rel=1e-9)


@pytest.mark.parametrize(
    "pld",
    [
        privacy_loss_distribution.from_gaussian_mechanism(1.2, sampling_prob=0.05).self_compose(30),
        privacy_loss_distribution.from_gaussian_mechanism(0.8, sampling_prob=0.3),
        privacy_loss_distribution.from_gaussian_mechanism(5.0),  # symmetric
        privacy_loss_distribution.from_laplace_mechanism(1.0, value_discretization_interval=1e-3),
        privacy_loss_distribution.identity(),  # a sparse PMF: dp_accounting's own code
    ],
)
def test_profile_equals_dp_accountings_get_delta_for_epsilon_bitwise(pld):
    eps_hi = pld.get_epsilon_for_delta(1e-9)
    grid = np.concatenate(
        [[-np.inf, -1.0], np.linspace(0.0, 1.5 * max(eps_hi, 1e-3), 600), [1e3, np.inf]]
    )
    with np.errstate(over="ignore", invalid="ignore"):  # both give NaN at 1e3: inf * 0
        got = epsilon._profile_of(pld, grid)
        want = np.asarray(pld.get_delta_for_epsilon(grid))
    np.testing.assert_array_equal(got, want)  # NaN where dp_accounting has NaN
    assert np.all(np.diff(got[:-2]) <= 0)  # a privacy profile falls with epsilon
