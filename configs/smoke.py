"""Smoke run: a REAL, small private tuning job on the 10,000 MNIST digits shipped with dptune
(offline; about a minute on 2 CPU cores). Random stopping with a logarithmic number of candidates
(mean 2.5) over learning rate and clipping norm; total (epsilon, delta) = (4, 1e-5), tuning
included.

    dptune --config=configs/smoke.py --workdir=/tmp/dptune-smoke
"""

from ml_collections import config_dict

from dptune import space


def get_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    # "<shipped:mnist-10k>" is dptune/data/mnist-10k (8,000 train / 2,000 test, IDX gz)
    c.data = dict(name="mnist", source="idx", dir="<shipped:mnist-10k>", validation_size=1000)
    # privacy model of the data (docs/privacy-model.md): each record's split is a keyed hash of
    # that record; sampling rates come from the PUBLIC size of the training file (default: the
    # published size of data.name), never from len() of the loaded arrays
    c.data.num_examples = 8000  # the shipped subset's training file
    c.data.split_seed = 0
    c.data.validation_dir = config_dict.placeholder(str)  # a separate validation set (IDX train-*)
    c.data.validation_public = False  # True only for a separate, public validation set
    c.train = dict(
        model="cnn26k", batch_size=256, epochs=2, optimizer="sgd", momentum=0.9,
        score_noise_std=5.0,  # Gaussian noise (in counts) on the number of correct val predictions
    )  # fmt: skip
    c.space = dict(
        learning_rate=space.log_uniform(1.0, 4.0),
        clip_norm=space.log_uniform(0.5, 2.0),
        noise_multiplier="auto",
    )
    c.selection = dict(method="random_stopping", distribution="logarithmic", mean_trials=2.5)
    c.selection.shape = config_dict.placeholder(float)
    c.selection.threshold = config_dict.placeholder(float)
    c.selection.stop_probability = config_dict.placeholder(float)
    c.selection.max_trials = config_dict.placeholder(int)
    c.selection.k = config_dict.placeholder(int)
    c.privacy = dict(epsilon=4.0, delta=1e-5, accountant="auto")
    c.privacy.adjacency = "add_remove"  # or "replace_one" (fixed, public dataset size)
    # A demo dataset: its ledger budget allows many smoke runs (a real dataset's would not).
    c.ledger = dict(enabled=True, budget_epsilon=1000.0, budget_delta=1e-3)
    c.ledger.path = config_dict.placeholder(str)
    c.executor = dict(group_size=1)
    return c
