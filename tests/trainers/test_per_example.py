"""Per example by construction, at the edges of users' models: models that mix the examples of a
batch (at any position, active only away from initialisation) are refused, and whatever slips
past a probe is still clipped and counted per example; a record whose gradient is not finite,
or a padding slot that points at one, contributes exactly 0 on every clipping path; non-finite
private features are dropped per record and non-finite public ones refused."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainers import dpsgd, evaluate, ghost, models, step
from trainers.data import DROP_FEATURES, Dataset

B = 4


def _loss(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _norm(tree) -> float:
    return float(jnp.sqrt(sum(jnp.sum(v.astype(jnp.float32) ** 2)
                              for v in jax.tree_util.tree_leaves(tree))))  # fmt: skip


def _away_from_init(params, seed):
    """Initial parameters plus N(0, 0.5²): a zero-initialised branch is active here."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda v: jnp.asarray(np.asarray(v) + rng.normal(0, 0.5, v.shape), v.dtype), params
    )


# --- models that mix the examples of a batch ---------------------------------------------------


def _mix(kind: str, h: jax.Array) -> jax.Array:
    """An operation along the batch axis (axis 0) of h (b, d)."""
    if kind == "last":  # every example reads the last one (a later row)
        return jnp.broadcast_to(h[-1:], h.shape)
    if kind == "roll":  # example i reads example i + 1
        return jnp.roll(h, -1, axis=0)
    if kind == "mean":  # h - mean over the batch
        return h - jnp.mean(h, axis=0, keepdims=True)
    # attention across the batch to later rows only (row i attends to rows j > i; the last row
    # to itself)
    b = h.shape[0]
    j = jnp.arange(b)
    later = (j[None, :] > j[:, None]) | ((j[:, None] == b - 1) & (j[None, :] == b - 1))
    return jax.nn.softmax(jnp.where(later, h @ h.T, -jnp.inf), axis=1) @ h


class _Mixer(nn.Module):
    """Dense/LayerNorm layers on (b, d) rows, with a mixing operation after layer ``at``: added
    as it is (``gated`` False) or through a zero-initialised Dense (active only away from
    initialisation); then a 3-class head."""

    layers: tuple
    at: int
    kind: str
    gated: bool

    @nn.compact
    def __call__(self, x):
        h = x
        for i, layer in enumerate(self.layers):
            h = jnp.tanh(nn.Dense(5)(h)) if layer == "dense" else nn.LayerNorm()(h)
            if i == self.at:
                m = _mix(self.kind, h)
                if self.gated:
                    m = nn.Dense(h.shape[-1], kernel_init=nn.initializers.zeros)(m)
                h = h + m
        return nn.Dense(3)(h)


_MIXERS = dict(
    layers=st.lists(st.sampled_from(["dense", "layernorm"]), min_size=1, max_size=3),
    at=st.integers(0, 2),
    kind=st.sampled_from(["last", "roll", "mean", "attention"]),
    gated=st.booleans(),
    seed=st.integers(0, 2**16),
)


def _removed(x, mask, i):
    """The batch without example i, as the sampler pads it: the slot points at another record
    (here the next example) with mask 0."""
    x2, m2 = x.copy(), mask.copy()
    x2[i], m2[i] = x[(i + 1) % len(x)], 0
    return x2, m2


