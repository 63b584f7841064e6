"""DP feature selection + Fisher classifier (dptune/learners/fisher.py): privacy against an
independent computation, the implemented noise against the declared event, sensitivities on real
data, and tuning by dptune like any candidate."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, stats

import dptune
from dptune import accounting, space
from dptune.errors import TuningConfigError
from dptune.learners import fisher
from selection import RandomStopping


def analytic_gaussian_epsilon(mu: float, delta: float) -> float:
    """Independent closed form: the Gaussian mechanism with sensitivity / std = mu is
    (eps, delta)-DP iff delta >= Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu) (Balle & Wang
    2018, Thm 8), solved for eps with scipy (no dp_accounting)."""

    def gap(eps: float) -> float:
        return (
            stats.norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * stats.norm.cdf(-mu / 2 - eps / mu)
        ) - delta

    return optimize.brentq(gap, 0.0, 200.0, xtol=1e-10)


@pytest.mark.parametrize("s,f", [(0.8, 0.3), (2.0, 0.1), (2.0, 0.9), (5.0, 0.5)])
def test_fisher_event_matches_one_gaussian_closed_form(s, f):
    """dptune's accounting (PLD through dp_accounting) of the three composed stages equals the
    analytic Gaussian mechanism of multiplier s (GDP composition, Dong-Roth-Su 2019 Cor. 3.3, and
    Balle-Wang 2018 Thm 8): an independent formula, compared at the PLD's discretisation."""
    delta = 1e-5
    event = fisher.fisher_event(s, f)
    got = accounting.pld_epsilon(accounting.EventCandidate(event), delta)
    want = analytic_gaussian_epsilon(1.0 / s, delta)
    assert got == pytest.approx(want, rel=2e-3, abs=2e-3)
    assert got >= want - 1e-3  # the PLD is pessimistic, never optimistic beyond rounding
    # RDP is an upper bound of the same mechanism: never below the exact epsilon
    assert accounting.rdp_epsilon(accounting.EventCandidate(event), delta)[0] >= want


def test_privacy_split_does_not_change_total_but_each_stage_gets_its_share():
    sig = fisher.stage_noise_multipliers(3.0, 0.25)
    assert sum(x**-2 for x in sig) == pytest.approx(3.0**-2, rel=1e-12)
    assert sig[0] ** -2 == pytest.approx(0.25 * 3.0**-2, rel=1e-12)


