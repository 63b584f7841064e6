"""A private training split with no record (possible on a small Poisson subset of subsampled
tuning) trains like its neighbour with one record that no batch sampled: empty batches, noise
alone. A failure there would be a function of the data itself, not of the candidate's private
output (docs/privacy-model.md, assumption ``failures``)."""

import dataclasses

import flax.linen as nn
import jax
import numpy as np

from trainers import loop, models
from trainers.data import Dataset
from trainers.sampling import PoissonSampler
from trainers.spec import Hyperparams


def test_a_sampler_over_no_record_draws_empty_batches_of_padding():
    s = PoissonSampler(0, 10, np.random.default_rng(0), sampling_rate=0.1)
    batch = s.sample()
    assert batch.shape == (0,)
    (idx, mask), *rest = s.chunks(batch)
    assert rest == [] and not mask.any()


def test_a_candidate_on_an_empty_training_split_trains_and_is_scored():
    rng = np.random.default_rng(0)
    x, y = rng.random((30, 4), dtype=np.float32), rng.integers(0, 3, 30).astype(np.int32)
    data = Dataset(x[:0], y[:0], x[:20], y[:20], x[20:], y[20:], 3, "synthetic")
    data = dataclasses.replace(data, public_num_train=100, public_num_val=20)
    spec = models.user_model(nn.Dense(3), (4,), "float32", num_classes=3)
    hp = Hyperparams(
        model=spec, batch_size=10, epochs=2, noise_multiplier=1.0, learning_rate=0.1,
        score_noise_std=10.0,
    )  # fmt: skip
    r = loop.train_candidates([hp], data, [np.array([1, 2], np.uint32)])[0]
    assert not r.failed, r.error
    assert np.isfinite(r.validation_score)
    assert [h["steps"] for h in r.history] == [10, 20]  # the public schedule: 2 x 100 / 10
    leaves = [np.asarray(v) for v in jax.tree_util.tree_leaves(r.params)]
    assert all(np.isfinite(v).all() for v in leaves) and any(np.abs(v).sum() > 0 for v in leaves)
