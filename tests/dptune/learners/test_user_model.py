"""A user's Flax module and arrays through dptune.DpSgdTrainer: the same privacy route, checks,
ledger and release as a shipped model; refusals before anything private runs; load_release."""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dptune
from dptune import space
from dptune.errors import TuningConfigError
from selection import RandomStopping
from tests.dptune.test_privacy_model import LeakyDpSgdTrainer, assert_leak_refused


class MLP(nn.Module):
    hidden: int = 16

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(jnp.tanh(nn.Dense(self.hidden)(x)))


def _data(n=1200, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n + 200, 6))
    y = np.argmax(x @ rng.standard_normal((6, 3)), axis=1)
    return dptune.Dataset.from_arrays(
        x[:n], y[:n], num_examples=n, x_test=x[n:], y_test=y[n:], validation_fraction=0.2
    )


SPACE = {"learning_rate": space.log_uniform(0.3, 3.0), "noise_multiplier": "auto"}


def test_user_module_gets_the_same_privacy_statement_and_ledger_id_as_a_shipped_model():
    data = _data()
    base = dict(batch_size=60, epochs=2)
    user = dptune.DpSgdTrainer(data, model=MLP(), base=base, epoch_progress=False)
    shipped = dptune.DpSgdTrainer(data, base={**base, "model": "cnn26k"}, epoch_progress=False)
    plans = [
        dptune.make_privacy_plan(
            t, dptune.Space(SPACE), RandomStopping.logarithmic(mean=3), dptune.Budget(3.0, 1e-5)
        )  # fmt: skip
        for t in (user, shipped)
    ]
    user_st, shipped_st = (p.statement.to_dict() for p in plans)
    # the same numbers, theorem and route; the user model's statement says one more thing checked
    user_checked, shipped_checked = user_st.pop("checked"), shipped_st.pop("checked")
    assert user_st == shipped_st
    assert user_checked[: len(shipped_checked)] == shipped_checked
    assert "the model (MLP) is the user's" in user_checked[-1]
    assert user.fingerprint == shipped.fingerprint
    assert user.privacy({"noise_multiplier": 1.0, "learning_rate": 1.0}) == shipped.privacy(
        {"noise_multiplier": 1.0, "learning_rate": 1.0}
    )
    described = user.describe()
    json.dumps(described)  # the journal binds it: JSON-safe, no object addresses
    assert described["base"]["model"]["params"]["['Dense_1']['kernel']"] == [6, 16]
    assert described == dptune.DpSgdTrainer(data, model=MLP(), base=base).describe()


def test_per_candidate_check_refuses_an_unaccounted_noise_multiplier_for_a_user_module():
    data = _data(600)

    base = dict(batch_size=50, epochs=1)
    assert_leak_refused(LeakyDpSgdTrainer(data, model=MLP(), base=base, epoch_progress=False))