class RecordingRng:
    """Wraps a Generator and records the scale of every ``normal`` draw (the released noise)."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)
        self.scales = []

    def normal(self, loc=0.0, scale=1.0, size=None):
        self.scales.append((float(scale), size))
        return self.rng.normal(loc, scale, size)


def test_implemented_noise_is_the_declared_event(mnist):
    """The noise the code draws = (declared multiplier) x (sensitivity) for each stage."""
    hp = fisher.FisherHyperparams(num_features=40, selection_fraction=0.2, noise_multiplier=2.0,
                                  clip_norm=5.0)  # fmt: skip
    rng = RecordingRng(0)
    x = mnist.train_x[:500].reshape(500, -1)
    fisher.fit_private_fisher(x, mnist.train_y[:500], 10, hp, rng)
    declared = [e.noise_multiplier for e in fisher.fisher_event(2.0, 0.2).events]
    c = hp.clip_norm
    sensitivities = [math.sqrt(c * c + 1), c, c * c]
    assert [s for s, _ in rng.scales] == pytest.approx(
        [m * d for m, d in zip(declared, sensitivities, strict=True)], rel=1e-12
    )
    assert rng.scales[0][1] == (10, 785) and rng.scales[1][1] == (10, 40)
    assert rng.scales[2][1] == (40, 40)


def test_sensitivities_hold_on_real_records(mnist):
    """Removing any record changes each released statistic by at most its stated L2 sensitivity,
    and by exactly that for a record whose norm reaches the clip (so the bound is tight)."""
    c = 6.0
    x = mnist.train_x[:300].reshape(300, -1).astype(np.float64)
    y = mnist.train_y[:300]
    feats = np.arange(100, 160)
    t_all = fisher.selection_statistics(x, y, 10, c)
    s_all, m_all = fisher.fisher_statistics(x[:, feats], y, 10, c)
    norms = np.linalg.norm(x, axis=1)
    for i in range(0, 300, 7):
        keep = np.arange(300) != i
        t = fisher.selection_statistics(x[keep], y[keep], 10, c)
        s, m = fisher.fisher_statistics(x[keep][:, feats], y[keep], 10, c)
        d1 = np.linalg.norm(t_all - t)
        d2, d3 = np.linalg.norm(s_all - s), np.linalg.norm(m_all - m)
        assert d1 <= math.sqrt(c * c + 1) + 1e-9
        assert d2 <= c + 1e-9 and d3 <= c * c + 1e-9
        if norms[i] >= c:
            assert d1 == pytest.approx(math.sqrt(c * c + 1), rel=1e-9)
    assert (norms >= c).any()


def test_accuracy_with_little_noise(mnist):
    """With almost no noise the pipeline is plain LDA on the top 300 pixels: ~0.87 on MNIST."""
    tr = fisher.FisherTrainer(mnist)
    score, model = tr({"noise_multiplier": 0.01, "num_features": 300}, np.random.default_rng(1))
    acc = tr.release_view({}, model).test_accuracy
    assert acc > 0.84 and score > 0.8
    assert len(model["features"]) == 300


def test_dptune_tunes_fisher_and_checks_privacy_fields(mnist):
    """dptune calibrates the noise to the total budget, searches the number of features and the
    split, and refuses a continuous distribution over the (declared) privacy split."""
    tr = fisher.FisherTrainer(mnist)
    sp = {
        "num_features": space.choice(50, 150),
        "selection_fraction": space.choice(0.2, 0.5),
        "noise_multiplier": "auto",
    }
    rel = dptune.tune(tr, sp, RandomStopping.logarithmic(mean=2), (2.0, 1e-5), seed=0,
                      progress=False)  # fmt: skip
    assert rel.privacy["total_epsilon"] <= 2.0 + 1e-9
    assert rel.privacy["total_epsilon"] > 1.9
    if rel.released:
        assert rel.hparams["num_features"] in (50, 150)
        assert rel.test_accuracy > 0.5
    bad = {**sp, "selection_fraction": space.uniform(0.1, 0.9)}
    with pytest.raises(TuningConfigError):
        dptune.plan_privacy(tr, bad, RandomStopping.logarithmic(mean=2), (2.0, 1e-5))
    with pytest.raises(TuningConfigError):
        dptune.plan_privacy(tr, sp, RandomStopping.logarithmic(mean=2), (2.0, 1e-5),
                            adjacency="replace_one")  # fmt: skip


def tiny_dataset(n: int = 60, k: int = 3, seed: int = 0, **kw):
    """A user's own small image-shaped arrays (n, 2, 3) with k classes and a public test split."""
    from trainers.data import Dataset

    rng = np.random.default_rng(seed)
    x, xt = rng.uniform(size=(n, 2, 3)), rng.uniform(size=(40, 2, 3))
    y, yt = rng.integers(0, k, n), rng.integers(0, k, 40)
    return Dataset.from_arrays(x, y, num_examples=n, num_classes=k, x_test=xt, y_test=yt, **kw)


@pytest.mark.parametrize("split", ["train", "val"])
def test_an_empty_split_trains_like_any_other(split):
    """A private split with no records is a dataset like any other (its neighbour has one
    record): the candidate trains and scores (noise only) instead of failing, which made one
    record flip the release between a model and "no candidate succeeded"."""
    import dataclasses

    d = tiny_dataset()
    d = dataclasses.replace(
        d,
        **{f"{split}_x": getattr(d, f"{split}_x")[:0], f"{split}_y": getattr(d, f"{split}_y")[:0]},
    )
    score, model = fisher.FisherTrainer(d)(
        {"num_features": 3, "noise_multiplier": 1.0}, np.random.default_rng(0)
    )
    assert math.isfinite(score) and model["weights"].shape == (3, 3)


