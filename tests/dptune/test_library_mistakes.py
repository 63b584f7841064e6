"""A library user's mistakes with ``dptune.tune`` and the own-loop pieces: each ends in one
``dptune.Refused`` line naming the keyword and the fix, before anything trains or is charged."""

from __future__ import annotations

import numpy as np
import pytest
from dp_accounting import dp_event

import dptune
from dptune import space
from selection import RandomStopping

N = 1000
DATA = np.random.default_rng(0).uniform(size=N)  # stands for private data
SPACE = {"guess": space.uniform(0.0, 1.0), "noise_multiplier": "auto"}
SELECTION = RandomStopping.logarithmic(mean=2)


def _train(hp, rng):
    trained.append(hp)
    return -abs(DATA.mean() - hp["guess"]) + 0.01 * rng.normal(), {"guess": hp["guess"]}


trained: list = []


def _gaussian(hp):
    return dp_event.GaussianDpEvent(hp["noise_multiplier"])


def _refused(trainer, tmp_path, space_=SPACE, match=None):
    """tune() refuses with ``match``; nothing trained, no ledger written."""
    trained.clear()
    ledger = tmp_path / "ledger.sqlite"
    with pytest.raises(dptune.Refused, match=match) as info:
        dptune.tune(trainer, space_, SELECTION, (3.0, 1e-5), progress=False, ledger=ledger,
                    fingerprint="toy")  # fmt: skip
    assert not trained and not ledger.exists()
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_plain_function_as_trainer_is_refused_with_the_decorator_named(tmp_path):
    # A function with no privacy declaration (the decorator forgotten): it crashed in the code
    # digest with AttributeError ('getset_descriptor' object has no attribute 'co_code').
    _refused(_train, tmp_path, match=r"trainer=.*privacy\(hparams\).*@dptune\.trainer")


def test_a_trainer_that_is_not_callable_is_refused(tmp_path):
    class NoCall:
        def privacy(self, hp):
            return _gaussian(hp)

    _refused(NoCall(), tmp_path, match=r"trainer=.*__call__\(hparams, rng\)")


def test_a_privacy_function_that_raises_is_refused_naming_privacy(tmp_path):
    tr = dptune.trainer(privacy=lambda hp: _gaussian(hp) if hp["missing"] else None,
                        num_examples=N, score_kind="covered")(_train)  # fmt: skip
    msg = _refused(tr, tmp_path, match=r"privacy=")
    assert "KeyError" in msg and "'missing'" in msg


def test_a_privacy_pair_is_refused_with_what_it_returned(tmp_path):
    # (epsilon, delta) is not a declaration: the message said "candidate=1.0 is not ..."
    tr = dptune.trainer(privacy=lambda hp: (1.0, 1e-5), num_examples=N, score_kind="covered")(
        _train
    )
    msg = _refused(tr, tmp_path, match=r"privacy\(hparams\) returned \(1\.0, 1e-05\)")
    assert "DpEvent" in msg


@pytest.mark.parametrize("value", ["atuo", "Auto", "none"])
def test_a_misspelt_auto_is_refused_naming_the_field(tmp_path, value):
    # A string reached the accountant: TypeError '<' not supported between 'str' and 'int'.
    tr = dptune.trainer(privacy=_gaussian, num_examples=N, score_kind="covered")(_train)
    sp = {**SPACE, "noise_multiplier": value}
    _refused(tr, tmp_path, sp, match=rf"noise_multiplier={value!r}.*'auto'")


@pytest.mark.parametrize(
    "n, why",
    [(DATA, r"num_examples=<array of shape \(1000,\)>.*PUBLIC"), (-5, "num_examples=-5"),
     (0, "num_examples=0"), (True, "num_examples=True"), (10.5, "num_examples=10.5")],
)  # fmt: skip
def test_num_examples_must_be_a_public_positive_integer(n, why):
    # A private array crashed in the delta check ("truth value of an array ... is ambiguous");
    # -5 was reported as "delta must be below 1/n = -0.2".
    with pytest.raises(dptune.Refused, match=why):
        dptune.trainer(privacy=_gaussian, num_examples=n, score_kind="covered")(_train)
    with pytest.raises(dptune.Refused, match=why):
        dptune.FunctionTrainer(_train, _gaussian, num_examples=n)


def test_num_examples_as_a_whole_float_or_numpy_integer_is_accepted():
    assert dptune.FunctionTrainer(_train, _gaussian, num_examples=1000.0).num_examples == 1000
    assert dptune.FunctionTrainer(_train, _gaussian, num_examples=np.int64(7)).num_examples == 7


