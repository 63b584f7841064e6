"""Any labels, inputs and outputs through dptune.DpSgdTrainer and dptune.tune: regression,
multi-label, next-token (sequence) labels, dict inputs and tuple outputs, each released and
reloaded; the refusals that say what to pass instead."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dptune
from dptune import space
from dptune.errors import TuningConfigError
from selection import RandomStopping

SPACE = {"learning_rate": space.log_uniform(0.3, 1.0), "noise_multiplier": "auto"}
N = 300


def _tune_and_reload(trainer, tmp_path):
    release = dptune.tune(
        trainer, SPACE, RandomStopping.logarithmic(mean=1.5), (4.0, 1e-5), workdir=tmp_path,
        seed=1, progress=False,
    )  # fmt: skip
    assert release.released and release.privacy["total_epsilon"] <= 4.0
    assert np.isfinite(release.validation_score)
    loaded = dptune.load_release(tmp_path)
    assert loaded.test_metric == release.test_metric
    return release, loaded


class Regressor(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(jnp.tanh(nn.Dense(8)(x)))[:, 0]


def test_float_regression_targets_train_release_and_reload(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N + 100, 4))
    y = x @ np.array([0.5, -0.3, 0.2, 0.1]) + 0.05 * rng.standard_normal(N + 100)
    data = dptune.Dataset.from_arrays(x[:N], y[:N], num_examples=N, x_test=x[N:], y_test=y[N:],
                                      validation_fraction=0.3)  # fmt: skip
    assert data.train_y.dtype == np.float32 and data.num_classes == 0 and not data.class_labels
    metric = dptune.Metric(lambda out, y: -jnp.abs(out - y), lo=-2.0, hi=0.0, name="neg_mae")
    trainer = dptune.DpSgdTrainer(
        data, model=Regressor(), loss=lambda out, y: (out - y) ** 2, metric=metric,
        base=dict(batch_size=50, epochs=1), epoch_progress=False,
    )  # fmt: skip
    release, loaded = _tune_and_reload(trainer, tmp_path)
    out = Regressor().apply({"params": release.params}, data.test_x)
    exact = float(np.mean(-np.clip(np.abs(np.asarray(out) - data.test_y), 0, 2)))
    assert release.test_metric["value"] == pytest.approx(exact, abs=1e-5)


class MultiLabel(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x)


def test_multi_label_targets_train_release_and_reload(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((N + 60, 5)).astype(np.float32)
    y = (x[:, :3] > 0).astype(np.float32)  # (n, 3) binary labels
    data = dptune.Dataset.from_arrays(x[:N], y[:N], num_examples=N, x_test=x[N:], y_test=y[N:])

    def loss(logits, y):
        return jnp.sum(optax.sigmoid_binary_cross_entropy(logits, y), axis=-1)

    def hamming(logits, y):
        return jnp.mean((logits > 0) == (y > 0.5), axis=-1)

    trainer = dptune.DpSgdTrainer(
        data, model=MultiLabel(), loss=loss, metric=dptune.Metric(hamming, 0.0, 1.0, "hamming"),
        base=dict(batch_size=50, epochs=1), epoch_progress=False,
    )  # fmt: skip
    release, _ = _tune_and_reload(trainer, tmp_path)
    assert 0.0 <= release.test_metric["value"] <= 1.0


VOCAB, LENGTH = 7, 6


class TinyLM(nn.Module):
    """Next-token logits (b, L, V) from token ids (b, L), with dropout in training mode."""

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        h = nn.Embed(VOCAB, 8)(tokens)
        h = nn.Dropout(0.1, deterministic=not train)(h)
        return nn.Dense(VOCAB)(jnp.tanh(nn.Dense(8)(h)))


def token_loss(logits, y):
    """A sequence is one record: its loss is the mean over its tokens, (b,)."""
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y), axis=-1)


def token_accuracy(logits, y):
    return jnp.mean(jnp.argmax(logits, -1) == y, axis=-1)


def test_next_token_sequence_labels_train_release_and_reload(tmp_path):
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, VOCAB, size=(N + 50, LENGTH + 1))
    tokens[:, 1:] = (tokens[:, :-1] + 1) % VOCAB  # a learnable rule: the next id is one more
    x, y = tokens[:, :-1], tokens[:, 1:]
    data = dptune.Dataset.from_arrays(x[:N], y[:N], num_examples=N, x_test=x[N:], y_test=y[N:],
                                      num_classes=VOCAB)  # fmt: skip
    assert data.train_y.shape[1:] == (LENGTH,) and data.num_classes == VOCAB
    trainer = dptune.DpSgdTrainer(
        data, model=TinyLM(), loss=token_loss,
        metric=dptune.Metric(token_accuracy, 0.0, 1.0, "token_accuracy"),
        base=dict(batch_size=50, epochs=1), epoch_progress=False,
    )  # fmt: skip
    release, _ = _tune_and_reload(trainer, tmp_path)
    logits = TinyLM().apply({"params": release.params}, data.test_x)  # evaluation mode
    exact = float(np.mean(token_accuracy(logits, data.test_y)))
    assert release.test_metric["value"] == pytest.approx(exact, abs=1e-5)


class TwoInputs(nn.Module):
    """A dict input: token ids and a per-record length (masking the padded positions)."""

    @nn.compact
    def __call__(self, batch):
        h = nn.Embed(VOCAB, 4)(batch["tokens"])
        keep = jnp.arange(LENGTH)[None, :] < batch["length"][:, None]
        pooled = jnp.sum(h * keep[..., None], axis=1) / jnp.maximum(batch["length"], 1)[:, None]
        return nn.Dense(2)(jnp.concatenate([pooled, batch["extra"]], axis=-1))


def _dict_data(n, rng):
    tokens = rng.integers(0, VOCAB, size=(n, LENGTH))
    length = rng.integers(1, LENGTH + 1, size=n)
    extra = rng.standard_normal((n, 2))
    y = (tokens[:, 0] > 3).astype(np.int64)
    return {"tokens": tokens, "length": length, "extra": extra}, y


def test_dict_inputs_reach_the_model_as_that_dict_and_release(tmp_path):
    rng = np.random.default_rng(3)
    x, y = _dict_data(N, rng)
    x_test, y_test = _dict_data(60, rng)
    data = dptune.Dataset.from_arrays(x, y, num_examples=N, x_test=x_test, y_test=y_test)
    assert data.input_layout is not None and data.train_x.shape[1:] == (LENGTH + 1 + 2,)
    back = data.input_layout.unpack(data.test_x)
    np.testing.assert_array_equal(back["tokens"], x_test["tokens"])
    np.testing.assert_array_equal(back["length"], x_test["length"])
    assert back["tokens"].dtype == np.int32 and back["extra"].dtype == np.float32
    trainer = dptune.DpSgdTrainer(
        data, model=TwoInputs(), base=dict(batch_size=50, epochs=1), epoch_progress=False
    )
    release, loaded = _tune_and_reload(trainer, tmp_path)
    logits = TwoInputs().apply({"params": loaded.params}, x_test)  # the user's own dict
    accuracy = float(np.mean(np.argmax(np.asarray(logits), 1) == y_test))
    assert accuracy == pytest.approx(release.test_accuracy, abs=1e-6)


class TupleOut(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = jnp.tanh(nn.Dense(8)(x))
        return nn.Dense(3)(h), {"aux": nn.Dense(1)(h)}


def test_tuple_outputs_with_a_loss_that_picks_the_logits_release(tmp_path):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((N + 60, 4))
    y = np.argmax(x[:, :3], axis=1)
    data = dptune.Dataset.from_arrays(x[:N], y[:N], num_examples=N, x_test=x[N:], y_test=y[N:])

    def loss(out, y):
        return optax.softmax_cross_entropy_with_integer_labels(out[0], y)

    def accuracy(out, y):
        return (jnp.argmax(out[0], -1) == y).astype(jnp.float32)

    trainer = dptune.DpSgdTrainer(
        data, model=TupleOut(), loss=loss, metric=dptune.Metric(accuracy, 0.0, 1.0, "acc"),
        base=dict(batch_size=50, epochs=1), epoch_progress=False,
    )  # fmt: skip
    release, _ = _tune_and_reload(trainer, tmp_path)
    logits, _ = TupleOut().apply({"params": release.params}, data.test_x)
    exact = float(np.mean(np.argmax(np.asarray(logits), 1) == data.test_y))
    assert release.test_metric["value"] == pytest.approx(exact, abs=1e-6)


def _class_data(n=120):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((n, 4))
    return x, np.argmax(x[:, :3], axis=1)


def test_default_loss_and_metric_refuse_what_they_cannot_read_and_say_what_to_pass():
    x, y = _class_data()
    floats = dptune.Dataset.from_arrays(x, y.astype(np.float64), num_examples=len(x))
    with pytest.raises(TuningConfigError, match=r"^dptune: .*default loss.*pass loss="):
        dptune.DpSgdTrainer(floats, model=Regressor())
    with pytest.raises(TuningConfigError, match=r"^dptune: .*shipped model 'cnn26k'.*loss="):
        dptune.DpSgdTrainer(floats)
    classes = dptune.Dataset.from_arrays(x, y, num_examples=len(x), num_classes=3)
    # a tuple output: the default loss needs one logits array; the message says so (it used to
    # be NumPy's "inhomogeneous shape")
    with pytest.raises(TuningConfigError, match=r"^dptune: .*returns a tuple.*pass loss="):
        dptune.DpSgdTrainer(classes, model=TupleOut())
    # loss= given, metric= not: accuracy cannot read a tuple
    with pytest.raises(TuningConfigError, match=r"^dptune: .*default metric.*metric=dptune.Metric"):
        dptune.DpSgdTrainer(classes, model=TupleOut(), loss=lambda o, y: jnp.sum(o[0], -1))


def test_string_labels_are_refused_with_how_to_encode_them():
    x, _ = _class_data(5)
    with pytest.raises(ValueError, match=r"^dptune: y holds <U.*np.unique\(y, return_inverse"):
        dptune.Dataset.from_arrays(x, np.array(list("abcab")), num_examples=5)


def test_loss_probes_use_label_shapes_like_the_real_ones_never_their_values():
    """A sequence loss reads labels (b, L): the check probes it with (3, L) zeros (it used to
    probe with (3,) integers: `axis 2 is out of bounds`), and the own-loop pieces too."""
    x = np.zeros((20, LENGTH), np.int32)
    y = np.zeros((20, LENGTH), np.int32)
    grad_sum = dptune.clipped_grad_sum(TinyLM(), loss=token_loss)
    params = TinyLM().init(jax.random.PRNGKey(0), x[:1])["params"]
    g, loss = grad_sum(params, x, y, np.ones(20, np.float32), 1.0)
    assert np.isfinite(float(loss))
    assert grad_sum.impl(x, y) in ("ghost", "vmap")


def test_labels_are_dropped_per_record_never_refused_on_private_values():
    x, y = _class_data(50)
    yf = y.astype(np.float32)
    yf[3] = np.nan  # a non-finite private target: that record alone is left out
    data = dptune.Dataset.from_arrays(x, yf, num_examples=50, validation_fraction=0.0)
    assert len(data.train_y) == 49 and np.isfinite(data.train_y).all()
    seq = np.zeros((50, 3), np.int64)
    seq[7, 1] = 9  # outside [0, num_classes): that sequence alone is dropped
    data = dptune.Dataset.from_arrays(x, seq, num_examples=50, num_classes=5,
                                      validation_fraction=0.0)  # fmt: skip
    assert len(data.train_y) == 49


CLI_MODULE = """
import flax.linen as nn
import jax.numpy as jnp
import numpy as np