def _check_mixer(layers, at, kind, gated, seed):
    module = _Mixer(tuple(layers), min(at, len(layers) - 1), kind, gated)
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, 4)).astype(np.float32)
    y = rng.integers(0, 3, B).astype(np.int32)
    # Refused: the probe replaces every position, at the initial parameters and random draws.
    with pytest.raises(ValueError, match="mixes examples"):
        models.user_model(module, (4,), "float32")
    params = _away_from_init(module.init(jax.random.PRNGKey(seed), x[:1])["params"], seed)
    # Clipped per example even where a probe would not see the mixing: both clipping paths run
    # each example on its own, so removing one moves the clipped sum by at most C.
    clip = 0.1
    ghost_sum = jax.jit(
        lambda x, m: ghost.clipped_sum_ghost(module, _loss, params, x, y, m, clip)[0]
    )
    vmap_sum = jax.jit(lambda x, m: dpsgd.clipped_sum_naive(module.apply, params, x, y, m, clip,
                                                            _loss)[0])  # fmt: skip
    mask = np.ones(B, np.float32)
    i = seed % B
    x2, m2 = _removed(x, mask, i)
    for fn in (ghost_sum, vmap_sum):
        full = fn(x, mask)
        moved = jax.tree_util.tree_map(jnp.subtract, full, fn(x2, m2))
        assert _norm(moved) <= clip * (1 + 1e-5)
    # The validation count: removing one record moves it by at most 1.
    val_x = rng.standard_normal((9, 4)).astype(np.float32)
    val_y = rng.integers(0, 3, 9).astype(np.int32)
    full = evaluate.count_correct(params, module, val_x, val_y)
    keep = np.arange(9) != i
    assert abs(full - evaluate.count_correct(params, module, val_x[keep], val_y[keep])) <= 1


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(**_MIXERS)
def test_models_that_mix_examples_are_refused_and_still_clipped_per_example(
    layers, at, kind, gated, seed
):
    """Property: a model that mixes the examples of its batch, at a random position, with the
    mixing on at initialisation or only away from it, is refused by ``user_model``; and were
    it not (mixing a probe cannot see), the clipped sums (ghost and vmap(grad), away from
    initialisation) and the validation count still move by at most their sensitivity (C, 1)
    when one example is removed. (Three fixed draws here; the slow twin draws 25.)"""
    _check_mixer(layers, at, kind, gated, seed)


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(**_MIXERS)
def test_models_that_mix_examples_many(layers, at, kind, gated, seed):
    _check_mixer(layers, at, kind, gated, seed)


