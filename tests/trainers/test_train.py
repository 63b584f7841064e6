"""Candidates: privacy parameters, learning, no recompilation, failures, noisy scores."""

import dataclasses
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.paths import mnist_10k
from trainers import models
from trainers.data import load_dataset, make_synthetic, split_validation
from trainers.evaluate import evaluate
from trainers.evaluate import validation_score as _score
from trainers.loop import train_candidate, train_candidates
from trainers.spec import FAILURE_SCORE, Hyperparams, dpsgd_privacy
from trainers.step import get_step_functions, make_optimizer

MNIST10K = mnist_10k()  # ../shared/data/mnist-10k, else the copy shipped in dptune/data

# Every dataset here has N = 2000 training examples and every run B = 64, so all tests share the
# same compiled shapes (the step is compiled once per chunk shape and training-set shape).
HP = Hyperparams(learning_rate=2.0, clip_norm=1.0, noise_multiplier=0.7, batch_size=64, epochs=3)


@pytest.fixture(scope="module")
def synthetic():
    return make_synthetic(num_train=2500, num_test=500, validation_size=500, seed=0)


@pytest.fixture(scope="module")
def mnist2k():
    d = load_dataset("mnist", MNIST10K, validation_size=1000, num_examples=8000)
    # 2,000 real training examples, 1,000 validation, the 2,000 test digits
    return dataclasses.replace(
        d, train_x=d.train_x[:2000], train_y=d.train_y[:2000], public_num_train=2000
    )


@pytest.fixture(scope="module")
def synthetic_result(synthetic):
    events = []
    res = train_candidate(HP, synthetic, jax.random.PRNGKey(0), progress=events.append)
    return res, events


def test_dpsgd_privacy_is_what_the_trainer_runs(synthetic_result, synthetic):
    res, _ = synthetic_result
    priv = dpsgd_privacy(HP, 2000)
    assert priv.sampling_rate == 64 / 2000
    assert priv.steps == 3 * 32  # epochs * ceil(N / B)
    assert priv.noise_multiplier == 0.7
    assert res.history[-1]["steps"] == priv.steps
    assert dpsgd_privacy(dataclasses.replace(HP, batch_size=300), 1000).steps == 3 * 4
    with pytest.raises(ValueError, match="num_examples=10 < batch_size=64"):
        dpsgd_privacy(HP, 10)


def test_tiny_synthetic_training_learns(synthetic_result, synthetic):
    res, events = synthetic_result
    assert not res.failed and res.error is None
    assert res.validation_score > 0.6  # 10 classes: chance is 0.1
    # private by default: (correct + N(0, 10^2)) / public expected validation size (500)
    acc = evaluate(res.params, "cnn26k", synthetic.val_x, synthetic.val_y)
    correct = acc * len(synthetic.val_y)
    assert abs(res.validation_score * synthetic.public_num_val - correct) < 5 * 10.0
    assert [h["epoch"] for h in res.history] == [1, 2, 3]
    assert res.history[-1]["train_loss"] < res.history[0]["train_loss"]
    assert [e["epoch"] for e in events if e["event"] == "epoch"] == [1, 2, 3]
    assert set(events[0]) == {"event", "candidate", "epoch", "epochs", "step", "total_steps"}


def test_training_on_2000_real_mnist_digits_learns(mnist2k):
    hp = dataclasses.replace(HP, epochs=4)
    res = train_candidate(hp, mnist2k, jax.random.PRNGKey(1))
    assert not res.failed
    assert res.validation_score > 0.7  # chance 0.1
    assert evaluate(res.params, "cnn26k", mnist2k.test_x, mnist2k.test_y) > 0.7


def test_no_recompilation_across_steps_and_candidates(synthetic, synthetic_result):
    fns = get_step_functions("cnn26k", 10, "sgd", "bookkeeping")
    before = fns.trace_count
    assert before > 0
    other = dataclasses.replace(HP, learning_rate=0.5, clip_norm=3.0, noise_multiplier=2.0)
    train_candidate(other, synthetic, jax.random.PRNGKey(5))
    assert fns.trace_count == before


