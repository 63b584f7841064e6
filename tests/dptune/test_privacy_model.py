"""The privacy model holds for the data as loaded (docs/privacy-model.md).

Adjacency is per record: adding or removing one person must change nothing else the guarantee
depends on -- not another record's split, not the sampling rate, not the dataset's ledger budget.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from dp_accounting import dp_event, privacy_accountant
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

import dptune
from dptune import accounting, space
from dptune._state.ledger import BudgetExceededError, Ledger
from dptune.accounting.events import DpSgdCandidate, EventCandidate
from dptune.errors import TuningConfigError
from dptune.learners.dpsgd import DpSgdTrainer
from selection import RandomStopping
from selection.privacy import RandomStoppingPrivacy
from tests.paths import shared_data
from trainers.data import (
    _load_idx,
    load_dataset,
    make_synthetic,
    record_digests,
    split_validation,
)

REPLACE_ONE = privacy_accountant.NeighboringRelation.REPLACE_ONE
FMNIST = shared_data("fashion-mnist")


def _tune_logarithmic(trainer, fields: dict, epsilon: float, *, seed: int):
    """dptune.tune: logarithmic random stopping (E[K] = 10), delta 1e-5, no ledger."""
    return dptune.tune(
        trainer,
        dptune.Space(fields),
        RandomStopping.logarithmic(mean=10),
        (epsilon, 1e-5),
        seed=seed,
        progress=False,
        ledger=None,
    )


def _val_digests(d) -> set[bytes]:
    return set(record_digests(d.val_x, d.val_y))


@pytest.mark.skipif(
    FMNIST is None, reason="../shared/data/fashion-mnist is not beside the checkout"
)
@pytest.mark.parametrize("position", [0, 31_337, 59_999])
def test_removing_one_fashion_mnist_record_moves_no_other_record(position):
    """Real Fashion-MNIST (60,000 training records): delete record `position` from the training
    file; every other record keeps its split (the positional split moved ~8,000)."""
    x, y, tx, ty = _load_idx(FMNIST)
    full = split_validation(x, y, tx, ty, 10, "fashion_mnist", 5000, num_examples=60000)
    keep = np.arange(len(x)) != position
    less = split_validation(x[keep], y[keep], tx, ty, 10, "fashion_mnist", 5000, num_examples=60000)
    removed = record_digests(x[~keep], y[~keep])[0]
    full_val, less_val = _val_digests(full), _val_digests(less)
    assert less_val == full_val - {removed}
    assert len(full.train_y) + len(full.val_y) == 60000
    # public sizes do not move either: they come from the declared size, not len()
    assert (less.public_num_train, less.public_num_val) == (full.public_num_train, 5000.0)
    assert abs(len(full.val_y) - 5000) < 4 * math.sqrt(60000 * (1 / 12) * (11 / 12))


def test_public_sizes_decide_the_privacy_not_the_arrays():
    d = make_synthetic(num_train=600, num_test=50, validation_size=100)
    fewer = dataclasses.replace(d, train_x=d.train_x[1:], train_y=d.train_y[1:])  # one person less
    hp = dict(batch_size=50, epochs=2, learning_rate=1.0, noise_multiplier=1.0)
    assert DpSgdTrainer(d).privacy(hp) == DpSgdTrainer(fewer).privacy(hp)
    assert DpSgdTrainer(d).privacy(hp).sampling_rate == 50 / 500


def test_data_far_from_its_declared_size_is_warned_not_refused(caplog):
    """A refusal would depend on the private file's size: the curator is warned on
    the console, and the public sizes come from the declaration either way."""
    import logging

    from dptune.data import MNIST_10K_DIR

    with caplog.at_level(logging.WARNING):
        wrong = load_dataset("mnist", MNIST_10K_DIR, validation_size=1000, source="idx")
    assert "declared public size 60000" in caplog.text and wrong.public_num_train == 59000
    d = load_dataset("mnist", MNIST_10K_DIR, 1000, "idx", num_examples=8000)
    assert d.public_num_train == 7000 and d.split["kind"] == "record_hash"


def _gaussian_trainer(calls: list):
    @dptune.trainer(privacy=lambda hp: dp_event.GaussianDpEvent(hp["sigma"]), score_kind="covered")
    def train(hp, rng):
        calls.append(hp)
        return float(rng.uniform()), None

    return train


def test_user_trainer_is_accounted_over_every_field_its_privacy_depends_on():
    """sigma is not a known privacy field and not marked privacy=True: it is still accounted at
    its worst value (0.5). Logarithmic random stopping (mean 10) over one Gaussian(0.5) costs 15.07
    by RDP (PS Thm 2) and 13.37 by the tighter profile route that auto takes; at sigma = 5 it
    would be below 1.5, so a statement accounted at the wrong value is caught."""
    fields = dict(sigma=space.choice(5.0, 0.5), lr=space.log_uniform(0.1, 1.0))
    # the worst case, computed independently through dp_accounting's RDP of one Gaussian
    worst = accounting.total_privacy(
        dp_event.GaussianDpEvent(0.5), RandomStoppingPrivacy.from_mean(10, 0.0), 1e-5, "rdp"
    ).total_epsilon
    assert worst > 15.06
    tightest = accounting.total_privacy(
        dp_event.GaussianDpEvent(0.5), RandomStoppingPrivacy.from_mean(10, 0.0), 1e-5, "auto"
    ).total_epsilon
    best_case = accounting.total_privacy(
        dp_event.GaussianDpEvent(5.0), RandomStoppingPrivacy.from_mean(10, 0.0), 1e-5, "auto"
    ).total_epsilon
    assert best_case < 1.5 and 12.0 < tightest <= worst
    calls: list = []
    release = _tune_logarithmic(_gaussian_trainer(calls), fields, 20.0, seed=1)
    assert release.privacy["total_epsilon"] == pytest.approx(tightest, rel=1e-3)
    calls.clear()
    with pytest.raises(dptune.ImpossibleBudgetError, match=f"{tightest:.2f}"):
        _tune_logarithmic(_gaussian_trainer(calls), fields, 3.0, seed=1)
    assert calls == []


def test_a_drawn_candidate_not_covered_by_the_statement_stops_the_run_before_training():
    """The privacy depends on a and b only jointly, which a one-field-at-a-time probe cannot see;
    the per-candidate check refuses the run before any candidate trains."""
    calls: list = []

    @dptune.trainer(
        privacy=lambda hp: dp_event.GaussianDpEvent(0.5 if hp["a"] == hp["b"] == 1 else 5.0),
        score_kind="covered",
    )
    def train(hp, rng):
        calls.append(hp)
        return 0.5, None

    fields = dict(a=space.choice(0, 1), b=space.choice(0, 1), lr=space.uniform(0.0, 1.0))
    with pytest.raises(TuningConfigError, match=r"not covered.*\['a', 'b'\]"):
        _tune_logarithmic(train, fields, 3.0, seed=3)
    assert calls == []


class LeakyDpSgdTrainer(DpSgdTrainer):
    """Less noise than accounted for large learning rates: the per-candidate check must notice."""

    def privacy(self, hparams):
        sigma = 0.3 if hparams["learning_rate"] > 1.0 else hparams["noise_multiplier"]
        return super().privacy({**hparams, "noise_multiplier": sigma})


def assert_leak_refused(trainer: LeakyDpSgdTrainer) -> None:
    """Tuning ``trainer`` over learning rates 0.5 to 2 is refused before training, naming it."""
    with pytest.raises(TuningConfigError, match="learning_rate"):
        dptune.tune(
            trainer,
            dptune.Space(dict(learning_rate=space.log_uniform(0.5, 2.0), noise_multiplier=2.0)),
            RandomStopping.logarithmic(mean=3),
            (50.0, 1e-5),
            seed=0,
            progress=False,
        )


def test_dpsgd_trainer_goes_through_the_same_check():
    d = make_synthetic(num_train=600, num_test=50, validation_size=100)
    assert_leak_refused(LeakyDpSgdTrainer(d, dict(batch_size=50, epochs=1)))


def test_exact_validation_score_needs_a_public_separate_validation_set(tmp_path):
    d = make_synthetic(num_train=600, num_test=50, validation_size=100)
    exact = DpSgdTrainer(d, dict(batch_size=50, epochs=1, score_noise_std=None))
    with pytest.raises(TuningConfigError, match="validation split is private"):
        dptune.plan_privacy(
            exact,
            dptune.Space(dict(learning_rate=space.log_uniform(0.5, 2.0), noise_multiplier="auto")),
            RandomStopping.logarithmic(mean=3),
            dptune.Budget(3.0, 1e-5),
        )
    with pytest.raises(ValueError, match="separate validation set"):
        load_dataset("synthetic", validation_public=True)


def test_a_declared_public_validation_set_may_be_scored_exactly(tmp_path):
    from dptune.data import MNIST_10K_DIR

    # the shipped test file stands in for a separately published validation set
    x, y, tx, ty = _load_idx(MNIST_10K_DIR)
    _write_idx_pair(tmp_path, tx[:500], ty[:500])
    d = load_dataset(
        "mnist",
        MNIST_10K_DIR,
        source="idx",
        num_examples=8000,
        validation_dir=tmp_path,
        validation_public=True,
    )
    assert d.validation_public and len(d.val_y) == 500 and len(d.train_y) == 8000
    assert "supplied separately (public)" in d.describe_split()
    trainer = DpSgdTrainer(d, dict(batch_size=256, epochs=1, score_noise_std=None))
    _, st = dptune.plan_privacy(
        trainer,
        dptune.Space(dict(learning_rate=space.log_uniform(0.5, 2.0), noise_multiplier="auto")),
        RandomStopping.logarithmic(mean=3),
        dptune.Budget(3.0, 1e-5),
    )
    assert st.candidates[0]["score_noise_std"] is None
    assert any("supplied separately (public)" in n for n in st.notes)


def _write_idx_pair(folder, x, y):
    import gzip

    imgs = np.round(x[..., 0] * 255).astype(np.uint8)
    with gzip.open(folder / "train-images-idx3-ubyte.gz", "wb") as f:
        f.write(bytes([0, 0, 8, 3]) + np.array(imgs.shape, ">u4").tobytes() + imgs.tobytes())
    with gzip.open(folder / "train-labels-idx1-ubyte.gz", "wb") as f:
        lab = y.astype(np.uint8)
        f.write(bytes([0, 0, 8, 1]) + np.array(lab.shape, ">u4").tobytes() + lab.tobytes())


@pytest.mark.slow  # four CLI runs on real data (~40 s)
def test_changing_the_split_does_not_reset_the_ledger(tmp_path):
    """Another validation size or split seed is another split of the same people: one budget."""
    from trainers.data import _synthetic_arrays

    x, y, tx, ty, _ = _synthetic_arrays(600, 50)
    a = split_validation(x, y, tx, ty, 10, "synthetic", 100, 0)
    b = split_validation(x, y, tx, ty, 10, "synthetic", 150, 7)
    order = np.random.default_rng(0).permutation(len(x))
    c = split_validation(x[order], y[order], tx, ty, 10, "synthetic", 100, 0)
    assert a.fingerprint() == b.fingerprint() == c.fingerprint()
    assert (
        a.fingerprint()
        != split_validation(x[1:], y[1:], tx, ty, 10, "synthetic", 100).fingerprint()
    )

    ledger = Ledger(tmp_path / "ledger.sqlite")
    sp = dptune.Space(dict(learning_rate=space.log_uniform(0.5, 2.0), noise_multiplier="auto"))
    base = dict(batch_size=100, epochs=1)
    dptune.tune(
        DpSgdTrainer(a, base, epoch_progress=False), sp, RandomStopping.logarithmic(mean=1.5),
        (2.0, 1e-6), ledger=ledger, dataset_budget=(3.0, 1e-5), seed=0, progress=False,
    )  # fmt: skip
    with pytest.raises(BudgetExceededError):
        dptune.tune(
            DpSgdTrainer(b, base, epoch_progress=False), sp, RandomStopping.logarithmic(mean=1.5),
            (2.0, 1e-6), ledger=ledger, dataset_budget=(3.0, 1e-5), seed=0, progress=False,
        )  # fmt: skip


def test_replace_one_dpsgd_equals_dp_accounting():
    q, steps, sigma, delta = 256 / 60000, 7032, 1.1, 1e-5
    cand = DpSgdCandidate(q, steps, sigma, adjacency="replace_one")
    st = accounting.total_privacy(cand, None, delta, "pld")
    acc = pld_privacy_accountant.PLDAccountant(neighboring_relation=REPLACE_ONE)
    acc.compose(cand.training_event())
    assert st.total_epsilon == pytest.approx(acc.get_epsilon(delta), rel=1e-6)
    assert st.adjacency == "replace_one" and "replacing one example" in st.to_text()
    add_remove = accounting.total_privacy(DpSgdCandidate(q, steps, sigma), None, delta, "pld")
    assert st.total_epsilon > add_remove.total_epsilon  # a replacement is a removal + an addition
    # the RDP route (Mironov 2017 Prop. 11 from the add/remove curve) is valid, hence not below
    rdp = accounting.total_privacy(cand, None, delta, "rdp").total_epsilon
    assert rdp >= st.total_epsilon


def test_replace_one_random_stopping_equals_dp_accounting():
    """A candidate dp_accounting's RDP accountant supports under REPLACE_ONE (sampling without
    replacement): our random-stopping total = its RepeatAndSelectDpEvent total. dptune's one
    replace-one rule (noise multipliers are over the add/remove sensitivity, which a
    replacement doubles, as dp_accounting's PLD accountant reads a Gaussian) halves the sigma
    that dp_accounting's RDP accountant reads as over the replace-one sensitivity."""

    def event(sigma):
        return dp_event.SelfComposedDpEvent(
            dp_event.SampledWithoutReplacementDpEvent(60000, 256, dp_event.GaussianDpEvent(sigma)),
            2000,
        )

    cand = EventCandidate(event(1.1), adjacency="replace_one")
    ours = accounting.total_privacy(cand, RandomStoppingPrivacy.from_mean(10, 0.0), 1e-5, "rdp")
    acc = rdp_privacy_accountant.RdpAccountant(
        list(accounting.DEFAULT_ORDERS), neighboring_relation=REPLACE_ONE
    )
    acc.compose(dp_event.RepeatAndSelectDpEvent(event(0.55), 10, 0.0))
    assert ours.total_epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)


