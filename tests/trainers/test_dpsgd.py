"""DP-SGD gradient math: per-example gradients, clipping, masking, noise; the compiled fast path vs
vmap(grad)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainers import dpsgd, models
from trainers.spec import Hyperparams
from trainers.step import get_step_functions, make_optimizer

B = 24  # small batches keep compile and run time low on the 2-core CI


def _batch(seed, b=B, shape=(28, 28, 1)):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, size=(b, *shape)).astype(np.float32)
    y = rng.integers(0, 10, size=b).astype(np.int32)
    return x, y


def _rel_err(a, b):
    """Largest absolute difference relative to the largest magnitude per leaf; max over leaves."""
    errs = jax.tree_util.tree_map(
        lambda u, v: float(jnp.max(jnp.abs(u - v)) / jnp.maximum(jnp.max(jnp.abs(u)), 1e-30)), a, b
    )
    return max(jax.tree_util.tree_leaves(errs))


@functools.cache
def _naive(model):
    """Jitted reference clipped sum from vmap(grad), compiled once per model (clip traced)."""
    apply = models.get_model(model).module.apply
    return jax.jit(lambda p, x, y, m, c: dpsgd.clipped_sum_naive(apply, p, x, y, m, c))


@pytest.fixture(scope="module")
def cnn26k():
    spec = models.get_model("cnn26k")
    return spec, models.init_params(spec, jax.random.PRNGKey(0))


def test_per_example_grads_equal_loop_of_single_example_grads(cnn26k):
    spec, params = cnn26k
    x, y = _batch(1, b=6)
    batched = jax.jit(lambda p, x, y: dpsgd.per_example_grads_naive(spec.module.apply, p, x, y))(
        params, x, y
    )

    def loss(p, xi, yi):
        return dpsgd.per_example_loss(spec.module.apply({"params": p}, xi[None]), yi[None])[0]

    grad = jax.jit(jax.grad(loss))
    for i in range(len(x)):
        single = grad(params, x[i], y[i])
        ith = jax.tree_util.tree_map(lambda g, i=i: g[i], batched)
        assert _rel_err(single, ith) < 1e-5


def test_clipped_norms_at_most_c_and_unclipped_kept(cnn26k):
    spec, params = cnn26k
    x, y = _batch(2)
    grads = jax.jit(lambda p: dpsgd.per_example_grads_naive(spec.module.apply, p, x, y))(params)
    sq = sum(jnp.sum(g.reshape(B, -1) ** 2, axis=1) for g in jax.tree_util.tree_leaves(grads))
    norms = np.sqrt(np.asarray(sq))
    clip = float(np.median(norms))  # about half the examples are clipped
    c = np.asarray(dpsgd.clip_factors(sq, jnp.ones(B), clip))
    clipped = norms * c
    assert np.all(clipped <= clip * (1 + 1e-6))
    small = norms < clip
    assert small.any() and (~small).any()
    np.testing.assert_allclose(clipped[small], norms[small], rtol=1e-6)  # below C: untouched
    np.testing.assert_allclose(clipped[~small], clip, rtol=1e-6)  # above C: scaled to exactly C
    # a zero gradient gets factor 1, not NaN
    assert float(dpsgd.clip_factors(jnp.zeros(1), jnp.ones(1), 1.0)[0]) == 1.0


@pytest.mark.parametrize("model", ["cnn26k", "cnn52k"])
@pytest.mark.parametrize("clip", [1.0, 10.0, "median"])
def test_compiled_bookkeeping_matches_naive_per_example_gradients(model, clip):
    """The fast path AS COMPILED (the jitted chunk sum used by the training step) vs vmap(grad), <=
    1e-5 rel."""
    fns = get_step_functions(model, 10, "sgd", "bookkeeping")
    params = models.init_params(fns.spec, jax.random.PRNGKey(3))
    x, y = _batch(4)
    mask = np.ones(B, np.float32)
    mask[-3:] = 0
    idx = np.arange(B, dtype=np.int32)
    if clip == "median":  # about half the examples clipped
        _, _, norms = _naive(model)(params, x, y, mask, jnp.float32(1.0))
        clip = float(np.median(np.asarray(norms)[:-3]))
    fast, fast_loss = fns.chunk_sum(params, x, y, idx, mask, jnp.float32(clip))
    ref, ref_loss, norms = _naive(model)(params, x, y, mask, jnp.float32(clip))
    if clip == 1.0:
        assert np.all(np.asarray(norms) > clip)  # every example clipped
    assert _rel_err(ref, fast) <= 1e-5
    np.testing.assert_allclose(float(fast_loss), float(ref_loss), rtol=1e-5)


def test_compiled_fused_step_applies_the_clipped_sum():
    """The fused jitted training step (sigma=0, sgd lr=1, B=1) moves the parameters by minus the
    clipped sum."""
    fns = get_step_functions("cnn26k", 10, "sgd", "bookkeeping")
    params = models.init_params(fns.spec, jax.random.PRNGKey(5))
    opt_state = make_optimizer(Hyperparams(learning_rate=1.0)).init(params)
    x, y = _batch(6)
    idx = np.arange(B, dtype=np.int32)
    mask = np.ones(B, np.float32)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    new, _, _ = fns.step(
        params, opt_state, zeros, jnp.float32(0), x, y, idx, mask, jax.random.PRNGKey(0),
        jnp.int32(0), jnp.float32(1.0), jnp.float32(0.0), jnp.float32(1.0),
    )  # fmt: skip
    moved = jax.tree_util.tree_map(lambda a, b: a - b, params, new)
    ref, _, _ = _naive("cnn26k")(params, x, y, mask, jnp.float32(1.0))
    assert _rel_err(ref, moved) <= 1e-5


def test_masked_examples_contribute_nothing():
    fns = get_step_functions("cnn26k", 10, "sgd", "bookkeeping")
    params = models.init_params(fns.spec, jax.random.PRNGKey(7))
    x, y = _batch(8)
    mask = np.ones(B, np.float32)
    mask[::3] = 0
    idx = np.arange(B, dtype=np.int32)
    g1, l1 = fns.chunk_sum(params, x, y, idx, mask, jnp.float32(1.0))
    # change the masked examples arbitrarily: nothing may change
    x2, y2 = x.copy(), y.copy()
    x2[::3] = np.random.default_rng(9).uniform(0, 1, size=x2[::3].shape)
    y2[::3] = (y2[::3] + 1) % 10
    g2, l2 = fns.chunk_sum(params, x2, y2, idx, mask, jnp.float32(1.0))
    for a, b in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert float(l1) == float(l2)
    # and the sum equals the sum over the unmasked examples alone
    keep = mask > 0
    ref, _, _ = _naive("cnn26k")(
        params, x[keep], y[keep], np.ones(keep.sum(), np.float32), jnp.float32(1.0)
    )
    assert _rel_err(ref, g1) <= 1e-5


def test_noise_std_is_sigma_times_c_in_compiled_step():
    """All-masked batch, sgd lr=1, B=1: the step's update is pure noise with std sigma*C per
    coordinate."""
    fns = get_step_functions("cnn26k", 10, "sgd", "bookkeeping")
    params = models.init_params(fns.spec, jax.random.PRNGKey(10))
    opt_state = make_optimizer(Hyperparams(learning_rate=1.0)).init(params)
    x, y = _batch(11)
    sigma, clip = 1.3, 2.0
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    new, _, _ = fns.step(
        params, opt_state, zeros, jnp.float32(0), x, y, np.arange(B, dtype=np.int32),
        np.zeros(B, np.float32),
        jax.random.PRNGKey(12), jnp.int32(3), jnp.float32(clip), jnp.float32(sigma),
        jnp.float32(1.0),
    )  # fmt: skip
    noise = np.concatenate(
        [
            np.ravel(a - b)
            for a, b in zip(
                jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(new), strict=True
            )
        ]
    )
    assert noise.size == 26010
    # std of the sample std of n normals is ~ std / sqrt(2n) = 0.44%: 2% is > 4 standard errors
    assert abs(noise.std() / (sigma * clip) - 1) < 0.02
    assert abs(noise.mean()) < 4 * sigma * clip / np.sqrt(noise.size)


def test_noise_differs_between_steps_and_keys():
    g = {"w": jnp.zeros(1000)}
    a = dpsgd.add_noise(g, jax.random.PRNGKey(0), 1.0, 1.0)["w"]
    b = dpsgd.add_noise(g, jax.random.PRNGKey(1), 1.0, 1.0)["w"]
    assert not np.allclose(np.asarray(a), np.asarray(b))


def test_im2col_s2d_matches_convolution():
    rng = np.random.default_rng(13)
    x = jnp.asarray(rng.standard_normal((2, 13, 13, 3)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((4, 4, 3, 5)), jnp.float32)
    ref = dpsgd._conv(x, k, 2, "VALID").reshape(2, 25, 5)
    got = dpsgd.im2col_s2d(x, 4, 2, 0, 5) @ dpsgd.kernel_to_s2d(k, 2)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(
        np.asarray(dpsgd.kernel_from_s2d(dpsgd.kernel_to_s2d(k, 2), 4, 2, 3)), np.asarray(k)
    )
