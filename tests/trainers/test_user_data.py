"""A user's arrays and model through trainers: Dataset.from_arrays (public sizes, per-record split),
2-D / integer-token / 4-D inputs through the training loop, the bounded metric's sensitivity, and
the own-loop pieces (schedule, clipped_grad_sum, add_noise)."""

from __future__ import annotations

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainers import loop, models
from trainers import step as step_lib
from trainers.data import Dataset, record_digests
from trainers.evaluate import BoundedMetric, metric_unit_sum, validation_score
from trainers.spec import DpSgdSchedule, Hyperparams, dpsgd_privacy
from trainers.userloop import add_noise, clipped_grad_sum


def _tabular(n=600, d=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d))
    return x, np.argmax(x @ rng.standard_normal((d, classes)), axis=1)


def test_from_arrays_needs_a_declared_size_and_splits_per_record(caplog):
    x, y = _tabular()
    with pytest.raises(ValueError, match="num_examples=<the public number of records"):
        Dataset.from_arrays(x, y, num_classes=3)
    with caplog.at_level(logging.WARNING):  # a warning, never a refusal (it would be private)
        far = Dataset.from_arrays(x, y, num_examples=1000, num_classes=3)
    assert "declared public size 1000" in caplog.text and far.public_num_train == 900
    with pytest.raises(ValueError, match="num_classes=...*public"):
        Dataset.from_arrays(x, y, num_examples=600)  # never read from the private labels
    d = Dataset.from_arrays(x, y, num_examples=600, validation_fraction=0.2, num_classes=3)
    assert d.train_x.dtype == np.float32 and d.train_x.shape[1:] == (6,)
    assert d.public_num_train == 480 and d.public_num_val == 120.0  # public: never len()
    assert len(d.train_x) + len(d.val_x) == 600 and d.split["kind"] == "record_hash"
    # removing one record moves no other between the splits
    fewer = Dataset.from_arrays(x[1:], y[1:], num_examples=600, validation_fraction=0.2,
                                num_classes=3)  # fmt: skip
    assert set(record_digests(fewer.val_x, fewer.val_y)) <= set(record_digests(d.val_x, d.val_y))
    assert fewer.public_num_train == d.public_num_train
    # num_classes from the PUBLIC test labels
    t = Dataset.from_arrays(x[:500], y[:500], num_examples=500, x_test=x[500:], y_test=y[500:])
    assert t.num_classes == int(y[500:].max()) + 1 and len(t.test_x) == 100


def test_from_arrays_public_validation_and_integer_tokens():
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 50, size=(300, 8))
    y = rng.integers(0, 2, size=300)
    d = Dataset.from_arrays(
        tokens[:200], y[:200], num_examples=200, public_validation=(tokens[200:], y[200:])
    )
    assert d.train_x.dtype == np.int32 and d.validation_public and d.public_num_val == 100
    assert d.num_classes == 2 and len(d.train_x) == 200
    # integer inputs hash as integers: ids beyond float32's exact range stay distinct records
    big = np.array([[2**24], [2**24 + 1]])
    assert len(set(record_digests(big, np.zeros(2, int)))) == 2
    # a private record with a label out of range is left out on its own (never a refusal)
    bad_y = y.copy()
    bad_y[:3] = 7
    kept = Dataset.from_arrays(tokens, bad_y, num_examples=300, num_classes=2)
    assert len(kept.train_x) + len(kept.val_x) == 297 and kept.public_num_train == 270
    with pytest.raises(ValueError, match="y_test must be integers in"):  # public labels
        Dataset.from_arrays(tokens, y, num_examples=300, x_test=tokens[:5], y_test=y[:5] + 5,
                            num_classes=2)  # fmt: skip


class _Text(nn.Module):
    @nn.compact
    def __call__(self, ids):
        return nn.Dense(2)(nn.Embed(50, 8)(ids).mean(axis=1))


