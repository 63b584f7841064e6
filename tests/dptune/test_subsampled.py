"""dptune.tune_subsampled with a user trainer (no JAX): tune on a subset, retrain once on all data,
one statement and one ledger charge for both phases, resume, refusals."""

import json
import logging
import math
from dataclasses import dataclass, field

import numpy as np
import pytest

import dptune
from dptune import space
from dptune._state.ledger import Ledger
from dptune.accounting.events import DpSgdCandidate
from dptune.tuner import FunctionTrainer, ImpossibleBudgetError, TuningConfigError
from selection import RandomStopping

N = 10_000


@dataclass
class SubsetToy:
    """DP-SGD-like privacy (batch 100 of n public records, 5 epochs); scores peak at lr 0.3.
    ``subset`` records which trainer each call went to."""

    n: int = N
    calls: list = field(default_factory=list)
    keys: list = field(default_factory=list)
    key: bytes = b""
    score_std: float | None = None
    crash_at: int | None = None
    num_examples: int = N
    fingerprint: str = "toy-data"
    calibrated_field: str = "noise_multiplier"
    score_kind: str = "covered"  # a noisy score the declared privacy covers (a toy: say so)

    def privacy(self, hp):
        batch = 100 * self.n / N  # the full run's schedule on fewer records
        return DpSgdCandidate(
            batch / self.n, 2 * math.ceil(self.n / batch), hp["noise_multiplier"], self.score_std
        )

    def __call__(self, hp, rng):
        if self.crash_at is not None and len(self.calls) == self.crash_at:
            raise KeyboardInterrupt  # stands for a killed process
        self.calls.append((self.n, dict(hp), self.key))
        return -abs(math.log(hp["learning_rate"] / 0.3)) + 0.01 * rng.normal(), {"n": self.n}

    def subset(self, fraction, key):
        self.keys.append(key)
        return SubsetToy(
            round(fraction * self.n), self.calls, self.keys, key, self.score_std, self.crash_at
        )


SPACE = dict(learning_rate=space.log_uniform(0.01, 10.0), noise_multiplier="auto")


def test_tunes_on_subset_then_trains_once_on_all_data(tmp_path):
    toy = SubsetToy()
    ledger = tmp_path / "ledger.sqlite"
    rel = dptune.tune_subsampled(
        toy, SPACE, RandomStopping.logarithmic(4), (2.0, 1e-5), fraction=0.2,
        tuning_epsilon=0.3, seed=4, workdir=tmp_path / "run", ledger=ledger,
    )  # fmt: skip
    assert rel.released
    tuning_calls = [hp for n, hp, _ in toy.calls if n == 2000]
    final_calls = [hp for n, hp, _ in toy.calls if n == N]
    assert len(final_calls) == 1 and len(tuning_calls) >= 1
    # The final run uses the selected learning rate with its own, smaller noise.
    assert final_calls[0]["learning_rate"] in [hp["learning_rate"] for hp in tuning_calls]
    assert final_calls[0]["noise_multiplier"] < tuning_calls[0]["noise_multiplier"]
    assert rel.hparams == final_calls[0]
    p = rel.privacy
    assert 1.95 < p["total_epsilon"] <= 2.0 and p["method"].startswith("subsampled/")
    assert p["selection"]["tuning_epsilon"] <= 0.3 + 1e-9 and p["selection"]["fraction"] == 0.2
    # One charge of the whole run's epsilon.
    spend = Ledger(ledger).spend("toy-data")
    assert spend.spent_epsilon == pytest.approx(p["total_epsilon"]) and spend.runs == 1
    # Nothing of the tuning phase, nor the subset key, is in the release folder.
    released = "".join(f.read_text() for f in (tmp_path / "run/release").glob("*.json"))
    assert toy.keys[-1].hex() not in released and "subset_key" not in released
    assert json.loads((tmp_path / "run/release/privacy.json").read_text())["total_epsilon"] == (
        pytest.approx(p["total_epsilon"])
    )
    # Resume: the finished run returns its release, trains nothing, charges nothing more.
    before = len(toy.calls)
    again = dptune.tune_subsampled(
        toy, SPACE, RandomStopping.logarithmic(4), (2.0, 1e-5), fraction=0.2,
        tuning_epsilon=0.3, seed=4, workdir=tmp_path / "run", ledger=ledger,
    )  # fmt: skip
    assert len(toy.calls) == before and again.hparams == rel.hparams
    assert Ledger(ledger).spend("toy-data").spent_epsilon == pytest.approx(p["total_epsilon"])


