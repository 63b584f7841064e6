"""dptune.tune with a user trainer (no JAX): budget first, journal, resume, ledger, release."""

import json
import math

import pytest

import dptune
from dptune import space
from dptune._state.journal import ConfigChangedError
from dptune._state.ledger import BudgetExceededError, Ledger
from dptune.accounting.events import DpSgdCandidate
from dptune.tuner import FunctionTrainer, ImpossibleBudgetError, TuningConfigError
from selection import RandomStopping, Thresholding
from tests.release_whitelist import check_release_whitelist

N = 10_000  # the toy's "dataset size": delta must be < 1/N


class Toy:
    """A 'private' trainer: score peaks at lr = 0.3; privacy is a DP-SGD event in sigma."""

    def __init__(self, crash_at=None):
        self.calls = []
        self.crash_at = crash_at

    def __call__(self, hp, rng):
        if self.crash_at is not None and len(self.calls) == self.crash_at:
            raise KeyboardInterrupt  # stands for a killed process: not a candidate failure
        self.calls.append(dict(hp))
        score = -abs(math.log(hp["learning_rate"] / 0.3)) + 0.01 * rng.normal()
        return score, {"lr": hp["learning_rate"], "history": [{"epoch": 1, "loss": 1.0}]}


def make_trainer(toy):
    return FunctionTrainer(
        toy,
        lambda hp: DpSgdCandidate(0.01, 500, hp["noise_multiplier"]),
        num_examples=N,
        fingerprint="toy-data",
        score_kind="covered",
    )


SPACE = dict(learning_rate=space.log_uniform(0.01, 10.0), noise_multiplier="auto")


def test_tune_in_memory_calibrates_and_releases_best():
    toy = Toy()
    rel = dptune.tune(make_trainer(toy), SPACE, RandomStopping.logarithmic(6), (2.0, 1e-5), seed=3)
    assert rel.released
    assert rel.privacy["total_epsilon"] <= 2.0
    assert rel.privacy["total_epsilon"] > 1.9  # calibration uses the budget, not far below it
    sigma = rel.hparams["noise_multiplier"]
    assert all(c["noise_multiplier"] == sigma for c in toy.calls)
    k = len(toy.calls)
    assert k == rel.private.num_trials
    best = max(range(k), key=lambda i: rel.private.scores[i])
    assert rel.hparams == toy.calls[best]
    shown = repr(rel) + str(rel) + repr(rel.private)
    others = [f"{x:.4g}" for i, x in enumerate(rel.private.scores) if i != best]
    assert k > 1 and not any(o in shown for o in others)
    assert rel.privacy["seeded"] is True and any("secret" in n for n in rel.privacy["notes"])


def test_release_folder_and_resume_after_crash(tmp_path):
    ref = dptune.tune(
        make_trainer(Toy()), SPACE, RandomStopping.logarithmic(6), (2.0, 1e-5), seed=9
    )
    k = ref.private.num_trials
    assert k >= 3, "pick a seed with a few trials"

    work = tmp_path / "run"
    crashing = Toy(crash_at=2)
    with pytest.raises(KeyboardInterrupt):
        dptune.tune(
            make_trainer(crashing), SPACE, RandomStopping.logarithmic(6), (2.0, 1e-5), seed=9,
            workdir=work, ledger=tmp_path / "ledger.sqlite",
        )  # fmt: skip
    assert not (work / "release").exists()
    resumed = Toy()
    rel = dptune.tune(
        make_trainer(resumed), SPACE, RandomStopping.logarithmic(6), (2.0, 1e-5), seed=9,
        workdir=work, ledger=tmp_path / "ledger.sqlite",
    )  # fmt: skip
    assert len(resumed.calls) == k - 2  # the two finished candidates were not retrained
    assert rel.hparams == ref.hparams and rel.validation_score == pytest.approx(
        ref.validation_score
    )
    # charged once, although the run started twice
    assert Ledger(tmp_path / "ledger.sqlite").spend("toy-data").runs == 1

    files = {p.name for p in (work / "release").iterdir()}
    assert {"result.json", "privacy.json", "privacy.txt", "epsilon.png"} <= files
    result = json.loads((work / "release" / "result.json").read_text())
    assert set(result) >= {"released", "hparams", "validation_score", "test_accuracy"}
    privacy = json.loads((work / "release" / "privacy.json").read_text())
    assert set(privacy) >= {"total_epsilon", "delta", "single_run_epsilon", "selection"}
    assert privacy["total_epsilon"] <= 2.0
    # nothing of K or the other candidates: every key of every release file is whitelisted
    check_release_whitelist(work / "release")

    def keys(x):
        if isinstance(x, dict):
            return set(x) | set().union(*(keys(v) for v in x.values()))
        return set().union(*(keys(v) for v in x)) if isinstance(x, list) else set()

    for f in (work / "release").glob("*.json"):
        assert not {"num_trials", "scores", "k"} & keys(json.loads(f.read_text())), f.name

    # a finished run called again returns its release without training
    again = Toy()
    rel2 = dptune.tune(
        make_trainer(again), SPACE, RandomStopping.logarithmic(6), (2.0, 1e-5), seed=9, workdir=work
    )
    assert again.calls == [] and rel2.hparams == rel.hparams
    with pytest.raises(ConfigChangedError, match="budget"):
        dptune.tune(
            make_trainer(Toy()), SPACE, RandomStopping.logarithmic(6), (2.5, 1e-5), workdir=work
        )