def test_the_issues_mixing_models_are_refused():
    """Mixing that leaves example 0 alone, or that is off at initialisation: each passed the old
    probe (example 0 replaced, at the initial or all-zero parameters)."""

    class LastRow(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(4)(x)
            return nn.Dense(3)(h + h[-1:])

    class ZeroResidual(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(4)(x)
            branch = nn.Dense(4, kernel_init=nn.initializers.zeros)(h - h.mean(0, keepdims=True))
            return nn.Dense(3)(h + branch)

    for module in (LastRow(), ZeroResidual()):
        with pytest.raises(ValueError, match="mixes examples"):
            models.user_model(module, (4,), "float32")
        params = jax.tree_util.tree_map(
            jnp.zeros_like, module.init(jax.random.PRNGKey(0), jnp.zeros((1, 4)))["params"]
        )  # the plan's parameters (step.ghost_plan): all zeros
        plan = ghost.analyze(module, params, jax.ShapeDtypeStruct((3, 4), jnp.float32), _loss,
                             jax.ShapeDtypeStruct((3,), jnp.int32))  # fmt: skip
        assert "mixes examples" in plan.reason


def test_the_validation_count_of_a_mixing_model_moves_by_at_most_one():
    """Every record's prediction reads the batch's sum of feature 0: evaluated in batches, one
    record removed flipped all the others (the count moved by 9 of 10); per record it moves by
    at most 1."""

    def apply(params, x):
        s = jnp.sum(x[:, 0]) * jnp.ones(x.shape[0])
        return jnp.stack([s, -s], axis=1) + 0 * params["w"]

    spec = models.ModelSpec("summing", None, (2,), None, "float32", None, apply, shipped=False)
    x = np.zeros((10, 2), np.float32)
    x[:, 0] = [-0.1] * 9 + [5.0]  # the batch sum is positive only with record 9
    y = np.zeros(10, np.int32)  # label 0: correct where the sum is positive
    params = {"w": jnp.zeros(())}
    full = evaluate.count_correct(params, spec, x, y)
    without = evaluate.count_correct(params, spec, x[:9], y[:9])
    assert abs(full - without) <= 1
    assert (full, without) == (1, 0)  # only record 9 itself, alone, is positive


# --- one record with a non-finite gradient ------------------------------------------------------


class _Tokens(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Embed(5, 4)(x)
        return nn.Dense(3)(nn.LayerNorm()(jnp.tanh(nn.Dense(4)(h))).mean(axis=1))


class _WSNet(nn.Module):
    """Weight-standardised convolutions (reparametrised layers of the ghost path) and a head."""

    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(models.WSConv(3, name="a")(x))
        x = jnp.tanh(models.WSConv(3, name="b")(x))
        return nn.Dense(3)(x.reshape(x.shape[0], -1))


def _nan_record_case(fn, params, x, y, x_ok):
    """Record 0 has a non-finite gradient; slot 3 is padding pointing at it (mask 0). The clipped
    sum must equal the one with record 0 replaced by a finite input and masked out, and be
    finite."""
    mask = np.ones(len(x), np.float32)
    mask[3] = 0
    x = x.copy()
    x[3] = x[0]  # a padding slot points at record 0
    got, loss, _ = fn(params, x, y, mask, 0.5)
    ref_x = x.copy()
    ref_x[0] = ref_x[3] = x_ok
    ref_mask = mask.copy()
    ref_mask[0] = 0
    want, want_loss, _ = fn(params, ref_x, y, ref_mask, 0.5)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert np.all(np.isfinite(g))
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7)
    assert np.isfinite(loss) and abs(float(loss) - float(want_loss)) <= 1e-4 * abs(float(want_loss))


@pytest.mark.parametrize("path", ["ghost", "vmap"])
def test_a_token_id_out_of_vocabulary_drops_only_its_record(path):
    """nn.Embed gives NaN for a token id equal to the vocabulary size: that record (and the
    padding slot that points at it) adds exactly 0; the other records' sum is unchanged."""
    module = _Tokens()
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, (6, 3)).astype(np.int32)
    x[0, 1] = 5
    y = rng.integers(0, 3, 6).astype(np.int32)
    params = module.init(jax.random.PRNGKey(0), x[:1] % 5)["params"]
    spec = models.user_model(module, (3,), "int32")
    assert step.resolve_grad_impl(spec, "auto", (3,)) == "ghost"
    if path == "ghost":
        fn = jax.jit(lambda p, x, y, m, c: ghost.clipped_sum_ghost(module, _loss, p, x, y, m, c))
    else:
        fn = jax.jit(lambda p, x, y, m, c: dpsgd.clipped_sum_naive(module.apply, p, x, y, m, c,
                                                                   _loss))  # fmt: skip
    _nan_record_case(fn, params, x, y, np.zeros(3, np.int32))


def test_a_nan_image_drops_only_its_record_on_reparametrised_ghost_layers():
    """Weight-standardised convolutions: the reparametrised clipped sum and the ordering of the
    layers' norms must not carry one record's NaN to the others."""
    module = _WSNet()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 4, 4, 2)).astype(np.float32)
    x[0, 2, 2, 1] = np.nan
    y = rng.integers(0, 3, 5).astype(np.int32)
    params = module.init(jax.random.PRNGKey(0), x[1:2])["params"]
    fn = jax.jit(lambda p, x, y, m, c: ghost.clipped_sum_ghost(module, _loss, p, x, y, m, c))
    _nan_record_case(fn, params, x, y, np.zeros((4, 4, 2), np.float32))


@pytest.mark.parametrize("model", ["cnn26k", "scatter_linear"])
def test_a_nan_image_drops_only_its_record_on_the_shipped_fast_paths(model):
    spec = models.get_model(model)
    fn = jax.jit(
        dpsgd.clipped_sum_bookkeeping if model == "cnn26k" else dpsgd.clipped_sum_scatter_linear
    )
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, *spec.input_shape)).astype(np.float32)
    x[0, 3, 3, 0] = np.inf
    y = rng.integers(0, 10, 5).astype(np.int32)
    params = models.init_params(spec, jax.random.PRNGKey(0))
    _nan_record_case(fn, params, x, y, np.zeros(spec.input_shape, np.float32))