@pytest.mark.parametrize(
    "kwargs, why",
    [(dict(num_examples=DATA, batch_size=10, epochs=1),
      r"num_examples=<array of shape \(1000,\)>.*PUBLIC"),
     (dict(num_examples=10, batch_size=100, epochs=1), r"num_examples=10 .*batch_size=100"),
     (dict(num_examples=100, batch_size=10, epochs=0), r"epochs=0"),
     (dict(num_examples=100, batch_size="10", epochs=1), r"batch_size='10'")],
)  # fmt: skip
def test_the_schedule_names_the_keyword(kwargs, why):
    with pytest.raises(ValueError, match=rf"DpSgdSchedule\({why}"):
        dptune.DpSgdSchedule(**kwargs)


def test_the_report_shows_a_functions_score_in_its_own_units():
    # A user function's score is whatever it returns (here minus a distance): the report printed
    # it as a percentage ("-12.58 %") next to "Test accuracy: n/a".
    from dptune.release import Release
    from dptune.report import report_markdown

    privacy = {"total_epsilon": 2.5, "delta": 1e-5, "single_run_epsilon": 2.0, "method": "m"}
    rel = Release(True, {"guess": 0.6}, -0.1258, None, privacy, "text",
                  trainer_name="your function 'train'")  # fmt: skip
    md = report_markdown(rel, set())
    assert "private): -0.1258 (the function's own score)" in md
    assert "%" not in md.split("## Privacy")[0] and "Test accuracy" not in md
    shipped = Release(True, {"lr": 0.1}, 0.5, 0.4, privacy, "text", trainer_name="DP-SGD")
    assert "50.00 %" in report_markdown(shipped, set())


def test_a_privacy_function_that_is_not_pure_is_named_as_such(tmp_path):
    # It was blamed on the searched field: "space field 'guess' changes each candidate's privacy
    # loss ... use space.choice(...)", which would not help.
    draws = iter(np.linspace(1.0, 2.0, 1000))
    tr = dptune.trainer(privacy=lambda hp: dp_event.GaussianDpEvent(next(draws)),
                        num_examples=N, score_kind="covered")(_train)  # fmt: skip
    _refused(tr, tmp_path, {"guess": space.uniform(0.0, 1.0)}, match=r"privacy.*not a pure")


@pytest.mark.parametrize(
    "declared", [dp_event.GaussianDpEvent(3.0), lambda hp: dp_event.GaussianDpEvent(3.0)]
)
def test_auto_is_refused_when_the_declaration_ignores_the_calibrated_field(tmp_path, declared):
    # "auto" was calibrated to its search's floor (0.05) and handed to the function as
    # hp["noise_multiplier"], while the statement accounted the constant sigma = 3.
    tr = dptune.FunctionTrainer(_train, declared, num_examples=N, score_kind="covered")
    msg = _refused(tr, tmp_path, match=r"noise_multiplier='auto'.*privacy")
    assert "hp['noise_multiplier']" in msg


@pytest.mark.parametrize(
    "dataset_budget, why",
    [(10.0, r"^dataset_budget=10\.0 must be \(epsilon, delta\)"),
     ((-1.0, 1e-5), r"^dataset_budget: .*epsilon=-1\.0")],
)  # fmt: skip
def test_a_wrong_dataset_budget_is_named_dataset_budget(tmp_path, dataset_budget, why):
    # It read "budget=10.0 must be (epsilon, delta)", naming the run's budget, which was right.
    tr = dptune.trainer(privacy=_gaussian, num_examples=N, score_kind="covered")(_train)
    with pytest.raises(dptune.Refused, match=why):
        dptune.tune(tr, SPACE, SELECTION, (3.0, 1e-5), progress=False, fingerprint="toy",
                    ledger=tmp_path / "ledger.sqlite", dataset_budget=dataset_budget)  # fmt: skip
    assert not (tmp_path / "ledger.sqlite").exists()


def test_a_selection_class_is_refused_with_an_instance_named(tmp_path):
    # RandomStopping (the class) crashed: AttributeError 'property' object has no attribute
    # 'describe'.
    tr = dptune.trainer(privacy=_gaussian, num_examples=N, score_kind="covered")(_train)
    with pytest.raises(dptune.Refused, match=r"selection=RandomStopping is a class.*\(mean="):
        dptune.tune(tr, SPACE, RandomStopping, (3.0, 1e-5), progress=False, ledger=None)


