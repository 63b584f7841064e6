"""One replace-one rule for user DpEvents, on every route.

A user event describes its mechanism under add/remove (its noise multiplier is the noise over the
add/remove sensitivity); a replacement is a removal plus an addition, so it moves the query by up
to twice that. dp_accounting's PLD accountant reads a GaussianDpEvent that way under REPLACE_ONE
(its privacy loss shifts by 2 x sensitivity; REPLACE_SPECIAL equals add/remove), while its RDP
accountant under REPLACE_ONE keeps the shift 1. dptune pins every route to the PLD accountant's
relation: a user Gaussian(sigma) under replace-one is exactly an add/remove Gaussian(sigma / 2).
"""

from __future__ import annotations

import math

import pytest
from dp_accounting import dp_event, privacy_accountant
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dptune import accounting
from dptune.accounting.events import EventCandidate
from selection.privacy import RandomStoppingPrivacy

REL = privacy_accountant.NeighboringRelation
DELTA = 1e-5


def _pld_eps(event, relation) -> float:
    acc = pld_privacy_accountant.PLDAccountant(neighboring_relation=relation)
    acc.compose(event)
    return acc.get_epsilon(DELTA)


def _rdp_eps(event) -> float:
    acc = rdp_privacy_accountant.RdpAccountant(list(accounting.DEFAULT_ORDERS))
    acc.compose(event)
    return acc.get_epsilon(DELTA)


def test_dp_accountings_replace_one_doubles_the_gaussian_sensitivity():
    """The pin itself, from dp_accounting alone: REPLACE_ONE of Gaussian(2) = add/remove of
    Gaussian(1); REPLACE_SPECIAL = add/remove of Gaussian(2)."""
    g2, g1 = dp_event.GaussianDpEvent(2.0), dp_event.GaussianDpEvent(1.0)
    replace = _pld_eps(g2, REL.REPLACE_ONE)
    assert replace == pytest.approx(_pld_eps(g1, REL.ADD_OR_REMOVE_ONE), rel=1e-6)
    assert _pld_eps(g2, REL.REPLACE_SPECIAL) == pytest.approx(
        _pld_eps(g2, REL.ADD_OR_REMOVE_ONE), rel=1e-6
    )
    assert 4.3 < replace < 4.45  # the 4.377


def test_user_gaussian_under_replace_one_is_the_same_on_every_route():
    cand = EventCandidate(dp_event.GaussianDpEvent(2.0), adjacency="replace_one")
    pinned = _pld_eps(dp_event.GaussianDpEvent(2.0), REL.REPLACE_ONE)
    # one run: PLD is dp_accounting's REPLACE_ONE; RDP is the exact RDP of Gaussian(1)
    # (alpha * 2^2 / (2 * 2^2) = alpha / 2), converted by dp_accounting; auto takes the smaller
    pld = accounting.total_privacy(cand, None, DELTA, "pld").total_epsilon
    rdp = accounting.total_privacy(cand, None, DELTA, "rdp").total_epsilon
    auto = accounting.total_privacy(cand, None, DELTA, "auto").total_epsilon
    assert pld == pytest.approx(pinned, rel=1e-6)
    assert rdp == pytest.approx(_rdp_eps(dp_event.GaussianDpEvent(1.0)), rel=1e-9)
    assert rdp >= pld and auto == pytest.approx(pld, rel=1e-9)
    assert rdp > 4.3  # today: 2.166 (the RDP accountant's shift 1)
    curve = accounting.rdp_curve(cand, [2.0, 8.0, 32.0])
    assert list(curve) == pytest.approx([1.0, 4.0, 16.0], rel=1e-12)