def test_user_mistakes_are_one_line_refusals():
    data = _data(300)

    class WithBN(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x)))

    with pytest.raises(TuningConfigError, match="BatchNorm_0.*GroupNorm or nn.LayerNorm"):
        dptune.DpSgdTrainer(data, model=WithBN())
    with pytest.raises(TuningConfigError, match=r"dptune.Metric\(fn, lo=0.0, hi=1.0\)"):
        dptune.DpSgdTrainer(data, model=MLP(), metric=lambda out, y: out[:, 0])
    with pytest.raises(TuningConfigError, match="given twice"):
        dptune.DpSgdTrainer(data, model=MLP(), base={"model": "cnn26k"})
    with pytest.raises(TuningConfigError, match=r"needs \(num_classes,\) = \(3,\) logits"):
        dptune.DpSgdTrainer(data, model=nn.Dense(2))

    class Custom(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x @ self.param("w", nn.initializers.lecun_normal(), (6, 3))

    with pytest.raises(TuningConfigError, match="grad_impl='ghost' does not apply.*'w'"):
        dptune.DpSgdTrainer(data, model=Custom(), grad_impl="ghost")
    assert dptune.DpSgdTrainer(data, model=Custom()).grad_impl == "auto"  # vmap: fine


def test_tuned_user_module_releases_and_loads_back(tmp_path):
    data = _data()
    trainer = dptune.DpSgdTrainer(
        data, model=MLP(), base=dict(batch_size=60, epochs=2), epoch_progress=False
    )
    release = dptune.tune(
        trainer, SPACE, RandomStopping.logarithmic(mean=2), (4.0, 1e-5), workdir=tmp_path,
        seed=1, progress=False,
    )  # fmt: skip
    assert release.released and release.privacy["total_epsilon"] <= 4.0
    loaded = dptune.load_release(tmp_path)  # the workdir; its release/ folder works too
    assert loaded.hparams == release.hparams
    assert loaded.privacy_text == dptune.load_release(tmp_path / "release").privacy_text
    like = jax.eval_shape(MLP().init, jax.random.PRNGKey(0), jnp.zeros((1, 6)))["params"]
    typed = dptune.load_release(tmp_path, like=like)
    logits = MLP().apply({"params": typed.params}, data.test_x)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == data.test_y))
    assert accuracy == pytest.approx(release.test_accuracy, abs=1e-6)
    for a, b in zip(jax.tree_util.tree_leaves(loaded.params),
                    jax.tree_util.tree_leaves(release.payload["params"]), strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(FileNotFoundError, match="holds no release"):
        dptune.load_release(tmp_path / "private")


class _Regressor(nn.Module):
    """One output per record: arg-max "accuracy" over a single output is always index 0."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(jnp.tanh(nn.Dense(8)(x)))


def test_a_model_scored_by_its_own_metric_releases_that_metric_on_the_test_split(tmp_path):
    """A regression-like model with a declared metric (minus the absolute error, in [-3, 0]):
    the release reports that metric on the public test split, in its units, named, in the
    result, its text, report.md and what load_release reads back, and no arg-max "accuracy"
    (for one output it is the fraction of test labels equal to 0, a meaningless number that
    earlier releases printed as the model's test accuracy)."""
    data = _data()
    metric = dptune.Metric(lambda out, y: -jnp.abs(out[:, 0] - y), lo=-3.0, hi=0.0, name="neg_mae")
    trainer = dptune.DpSgdTrainer(
        data, model=_Regressor(), base=dict(batch_size=60, epochs=2), epoch_progress=False,
        loss=lambda out, y: (out[:, 0] - y) ** 2, metric=metric, test_curve=True,
    )  # fmt: skip
    release = dptune.tune(
        trainer, SPACE, RandomStopping.logarithmic(mean=2), (4.0, 1e-5), workdir=tmp_path,
        seed=1, progress=False,
    )  # fmt: skip
    assert release.released and release.test_accuracy is None
    assert release.test_metric["name"] == "neg_mae"
    out = _Regressor().apply({"params": release.params}, data.test_x)[:, 0]
    exact = float(np.mean(-np.clip(np.abs(np.asarray(out) - data.test_y), 0.0, 3.0)))
    assert release.test_metric["value"] == pytest.approx(exact, abs=1e-5)
    result = json.loads((tmp_path / "release" / "result.json").read_text())
    assert result["test_accuracy"] is None and result["test_metric"] == release.test_metric
    assert f"test neg_mae {release.test_metric['value']:.4g}" in str(release)
    assert "test accuracy" not in str(release)
    report = (tmp_path / "release" / "report.md").read_text()
    assert "**Test neg_mae**" in report and "Test accuracy" not in report
    assert "%" not in report.split("## What was released")[1].split("|")[0]  # no percentages
    # the per-epoch test curve (test_curve=True) carries the same metric under test_metric
    curve = json.loads((tmp_path / "release" / "training_curve.json").read_text())
    assert [set(row) & {"test_accuracy", "test_metric"} for row in curve] == [{"test_metric"}] * 2
    assert curve[-1]["test_metric"] == pytest.approx(release.test_metric["value"])
    assert dptune.load_release(tmp_path).test_metric == release.test_metric


def test_a_setting_the_space_can_draw_and_the_data_cannot_take_is_refused_before_charging(
    tmp_path,
):
    """augmult > 0 augments images; on tabular rows the loop refuses it. When the space draws it
    only sometimes (choice(0, 2): its example point is 0), the refusal still comes before
    anything runs or is charged, naming the field and value, not from a candidate failing after
    the run was charged."""
    data = _data(300)
    trainer = dptune.DpSgdTrainer(
        data, model=MLP(), base=dict(batch_size=60, epochs=1), epoch_progress=False
    )
    sp = {**SPACE, "augmult": space.choice(0, 2)}
    ledger = tmp_path / "ledger.sqlite"
    with pytest.raises(TuningConfigError, match=r"augmult=2.*\(at augmult=2, a value the search"):
        dptune.tune(
            trainer, sp, RandomStopping.logarithmic(mean=2), (4.0, 1e-5), progress=False,
            workdir=tmp_path / "run", ledger=ledger,
        )  # fmt: skip
    assert not (tmp_path / "run" / "private" / "journal.sqlite").exists()  # nothing trained
    assert not ledger.exists() or dptune.Ledger(ledger).spend(trainer.fingerprint) is None