import dptune


class Reg(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(jnp.tanh(nn.Dense(8)(x)))[:, 0]


def make(num_classes):
    assert num_classes == 0  # float labels are not class ids
    return {
        "model": Reg(),
        "loss": lambda out, y: (out - y) ** 2,
        "metric": dptune.Metric(lambda out, y: -jnp.abs(out - y), -2.0, 0.0, "neg_mae"),
    }
"""


def test_cli_npz_with_float_labels_and_a_factory_that_names_loss_and_metric(tmp_path, monkeypatch):
    import sys

    from dptune.cli.build import run_config
    from dptune.configs import user

    (tmp_path / "labels_cli_mod.py").write_text(CLI_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "labels_cli_mod", raising=False)
    rng = np.random.default_rng(6)
    x = rng.standard_normal((N + 50, 3)).astype(np.float32)
    y = (x @ np.array([0.4, -0.2, 0.1])).astype(np.float32)
    np.savez(tmp_path / "d.npz", x_train=x[:N], y_train=y[:N], x_test=x[N:], y_test=y[N:])
    c = user.get_config().to_dict()
    c["model"] = "labels_cli_mod:make"
    c["data"].update(source="npz", path=str(tmp_path / "d.npz"), num_examples=N,
                     validation_size=100)  # fmt: skip
    c["train"].update(epochs=1, batch_size=50, score_noise_std=4.0)
    c["selection"]["mean_trials"] = 1.5
    c["ledger"]["path"] = str(tmp_path / "ledger.sqlite")
    release = run_config(c, tmp_path / "w", seed=0, progress=False)
    assert release.released and release.test_metric["name"] == "neg_mae"
    assert dptune.load_release(tmp_path / "w").test_metric == release.test_metric


def test_a_validation_set_too_small_for_its_score_noise_is_warned_about(caplog):
    """4 expected validation records and score noise 10: the score's noise is 2.5 accuracy
    units, and the curator is told (from public numbers only); 400 records (0.025): silence."""
    from dptune.learners.dpsgd import score_noise

    x, y = _class_data(400)
    tiny = dptune.Dataset.from_arrays(x, y, num_examples=400, num_classes=3,
                                      validation_fraction=0.01)  # fmt: skip
    assert score_noise(10.0, tiny.public_num_val) == pytest.approx(2.5)
    with caplog.at_level("WARNING", logger="dptune"):
        dptune.DpSgdTrainer(tiny, model=MultiLabelHead(), base=dict(batch_size=50, epochs=1))
    assert "2.5 score units" in caplog.text and "at least 200 validation records" in caplog.text
    caplog.clear()
    ample = dptune.Dataset.from_arrays(x, y, num_examples=400, num_classes=3,
                                       validation_fraction=0.5)  # fmt: skip
    with caplog.at_level("WARNING", logger="dptune"):
        dptune.DpSgdTrainer(ample, model=MultiLabelHead(), base=dict(batch_size=50, epochs=1))
    assert "score units" not in caplog.text


class MultiLabelHead(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x)


def test_suggested_settings_follow_the_declared_size_and_the_optimiser():
    from dptune.learners.dpsgd import MAX_SCORE_NOISE, suggested_settings

    small, large = suggested_settings(2000), suggested_settings(60000, "adam")
    assert small["validation_size"] == 200 and 10.0 / 200 <= MAX_SCORE_NOISE
    assert (small["batch_size"], small["epochs"], small["mean_trials"]) == (64, 18, 4.0)
    assert suggested_settings(1999)["mean_trials"] == 2.0
    assert (large["validation_size"], large["batch_size"], large["epochs"]) == (1000, 256, 10)
    # Adam's range as published; SGD's scale with the batch (lr * C per record of the batch)
    assert large["learning_rate"] == (1e-4, 1e-2)
    assert small["learning_rate"] == pytest.approx((64 * 5e-5, 64 * 1e-3))
    assert suggested_settings(60000, "sgd")["learning_rate"] == pytest.approx((0.128, 2.56))
    # a user's model without batch size and epochs in `base` gets them from the table
    x, y = _class_data(2000)
    data = dptune.Dataset.from_arrays(x, y, num_examples=2000, num_classes=3)
    trainer = dptune.DpSgdTrainer(data, model=MultiLabelHead(), base=dict(optimizer="momentum"))
    assert (trainer.base["batch_size"], trainer.base["epochs"]) == (64, 18)


def test_two_candidates_with_sequence_labels_train_together():
    """The vectorise-or-not probe times a step on zeros shaped like the labels (b, L)."""
    rng = np.random.default_rng(7)
    x = rng.integers(0, VOCAB, size=(200, LENGTH))
    data = dptune.Dataset.from_arrays(x, (x + 1) % VOCAB, num_examples=200, num_classes=VOCAB)
    trainer = dptune.DpSgdTrainer(
        data, model=TinyLM(), loss=token_loss,
        metric=dptune.Metric(token_accuracy, 0.0, 1.0, "token_accuracy"),
        base=dict(batch_size=40, epochs=1, noise_multiplier=1.0), epoch_progress=False,
    )  # fmt: skip
    hps = [{"learning_rate": 0.5}, {"learning_rate": 1.0}]
    out = trainer.train_many(hps, [np.random.default_rng(i) for i in range(2)])
    assert all(np.isfinite(score) for score, _ in out)