def test_replace_one_through_the_tuner_requires_the_exact_declared_size():
    d = make_synthetic(num_train=600, num_test=50, validation_size=100)
    sp = dptune.Space(dict(learning_rate=space.log_uniform(0.5, 2.0), noise_multiplier=2.0))
    trainer = DpSgdTrainer(d, dict(batch_size=50, epochs=1))
    _, st = dptune.plan_privacy(
        trainer, sp, RandomStopping.logarithmic(mean=2), dptune.Budget(50.0, 1e-5),
        adjacency="replace_one",
    )  # fmt: skip
    assert st.adjacency == "replace_one"
    _, st_ar = dptune.plan_privacy(
        trainer, sp, RandomStopping.logarithmic(mean=2), dptune.Budget(50.0, 1e-5)
    )
    assert st.total_epsilon > st_ar.total_epsilon
    fewer = dataclasses.replace(d, train_x=d.train_x[1:], train_y=d.train_y[1:])
    with pytest.raises(TuningConfigError, match="fixed, public size"):
        dptune.plan_privacy(
            DpSgdTrainer(fewer, dict(batch_size=50, epochs=1)), sp,
            RandomStopping.logarithmic(mean=2), dptune.Budget(50.0, 1e-5),
            adjacency="replace_one",
        )  # fmt: skip