def test_subset_key_is_drawn_once_and_from_os_entropy(tmp_path):
    from dptune._state.journal import Journal

    args = (SPACE, RandomStopping.logarithmic(3), (2.0, 1e-5))
    kw = dict(fraction=0.3, tuning_epsilon=0.5, progress=False)
    crashing = SubsetToy(crash_at=1)
    with pytest.raises(KeyboardInterrupt):
        dptune.tune_subsampled(crashing, *args, workdir=tmp_path / "run", **kw)
    resumed = SubsetToy()
    dptune.tune_subsampled(resumed, *args, workdir=tmp_path / "run", **kw)
    used = {k for n, _, k in crashing.calls + resumed.calls if n < N}
    assert len(used) == 1  # the resume trained on the same subset
    with Journal(tmp_path / "run" / "private") as j:
        assert bytes.fromhex(j.get("subset_key")) in used and len(used.pop()) == 32
    other = SubsetToy()
    dptune.tune_subsampled(other, *args, **kw)
    assert {k for n, _, k in other.calls if n < N}.isdisjoint(
        {k for n, _, k in resumed.calls if n < N}
    )


def test_nothing_released_when_tuning_releases_nothing():
    toy = SubsetToy()
    # Poisson random stopping draws K = 0 with this seed: the tuning phase releases nothing.
    rel = dptune.tune_subsampled(
        toy, SPACE, RandomStopping.poisson(1.0), (2.0, 1e-5), fraction=0.3,
        tuning_epsilon=0.5, seed=9, progress=False,
    )  # fmt: skip
    assert rel.private["tuning"].num_trials == 0
    assert not rel.released and rel.privacy["total_epsilon"] <= 2.0
    assert toy.calls == []  # no final run either


def test_refusals_charge_nothing(tmp_path):
    sel, budget = RandomStopping.logarithmic(2), (2.0, 1e-5)
    plain = FunctionTrainer(lambda hp, rng: (0.0, None), DpSgdCandidate(0.01, 100, 1.0))
    cases = [
        (plain, SPACE, dict(), "subset"),
        (SubsetToy(), SPACE, dict(adjacency="replace_one"), "add/remove"),
        (SubsetToy(), SPACE, dict(accountant="rdp"), "PLD"),
        (SubsetToy(), {**SPACE, "noise_multiplier": 1.0}, dict(), "'auto'"),
        (SubsetToy(), SPACE, dict(tuning_epsilon=2.0), "below the total"),
    ]
    for trainer, sp_, kw, match in cases:
        kw = {"fraction": 0.3, "tuning_epsilon": 0.5, **kw}
        with pytest.raises(TuningConfigError, match=match):
            dptune.tune_subsampled(
                trainer, sp_, sel, budget, workdir=tmp_path / "x", ledger=tmp_path / "l", **kw
            )
    # A noisy validation count costs a fixed epsilon (about 0.4 at std 10) whatever the noise
    # multiplier: the final run alone needs more than 0.3 - 0.2 ...
    noisy = SubsetToy(score_std=10.0)
    with pytest.raises(ImpossibleBudgetError, match="final noise multiplier.*tuning_epsilon"):
        dptune.tune_subsampled(
            noisy, SPACE, sel, (0.3, 1e-5), fraction=0.1, tuning_epsilon=0.2,
            workdir=tmp_path / "x", ledger=tmp_path / "l",
        )  # fmt: skip
    # ... and candidates on a subset of rate 0.5 get too little from a tuning epsilon of 0.05.
    with pytest.raises(ImpossibleBudgetError, match="tuning phase's budget"):
        dptune.tune_subsampled(
            noisy, SPACE, sel, (3.0, 1e-5), fraction=0.5, tuning_epsilon=0.05,
            workdir=tmp_path / "x", ledger=tmp_path / "l",
        )  # fmt: skip
    assert not (tmp_path / "x" / "private").exists()
    assert Ledger(tmp_path / "l").spend("toy-data") is None


