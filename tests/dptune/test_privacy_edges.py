"""Issue 25: what a release publishes must be covered by the theorem that states it.

One test (at least) per item of the issue, each failing on the code before the fix: a declaration
that changes after accounting (item 4), candidates covered jointly (item 6), owner-only private
files (item 8), one-bit refusals decided on public quantities (item 5), the score a trainer
declares against what the method needs (item 2), the release whitelist (item 1), and a statement
that says what it takes on the trainer's word (item 9). Items 3 and 7 are tested in
``tests/dptune/accounting/test_replace_one_events.py`` and
``tests/selection/test_privacy_edges.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
from dp_accounting import dp_event

import dptune
from dptune import space
from dptune import tuner as tuner_mod
from dptune.errors import TuningConfigError
from dptune.trainer_protocol import FunctionTrainer
from selection import RandomStopping

N = 10_000
SPACE = dict(lr=space.uniform(0.0, 1.0))


# ------------------------------------------------------------------------------------------------
# item 4: the train-time check compares with the accounted candidate


def test_a_declaration_that_changes_after_accounting_is_stopped_before_it_trains(monkeypatch):
    """The privacy function returns sigma = 5 while dptune accounts the run, then 0.5 (a counter,
    the clock, a global: anything but the hyperparameters). Nothing may train under the statement
    that was computed for sigma = 5."""
    state = {"after": False}
    trained: list = []

    def privacy(hp):
        return dp_event.GaussianDpEvent(0.5 if state["after"] else 5.0)

    def train(hp, rng):
        trained.append(hp)
        return 0.5, None, privacy(hp)  # the event it really used: it agrees with a fresh call

    original = tuner_mod.check_candidates

    def then_change(*args, **kwargs):
        out = original(*args, **kwargs)
        state["after"] = True  # the declaration changes once the accounting is done
        return out

    monkeypatch.setattr(tuner_mod, "check_candidates", then_change)
    trainer = FunctionTrainer(train, privacy, num_examples=N, score_kind="covered")
    with pytest.raises(TuningConfigError, match="changed after"):
        dptune.tune(
            trainer, SPACE, RandomStopping.logarithmic(mean=3), (3.0, 1e-5), seed=0,
            progress=False,
        )  # fmt: skip
    assert trained == []


def test_the_returned_event_is_compared_with_the_accounted_one_not_a_fresh_call():
    state = {"sigma": 5.0}
    trainer = FunctionTrainer(
        lambda hp, rng: (0.5, None, dp_event.GaussianDpEvent(state["sigma"])),
        lambda hp: dp_event.GaussianDpEvent(state["sigma"]),
        num_examples=N,
        score_kind="covered",
    )
    hp = {"lr": 0.5}
    trainer.bind_accounted([(hp, dp_event.GaussianDpEvent(5.0))])
    assert trainer(hp, np.random.default_rng(0))[0] == 0.5
    state["sigma"] = 0.5  # a fresh call would now agree with the event the function returns
    with pytest.raises(RuntimeError, match="accounted"):
        trainer(hp, np.random.default_rng(0))
