"""An epoch's Poisson batches go to the device once; its steps then make no host-to-device
transfer and compute what the step-by-step loop computed (same seed, same parameters)."""

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest

from trainers import models
from trainers.data import make_synthetic
from trainers.loop import _epoch_batches, same_step, train_candidates
from trainers.sampling import PoissonSampler
from trainers.spec import DpSgdSchedule, Hyperparams
from trainers.step import StepFunctions, get_step_functions, optimizer_numbers

N, B, CHUNK = 240, 48, 16  # 3 body chunks of 16 and tail chunks: every kind of chunk is used


class _Tiny(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.tanh(nn.Dense(7)(x.reshape((x.shape[0], -1))))
        return nn.Dense(10)(x)


@pytest.fixture(scope="module")
def data():
    d = make_synthetic(num_train=N, num_test=10, validation_size=60, seed=3)
    return jax.device_put(d.train_x), jax.device_put(d.train_y)


def _samplers(k: int, seed: int = 7) -> list[PoissonSampler]:
    return [
        PoissonSampler(N, B, np.random.default_rng(seed + c), max_chunk=CHUNK) for c in range(k)
    ]


def _start(fns: StepFunctions, k: int, lr: float = 0.5):
    group = fns.group(k)
    params = [models.init_params(fns.spec, jax.random.PRNGKey(c)) for c in range(k)]
    hp = Hyperparams(learning_rate=lr, optimizer="sgd")
    opt = group.stack([fns.init_opt(p, optimizer_numbers(hp)) for p in params])
    consts = (
        group.stack([np.asarray([c, 9], np.uint32) for c in range(k)]),  # noise keys
        group.stack([np.float32(1.0 + c) for c in range(k)]),  # clip norms
        group.stack([np.float32(0.8)] * k),  # noise multipliers
        jax.device_put(np.float32(B)),
    )
    return group, group.stack(params), opt, consts


def _stepwise(fns, k, samplers, steps, data, noise_step, lr=0.5):
    """The step-by-step loop: each step's chunks handed to the compiled functions from the
    host, as the training loop did before its epochs moved to the device."""
    group, params, opt, (keys, clip, sigma, b) = _start(fns, k, lr)
    loss = group.stack([np.float32(0.0)] * k)
    zero = jax.tree_util.tree_map(np.zeros_like, params)
    for step in range(steps):
        chunked = [s.chunks(s.sample()) for s in samplers]
        gsum = zero
        for j in range(1, max(len(c) for c in chunked)):
            idx, mask = group.chunk(chunked, j)
            gsum, loss = group.accumulate(
                params, gsum, loss, *data, idx, mask, clip, keys, np.int32(step), np.int32(j)
            )
        idx, mask = group.chunk(chunked, 0)
        params, opt, loss = group.step(
            params, opt, gsum, loss, *data, idx, mask, keys, np.int32(noise_step(step)), clip,
            sigma, b,
        )  # fmt: skip
    return params, loss


def _on_device(fns, k, samplers, steps, data, noise_step, lr=0.5):
    """The same steps from the epoch's batches put on the device in one transfer."""
    group, params, opt, (keys, clip, sigma, b) = _start(fns, k, lr)
    host, chunks, _ = _epoch_batches(samplers, steps, 0, noise_step, 1)
    batches = jax.device_put(host)  # the epoch's one transfer
    zero = jax.tree_util.tree_map(lambda a: jax.device_put(np.zeros_like(a)), params)
    # the loss sum and the count of examples dropped from the clipped sums
    totals = (group.stack([np.float32(0.0)] * k), group.stack([np.int32(0)] * k))
    t, one = jax.device_put(np.int32(0)), jax.device_put(np.int32(1))
    with jax.transfer_guard("disallow"):  # a per-step host value would raise here
        for body, tail in chunks:
            acc = (zero, totals, one)
            for part, n in (("body", body - 1), ("tail", tail)):
                for _ in range(n):
                    acc = group.run_chunk(part, params, acc, batches, *data, keys, clip, t)
            params, opt, totals, t = group.run(
                params, opt, acc, batches, *data, keys, clip, sigma, b, t
            )
        # the guard does catch a step handed a host value (the step-by-step loop's way)
        with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
            group.step(
                params, opt, zero, totals[0], *data, host["body_idx"][0, 0],
                host["body_mask"][0, 0], keys, t, clip, sigma, b,
            )  # fmt: skip
    assert int(t) == steps
    assert not np.asarray(totals[1]).any()  # every gradient finite: nothing dropped
    return params, totals[0]


@pytest.mark.parametrize(
    "k,augmult,noise_step", [(1, 0, same_step), (2, 0, same_step), (1, 2, lambda s: 5)]
)
def test_an_epoch_on_the_device_equals_the_step_by_step_loop(data, k, augmult, noise_step):
    """Same samplers' seeds, same keys: the same parameters and loss sum, bitwise, for one
    candidate, a vmapped group of two, augmentation copies (keyed by step and chunk) and an
    audit's constant noise step. Under the transfer guard: no host-to-device transfer."""
    spec = models.user_model(_Tiny(), (28, 28, 1), "float32")
    fns = get_step_functions(spec, 10, "sgd", "vmap", augmult)
    steps = 6
    drawn = [[len(s.chunk_sizes(len(s.sample()))) for _ in range(steps)] for s in _samplers(k)]
    assert max(map(max, drawn)) > 3 and min(map(min, drawn)) < 4  # tails in some steps only
    want, want_loss = _stepwise(fns, k, _samplers(k), steps, data, noise_step)
    got, got_loss = _on_device(fns, k, _samplers(k), steps, data, noise_step)
    # the same compiled arithmetic, the chunks read on the device: bitwise the same
    for a, b in zip(jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got), strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
    np.testing.assert_array_equal(np.asarray(got_loss), np.asarray(want_loss))


def test_a_training_run_makes_no_transfer_inside_its_epochs(monkeypatch):
    """train_candidates end to end (two vmapped candidates, progress events every 3 steps):
    every step is made under the transfer guard."""
    runs = []
    group = StepFunctions.group

    def guarded(self, k):
        g = group(self, k)

        def guard(fn):
            def call(*args):
                runs.append(fn is g.run)
                with jax.transfer_guard("disallow"):
                    return fn(*args)

            return call

        return dataclasses.replace(g, run=guard(g.run), run_chunk=guard(g.run_chunk))

    monkeypatch.setattr(StepFunctions, "group", guarded)
    d = make_synthetic(num_train=N, num_test=10, validation_size=60, seed=3)
    spec = models.user_model(_Tiny(), (28, 28, 1), "float32")
    hps = [
        Hyperparams(model=spec, learning_rate=lr, batch_size=B, epochs=2, microbatch_size=CHUNK)
        for lr in (0.1, 0.2)
    ]
    events = []
    keys = [jax.random.PRNGKey(1), jax.random.PRNGKey(2)]
    res = train_candidates(
        hps, d, keys, vectorize=True, grad_impl="vmap", progress=events.append, progress_every=3
    )
    assert not any(r.failed for r in res), [r.error for r in res]
    assert DpSgdSchedule.from_hyperparams(hps[0], d.public_num_train).steps_per_epoch == 4
    steps = [e["step"] for e in events if e["event"] == "step" and e["candidate"] == 0]
    assert steps == [3, 6]
    assert sum(runs) == 8 and len(runs) > 8  # the steps and their other chunks, under the guard