def test_dpsgd_trainer_subset_keeps_the_schedule():
    from dptune.learners.dpsgd import DpSgdTrainer
    from trainers.data import Dataset

    rng = np.random.default_rng(0)
    x, y = rng.random((1000, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, 1000)
    data = Dataset(x[:900], y[:900].astype(np.int32), x[900:], y[900:].astype(np.int32), x[:5],
                   y[:5].astype(np.int32), 10, "synthetic")  # fmt: skip
    full = DpSgdTrainer(data, dict(batch_size=80, epochs=2), epoch_progress=False)
    sub = full.subset(0.25, b"s" * 32)
    hp = {"noise_multiplier": 1.0, "learning_rate": 1.0}
    assert sub.hyperparams(hp).batch_size == 20 and full.hyperparams(hp).batch_size == 80
    a, b = full.privacy(hp), sub.privacy(hp)
    assert b.sampling_rate == pytest.approx(a.sampling_rate) and b.steps == a.steps == 24
    assert sub.num_examples == 225 and not sub.test_curve


def test_charges_the_default_ledger_when_none_is_named(tmp_path, monkeypatch):
    # Like dptune.tune: a library call that names no ledger is charged to the curator's default
    # ledger ($DPTUNE_LEDGER here), once for both phases.
    monkeypatch.setenv("DPTUNE_LEDGER", str(tmp_path / "default.sqlite"))
    rel = dptune.tune_subsampled(
        SubsetToy(), SPACE, RandomStopping.logarithmic(4), (2.0, 1e-5), fraction=0.2,
        tuning_epsilon=0.3, seed=4, workdir=tmp_path / "run",
    )  # fmt: skip
    spend = Ledger(tmp_path / "default.sqlite").spend("toy-data")
    assert spend is not None and spend.runs == 1
    assert spend.spent_epsilon == pytest.approx(rel.privacy["total_epsilon"])


def test_resume_after_the_tuning_phase_reuses_it_without_a_new_workdir_warning(tmp_path, caplog):
    class CrashOnFinal(SubsetToy):
        crash = True  # a class attribute: the resumed run's config must be the same

        def __call__(self, hp, rng):
            if self.n == N and CrashOnFinal.crash:
                raise KeyboardInterrupt  # killed during the final run, after the tuning phase
            return super().__call__(hp, rng)

    args = (SPACE, RandomStopping.logarithmic(3), (2.0, 1e-5))
    kw = dict(fraction=0.3, tuning_epsilon=0.5, progress=False, ledger=None)
    with pytest.raises(KeyboardInterrupt):
        dptune.tune_subsampled(CrashOnFinal(), *args, workdir=tmp_path / "run", **kw)
    CrashOnFinal.crash = False
    resumed = CrashOnFinal()
    with caplog.at_level("INFO", logger="dptune"):
        rel = dptune.tune_subsampled(resumed, *args, workdir=tmp_path / "run", **kw)
    assert rel.released and [n for n, _, _ in resumed.calls] == [N]  # the final run alone
    assert "the tuning phase finished already" in caplog.text
    assert not [r for r in caplog.records if r.levelname == "WARNING" and "--workdir" in r.message]


def test_what_building_the_subset_says_is_said_once(caplog):
    """The plan's subset and the run's (same public sizes) are two builds: a warning of the
    build (the real trainer's score-noise warning) reaches the console once."""

    class Warns(SubsetToy):
        def subset(self, fraction, key):
            logging.getLogger("dptune").warning("the subset's score noise is high")
            return super().subset(fraction, key)

    with caplog.at_level("WARNING", logger="dptune"):
        dptune.tune_subsampled(
            Warns(), SPACE, RandomStopping.logarithmic(2), (2.0, 1e-5), fraction=0.3,
            tuning_epsilon=0.5, progress=False, ledger=None,
        )  # fmt: skip
    assert caplog.text.count("score noise is high") == 1, caplog.text