class _Tabular(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(jnp.tanh(nn.Dense(8)(x)))


class _Images(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Conv(4, (3, 3), strides=2)(x))
        return nn.Dense(3)(nn.max_pool(x, (2, 2)).reshape(x.shape[0], -1))


@pytest.mark.parametrize("kind", ["tabular_2d", "tokens_int", "images_4d"])
def test_user_models_train_on_2d_token_and_4d_inputs(kind):
    """Before: any input that was not 4-D was taken for augmentation copies (a ValueError)."""
    rng = np.random.default_rng(2)
    if kind == "tabular_2d":
        x, y = _tabular(400)
        module = _Tabular()
    elif kind == "tokens_int":
        x = rng.integers(0, 50, size=(400, 6))
        y = (x[:, 0] < 25).astype(int)
        module = _Text()
    else:
        x = rng.uniform(size=(400, 6, 6, 1))
        y = rng.integers(0, 3, size=400)
        module = _Images()
    d = Dataset.from_arrays(x, y, num_examples=400, num_classes=int(y.max()) + 1)
    spec = models.user_model(module, d.image_shape, d.train_x.dtype, num_classes=d.num_classes)
    hp = Hyperparams(model=spec, batch_size=64, epochs=1, learning_rate=0.5, noise_multiplier=1.0)
    r = loop.train_candidate(hp, d, jax.random.PRNGKey(0))
    assert not r.failed, r.error
    assert np.isfinite(r.validation_score) and len(r.history) == 1
    if kind != "images_4d":  # augmentation multiplicity is for images only
        with pytest.raises(ValueError, match="augments images"):
            loop.train_candidate(
                Hyperparams(model=spec, batch_size=64, epochs=1, augmult=2), d,
                jax.random.PRNGKey(0),
            )  # fmt: skip


def test_bounded_metric_sum_has_sensitivity_one_under_add_remove():
    """Each record's value is clipped to [lo, hi] and rescaled to [0, 1]: adding or removing any
    one record (however extreme its raw value) moves the summed score by at most 1, the
    sensitivity the score noise is calibrated to. The raw clipped sum would move by up to
    max(|lo|, |hi|) = 3 here."""
    metric = BoundedMetric(lambda out, y: out[:, 0] * 100.0 - y, lo=-3.0, hi=1.0)
    spec = models.user_model(
        nn.Dense(2), (4,), "float32", loss=lambda o, y: jnp.sum(o**2, axis=1), metric=metric
    )
    params = models.init_params(spec, jax.random.PRNGKey(0))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((40, 4)).astype(np.float32) * 10  # raw values far outside [lo, hi]
    y = rng.integers(0, 2, size=40).astype(np.int32)
    full = metric_unit_sum(params, spec, x, y)
    moves = [abs(full - metric_unit_sum(params, spec, np.delete(x, i, 0), np.delete(y, i)))
             for i in range(len(x))]  # fmt: skip
    assert max(moves) <= 1.0 + 1e-5
    assert max(moves) > 0.9  # some record sits at a bound: the bound is attained, not loose
    raw = np.clip(np.asarray(metric.fn(spec.apply({"params": params}, x), y)), -3, 1)
    assert np.max(np.abs(raw)) == pytest.approx(3.0)  # what the unrescaled sum would move by
    with pytest.raises(ValueError, match="finite lo < hi"):
        BoundedMetric(lambda o, y: o[:, 0], lo=1.0, hi=1.0)


def test_user_metric_score_is_noisy_in_its_units():
    metric = BoundedMetric(lambda out, y: -jnp.abs(out[:, 0] - y), lo=-2.0, hi=0.0, name="neg_mae")
    x, y = _tabular(300, classes=2)
    d = Dataset.from_arrays(x, y, num_examples=300, num_classes=2)
    spec = models.user_model(_Tabular(), d.image_shape, d.train_x.dtype, metric=metric)
    params = models.init_params(spec, jax.random.PRNGKey(1))
    exact = metric_unit_sum(params, spec, d.val_x, d.val_y) / d.public_num_val
    scores = [validation_score(Hyperparams(model=spec, score_noise_std=10.0), params, d,
                               jax.random.PRNGKey(k)) for k in range(200)]  # fmt: skip
    # lo + (hi - lo) * (S + N(0, 10²)) / public size: mean at the exact value, std 2 * 10 / 30
    assert np.mean(scores) == pytest.approx(-2.0 + 2.0 * exact, abs=0.15)
    assert np.std(scores) == pytest.approx(2.0 * 10.0 / d.public_num_val, rel=0.15)


def test_own_loop_pieces_match_the_loop_declaration():
    """The schedule's privacy is the built-in trainer's (same q, steps, sigma), its batches are
    Poisson chunks of fixed shapes, clipped_grad_sum is bounded by C per example, and add_noise
    divides by the expected batch size."""
    hp = Hyperparams(batch_size=50, epochs=3, noise_multiplier=1.3)
    schedule = DpSgdSchedule.from_hyperparams(hp, 480)
    assert schedule.privacy(1.3) == dpsgd_privacy(hp, 480)
    assert schedule.steps == 3 * 10 and schedule.sampling_rate == 50 / 480
    batches = list(schedule.batches(475, np.random.default_rng(0), max_chunk=32))
    assert len(batches) == schedule.steps
    sizes = {tuple(len(i) for i, _ in chunks) for chunks in batches}
    assert all(s[:2] == (32, 32) for s in sizes)  # fixed body chunks: no recompiles
    assert all(int(m.sum()) <= len(m) for chunks in batches for _, m in chunks)

    x, y = _tabular(64)
    x = x.astype(np.float32)
    module = _Tabular()
    params = module.init(jax.random.PRNGKey(0), x[:1])["params"]
    grad_sum = clipped_grad_sum(module)
    assert grad_sum.impl(x) == "ghost"
    by_apply = clipped_grad_sum(lambda p, x: module.apply({"params": p}, x))
    assert by_apply.impl(x) == "vmap"
    mask = np.ones(64, np.float32)
    g1, loss1 = grad_sum(params, x, y, mask, 0.1)
    g2, _ = by_apply(params, x, y, mask, 0.1)
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7)
    norm = np.sqrt(sum(float(jnp.sum(v**2)) for v in jax.tree_util.tree_leaves(g1)))
    assert norm <= 64 * 0.1 * (1 + 1e-6) and np.isfinite(float(loss1))
    zero = jax.tree_util.tree_map(jnp.zeros_like, g1)
    noisy = add_noise(zero, jax.random.PRNGKey(0), 2.0, 0.5, expected_batch_size=4.0)
    leaf = np.asarray(noisy["Dense_1"]["kernel"])
    assert abs(leaf.std() / (2.0 * 0.5 / 4.0) - 1) < 0.3


def test_init_apply_pair_trains_on_the_vmap_path():
    """Non-linen JAX code: an (init_fn, apply_fn) pair takes the generic path, said by the plan."""

    def init_fn(key, x):
        return {"w": 0.1 * jax.random.normal(key, (x.shape[-1], 3)), "b": jnp.zeros(3)}

    def apply_fn(params, x):
        return x @ params["w"] + params["b"]

    x, y = _tabular(400)
    d = Dataset.from_arrays(x, y, num_examples=400, num_classes=3)
    spec = models.user_model((init_fn, apply_fn), d.image_shape, d.train_x.dtype, num_classes=3)
    assert step_lib.resolve_grad_impl(spec, "auto", d.image_shape) == "vmap"
    with pytest.raises(ValueError, match="grad_impl='ghost' does not apply"):
        step_lib.resolve_grad_impl(spec, "ghost", d.image_shape)
    hp = Hyperparams(model=spec, batch_size=64, epochs=2, learning_rate=1.0, noise_multiplier=0.5)
    r = loop.train_candidate(hp, d, jax.random.PRNGKey(0))
    assert not r.failed and set(r.params) == {"w", "b"} and np.isfinite(r.validation_score)
