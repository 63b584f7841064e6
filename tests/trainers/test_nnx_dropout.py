"""Dropout in an NNX model (``nnx.Dropout`` holding its ``nnx.Rngs``): per-example, per-step masks
at training time from the step's key, none at evaluation; the ghost path equals vmap(grad) with
the same masks; removing one example moves the clipped sum by at most C."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.trainers.test_dropout import _batch, _sums  # the same batch and both clipped sums
from trainers import dpsgd, ghost, models, step


class DropMLP(nnx.Module):
    """Dropout between known layers (Linear, LayerNorm)."""

    def __init__(self, rngs: nnx.Rngs, rate: float = 0.5):
        self.a = nnx.Linear(5, 16, rngs=rngs)
        self.norm = nnx.LayerNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=nnx.Rngs(dropout=0))
        self.b = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.b(self.drop(jnp.tanh(self.norm(self.a(x)))))


def _spec(rate: float = 0.5):
    return models.user_model(DropMLP(nnx.Rngs(0), rate), (5,), "float32")


def _flat(tree):
    return np.concatenate([np.ravel(v) for v in jax.tree_util.tree_leaves(tree)])


def test_an_nnx_dropout_model_trains_in_training_mode_on_the_ghost_path():
    spec = _spec()
    assert spec.stochastic
    assert step.ghost_plan(spec).supported, step.ghost_plan(spec).reason

    class Plain(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(5, 3, rngs=rngs)

        def __call__(self, x):
            return self.a(x)

    assert not models.user_model(Plain(nnx.Rngs(0)), (5,), "float32").stochastic


def test_dropout_is_on_at_training_time_per_key_and_off_at_evaluation():
    spec = _spec()
    params = models.init_params(spec, None)
    x, y = _batch()
    v = {"params": params}
    a = spec.training(jax.random.PRNGKey(1)).apply(v, x)
    b = spec.training(jax.random.PRNGKey(2)).apply(v, x)
    again = spec.training(jax.random.PRNGKey(1)).apply(v, x)
    assert not np.allclose(a, b)  # two steps' keys: different masks
    np.testing.assert_array_equal(a, again)  # the same key: the same masks
    evaluated = spec.apply(v, x)
    np.testing.assert_array_equal(evaluated, spec.apply(v, x))  # deterministic
    no_dropout = _spec(rate=0.0)
    np.testing.assert_allclose(evaluated, no_dropout.apply(v, x), rtol=1e-6, atol=1e-7)
    assert not np.allclose(a, evaluated)
    # the clipped sums of two steps differ, and repeat with the same key
    mask = jnp.ones(6, jnp.float32)
    s1, s2, s1b = (
        _flat(_sums(spec, params, x, y, mask, jax.random.PRNGKey(k), "ghost")[0]) for k in (1, 2, 1)
    )
    assert not np.allclose(s1, s2)
    np.testing.assert_array_equal(s1, s1b)


def test_one_examples_mask_and_output_do_not_depend_on_another_example():
    spec = _spec()
    params = models.init_params(spec, None)
    x, _ = _batch()
    x2 = x.at[0].set(jnp.ones(5) * 3.0)
    call = spec.training(jax.random.PRNGKey(3))
    a, b = call.apply({"params": params}, x), call.apply({"params": params}, x2)
    np.testing.assert_array_equal(a[1:], b[1:])
    assert not np.allclose(a[0], b[0])
    # slot i's mask differs from slot j's: the examples do not share one mask
    rows = call.apply({"params": params}, jnp.tile(x[:1], (6, 1)))
    assert len({tuple(np.round(np.asarray(r), 5)) for r in rows}) > 1


@pytest.mark.parametrize("impl", ["ghost", "vmap"])
def test_removing_one_example_moves_the_clipped_sum_by_at_most_c(impl):
    spec = _spec()
    params = models.init_params(spec, None)
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


def test_ghost_and_vmap_paths_draw_the_same_masks_and_agree():
    spec = _spec()
    params = models.init_params(spec, None)
    x, y = _batch(7)
    mask = jnp.ones(7, jnp.float32).at[2].set(0.0)
    rng = jax.random.PRNGKey(5)
    g1, l1, n1 = _sums(spec, params, x, y, mask, rng, "ghost")
    g2, l2, n2 = _sums(spec, params, x, y, mask, rng, "vmap")
    np.testing.assert_allclose(n1, n2, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(l1, l2, rtol=2e-5)
    np.testing.assert_allclose(_flat(g1), _flat(g2), rtol=2e-4, atol=2e-6)
    # and the masks are on: the evaluation-mode sums differ
    g0, _, _ = ghost.clipped_sum_ghost(spec.module, dpsgd.per_example_loss, params, x, y, mask, 1.0)
    assert not np.allclose(_flat(g0), _flat(g1))


@pytest.mark.parametrize("impl", ["ghost", "vmap"])
def test_the_compiled_step_trains_with_dropout_on_both_paths(impl):
    """The built-in step draws the chunk's dropout key from the candidate key: two different
    candidate keys give different clipped sums, the same key the same."""
    spec = _spec()
    fns = step.get_step_functions(spec, 0, "sgd", impl)
    params = models.init_params(spec, None)
    x, y = _batch(8)
    idx, mask = jnp.arange(8, dtype=jnp.int32), jnp.ones(8, jnp.float32)

    def run(seed):
        key = jax.random.PRNGKey(seed)
        return _flat(fns.chunk_sum(params, x, y, idx, mask, jnp.float32(1.0), key, 0, 0)[0])

    a, b, a2 = run(1), run(2), run(1)
    assert not np.allclose(a, b)
    np.testing.assert_array_equal(a, a2)