def test_clip_factors_are_zero_for_masked_and_non_finite_examples():
    sq = jnp.array([4.0, jnp.nan, jnp.inf, 0.25, 1.0])
    mask = jnp.array([1.0, 1.0, 1.0, 1.0, 0.0])
    np.testing.assert_array_equal(dpsgd.clip_factors(sq, mask, 1.0), [0.5, 0.0, 0.0, 1.0, 0.0])
    rows = jnp.array([[1.0, 1.0], [jnp.nan, 1.0], [jnp.inf, 0.0], [2.0, 2.0], [jnp.nan, 0.0]])
    c = dpsgd.clip_factors(sq, mask, 1.0)
    np.testing.assert_array_equal(c @ dpsgd.keep_rows(c, rows), [2.5, 2.5])


# --- non-finite features -----------------------------------------------------------------------


def _arrays(n=40):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((n, 3)).astype(np.float32)
    return x, rng.integers(0, 2, n).astype(np.int32)


def test_from_arrays_drops_records_with_non_finite_features_and_counts_them_privately():
    x, y = _arrays()
    x[5, 1], x[7, 0] = np.nan, -np.inf
    data = Dataset.from_arrays(x, y, num_examples=40, num_classes=2, validation_fraction=0.25)
    kept = np.concatenate([data.train_x, data.val_x])
    assert len(kept) == 38 and np.isfinite(kept).all()
    assert data.sanitized == {DROP_FEATURES: 2}
    # the same records, without the bad ones, go the same way (each record's split is its own)
    clean = Dataset.from_arrays(np.delete(x, [5, 7], 0), np.delete(y, [5, 7]), num_examples=40,
                                num_classes=2, validation_fraction=0.25)  # fmt: skip
    np.testing.assert_array_equal(clean.train_x, data.train_x)


@pytest.mark.parametrize("where", ["x_test", "public_validation"])
def test_non_finite_public_features_are_refused_in_one_line_naming_the_field(where):
    x, y = _arrays()
    xt, yt = _arrays(10)
    xt[4, 2] = np.nan
    kw = {"x_test": xt, "y_test": yt} if where == "x_test" else {"public_validation": (xt, yt)}
    with pytest.raises(ValueError, match=rf"^{where}.* 1 record\(s\) with a NaN or infinite "
                       r"feature, e.g. records \[4\]") as e:  # fmt: skip
        Dataset.from_arrays(x, y, num_examples=40, num_classes=2, **kw)
    assert "\n" not in str(e.value)


def test_the_npz_route_drops_and_refuses_the_same_way(tmp_path):
    from dptune.cli.build import ConfigError, load_data
    from dptune.configs import user

    x, y = _arrays()
    x[2, 0] = np.nan
    xt, yt = _arrays(10)
    cfg = user.get_config().to_dict()
    cfg["data"].update(source="npz", path=str(tmp_path / "d.npz"), num_examples=40,
                       validation_size=10, num_classes=2)  # fmt: skip
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)
    assert load_data(cfg).sanitized == {DROP_FEATURES: 1}
    xt[0, 0] = np.inf
    np.savez(tmp_path / "d.npz", x_train=x, y_train=y, x_test=xt, y_test=yt)
    with pytest.raises(ConfigError, match=r"config\.data.*x_test has 1 record\(s\) with a NaN"):
        load_data(cfg)


@pytest.mark.parametrize("n", [1, 7, 9, 40, 1000, 1001, 2047])
def test_counts_are_exact_at_every_padding_boundary(n):
    """Batches of 1,000 records, the last padded to a power of two: padding never counts, and
    no record is dropped or counted twice at any boundary."""

    def apply(params, x):
        return jnp.stack([x[:, 0], -x[:, 0]], axis=1) + 0 * params["w"]

    spec = models.ModelSpec("sign", None, (1,), None, "float32", None, apply, shipped=False)
    x = np.random.default_rng(n).normal(size=(n, 1)).astype(np.float32)
    y = np.zeros(n, np.int32)  # correct where x > 0; padding rows are 0, counted as class 0
    assert evaluate.count_correct({"w": jnp.zeros(())}, spec, x, y) == int(np.sum(x[:, 0] > 0))