class _DeepMLP(nn.Module):
    """A user's MLP whose depth sets its number of parameter leaves (odd widths: shapes no other
    test compiles)."""

    depth: int

    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        for width in (13, 11, 9, 7, 5, 3)[: self.depth]:
            x = nn.tanh(nn.Dense(width)(x))
        return nn.Dense(10)(x)


def _programs_lowered(fn) -> int:
    """How many programs JAX traces and lowers while ``fn()`` runs: each one is a cost a warm
    start still pays (JAX hashes the lowered module to look it up in the persistent cache)."""
    count = 0

    def listener(event: str, duration: float, **kwargs) -> None:
        nonlocal count
        count += event == "/jax/core/compile/jaxpr_to_mlir_module_duration"

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    return count


@pytest.mark.parametrize("k", [1, 2])
def test_a_run_lowers_a_few_programs_whatever_the_models_depth(synthetic, k):
    """The loop's set-up and checks (keys, initialisation, optimiser state, zeros, finiteness)
    run as a few compiled programs, not one eager operation per parameter leaf: a 1-layer and a
    6-layer model lower the same number of programs (eagerly, the deep one lowered about 40 more,
    each a trace and a cache lookup on every warm start)."""
    hp = dataclasses.replace(HP, epochs=1, batch_size=500)
    counts = []
    for depth in (2, 1, 6):  # the first run lowers what any model shares (key split, noise)
        spec = models.user_model(_DeepMLP(depth), (28, 28, 1), "float32")
        hps = [dataclasses.replace(hp, model=spec, learning_rate=0.1 * (c + 1)) for c in range(k)]
        keys = [jax.random.PRNGKey(c) for c in range(k)]
        counts.append(
            _programs_lowered(
                lambda hps=hps, keys=keys: train_candidates(
                    hps, synthetic, keys, vectorize=k > 1, grad_impl="vmap"
                )
            )
        )
    counts = counts[1:]
    assert counts[0] == counts[1], counts
    # init, optimiser init, accumulate, step, finiteness, the validation sum (the key split and
    # the score's noise were lowered by the first run); K > 1 adds the stacks of parameters and
    # of optimiser states, a candidate's row and the selection of finite candidates
    assert counts[1] <= (6 if k == 1 else 10), counts


def test_nan_candidate_fails_with_fixed_score_and_does_not_raise(synthetic):
    # noise std sigma * C = 1e60 overflows float32: the parameters become inf/NaN
    bad = dataclasses.replace(HP, clip_norm=1e30, noise_multiplier=1e30, epochs=1)
    res = train_candidate(bad, synthetic, jax.random.PRNGKey(2))
    assert res.failed and math.isnan(res.validation_score) and math.isnan(FAILURE_SCORE)


def test_errors_during_training_become_failures(synthetic, monkeypatch):
    import trainers.loop as t

    def boom(*a, **k):
        raise MemoryError("out of memory")

    monkeypatch.setattr(t, "_train_group_unsafe", boom)
    res = train_candidate(HP, synthetic, jax.random.PRNGKey(0))
    assert res.failed and math.isnan(res.validation_score) and "MemoryError" in res.error


def test_noisy_score_is_gaussian_on_the_count(synthetic_result, synthetic, monkeypatch):
    import trainers.evaluate as t
    from trainers.loop import _check

    res, _ = synthetic_result
    n_val = synthetic.public_num_val  # the noisy count is divided by the PUBLIC expected size
    assert n_val == 500 and len(synthetic.val_x) != 500  # the split's length is not used
    exact_hp = dataclasses.replace(HP, score_noise_std=None)
    with pytest.raises(ValueError, match="validation split is private"):
        _check(exact_hp, synthetic)  # an exact score needs a public validation set
    public = dataclasses.replace(synthetic, validation_public=True)
    exact = evaluate(res.params, "cnn26k", public.val_x, public.val_y)
    assert _score(exact_hp, res.params, public, jax.random.PRNGKey(0)) == exact
    monkeypatch.setattr(t, "count_correct", lambda *a: 300)  # isolate the noise from the model
    noisy_hp = dataclasses.replace(HP, score_noise_std=5.0)
    keys = [jax.random.PRNGKey(i) for i in range(400)]
    counts = np.array([_score(noisy_hp, None, synthetic, k) for k in keys]) * n_val
    assert abs(counts.mean() - 300) < 4 * 5.0 / np.sqrt(400)
    assert 0.85 < counts.std() / 5.0 < 1.15  # sample std of 400 normals: ~3.5% standard error
    assert len(set(counts.round(6))) == 400


