"""The own-loop pieces (``dptune.clipped_grad_sum``, ``add_noise``, ``DpSgdSchedule.batches``)
refuse a user's mistake in one line naming the argument, instead of training without privacy
(a zero noise multiplier or clip norm) or failing deep inside JAX."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import pytest

import dptune

X = np.random.default_rng(0).normal(size=(8, 4)).astype(np.float32)
Y = (X[:, 0] > 0).astype(np.int32)
MASK = np.ones(8, np.float32)
MODEL = nn.Dense(2)
PARAMS = MODEL.init(jax.random.PRNGKey(0), X[:1])["params"]
KEY = jax.random.PRNGKey(1)


@pytest.mark.parametrize("clip", [0.0, -1.0, float("nan"), float("inf")])
def test_clipped_grad_sum_refuses_a_clip_norm_that_is_not_positive(clip):
    # C <= 0 trained silently: zero gradients at 0, flipped ones below.
    with pytest.raises(ValueError, match=r"clip_norm=.* must be a finite number > 0"):
        dptune.clipped_grad_sum(MODEL)(PARAMS, X, Y, MASK, clip)


@pytest.mark.parametrize(
    "args, why",
    [((X, Y, MASK[:4]), r"mask has 4 rows but x has 8"),
     ((X, Y[:4], MASK), r"y has 4 rows but x has 8"),
     ((X, Y, None), r"mask=None: pass a \(b,\) array")],
)  # fmt: skip
def test_clipped_grad_sum_names_the_argument_whose_rows_disagree(args, why):
    with pytest.raises(ValueError, match=why):
        dptune.clipped_grad_sum(MODEL)(PARAMS, *args, 1.0)


@pytest.mark.parametrize(
    "kwargs, why",
    [(dict(noise_multiplier=0.0), r"noise_multiplier=0\.0 must be a finite number > 0"),
     (dict(noise_multiplier=-1.0), r"noise_multiplier=-1\.0"),
     (dict(clip_norm=0.0), r"clip_norm=0\.0"),
     (dict(expected_batch_size=0), r"expected_batch_size=0")],
)  # fmt: skip
def test_add_noise_refuses_settings_that_add_no_noise_or_divide_by_zero(kwargs, why):
    # sigma = 0 returned the sum unnoised; B = 0 returned infinities.
    args = dict(noise_multiplier=1.0, clip_norm=1.0) | kwargs
    with pytest.raises(ValueError, match=why):
        dptune.add_noise(PARAMS, KEY, **args)


def test_add_noise_refuses_a_numpy_generator_as_key():
    with pytest.raises(ValueError, match=r"key=.*jax\.random\.key"):
        dptune.add_noise(PARAMS, np.random.default_rng(0), 1.0, 1.0)


def test_add_noise_still_takes_traced_settings():
    f = jax.jit(lambda s, c: dptune.add_noise(PARAMS, KEY, s, c, expected_batch_size=4.0))
    out = f(1.0, 1.0)
    assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(PARAMS)


@pytest.mark.parametrize(
    "num_records, rng, why",
    [(X, np.random.default_rng(0), r"num_records=<array of shape \(8, 4\)>: pass len\(x\)"),
     (8, 0, r"rng=0: pass a numpy Generator")],
)  # fmt: skip
def test_schedule_batches_names_the_argument(num_records, rng, why):
    schedule = dptune.DpSgdSchedule(num_examples=8, batch_size=2, epochs=1)
    with pytest.raises(ValueError, match=why):
        next(iter(schedule.batches(num_records, rng)))


def test_a_first_call_inside_the_users_jit_checks_the_model_and_matches_eager():
    # A train step under jax.jit calling grad_sum first: the model checks ran on tracers and
    # failed (TracerArrayConversionError in "model=Dense failed on a batch of shape (3, 4)").
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.dense = nnx.Linear(4, 2, rngs=rngs)

        def __call__(self, x):
            return self.dense(x)

    net = Net(nnx.Rngs(0))
    for model, params in ((MODEL, PARAMS), (net, dptune.NnxModel(net).params())):
        traced = jax.jit(lambda p, m=model: dptune.clipped_grad_sum(m)(p, X, Y, MASK, 1.0))(params)
        eager = dptune.clipped_grad_sum(model)(params, X, Y, MASK, 1.0)
        leaves = zip(jax.tree.leaves(traced), jax.tree.leaves(eager), strict=True)
        for a, b in leaves:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_data_given_as_num_examples_is_refused_without_printing_it():
    # The refusal printed the private array's values: "num_examples=array([[ 0.1257, ...".
    with pytest.raises(ValueError, match=r"num_examples=<array of shape \(8, 4\)>") as info:
        dptune.Dataset.from_arrays(X, Y, num_classes=2, num_examples=X)
    assert "0.1257" not in str(info.value) and "array(" not in str(info.value)


@pytest.mark.parametrize("sigma", ["auto", None])
def test_dpsgd_privacy_names_a_noise_multiplier_that_is_not_a_number(sigma):
    # It read "could not convert string to float: 'auto'".
    schedule = dptune.DpSgdSchedule(num_examples=100, batch_size=10, epochs=1)
    with pytest.raises(ValueError, match=rf"noise_multiplier={sigma!r}: a number"):
        dptune.dpsgd_privacy(schedule, sigma)
