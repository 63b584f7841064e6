"""Smoke run: a REAL, small private tuning job on the 10,000 MNIST digits shipped with dptune
(offline; about a minute on 2 CPU cores). Random stopping with a logarithmic number of candidates
(mean 2.5) over learning rate and clipping norm; total (epsilon, delta) = (4, 1e-5), tuning
included.

    dptune --config=smoke --workdir=/tmp/dptune-smoke
"""

from dptune.configs import base


def get_config():
    c = base.get_config()
    # "<shipped:mnist-10k>" is dptune/data/mnist-10k (8,000 train / 2,000 test, IDX gz)
    c.data.update(source="idx", dir="<shipped:mnist-10k>", validation_size=1000, num_examples=8000)
    c.train.update(batch_size=256, epochs=2, optimizer="sgd", score_noise_std=5.0)
    c.space.learning_rate.update(low=1.0, high=4.0)
    c.space.clip_norm.update(low=0.5, high=2.0)
    c.selection.update(method="logarithmic", mean_trials=2.5)
    c.privacy.epsilon = 4.0
    # A demo dataset: its ledger budget allows many smoke runs (a real dataset's would not).
    c.ledger.update(budget_epsilon=1000.0, budget_delta=1e-3)
    return c
