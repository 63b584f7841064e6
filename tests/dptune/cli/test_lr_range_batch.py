"""The ``user`` config's derived learning-rate range is per record of the expected batch the run
uses: with a batch size the user set, the range scales with that batch (a public hyperparameter),
not with the batch dptune would have suggested."""

import pytest

from dptune.cli import build as cli
from dptune.configs import user
from dptune.learners.dpsgd import LEARNING_RATE_RANGES


@pytest.mark.parametrize("optimizer", ["momentum", "sgd"])
def test_the_derived_range_follows_the_batch_size_the_user_set(optimizer):
    cfg = user.get_config()
    cfg.data.update(path="arrays.npz", num_examples=60_000)  # suggested batch: 256
    cfg.train.update(batch_size=1024, optimizer=optimizer)
    got = cli.validate(cfg, None).cfg
    assert got["train"]["batch_size"] == 1024
    lr = got["space"]["learning_rate"]
    low, high = LEARNING_RATE_RANGES[optimizer]
    assert (lr["low"], lr["high"]) == pytest.approx((low * 1024, high * 1024))