def test_labels_that_are_not_classes_are_refused():
    """Regression targets (num_classes=0) are refused when the trainer is built (every candidate
    used to fail inside a charged run)."""
    from trainers.data import Dataset

    x = np.random.default_rng(0).uniform(size=(30, 4))
    d = Dataset.from_arrays(x, x[:, 0].astype(np.float32), num_examples=30, num_classes=0)
    with pytest.raises(TuningConfigError, match="FisherTrainer needs class labels.*num_classes="):
        fisher.FisherTrainer(d)


def test_a_misspelt_hyperparameter_names_the_fields_the_trainer_takes():
    """``num_feature=`` (a typo) is one TuningConfigError that names it and lists the fields
    (the fix), before anything trains."""
    with pytest.raises(TuningConfigError, match="num_feature.*DP-Fisher takes .*num_features"):
        dptune.tune(fisher.FisherTrainer(tiny_dataset()),
                    {"num_feature": space.choice(2, 3), "noise_multiplier": "auto"},
                    RandomStopping.logarithmic(2), (2.0, 1e-3), seed=0, ledger=None,
                    progress=False)  # fmt: skip


def test_a_users_empty_arrays_load_and_tune_like_any_other():
    """``Dataset.from_arrays`` on arrays with no record (a neighbour of a one-record dataset)
    loads (it raised a reshape ValueError) and dptune tunes it: the release is noise."""
    from trainers.data import Dataset

    x, y = np.zeros((0, 2, 3), np.float32), np.zeros(0, np.int64)
    xt, yt = np.random.default_rng(0).uniform(size=(10, 2, 3)), np.arange(10) % 3
    d = Dataset.from_arrays(x, y, num_examples=5, num_classes=3, x_test=xt, y_test=yt)
    rel = dptune.tune(fisher.FisherTrainer(d),
                      {"num_features": space.choice(2, 3), "noise_multiplier": "auto"},
                      RandomStopping.logarithmic(2), (2.0, 0.01), seed=0, ledger=None,
                      progress=False)  # fmt: skip
    assert rel.released and math.isfinite(rel.validation_score)


@pytest.mark.parametrize("trainer", ["fisher", "public_data"])
def test_an_infinite_score_noise_is_refused(trainer):
    """``score_noise_std=inf`` made every score infinite (every candidate a failure, after the
    run was charged); it is refused with the field named before anything trains."""
    from dptune.learners.public_data import PublicDataTrainer

    base = {"score_noise_std": math.inf}
    tr = (fisher.FisherTrainer(tiny_dataset(), base=base) if trainer == "fisher"
          else PublicDataTrainer(tiny_dataset(), num_public=20, base=base))  # fmt: skip
    field = "num_features" if trainer == "fisher" else "pca_dim"
    with pytest.raises(TuningConfigError, match="score_noise_std=inf"):
        dptune.tune(tr, {field: space.choice(2, 3), "noise_multiplier": "auto"},
                    RandomStopping.logarithmic(2), (2.0, 1e-3), seed=0, ledger=None,
                    progress=False)  # fmt: skip


@pytest.mark.parametrize("trainer", ["fisher", "public_data"])
def test_a_dataset_without_validation_split_is_refused(trainer):
    """``validation_fraction=0`` leaves nothing to score candidates on: refused when the trainer
    is built (every candidate used to fail on a division by the zero expected size, after the
    run was charged), as DP-SGD refuses it."""
    from dptune.learners.public_data import PublicDataTrainer

    d = tiny_dataset(validation_fraction=0.0)
    with pytest.raises(TuningConfigError, match="no validation split.*validation_fraction > 0"):
        if trainer == "fisher":
            fisher.FisherTrainer(d)
        else:
            PublicDataTrainer(d, num_public=20)