def test_cli_config_defaults_are_private_and_name_the_adjacency(tmp_path):
    """Through the config path users take: an exact score on the private split is refused before
    any private computation; replace-one is named in the statement."""
    from dptune.cli.build import ConfigError, run_config
    from dptune.configs import smoke

    cfg = smoke.get_config().to_dict()
    cfg["train"]["score_noise_std"] = None
    with pytest.raises((TuningConfigError, ConfigError), match="validation split is private"):
        run_config(cfg, tmp_path / "a", dry_run=True)
    cfg = smoke.get_config().to_dict()
    cfg["privacy"]["adjacency"] = "replace_one"
    st = run_config(cfg, tmp_path / "b", dry_run=True).statement
    assert st.adjacency == "replace_one" and st.total_epsilon <= 4.0 + 1e-9
    assert "replacing one example" in st.to_text()


def test_training_samples_at_the_accounted_rate_not_at_len_train(monkeypatch):
    """What trains is what was accounted: the loop's Poisson sampler gets q = B / N_public, the
    rate in the declared privacy, not B / len(private arrays) (here 399 of 500 public records are
    loaded). A loop that used len() would pass every other test and fail this one."""
    import trainers.loop

    d = make_synthetic(num_train=600, num_test=50, validation_size=100)
    fewer = dataclasses.replace(d, train_x=d.train_x[:399], train_y=d.train_y[:399])
    hp = dict(batch_size=50, epochs=1, learning_rate=1.0, noise_multiplier=1.0, clip_norm=1.0)
    trainer = DpSgdTrainer(fewer, epoch_progress=False, test_curve=False)
    seen = []

    class Spy(trainers.loop.PoissonSampler):
        def __init__(self, n, batch_size, rng, *, sampling_rate=None, **kw):
            seen.append((n, sampling_rate))
            raise _Stop  # recorded: no need to compile and train

    monkeypatch.setattr(trainers.loop, "PoissonSampler", Spy)
    score, payload = trainer(hp, np.random.default_rng(0))
    assert math.isnan(score) and payload.type == "_Stop"  # the spy's stop, journaled as a failure
    accounted = trainer.privacy(hp).sampling_rate
    assert seen == [(399, accounted)] and accounted == 50 / 500 != 50 / 399


class _Stop(Exception):
    pass