def test_replace_one_through_a_selection_theorem_equals_the_add_remove_half_noise():
    """PS Thm 2 (logarithmic, mean 10) on every route: the replace-one Gaussian(2) gives what the
    add/remove Gaussian(1) gives; the RDP route equals dp_accounting's RepeatAndSelectDpEvent."""
    tr = RandomStoppingPrivacy.from_mean(10, 0.0)
    rep = EventCandidate(dp_event.GaussianDpEvent(2.0), adjacency="replace_one")
    half = EventCandidate(dp_event.GaussianDpEvent(1.0))
    for acc in ("rdp", "pld", "auto"):
        ours = accounting.total_privacy(rep, tr, DELTA, acc)
        same = accounting.total_privacy(half, tr, DELTA, acc)
        assert ours.total_epsilon == pytest.approx(same.total_epsilon, rel=1e-6), acc
    rs = rdp_privacy_accountant.RdpAccountant(list(accounting.DEFAULT_ORDERS))
    rs.compose(dp_event.RepeatAndSelectDpEvent(dp_event.GaussianDpEvent(1.0), 10, 0.0))
    assert accounting.total_privacy(rep, tr, DELTA, "rdp").total_epsilon == pytest.approx(
        rs.get_epsilon(DELTA), rel=1e-6
    )
    profile = [
        r
        for r in accounting.routes(rep, tr, DELTA, "pld")
        if r.description.startswith("privacy profile")
    ]
    assert profile, "the profile route must apply"
    half_profile = [
        r
        for r in accounting.routes(half, tr, DELTA, "pld")
        if r.description.startswith("privacy profile")
    ]
    assert profile[0].epsilon == pytest.approx(half_profile[0].epsilon, rel=1e-6)


def test_other_user_events_follow_the_same_rule_or_are_refused():
    # Laplace(b) under replace-one: sensitivity 2, pure epsilon 2 / b (dp_accounting's PLD refuses
    # Laplace under REPLACE_ONE, so the pure and RDP routes state it)
    lap = EventCandidate(dp_event.LaplaceDpEvent(4.0), adjacency="replace_one")
    assert accounting.total_privacy(lap, None, DELTA, "auto").total_epsilon == pytest.approx(0.5)
    # composition and sampling without replacement (m = n: the plain Gaussian) agree with it
    both = EventCandidate(
        dp_event.ComposedDpEvent((dp_event.GaussianDpEvent(2.0), dp_event.GaussianDpEvent(2.0))),
        adjacency="replace_one",
    )
    assert accounting.rdp_curve(both, [4.0])[0] == pytest.approx(4.0, rel=1e-12)
    wor = EventCandidate(
        dp_event.SampledWithoutReplacementDpEvent(100, 100, dp_event.GaussianDpEvent(2.0)),
        adjacency="replace_one",
    )
    assert accounting.rdp_curve(wor, [4.0])[0] == pytest.approx(2.0, rel=1e-9)
    for event in (dp_event.ZCDpEvent(0.1), dp_event.RandomizedResponseDpEvent(0.5, 4)):
        with pytest.raises(ValueError, match="replace-one"):
            EventCandidate(event, adjacency="replace_one")
    # add/remove is unchanged
    assert accounting.total_privacy(
        EventCandidate(dp_event.GaussianDpEvent(2.0)), None, DELTA, "pld"
    ).total_epsilon == pytest.approx(_pld_eps(dp_event.GaussianDpEvent(2.0), REL.ADD_OR_REMOVE_ONE))
    assert math.isfinite(_rdp_eps(dp_event.GaussianDpEvent(2.0)))


def test_a_trainer_declaring_an_event_with_no_replace_one_form_is_one_line():
    import dptune
    from dptune import space
    from dptune.errors import TuningConfigError
    from selection import RandomStopping

    trainer = dptune.trainer(privacy=dp_event.ZCDpEvent(0.1), score_kind="covered")(
        lambda hp, rng: (0.5, None)
    )
    with pytest.raises(TuningConfigError, match="replace-one sensitivity"):
        dptune.plan_privacy(
            trainer,
            dptune.Space(dict(lr=space.uniform(0.0, 1.0))),
            RandomStopping.logarithmic(mean=2),
            dptune.Budget(5.0, 1e-5),
            adjacency="replace_one",
        )