def test_vectorised_step_equals_sequential_steps():
    """The vmapped compiled step (K=2, different lr, C, keys) equals two single steps."""
    fns = get_step_functions("cnn26k", 10, "sgd", "bookkeeping")
    ps = [models.init_params(fns.spec, jax.random.PRNGKey(i)) for i in range(2)]
    opts = [
        make_optimizer(Hyperparams(learning_rate=lr)).init(p)
        for lr, p in zip([2.0, 0.5], ps, strict=True)
    ]
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (500, 28, 28, 1)).astype(np.float32)
    y = rng.integers(0, 10, 500).astype(np.int32)
    idx = np.stack([np.sort(rng.choice(500, 64, replace=False)) for _ in range(2)]).astype(np.int32)
    mask = np.ones((2, 64), np.float32)
    mask[1, 50:] = 0
    keys = jnp.stack([jax.random.PRNGKey(10), jax.random.PRNGKey(11)])
    clip, sigma = jnp.array([1.0, 2.0]), jnp.array([0.7, 1.3])
    zeros = [jax.tree_util.tree_map(jnp.zeros_like, p) for p in ps]

    def stack(xs):
        return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *xs)

    vec, _, vloss = fns.vstep(
        stack(ps), stack(opts), stack(zeros), jnp.zeros(2), x, y, idx, mask, keys, jnp.int32(3),
        clip, sigma, jnp.float32(64.0),
    )  # fmt: skip
    for i in range(2):
        one, _, loss = fns.step(
            ps[i], opts[i], zeros[i], jnp.float32(0), x, y, idx[i], mask[i], keys[i], jnp.int32(3),
            clip[i], sigma[i], jnp.float32(64.0),
        )  # fmt: skip
        for u, v in zip(
            jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(vec), strict=True
        ):
            np.testing.assert_allclose(np.asarray(u), np.asarray(v[i]), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(float(loss), float(vloss[i]), rtol=1e-5)
    # the loop's groups: a group of one is the plain jitted step, K > 1 the vmapped one
    assert (fns.group(1).accumulate, fns.group(1).step) == (fns.accumulate, fns.step)
    assert (fns.group(2).accumulate, fns.group(2).step) == (fns.vaccumulate, fns.vstep)


def test_group_layouts_hold_the_same_candidate_values():
    """A group's layout (trainers.step.Group): K = 1 keeps the candidate's values as they are, K > 1
    stacks them on a leading axis; row, chunk, finite and keep_finite read both the same way."""
    fns = get_step_functions("cnn26k", 10, "sgd", "bookkeeping")
    trees = [{"w": jnp.full((2, 3), float(c)), "b": jnp.float32(c)} for c in range(3)]
    one, three = fns.group(1), fns.group(3)
    assert one.stack(trees[:1])["w"].shape == (2, 3)
    assert three.stack(trees)["w"].shape == (3, 2, 3)
    for c in range(3):
        np.testing.assert_array_equal(three.row(three.stack(trees), c)["w"], trees[c]["w"])
    np.testing.assert_array_equal(one.row(one.stack(trees[:1]), 0)["w"], trees[0]["w"])
    with pytest.raises(ValueError, match="expected 3"):
        three.stack(trees[:2])
    # chunks: candidate 1 has no second chunk, so it gets an all-masked one of the same size
    chunks = [
        [(np.arange(4, dtype=np.int32), np.ones(4, np.float32))] * 2,
        [(np.arange(4, dtype=np.int32), np.ones(4, np.float32))],
        [(np.arange(4, dtype=np.int32), np.ones(4, np.float32))] * 2,
    ]
    idx, mask = three.chunk(chunks, 1)
    assert idx.shape == mask.shape == (3, 4)
    np.testing.assert_array_equal(mask.sum(axis=1), [4, 0, 4])
    assert one.chunk(chunks[:1], 1)[0].shape == (4,)
    # finiteness per candidate, and the last finite values kept for the others
    bad = [trees[0], {"w": jnp.full((2, 3), jnp.nan), "b": jnp.float32(1)}, trees[2]]
    assert three.finite(three.stack(bad)) == [True, False, True]
    assert one.finite(one.stack(bad[1:2])) == [False]
    kept = three.keep_finite(three.stack(trees), three.stack(bad), [True, False, True])
    np.testing.assert_array_equal(kept["w"][1], trees[1]["w"])
    assert one.keep_finite("old", "new", [False]) == "old"


@pytest.mark.slow  # ~10 s; fast twin: test_vectorised_step_equals_sequential_steps
def test_vectorised_training_runs_and_learns(synthetic):
    # Whole runs agree only up to chaotic amplification of float rounding, so compare outcomes.
    hps = [HP, dataclasses.replace(HP, noise_multiplier=0.5, learning_rate=1.5)]
    keys = [jax.random.PRNGKey(10), jax.random.PRNGKey(11)]
    events = []
    vec = train_candidates(hps, synthetic, keys, vectorize=True, progress=events.append)
    assert [r.validation_score > 0.5 for r in vec] == [True, True]
    assert {e["candidate"] for e in events} == {0, 1}


def test_chunked_batch_equals_one_chunk():
    """A batch split into main + tail chunks makes the same update as one chunk (none dropped)."""
    fns = get_step_functions("cnn26k", 10, "sgd", "bookkeeping")
    params = models.init_params(fns.spec, jax.random.PRNGKey(0))
    opt = make_optimizer(Hyperparams(learning_rate=1.0)).init(params)
    rng = np.random.default_rng(0)
    x = rng.uniform(0, 1, (500, 28, 28, 1)).astype(np.float32)
    y = rng.integers(0, 10, 500).astype(np.int32)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    rest = (jax.random.PRNGKey(3), jnp.int32(7), jnp.float32(1.0), jnp.float32(1.1), 60.0)
    idx = np.sort(rng.choice(500, 70, replace=False)).astype(np.int32)

    def chunk(ids, size):
        out, mask = np.zeros(size, np.int32), np.zeros(size, np.float32)
        out[: len(ids)], mask[: len(ids)] = ids, 1
        return out, mask

    # 60 examples in one 64-slot chunk, or 50 in the main chunk + 10 in a 16-slot tail chunk
    one, _, l1 = fns.step(params, opt, zeros, jnp.float32(0), x, y, *chunk(idx[:60], 64), *rest)
    g, lo = fns.accumulate(params, zeros, jnp.float32(0), x, y, *chunk(idx[50:60], 16), 1.0)
    two, _, l2 = fns.step(params, opt, g, lo, x, y, *chunk(idx[:50], 64), *rest)
    for u, v in zip(jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(two), strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(l1), float(l2), rtol=1e-5)


def test_invalid_hyperparameters_name_the_field(synthetic):
    bad = [
        ("learning_rate", 0.0), ("clip_norm", -1.0), ("noise_multiplier", float("nan")),
        ("batch_size", 0), ("epochs", 1.5), ("optimizer", "lbfgs"), ("momentum", 1.0),
        ("model", "vgg"), ("score_noise_std", 0.0),
    ]  # fmt: skip
    for field, value in bad:
        with pytest.raises(ValueError, match=field):
            dataclasses.replace(HP, **{field: value})
    with pytest.raises(ValueError, match="expects images"):
        train_candidate(
            dataclasses.replace(HP, model="cifar_cnn"), synthetic, jax.random.PRNGKey(0)
        )
    with pytest.raises(ValueError, match="keys"):
        train_candidates([HP, HP], synthetic, [jax.random.PRNGKey(0)])


def test_split_validation_validation_size_zero_is_refused_for_scoring(synthetic):
    d = split_validation(
        synthetic.train_x, synthetic.train_y, synthetic.test_x, synthetic.test_y, 10, "s", 0
    )
    with pytest.raises(ValueError, match="validation"):
        train_candidate(HP, d, jax.random.PRNGKey(0))


def test_the_privacy_spec_imports_without_jax():
    """trainers.spec (hyperparameters -> q, steps, sigma) is what accounting and config checks
    need: it must not pull in JAX, Flax or Optax."""
    import subprocess
    import sys

    code = (
        "import sys, trainers.spec as s; "
        "s.dpsgd_privacy(s.Hyperparams(), 60000); "
        "print(sorted(m for m in ('jax', 'flax', 'optax') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
