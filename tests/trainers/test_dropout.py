"""Dropout in a user's model: per-example, per-step masks at training time, none at evaluation;
the ghost path keeps working and equals vmap(grad) with the same masks; removing one example
moves the clipped sum by at most C on both paths."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainers import dpsgd, ghost, models, step, train_mode


class DropMLP(nn.Module):
    """Dropout between known layers (Dense, LayerNorm), switched by a `train` keyword."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = jnp.tanh(nn.LayerNorm()(nn.Dense(16)(x)))
        h = nn.Dropout(0.5, deterministic=not train)(h)
        return nn.Dense(3)(h)


class DetMLP(nn.Module):
    """Flax's other spelling: a `deterministic` keyword."""

    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        return nn.Dense(3)(nn.Dropout(0.5)(nn.Dense(8)(x), deterministic=deterministic))


def _spec(module=None):
    return models.user_model(module or DropMLP(), (5,), "float32")


def _batch(b=6, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((b, 5)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, b), jnp.int32)
    return x, y


def _sums(spec, params, x, y, mask, rng, impl):
    call = spec.training(rng)
    loss = dpsgd.per_example_loss
    if impl == "ghost":
        return ghost.clipped_sum_ghost(call, loss, params, x, y, mask, 1.0)
    return dpsgd.clipped_sum_naive(call.apply_slots, params, x, y, mask, 1.0, loss, False, True)


def _flat(tree):
    return np.concatenate([np.ravel(v) for v in jax.tree_util.tree_leaves(tree)])


# Checks shared with the NNX twins (tests/trainers/test_nnx_dropout.py), for a model spec with
# dropout on 5 float features and 3 classes, and its parameters.


def check_masks_follow_the_key(spec, params, x):
    """Two steps' keys give different masks, the same key the same; evaluation is deterministic.
    Returns (a training-mode output, the evaluation output)."""
    v = {"params": params}
    a = spec.training(jax.random.PRNGKey(1)).apply(v, x)
    b = spec.training(jax.random.PRNGKey(2)).apply(v, x)
    again = spec.training(jax.random.PRNGKey(1)).apply(v, x)
    assert not np.allclose(a, b)  # two steps' keys: different masks
    np.testing.assert_array_equal(a, again)  # the same key: the same masks
    evaluated = spec.apply(v, x)
    np.testing.assert_array_equal(evaluated, spec.apply(v, x))  # deterministic
    return a, evaluated


def check_one_example_alone(spec, params):
    """Example 0 changed: the other rows' outputs stay; the examples do not share one mask."""
    x, _ = _batch()
    x2 = x.at[0].set(jnp.ones(5) * 3.0)
    call = spec.training(jax.random.PRNGKey(3))
    a, b = call.apply({"params": params}, x), call.apply({"params": params}, x2)
    np.testing.assert_array_equal(a[1:], b[1:])
    assert not np.allclose(a[0], b[0])
    # slot i's mask differs from slot j's: the examples do not share one mask
    rows = call.apply({"params": params}, jnp.tile(x[:1], (6, 1)))
    assert len({tuple(np.round(np.asarray(r), 5)) for r in rows}) > 1


def check_removal_moves_at_most_c(spec, params, impl):
    """Removing example k moves the clipped sum by exactly its clipped gradient, at most C = 1."""
    x, y = _batch(8)
    rng = jax.random.PRNGKey(11)
    full = jnp.ones(8, jnp.float32)
    base, _, norms = _sums(spec, params, x, y, full, rng, impl)
    assert float(jnp.min(norms)) > 0
    for k in range(8):
        other, _, _ = _sums(spec, params, x, y, full.at[k].set(0.0), rng, impl)
        moved = float(np.linalg.norm(_flat(base) - _flat(other)))
        assert moved <= 1.0 + 1e-5
        # exactly example k's clipped gradient: min(1, C / |g_k|) |g_k|
        assert moved == pytest.approx(min(1.0, float(norms[k])), rel=1e-4, abs=1e-6)


