"""The count of sampled examples left out of the clipped sums because their gradient norm was not
finite: carried on the device with the loss, in the candidate's (private) result, exact."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainers import models
from trainers.data import Dataset
from trainers.loop import _numpy_rng, train_candidates
from trainers.sampling import PoissonSampler
from trainers.spec import DpSgdSchedule, Hyperparams

VOCAB, N, B = 5, 80, 16


class _Tokens(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Embed(VOCAB, 4)(x)  # a token id equal to VOCAB gives NaN
        return nn.Dense(3)(jnp.tanh(nn.Dense(4)(h)).mean(axis=1))


_SPEC = models.user_model(_Tokens(), (3,), "int32")


def _data(bad: tuple[int, ...] = ()) -> Dataset:
    rng = np.random.default_rng(0)
    x = rng.integers(0, VOCAB, (N, 3)).astype(np.int32)
    y = rng.integers(0, 3, N).astype(np.int32)
    xv, yv = x[:20] % VOCAB, y[:20]
    x[list(bad), 1] = VOCAB
    return Dataset.from_arrays(x, y, num_examples=N, public_validation=(xv, yv), num_classes=3)


def _sampled(hp: Hyperparams, data: Dataset, key, records: np.ndarray) -> int:
    """How often the loop's Poisson sampler (same key, same stream) draws any of ``records``
    (each once per step at most)."""
    schedule = DpSgdSchedule.from_hyperparams(hp, data.public_num_train)
    sk = np.asarray(jax.random.split(jax.device_put(np.asarray(key, np.uint32)), 4))
    sampler = PoissonSampler(
        len(data.train_x), schedule.batch_size, _numpy_rng(sk[1]),
        sampling_rate=schedule.sampling_rate, max_chunk=hp.microbatch_size or B,
    )  # fmt: skip
    return sum(int(np.isin(records, sampler.sample()).sum()) for _ in range(schedule.steps))


@pytest.mark.parametrize("k", [1, 2])
def test_the_count_is_the_times_the_non_finite_record_was_sampled(k):
    """Records whose gradient is NaN (an out-of-vocabulary token): each candidate trains and
    counts each once per step it was sampled in (checked against the same Poisson stream); with
    microbatches of 8 the batches span body and tail chunks. A clean dataset counts 0."""
    bad = _data((7, 30, 51))
    # the bad records' rows in the training split (each record's split is its own)
    rows = np.flatnonzero((bad.train_x == VOCAB).any(axis=1))
    assert len(rows) == 3
    hps = [
        Hyperparams(model=_SPEC, learning_rate=lr, batch_size=B, epochs=2, microbatch_size=8,
                    score_noise_std=None)
        for lr in (0.5, 1.0)[:k]
    ]  # fmt: skip
    keys = [np.asarray([3, c], np.uint32) for c in range(k)]
    got = train_candidates(hps, bad, keys, vectorize=k > 1, grad_impl="vmap")
    for hp, key, r in zip(hps, keys, got, strict=True):
        assert not r.failed, r.error
        want = _sampled(hp, bad, key, rows)
        assert want > 0
        assert r.dropped == want
        assert np.isfinite(r.validation_score)
        assert "dropped" not in str(r.history)  # not in the per-epoch rows
    clean = train_candidates(hps, _data(), keys, vectorize=k > 1, grad_impl="vmap")
    assert [r.dropped for r in clean] == [0] * k


def test_the_ghost_path_counts_the_same():
    bad = _data((7,))
    hp = Hyperparams(model=_SPEC, learning_rate=0.5, batch_size=B, epochs=1, score_noise_std=None)
    key = np.asarray([3, 0], np.uint32)
    rows = np.flatnonzero((bad.train_x == VOCAB).any(axis=1))
    (r,) = train_candidates([hp], bad, [key], vectorize=False, grad_impl="ghost")
    assert not r.failed and r.dropped == _sampled(hp, bad, key, rows) > 0
