"""Every compiled DP-SGD step draws fresh Gaussian noise: statistical checks on the jitted step.

The privacy argument (Abadi et al. 2016, Alg. 1; the accountant's composition over ``steps``
Poisson-subsampled Gaussian mechanisms) needs independent noise at every step. A regression that
reused a key (e.g. dropping ``fold_in(key, step)`` inside the step, or a loop that stops advancing
the step counter) would repeat the same noise vector at every step: the noise would then cancel out
of differences of updates and the guarantee would be void, silently. These tests isolate the noise
of the compiled step itself: with every example masked out the clipped sum is exactly zero, so with
plain SGD (learning rate 1, expected batch 1) the update *is* the negated noise vector.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainers import models
from trainers.data import make_synthetic
from trainers.loop import train_candidate
from trainers.spec import Hyperparams
from trainers.step import get_step_functions, make_optimizer

B = 64  # chunk size of the masked batch (its content is irrelevant: every example is masked)
SIGMA, CLIP = 1.3, 0.7  # noise std per coordinate = SIGMA * CLIP (expected batch 1)


@pytest.fixture(scope="module")
def setup():
    fns = get_step_functions("cnn26k", 10, "sgd", "bookkeeping")
    params = models.init_params(fns.spec, jax.random.PRNGKey(0))
    opt_state = make_optimizer(Hyperparams(optimizer="sgd", learning_rate=1.0)).init(params)
    x = jnp.zeros((B, 28, 28, 1), jnp.float32)
    y = jnp.zeros((B,), jnp.int32)
    idx, mask = np.arange(B, dtype=np.int32), np.zeros(B, np.float32)
    zero = jax.tree_util.tree_map(jnp.zeros_like, params)
    return fns, params, opt_state, (x, y, idx, mask, zero)


def _flat(tree) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(v)) for v in jax.tree_util.tree_leaves(tree)])


def noise_of_step(setup, key, step: int) -> np.ndarray:
    """The noise the jitted step adds at ``step`` with candidate key ``key`` (clipped sum = 0)."""
    fns, params, opt_state, (x, y, idx, mask, zero) = setup
    new, _, loss = fns.step(
        params, opt_state, zero, jnp.float32(0), x, y, idx, mask, key, jnp.int32(step),
        jnp.float32(CLIP), jnp.float32(SIGMA), jnp.float32(1.0),
    )  # fmt: skip
    assert float(loss) == 0.0  # every example masked: nothing but noise moved the parameters
    return _flat(params) - _flat(new)  # SGD, lr 1: new = params - noisy_sum / 1


def test_each_step_draws_fresh_noise_of_the_right_scale(setup):
    key = jax.random.key_data(jax.random.PRNGKey(1234))
    steps = [0, 1, 2, 3, 7, 1000]
    noises = np.stack([noise_of_step(setup, key, s) for s in steps])
    n = noises.shape[1]  # 26,010 coordinates
    # the Gaussian mechanism the accountant assumes: mean 0, std sigma * C per coordinate
    for z in noises:
        assert z.std() == pytest.approx(SIGMA * CLIP, rel=0.03)  # 3% ~ 7 standard errors
        assert abs(z.mean()) < 6 * SIGMA * CLIP / np.sqrt(n)
    # independent across steps: the correlation of two independent N(0, s^2) vectors of length n
    # has standard deviation 1/sqrt(n) ~ 0.006; a repeated key gives exactly 1
    corr = np.corrcoef(noises)
    off = corr[~np.eye(len(steps), dtype=bool)]
    assert np.max(np.abs(off)) < 6 / np.sqrt(n), np.round(corr, 3)
    # and no step's noise is a copy of another's
    assert len({z.tobytes() for z in noises}) == len(steps)


def test_noise_is_a_function_of_key_and_step_only(setup):
    """Same (key, step): the same noise (a resume reproduces a run); another key: independent."""
    k1 = jax.random.key_data(jax.random.PRNGKey(5))
    k2 = jax.random.key_data(jax.random.PRNGKey(6))
    a, b = noise_of_step(setup, k1, 3), noise_of_step(setup, k1, 3)
    np.testing.assert_array_equal(a, b)
    c = noise_of_step(setup, k2, 3)
    assert abs(np.corrcoef(a, c)[0, 1]) < 6 / np.sqrt(a.size)


def test_vectorised_step_draws_each_candidates_own_fresh_noise(setup):
    """vstep (K candidates under vmap): candidate k's noise at step s is the single step's noise
    with its own key, fresh at every step."""
    fns, params, opt_state, (x, y, idx, mask, zero) = setup
    keys = jnp.stack([jax.random.key_data(jax.random.PRNGKey(s)) for s in (11, 12)])

    def stack(t):
        return jax.tree_util.tree_map(lambda a: jnp.stack([a, a]), t)

    def vnoise(step):
        new, _, _ = fns.vstep(
            stack(params), stack(opt_state), stack(zero), jnp.zeros(2), x, y,
            np.stack([idx, idx]), np.stack([mask, mask]), keys, jnp.int32(step),
            jnp.full(2, CLIP, jnp.float32), jnp.full(2, SIGMA, jnp.float32), jnp.float32(1.0),
        )  # fmt: skip
        p0 = _flat(params)
        return [p0 - _flat(jax.tree_util.tree_map(lambda a, k=k: a[k], new)) for k in (0, 1)]

    s0, s1 = vnoise(0), vnoise(1)
    n = s0[0].size
    for k in (0, 1):  # same numbers as the single step with that candidate's key
        np.testing.assert_allclose(s0[k], noise_of_step(setup, keys[k], 0), rtol=1e-5, atol=1e-6)
    pairs = [(s0[0], s1[0]), (s0[1], s1[1]), (s0[0], s0[1])]
    for a, b in pairs:
        assert abs(np.corrcoef(a, b)[0, 1]) < 6 / np.sqrt(n)


def test_the_training_loop_passes_every_step_index_once(monkeypatch):
    """The loop around the compiled step advances the step counter: steps 0..T-1, each once."""
    data = make_synthetic(num_train=640, num_test=100, validation_size=100, seed=0)
    hp = Hyperparams(batch_size=64, epochs=2, noise_multiplier=1.0)
    fns = get_step_functions(hp.model, data.num_classes, hp.optimizer, "bookkeeping")
    seen: list[tuple[int, bytes]] = []
    real_group = fns.group

    def group(k):
        real = real_group(k)

        def spy(params, opt_state, acc, epoch, data_x, data_y, key, *rest):
            # the step's index as the compiled step reads it (its epoch's device arrays at the
            # device counter t, the last argument), and the candidate key it folds it into
            t = int(rest[-1])
            step = int(np.asarray(epoch["noise_step"])[t])
            seen.append((step, np.asarray(key).tobytes()))
            return real.run(params, opt_state, acc, epoch, data_x, data_y, key, *rest)

        return dataclasses.replace(real, run=spy)

    monkeypatch.setattr(fns, "group", group)
    res = train_candidate(hp, data, jax.random.PRNGKey(3), grad_impl="bookkeeping")
    assert not res.failed
    total = 2 * -(-len(data.train_x) // 64)  # epochs * ceil(N / B)
    assert total >= 16
    assert [s for s, _ in seen] == list(range(total))
    assert len({k for _, k in seen}) == 1  # one candidate key, folded with the step inside
