"""The budget checks exactly at their boundary: spending 1.0x the budget is accepted, 1.0001x is
refused (the ledger, the plan's total, and the check of every drawn candidate against what was
accounted). A check that compared with the wrong slack, or the wrong way round, fails here."""

from __future__ import annotations

import pytest

from dptune import space
from dptune._state.ledger import BudgetExceededError, Ledger
from dptune.accounting import total_privacy
from dptune.accounting.events import DpSgdCandidate
from dptune.errors import ImpossibleBudgetError, TuningConfigError
from dptune.plan import Budget, check_candidates, make_privacy_plan
from dptune.space import Space
from dptune.trainer_protocol import FunctionTrainer
from selection import RandomStopping

OVER = 1.0001


@pytest.mark.parametrize("which", ["epsilon", "delta"])
def test_ledger_accepts_exactly_the_budget_and_refuses_a_1_0001x_overspend(tmp_path, which):
    budget = dict(budget_epsilon=4.0, budget_delta=1e-5)
    eps, delta = (2.0, 4e-6)
    with Ledger(tmp_path / "l.sqlite") as led:
        led.charge("fp", "first", eps, delta, **budget)
        rest = (4.0 - eps, 1e-5 - delta)  # what is left, exactly
        over = (rest[0] * OVER, rest[1]) if which == "epsilon" else (rest[0], rest[1] * OVER)
        with pytest.raises(BudgetExceededError):
            led.charge("fp", "over", *over, **budget)
        with pytest.raises(BudgetExceededError):
            led.check("fp", "over", *over, **budget)
        assert led.spend("fp").runs == 1
        led.check("fp", "exact", *rest, **budget)
        spend = led.charge("fp", "exact", *rest, **budget)
        assert spend.spent_epsilon == pytest.approx(4.0) and spend.runs == 2


def _trainer():
    return FunctionTrainer(
        lambda hp, rng: (0.0, {}),
        lambda hp: DpSgdCandidate(0.01, 300, hp["sigma"]),
        10_000,
        "toy",
        privacy_fields=("sigma",),
        score_kind="covered",
    )


SPACE = Space(lr=space.log_uniform(0.1, 1.0), sigma=1.0)
SELECTION = RandomStopping.logarithmic(3)


def test_plan_accepts_a_total_exactly_at_the_budget_and_refuses_1_0001x():
    stated = make_privacy_plan(_trainer(), SPACE, SELECTION, (100.0, 1e-5)).statement
    total = stated.total_epsilon
    plan = make_privacy_plan(_trainer(), SPACE, SELECTION, (total, 1e-5))
    assert plan.statement.total_epsilon == pytest.approx(total)
    with pytest.raises(ImpossibleBudgetError, match="would cost"):
        make_privacy_plan(_trainer(), SPACE, SELECTION, Budget(total / OVER, 1e-5))


def test_a_score_noise_floor_above_the_budget_is_refused_naming_score_noise_std():
    """The score's own noise costs privacy that no noise multiplier removes: with a score noise
    of 2 counts, epsilon 1 is out of reach however noisy the training, and the refusal says so."""
    tr = FunctionTrainer(
        lambda hp, rng: (0.0, {}),
        lambda hp: DpSgdCandidate(0.01, 300, hp["noise_multiplier"], score_noise_std=2.0),
        10_000, "toy", privacy_fields=("noise_multiplier",), score_kind="covered",
    )  # fmt: skip
    searched = Space(lr=space.log_uniform(0.1, 1.0), noise_multiplier="auto")
    with pytest.raises(ImpossibleBudgetError, match="score_noise_std"):
        make_privacy_plan(tr, searched, SELECTION, (1.0, 1e-5))


def test_drawn_candidate_check_accepts_the_accounted_one_and_refuses_a_1_0001x_one():
    tr = _trainer()
    plan = make_privacy_plan(tr, SPACE, SELECTION, (100.0, 1e-5))
    check_candidates(tr, plan, [{"lr": 0.5, "sigma": 1.0}])  # what was accounted: 1.0x
    # a drawn candidate with slightly less noise: the total grows by a hair over 1.0001x
    sigma = 0.99985
    grown = total_privacy(
        [*plan.candidates, DpSgdCandidate(0.01, 300, sigma)], plan.transform, 1e-5, plan.accountant
    ).total_epsilon
    assert 1.0001 <= grown / plan.statement.total_epsilon < 1.001
    with pytest.raises(TuningConfigError, match="not covered"):
        check_candidates(tr, plan, [{"lr": 0.5, "sigma": sigma}])
