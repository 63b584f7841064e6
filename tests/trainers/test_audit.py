"""``trainers.audit``: a gradient canary's per-example gradient is a Dirac on its own slot (zero on
the model), real records never touch the canary block, the model is unchanged on real images, the
canaries land in the split they are meant for, and the loop's noise_step argument keys the noise."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainers import audit, dpsgd, models
from trainers.data import make_synthetic
from trainers.spec import AUDIT_MODEL_SUFFIX, Hyperparams


@pytest.fixture(scope="module")
def data():
    return make_synthetic(num_train=200, num_test=10, validation_size=40)


@pytest.fixture(scope="module")
def wrapped():
    spec = audit.gradient_canary_spec(models.get_model("cnn26k"))
    return spec, models.init_params(spec, jax.random.PRNGKey(0))


def test_gradient_canary_is_a_dirac_on_its_slot(data, wrapped):
    spec, params = wrapped
    cx, cy = audit.gradient_canary_records(3, data.image_shape, data)
    x = np.concatenate([cx, data.train_x[:2]])
    y = np.concatenate([cy, data.train_y[:2]])
    grads = jax.jit(functools.partial(dpsgd.per_example_grads_naive, spec.module.apply))(
        params, jnp.asarray(x), jnp.asarray(y)
    )
    block = np.asarray(grads["canaries"])
    for j in range(3):
        expected = np.zeros(audit.GRADIENT_CANARY_SLOTS)
        expected[j] = audit.GAIN
        np.testing.assert_allclose(block[j], expected, rtol=1e-6)
        for leaf in jax.tree_util.tree_leaves(grads["base"]):
            assert not np.any(np.asarray(leaf[j]))  # exactly zero on the model's own parameters
    assert not np.any(block[3:])  # real records never touch the canary block
    # the engine clips a canary like any example: C e_j
    clipped = jax.jit(functools.partial(dpsgd.clipped_sum_naive, spec.module.apply))
    summed, _, norms = clipped(params, jnp.asarray(x[:3]), jnp.asarray(y[:3]), jnp.ones(3), 0.5)
    np.testing.assert_allclose(np.asarray(norms), audit.GAIN, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(summed["canaries"])[:3], 0.5, rtol=1e-6)


def test_wrapped_model_is_the_model_on_real_images(data, wrapped):
    spec, params = wrapped
    base = models.get_model("cnn26k")
    x = jnp.asarray(data.val_x[:8])
    np.testing.assert_array_equal(
        spec.module.apply({"params": params}, x),
        base.module.apply({"params": params["base"]}, x),
    )


def test_canaries_land_in_the_split_they_are_meant_for(data):
    gx, gy = audit.gradient_canary_records(50, data.image_shape, data)
    assert not audit.in_validation(data, gx, gy).any()
    np.testing.assert_array_equal(gx[:, 0, 0, 0], -(np.arange(50) + 1.0))
    rng = np.random.default_rng(0)
    vx, vy = audit.input_canary_records(20, data.image_shape, 10, data, rng, validation=True)
    assert audit.in_validation(data, vx, vy).all()
    assert vx.min() >= 0 and vx.max() < 1  # in the data's range: only the labels are off


def test_model_names():
    spec = audit.gradient_canary_spec(models.get_model("cnn26k"))
    assert spec is audit.gradient_canary_spec(models.get_model("cnn26k"))  # one compiled step
    assert Hyperparams(model=spec).model.name.endswith(AUDIT_MODEL_SUFFIX)
    with pytest.raises(ValueError, match="model"):
        Hyperparams(model="cnn26k" + AUDIT_MODEL_SUFFIX)  # a wrapped model is a spec, not a name
    with pytest.raises(ValueError, match="features"):
        audit.gradient_canary_spec(models.get_model("scatter_linear"))


def test_the_noise_key_is_the_loops_argument(data):
    """``noise_step`` decides which step index each step's noise key is folded with: the default
    folds with the step itself; the audit's ``noise_reused`` control (every step folded with 0)
    trains to other parameters; an equal function to the same ones. No state of ``trainers``."""
    from trainers.loop import same_step, train_candidates

    hp = Hyperparams(model="cnn26k", batch_size=50, epochs=1, noise_multiplier=5.0)
    key = jax.random.PRNGKey(1)

    def params(noise_step):
        (r,) = train_candidates([hp], data, [key], vectorize=False, noise_step=noise_step)
        return np.concatenate([np.ravel(a) for a in jax.tree_util.tree_leaves(r.params)])

    default = params(same_step)
    np.testing.assert_array_equal(default, params(lambda step: step))
    assert not np.allclose(default, params(lambda step: 0))
