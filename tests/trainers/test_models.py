"""Models: parameter counts, slice max-pools and the space-to-depth convolution equal their flax
forms."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainers import models


@pytest.mark.parametrize(
    "name,count", [("cnn26k", 26010), ("cnn52k", 51642), ("cifar_cnn", 550570)]
)
def test_parameter_counts(name, count):
    spec = models.get_model(name)
    shapes = jax.eval_shape(
        lambda: spec.module.init(jax.random.PRNGKey(0), jnp.zeros((1, *spec.input_shape)))
    )
    assert models.param_count(shapes["params"]) == count


def test_pools_equal_flax_max_pool():
    x = np.random.default_rng(0).standard_normal((2, 14, 14, 3)).astype(np.float32)

    @jax.jit
    def both(x):
        return (
            models.max_pool_2x2_stride1(x),
            nn.max_pool(x, (2, 2), strides=(1, 1), padding="VALID"),
            models.max_pool_2x2_stride2(x),
            nn.max_pool(x, (2, 2), strides=(2, 2), padding="VALID"),
        )

    a, b, c, d = both(x)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(c), np.asarray(d))


def test_space_to_depth_conv_equals_flax_conv_compiled():
    x = jax.random.normal(jax.random.PRNGKey(1), (3, 28, 28, 2))
    m = models.Conv8x8Stride2(5)
    variables = jax.jit(m.init)(jax.random.PRNGKey(2), x)
    ref = jax.jit(nn.Conv(5, (8, 8), strides=(2, 2), padding="SAME").apply)(variables, x)
    got = jax.jit(m.apply)(variables, x)
    assert got.shape == (3, 14, 14, 5)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)


def test_forward_shapes_and_unknown_model():
    spec = models.get_model("cnn26k")
    params = jax.eval_shape(lambda: models.init_params(spec, jax.random.PRNGKey(0)))
    out = jax.eval_shape(
        lambda p: spec.module.apply({"params": p}, jnp.zeros((4, 28, 28, 1))), params
    )
    assert out.shape == (4, 10)
    assert set(params) == {"conv1", "conv2", "dense1", "dense2"}
    with pytest.raises(ValueError, match="unknown model"):
        models.get_model("resnet")