def test_ledger_refuses_overspend_before_training(tmp_path):
    led = tmp_path / "ledger.sqlite"
    args = (SPACE, RandomStopping.logarithmic(4), (2.0, 1e-5))
    dptune.tune(make_trainer(Toy()), *args, ledger=led, dataset_budget=(3.0, 1e-4))
    toy = Toy()
    with pytest.raises(BudgetExceededError, match="refused before any private computation"):
        dptune.tune(make_trainer(toy), *args, ledger=led, dataset_budget=(3.0, 1e-4))
    assert toy.calls == []


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(budget=(0.0, 1e-5)), "epsilon"),
        (dict(budget=(-1.0, 1e-5)), "epsilon"),
        (dict(budget=(float("nan"), 1e-5)), "epsilon"),
        (dict(budget=(float("inf"), 1e-5)), "epsilon"),
        (dict(budget=(1.0, 0.0)), "delta"),
        (dict(budget=(1.0, 1.0)), "delta"),
        (dict(budget=(1.0, 1e-3)), "1/n"),
        (dict(budget=(1.0,)), "budget"),
        (dict(budget=(1e-4, 1e-5)), "no noise multiplier"),
        (dict(space=dict(learning_rate=0.1, noise_multiplier="auto")), "empty"),
        (dict(space={}), "empty"),
        (
            dict(space=dict(learning_rate=space.log_uniform(0.1, 1), noise_multiplier=0.3)),
            "budget",
        ),
        (dict(space=dict(learning_rate=space.log_uniform(0.1, 1), noise_multiplier=0.0)), "noise"),
        (dict(space=dict(lr=space.uniform(0, 1), noise_multiplier=space.uniform(1, 2))), "worst"),
        (dict(selection=None), "selection"),
        (dict(group_size=0), "group_size"),
        (dict(accountant="magic"), "accountant"),
        (dict(seed=-1), "seed"),
        (dict(debug_nonprivate=True, ledger="unused.sqlite"), "ledger"),
    ],
)
def test_malformed_inputs_refused_before_training(change, message):
    toy = Toy()
    kwargs = dict(space=SPACE, selection=RandomStopping.logarithmic(4), budget=(2.0, 1e-5))
    kwargs.update(change)
    with pytest.raises((TuningConfigError, ValueError), match=message):
        dptune.tune(make_trainer(toy), **kwargs)
    assert toy.calls == []


def test_impossible_budget_is_a_config_error():
    assert issubclass(ImpossibleBudgetError, TuningConfigError)


def test_user_event_mismatch_is_caught():
    def fn(hp, rng):
        return 0.5, None, DpSgdCandidate(0.5, 1, 0.5)  # not what was declared

    tr = FunctionTrainer(
        fn, lambda hp: DpSgdCandidate(0.01, 500, hp["noise_multiplier"]), N, score_kind="covered"
    )
    rel = dptune.tune(tr, SPACE, RandomStopping.logarithmic(2), (2.0, 1e-5), seed=1, ledger=None)
    # the mismatch raises inside the candidate, which counts as a failure (never aborts); every
    # candidate failed, so no model is released
    assert all(math.isnan(s) for s in rel.private.scores)
    assert not rel.released and rel.outcome == "no_candidate_succeeded"


def test_thresholding_speculative_groups_release_first_hit():
    """Thresholding evaluated in groups of 4 releases the first candidate over the threshold."""
    toy = Toy()
    sel = Thresholding(threshold=-0.5, stop_probability=0.05)
    rel = dptune.tune(make_trainer(toy), SPACE, sel, (3.0, 1e-5), seed=5, group_size=4)
    scores = rel.private.scores
    hits = [i for i, s in enumerate(scores) if s >= -0.5]
    assert rel.released and hits
    assert rel.hparams == toy.calls[hits[0]]
    assert len(toy.calls) % 4 == 0 or len(toy.calls) == rel.private.num_trials
    assert "Liu & Talwar" in rel.privacy["theorem"] and rel.privacy["total_epsilon"] <= 3.0


def test_debug_nonprivate_prints_scores_and_voids_the_statement(capsys):
    rel = dptune.tune(
        make_trainer(Toy()), SPACE, RandomStopping.logarithmic(4), (2.0, 1e-5), seed=5,
        debug_nonprivate=True, ledger=None,
    )  # fmt: skip
    out = capsys.readouterr().out
    assert f"K={rel.private.num_trials}" in out
    assert rel.privacy["private"] is False and "NOT PRIVATE" in rel.privacy_text
    quiet = dptune.tune(make_trainer(Toy()), SPACE, RandomStopping.logarithmic(4), (2.0, 1e-5))
    assert "K=" not in capsys.readouterr().out and quiet.privacy["private"] is True
    assert quiet.privacy["seeded"] is False  # OS entropy by default


def test_privacy_relevant_choice_is_accounted_at_its_worst_case():
    """A space drawing steps from {200, 500} is charged as the 500-step run (uniform bound)."""
    tr = FunctionTrainer(
        Toy(),
        lambda hp: DpSgdCandidate(0.01, hp["steps"], hp["noise_multiplier"]),
        N,
        score_kind="covered",
    )
    sel = RandomStopping.logarithmic(4)

    def total(steps):
        sp = dict(learning_rate=space.log_uniform(0.1, 1.0), noise_multiplier=1.0, steps=steps)
        return dptune.plan_privacy(tr, sp, sel, dptune.Budget(50.0, 1e-5))[1].total_epsilon

    both = total(space.choice(200, 500))
    assert both == pytest.approx(total(500), rel=1e-9)
    assert total(200) < both
