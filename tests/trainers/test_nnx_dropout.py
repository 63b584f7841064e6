"""Dropout in an NNX model (``nnx.Dropout`` holding its ``nnx.Rngs``): per-example, per-step masks
at training time from the step's key, none at evaluation; the ghost path equals vmap(grad) with
the same masks; removing one example moves the clipped sum by at most C."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.trainers.test_dropout import (  # the same batch, clipped sums and checks
    _batch,
    _flat,
    _sums,
    check_compiled_step_keys,
    check_ghost_and_vmap_agree,
    check_masks_follow_the_key,
    check_one_example_alone,
    check_removal_moves_at_most_c,
)
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
    a, evaluated = check_masks_follow_the_key(spec, params, x)
    no_dropout = _spec(rate=0.0)
    v = {"params": params}
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
    check_one_example_alone(spec, models.init_params(spec, None))


@pytest.mark.parametrize("impl", ["ghost", "vmap"])
def test_removing_one_example_moves_the_clipped_sum_by_at_most_c(impl):
    spec = _spec()
    check_removal_moves_at_most_c(spec, models.init_params(spec, None), impl)


def test_ghost_and_vmap_paths_draw_the_same_masks_and_agree():
    spec = _spec()
    params = models.init_params(spec, None)
    g1, x, y, mask = check_ghost_and_vmap_agree(spec, params)
    # and the masks are on: the evaluation-mode sums differ
    g0, _, _ = ghost.clipped_sum_ghost(spec.module, dpsgd.per_example_loss, params, x, y, mask, 1.0)
    assert not np.allclose(_flat(g0), _flat(g1))


@pytest.mark.parametrize("impl", ["ghost", "vmap"])
def test_the_compiled_step_trains_with_dropout_on_both_paths(impl):
    """The built-in step draws the chunk's dropout key from the candidate key: two different
    candidate keys give different clipped sums, the same key the same."""
    spec = _spec()
    check_compiled_step_keys(spec, models.init_params(spec, None), impl)