def check_ghost_and_vmap_agree(spec, params):
    """The ghost and vmap(grad) paths draw the same masks: the same norms, losses and sums.
    Returns (the ghost sum, x, y, mask)."""
    x, y = _batch(7)
    mask = jnp.ones(7, jnp.float32).at[2].set(0.0)
    rng = jax.random.PRNGKey(5)
    g1, l1, n1 = _sums(spec, params, x, y, mask, rng, "ghost")
    g2, l2, n2 = _sums(spec, params, x, y, mask, rng, "vmap")
    np.testing.assert_allclose(n1, n2, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(l1, l2, rtol=2e-5)
    np.testing.assert_allclose(_flat(g1), _flat(g2), rtol=2e-4, atol=2e-6)
    return g1, x, y, mask


def check_compiled_step_keys(spec, params, impl):
    """The compiled step's chunk sum: two candidate keys differ, the same key repeats."""
    fns = step.get_step_functions(spec, 0, "sgd", impl)
    x, y = _batch(8)
    idx, mask = jnp.arange(8, dtype=jnp.int32), jnp.ones(8, jnp.float32)

    def run(seed):
        key = jax.random.PRNGKey(seed)
        return _flat(fns.chunk_sum(params, x, y, idx, mask, jnp.float32(1.0), key, 0, 0)[0])

    a, b, a2 = run(1), run(2), run(1)
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(a, a2)


def test_the_call_keyword_is_detected_and_the_ghost_path_still_applies():
    spec = _spec()
    assert spec.call_keyword == "train" and spec.stochastic
    assert _spec(DetMLP()).call_keyword == "deterministic"
    assert not _spec(nn.Dense(3)).stochastic  # no keyword: called as it is
    assert step.resolve_grad_impl(spec, "auto", (5,)) == "ghost"


def test_dropout_is_on_at_training_time_per_key_and_off_at_evaluation():
    spec = _spec()
    params = models.init_params(spec, jax.random.PRNGKey(0))
    x, _ = _batch()
    _, evaluated = check_masks_follow_the_key(spec, params, x)
    np.testing.assert_array_equal(evaluated, DropMLP().apply({"params": params}, x, train=False))
    # the step keys: one stream per (candidate key, step, chunk), apart from the noise's
    key = jax.random.PRNGKey(7)
    keys = {tuple(np.asarray(train_mode.dropout_key(key, s, c))) for s in range(3) for c in (0, 1)}
    assert len(keys) == 6 and tuple(np.asarray(jax.random.fold_in(key, 0))) not in keys


def test_one_examples_mask_and_output_do_not_depend_on_another_example():
    spec = _spec()
    check_one_example_alone(spec, models.init_params(spec, jax.random.PRNGKey(0)))


@pytest.mark.parametrize("impl", ["ghost", "vmap"])
def test_removing_one_example_moves_the_clipped_sum_by_at_most_c(impl):
    spec = _spec()
    check_removal_moves_at_most_c(spec, models.init_params(spec, jax.random.PRNGKey(0)), impl)


def test_ghost_and_vmap_paths_draw_the_same_masks_and_agree():
    spec = _spec()
    check_ghost_and_vmap_agree(spec, models.init_params(spec, jax.random.PRNGKey(0)))


@pytest.mark.parametrize("impl", ["ghost", "vmap"])
def test_the_compiled_step_trains_with_dropout_on_both_paths(impl):
    """The built-in step draws the chunk's dropout key from the candidate key: two different
    candidate keys give different clipped sums, the same key the same."""
    spec = _spec()
    check_compiled_step_keys(spec, models.init_params(spec, jax.random.PRNGKey(0)), impl)


def test_a_model_that_needs_an_rng_to_evaluate_is_refused_with_the_convention():
    class AlwaysDrop(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.Dropout(0.5, deterministic=False)(x))

    with pytest.raises(
        ValueError, match=r"^dptune: .*needs PRNG.*`train` \(or `deterministic`\) keyword"
    ):
        models.user_model(AlwaysDrop(), (4,), "float32")


def test_dropout_with_a_trainable_part_agrees_on_both_paths_and_leaves_the_frozen_part_zero():
    """Fine-tuning's trainable mask and the per-example dropout keys together in the step: the
    ghost and vmap(grad) sums agree (the same masks) and are zero at the frozen layer."""
    import dataclasses

    from trainers import finetune

    base = _spec()
    params = models.init_params(base, jax.random.PRNGKey(0))
    trainable = finetune.trainable_mask(params, ["LayerNorm_0", "Dense_1"])
    spec = dataclasses.replace(base, trainable=trainable)
    x, y = _batch(8)
    idx, mask = jnp.arange(8, dtype=jnp.int32), jnp.ones(8, jnp.float32).at[3].set(0.0)
    key = jax.random.PRNGKey(4)
    sums = [
        step.get_step_functions(spec, 0, "sgd", impl).chunk_sum(
            params, x, y, idx, mask, jnp.float32(1.0), key, 2, 1
        )[0]
        for impl in ("ghost", "vmap")
    ]
    assert not np.any(np.asarray(sums[0]["Dense_0"]["kernel"]))
    assert np.any(np.asarray(sums[0]["Dense_1"]["kernel"]))
    for a, b in zip(*(jax.tree_util.tree_leaves(s) for s in sums), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
