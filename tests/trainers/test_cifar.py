"""CIFAR-10 models in DP-SGD: the compiled book-keeping path of the CIFAR CNN and the vmap(grad)
path of WRN-16-4 (its default ghost path: tests/trainers/test_ghost.py), both with augmentation
multiplicity, against independent per-example gradients; augmentations; parameter EMA;
micro-batching; the privacy parameters do not depend on augmult."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainers import dpsgd, models
from trainers.data import make_synthetic
from trainers.loop import train_candidate
from trainers.spec import Hyperparams, dpsgd_privacy
from trainers.step import (
    default_grad_impl,
    default_microbatch_size,
    get_step_functions,
    make_optimizer,
    with_param_ema,
)


def _rel_err(a, b):
    """Largest absolute difference relative to the largest magnitude per leaf; max over leaves."""
    errs = jax.tree_util.tree_map(
        lambda u, v: float(jnp.max(jnp.abs(u - v)) / jnp.maximum(jnp.max(jnp.abs(u)), 1e-30)), a, b
    )
    return max(jax.tree_util.tree_leaves(errs))


def _cifar_batch(seed, b):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, size=(b, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, size=b).astype(np.int32)
    return x, y


@functools.cache
def _naive_sum(model):
    apply = models.get_model(model).module.apply
    return jax.jit(lambda p, x, y, m, c: dpsgd.clipped_sum_naive(apply, p, x, y, m, c))


def _loop_per_example_grads(apply_fn, params, x):
    """Per-example gradients (with K copies: the mean of the copies' gradients) one example and one
    copy at a time, without vmap: an independent computation of what the DP step clips."""

    @jax.jit
    def grad_one(p, xi, yi):
        def loss(p):
            return dpsgd.per_example_loss(apply_fn({"params": p}, xi[None]), yi[None])[0]

        return jax.grad(loss)(p)

    def per_example(i, y):
        if x.ndim == 4:
            return grad_one(params, x[i], y[i])
        gs = [grad_one(params, x[i, j], y[i]) for j in range(x.shape[1])]
        return jax.tree_util.tree_map(lambda *a: sum(a) / len(a), *gs)

    return per_example


# augmult 3 is slow (a second CIFAR CNN compile, ~10 s); its fast twins: augmult 0 here and the
# naive path with copies (test_cifar_cnn_naive_with_augmult_equals_loop_over_copies)
@pytest.mark.parametrize("augmult", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_cifar_cnn_compiled_bookkeeping_matches_naive(augmult):
    """The CIFAR CNN's book-keeping clipped sum AS COMPILED in the training step (the jitted chunk
    sum, augmentation included) equals vmap(grad) per-example clipping on the same copies, <= 1e-5
    relative, at C = median norm (about half clipped) and C tiny (all clipped)."""
    b = 6
    fast = get_step_functions("cifar_cnn", 10, "sgd", "bookkeeping", augmult)
    naive = get_step_functions("cifar_cnn", 10, "sgd", "naive", augmult)
    params = models.init_params(fast.spec, jax.random.PRNGKey(1))
    x, y = _cifar_batch(2, b)
    idx = np.arange(b, dtype=np.int32)
    mask = np.ones(b, np.float32)
    mask[-1] = 0
    key, step, chunk = jax.random.PRNGKey(3), jnp.int32(7), jnp.int32(1)
    # norms of the unclipped per-example gradients, through the naive path on the same copies
    xa = x if augmult == 0 else dpsgd_copies(key, step, chunk, x, augmult)
    _, _, norms = _naive_sum("cifar_cnn")(params, xa, y, mask, jnp.float32(1.0))
    for clip in (float(np.median(np.asarray(norms)[:-1])), 1e-3):
        c = jnp.float32(clip)
        got, got_loss = fast.chunk_sum(params, x, y, idx, mask, c, key, step, chunk)
        ref, ref_loss = naive.chunk_sum(params, x, y, idx, mask, c, key, step, chunk)
        assert _rel_err(ref, got) <= 1e-5
        np.testing.assert_allclose(float(got_loss), float(ref_loss), rtol=1e-5)
        # ... and the naive path itself is the clipped sum of the explicit per-example gradients
        ref2, _, _ = _naive_sum("cifar_cnn")(params, xa, y, mask, c)
        assert _rel_err(ref2, ref) <= 1e-5


def dpsgd_copies(key, step, chunk, x, augmult):
    """The augmented copies the compiled step makes for (key, step, chunk): mirrors the step's key
    derivation (trainers.step.StepFunctions._chunk_sum). A mismatch fails the tests that use it
    (different copies give different gradients)."""
    aug = jax.random.fold_in(jax.random.fold_in(key, 0x41554755), step)
    return dpsgd.augment_copies(jax.random.fold_in(aug, chunk), jnp.asarray(x), augmult)


def test_cifar_cnn_naive_with_augmult_equals_loop_over_copies():
    spec = models.get_model("cifar_cnn")
    params = models.init_params(spec, jax.random.PRNGKey(4))
    x, y = _cifar_batch(5, 3)
    xa = np.asarray(dpsgd.augment_copies(jax.random.PRNGKey(6), jnp.asarray(x), 2))
    batched = jax.jit(lambda p, x, y: dpsgd.per_example_grads_naive(spec.module.apply, p, x, y))(
        params, xa, y
    )
    loop = _loop_per_example_grads(spec.module.apply, params, xa)
    for i in range(3):
        ith = jax.tree_util.tree_map(lambda g, i=i: g[i], batched)
        assert _rel_err(loop(i, y), ith) <= 1e-5


@pytest.mark.slow  # compiles WRN-16-4 twice (~45 s)
def test_wrn16_4_compiled_step_with_augmult_matches_per_example_loop():
    """WRN-16-4 on its vmap(grad) path (no book-keeping path; the default is the ghost path,
    tested against this one in tests/trainers/test_ghost.py) with augmult 2: the compiled chunk
    sum equals clipping the per-example gradients computed one copy at a time."""
    assert default_grad_impl("wrn16_4", (32, 32, 3), 2) == "ghost"
    with pytest.raises(ValueError, match="not implemented"):
        get_step_functions("wrn16_4", 10, "sgd", "bookkeeping", 2)
    b, k = 3, 2
    fns = get_step_functions("wrn16_4", 10, "sgd", "naive", k)
    params = models.init_params(fns.spec, jax.random.PRNGKey(8))
    assert models.param_count(params) == 2_748_890
    x, y = _cifar_batch(9, b)
    key, step, chunk = jax.random.PRNGKey(10), jnp.int32(0), jnp.int32(0)
    xa = np.asarray(dpsgd_copies(key, step, chunk, x, k))
    per_example = _loop_per_example_grads(fns.spec.module.apply, params, xa)
    grads = [per_example(i, y) for i in range(b)]
    norms = [
        float(np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree_util.tree_leaves(gi))))
        for gi in grads
    ]
    clip = float(np.median(norms))
    factors = [min(1.0, clip / n) for n in norms]
    ref = jax.tree_util.tree_map(
        lambda *g: sum(f * gi for f, gi in zip(factors, g, strict=True)), *grads
    )
    idx = np.arange(b, dtype=np.int32)
    got, _ = fns.chunk_sum(params, x, y, idx, np.ones(b, np.float32), jnp.float32(clip), key,
                           step, chunk)  # fmt: skip
    assert _rel_err(ref, got) <= 1e-5


def test_augment_copies_are_flipped_crops_of_the_padded_image():
    rng = np.random.default_rng(11)
    x = rng.uniform(0, 1, size=(2, 8, 8, 3)).astype(np.float32)
    out = np.asarray(dpsgd.augment_copies(jax.random.PRNGKey(12), jnp.asarray(x), 16, pad=2))
    assert out.shape == (2, 16, 8, 8, 3)
    xp = np.pad(x, ((0, 0), (2, 2), (2, 2), (0, 0)), mode="reflect")
    seen = set()
    for i in range(2):
        crops = {
            (a, c, f): (xp[i, a : a + 8, c : c + 8][:, ::-1] if f else xp[i, a : a + 8, c : c + 8])
            for a in range(5)
            for c in range(5)
            for f in (0, 1)
        }
        for j in range(16):
            match = [t for t, crop in crops.items() if np.array_equal(crop, out[i, j])]
            assert match, "a copy is not a (flipped) crop of the padded image"
            seen.add(match[0])
    assert len(seen) > 8  # offsets and flips vary between copies


def test_param_ema_follows_its_definition():
    opt = with_param_ema(optax_sgd(1.0), 0.9)
    params = {"w": jnp.zeros(3)}
    state = opt.init(params)
    ema = np.zeros(3)
    for t in range(1, 6):
        grads = {"w": jnp.full(3, -float(t))}
        updates, state = opt.update(grads, state, params)
        params = {"w": params["w"] + updates["w"]}
        d = min(0.9, (1 + t) / (10 + t))
        ema = d * ema + (1 - d) * np.asarray(params["w"])
        np.testing.assert_allclose(np.asarray(state.ema["w"]), ema, rtol=1e-6)
    assert int(state.count) == 5


def optax_sgd(lr):
    import optax

    return optax.sgd(lr)


@pytest.fixture(scope="module")
def tiny_cifar():
    return make_synthetic(
        num_train=160, num_test=40, validation_size=40, image_shape=(32, 32, 3), seed=1
    )


@pytest.mark.slow  # trains the CIFAR CNN with augmentation (~30 s)
def test_train_cifar_cnn_with_augmult_and_ema(tiny_cifar):
    hp = Hyperparams(
        model="cifar_cnn", batch_size=32, epochs=1, learning_rate=0.5, clip_norm=1.0,
        noise_multiplier=1.0, augmult=2, ema_decay=0.9, microbatch_size=16,
    )  # fmt: skip
    seen = []
    res = train_candidate(
        hp, tiny_cifar, jax.random.PRNGKey(13), on_epoch=lambda *a: seen.append(a)
    )
    # the score is the noisy validation accuracy (std 10 counts on 40 records): finite, any sign
    assert not res.failed and np.isfinite(res.validation_score)
    assert len(res.history) == 1 and res.history[0]["steps"] == 4
    # the output is the parameter average, not the last iterate
    fns = get_step_functions("cifar_cnn", 10, "sgd", "bookkeeping", 2, True)
    assert fns.augmult == 2
    p_out = seen[0][2]
    assert _rel_err(p_out, res.params) == 0.0


# ~8 s; fast twin: tests/trainers/test_train.py::test_chunked_batch_equals_one_chunk
@pytest.mark.slow
def test_microbatch_size_does_not_change_the_result():
    data = make_synthetic(num_train=600, num_test=50, validation_size=100, seed=2)
    base = Hyperparams(batch_size=64, epochs=1, learning_rate=1.0, clip_norm=0.5)
    key = jax.random.PRNGKey(14)
    a = train_candidate(dataclasses.replace(base, microbatch_size=16), data, key)
    b = train_candidate(dataclasses.replace(base, microbatch_size=256), data, key)
    assert _rel_err(b.params, a.params) <= 1e-5
    assert a.validation_score == b.validation_score


def test_privacy_parameters_do_not_depend_on_augmult_ema_or_microbatch():
    base = Hyperparams(batch_size=256, epochs=3, noise_multiplier=1.3, model="cifar_cnn")
    other = dataclasses.replace(base, augmult=16, ema_decay=0.999, microbatch_size=8)
    assert dpsgd_privacy(base, 45000) == dpsgd_privacy(other, 45000)


def test_default_microbatch_and_validation():
    assert default_microbatch_size("cnn26k") == 256
    assert default_microbatch_size("wrn16_4", 16) % 8 == 0
    assert default_microbatch_size("wrn16_4", 1000) == 8
    for bad in (dict(augmult=-1), dict(augmult=1.5), dict(ema_decay=1.0), dict(microbatch_size=4)):
        with pytest.raises(ValueError):
            Hyperparams(**bad)
    # EMA lives in the optimiser state, so the step's structure knows about it
    hp = Hyperparams(ema_decay=0.99)
    state = make_optimizer(hp).init({"w": jnp.ones(2)})
    assert float(state.decay) == pytest.approx(0.99)
