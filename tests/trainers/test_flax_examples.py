"""Models as Flax's own examples write them, at tiny sizes: what dptune must accept and how.

Flax's ``examples/mnist`` CNN (NNX) passes its ``nnx.Rngs`` at call time,
``__call__(self, x, rngs)``, to ``nnx.Dropout(rate)`` layers built without rngs. dptune calls
such a module with an ``nnx.Rngs`` of its own: at training time seeded from the chunk's secret
dropout key (per-example masks, as for dropout that holds its rngs), at evaluation a fixed one
(dropout is off in evaluation mode).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.trainers.test_dropout import (  # the same batch, clipped sums and checks
    _flat,
    _sums,
    check_compiled_step_keys,
    check_ghost_and_vmap_agree,
    check_masks_follow_the_key,
    check_one_example_alone,
    check_removal_moves_at_most_c,
)
from trainers import models, step


class RngsAtCall(nnx.Module):
    """Flax's examples/mnist CNN's calling convention on 5 features and 3 classes: dropout
    layers without rngs, the ``nnx.Rngs`` passed to ``__call__`` and on to them."""

    def __init__(self, rngs: nnx.Rngs, rate: float = 0.5):
        self.a = nnx.Linear(5, 16, rngs=rngs)
        self.drop1 = nnx.Dropout(rate=rate)
        self.b = nnx.Linear(16, 16, rngs=rngs)
        self.drop2 = nnx.Dropout(rate=rate)
        self.c = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs):
        h = self.drop1(jnp.tanh(self.a(x)), rngs=rngs)
        return self.c(self.drop2(jnp.tanh(self.b(h)), rngs=rngs))


def _spec(rate: float = 0.5):
    return models.user_model(RngsAtCall(nnx.Rngs(0), rate), (5,), "float32")


def test_an_nnx_module_taking_rngs_at_call_is_accepted_stochastic_on_the_ghost_path():
    spec = _spec()
    assert spec.stochastic
    assert step.ghost_plan(spec).supported, step.ghost_plan(spec).reason


def test_rngs_at_call_dropout_is_on_per_key_in_training_and_off_at_evaluation():
    spec = _spec()
    params = models.init_params(spec, None)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 5)), jnp.float32)
    a, evaluated = check_masks_follow_the_key(spec, params, x)
    np.testing.assert_allclose(evaluated, _spec(0.0).apply({"params": params}, x), rtol=1e-6)
    assert not np.allclose(a, evaluated)


def test_rngs_at_call_one_example_alone_and_removal_moves_the_sum_by_at_most_c():
    spec = _spec()
    params = models.init_params(spec, None)
    check_one_example_alone(spec, params)
    for impl in ("ghost", "vmap"):
        check_removal_moves_at_most_c(spec, params, impl)


def test_rngs_at_call_ghost_and_vmap_draw_the_same_masks():
    spec = _spec()
    params = models.init_params(spec, None)
    g1, x, y, mask = check_ghost_and_vmap_agree(spec, params)
    g2, _, _ = _sums(spec, params, x, y, mask, jax.random.PRNGKey(6), "ghost")
    assert not np.allclose(_flat(g1), _flat(g2))  # another step's key, other masks


@pytest.mark.parametrize("impl", ["ghost", "vmap"])
def test_rngs_at_call_compiled_step_follows_the_candidate_key(impl):
    spec = _spec()
    check_compiled_step_keys(spec, models.init_params(spec, None), impl)
