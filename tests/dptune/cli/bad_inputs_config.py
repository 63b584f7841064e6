"""The tiny config of ``test_bad_inputs.py``: DP feature selection + Fisher (NumPy: no JAX to
compile) on a few hundred synthetic digits in the MNIST IDX layout, which the test writes and
points ``--config.data.dir`` at. Every refusal of the test starts from this config."""

from dptune import space
from dptune.configs import base


def get_config():
    c = base.get_config()
    c.data.update(name="mnist", source="idx", validation_size=40, num_examples=240)
    c.trainer = "fisher"
    c.train = dict(num_features=30, score_noise_std=2.0)
    c.space = dict(clip_norm=space.log_uniform(4.0, 8.0), noise_multiplier="auto")
    c.selection.update(method="logarithmic", mean_trials=2.0)
    c.privacy.update(epsilon=8.0, delta=1e-3)
    c.ledger.update(budget_epsilon=100.0, budget_delta=0.01)
    return c