@pytest.mark.parametrize("score", [None, "high", float("nan"), float("inf")])
def test_a_score_that_is_not_a_finite_number_is_a_recorded_failure(tmp_path, score):
    # Never released as a success; the journal says what the function returned (None was kept
    # as "TypeError: float() argument must be ...", from inside the wrapper).
    from dptune._state.journal import Journal

    tr = dptune.trainer(privacy=_gaussian, num_examples=N, score_kind="covered")(
        lambda hp, rng: (score, {"guess": hp["guess"]})
    )
    rel = dptune.tune(tr, SPACE, SELECTION, (3.0, 1e-5), progress=False, ledger=None, seed=1,
                      workdir=tmp_path / "run")  # fmt: skip
    assert not rel.released and rel.outcome == "no_candidate_succeeded" and rel.payload is None
    with Journal(tmp_path / "run" / "private", readonly=True) as journal:
        failures = list(journal.failures().values())
    assert failures and all(f.type in ("InvalidScore", "NonFiniteScore") for f in failures)


def test_a_refusal_from_inside_privacy_is_passed_on_as_it_is(tmp_path):
    schedule = dptune.DpSgdSchedule(num_examples=N, batch_size=10, epochs=1)
    tr = dptune.trainer(privacy=lambda hp: dptune.dpsgd_privacy(schedule, -1.0), num_examples=N,
                        score_kind="covered")(_train)  # fmt: skip
    msg = _refused(tr, tmp_path, {"guess": space.uniform(0.0, 1.0)}, match=r"^noise_multiplier=")
    assert "raised" not in msg


def test_a_laplace_event_without_noise_is_refused_not_a_traceback():
    """``LaplaceDpEvent(0)`` (noise_multiplier=0) ended in dp_accounting's ZeroDivisionError; it
    is one TuningConfigError naming the field."""
    tr = dptune.FunctionTrainer(
        lambda hp, rng: (0.5, None),
        lambda hp: dp_event.LaplaceDpEvent(hp["noise_multiplier"]),
        num_examples=1000,
        score_kind="covered",
    )
    with pytest.raises(
        dptune.TuningConfigError, match=r"LaplaceDpEvent\(noise_multiplier=0.0\).*give noise"
    ):
        dptune.tune(tr, {"a": space.choice(1, 2), "noise_multiplier": 0.0},
                    RandomStopping.logarithmic(2), (2.0, 1e-5), seed=0, ledger=None,
                    progress=False)  # fmt: skip


def test_an_impossible_budget_names_the_classical_learners_score_noise_keyword():
    """The classical learners' validation noise is their factory's ``score_noise_multiplier=``:
    the refusal named DP-SGD's ``score_noise_std``, which they do not have."""
    from dptune.learners import classical

    rng = np.random.default_rng(0)
    data = (rng.normal(size=(40, 3)), rng.choice([-1.0, 1.0], 40))
    tr = classical.ridge_trainer(data, data, 40, 40, 0.01)  # the score alone costs epsilon 100
    space_ = {"regularization": space.log_uniform(0.01, 1.0), "noise_multiplier": "auto"}
    with pytest.raises(dptune.ImpossibleBudgetError) as info:
        dptune.tune(tr, space_, SELECTION, (3.0, 1e-5), progress=False, ledger=None)
    msg = str(info.value)
    assert "or raise score_noise_multiplier (the validation score's noise" in msg, msg
    assert "score_noise_std" not in msg, msg


@pytest.mark.parametrize(
    "event",
    [
        dp_event.LaplaceDpEvent(-1.0),
        dp_event.GaussianDpEvent(-1.0),
        dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(-0.5), 3),
    ],
    ids=["laplace", "gaussian", "nested"],
)
def test_a_declared_event_with_negative_noise_is_named_with_the_fix(tmp_path, event):
    """dp_accounting refused it in its own words ("eps must be > 0. Got -1.0", "Noise
    multiplier must be non-negative"), naming neither the declared event nor the fix."""
    tr = dptune.trainer(privacy=lambda hp: event, num_examples=N, score_kind="covered")(_train)
    msg = _refused(tr, tmp_path, {"guess": space.uniform(0.0, 1.0), "noise_multiplier": 1.0})
    inner = event.event if isinstance(event, dp_event.SelfComposedDpEvent) else event
    assert f"the trainer declared {inner!r}: its noise multiplier" in msg, msg
    assert msg.endswith("give noise_multiplier a value > 0 or 'auto'"), msg
