"""CIFAR-10 (50k/10k via tensorflow-datasets): DP-SGD CIFAR CNN, random stopping (Poisson, mean
8) over learning rate and clipping norm, total (epsilon, delta) = (8, 1e-5) tuning included.

    dptune --config=configs/cifar10.py --workdir=runs/cifar10
    dptune --config=configs/cifar10.py --workdir=runs/cifar10 \
        --config.data.dir=/data/cifar-10-batches-py --config.data.source=cifar_pickle
"""

from ml_collections import config_dict

from dptune import space


def get_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    # data: tensorflow-datasets by default; a local IDX folder with --config.data.dir=...
    c.data = dict(name="cifar10", source="auto", validation_size=5000)
    c.data.dir = config_dict.placeholder(str)
    # privacy model of the data (docs/privacy-model.md): each record's split is a keyed hash of
    # that record; sampling rates come from the PUBLIC size of the training file (default: the
    # published size of data.name), never from len() of the loaded arrays
    c.data.num_examples = config_dict.placeholder(int)
    c.data.split_seed = 0
    c.data.validation_dir = config_dict.placeholder(str)  # a separate validation set (IDX train-*)
    c.data.validation_public = False  # True only for a separate, public validation set
    # fixed DP-SGD settings (trainers.train.Hyperparams fields)
    c.train = dict(
        model="cifar_cnn", batch_size=512, epochs=30, optimizer="momentum", momentum=0.9,
        score_noise_std=10.0,  # Gaussian noise (in counts) on the number of correct val predictions
    )  # fmt: skip
    # the search; noise_multiplier="auto" calibrates sigma so the TOTAL meets the budget
    c.space = dict(
        learning_rate=space.log_uniform(0.05, 2.0),
        clip_norm=space.log_uniform(0.1, 3.0),
        noise_multiplier="auto",
    )
    c.selection = dict(method="random_stopping", distribution="poisson", mean_trials=8.0)
    c.selection.shape = config_dict.placeholder(float)  # truncated_negative_binomial's eta
    c.selection.threshold = config_dict.placeholder(float)  # thresholding
    c.selection.stop_probability = config_dict.placeholder(float)  # thresholding
    c.selection.max_trials = config_dict.placeholder(int)
    c.selection.k = config_dict.placeholder(int)  # best_of_k / non_private_best
    c.privacy = dict(epsilon=8.0, delta=1e-5, accountant="auto")
    c.privacy.adjacency = "add_remove"  # or "replace_one" (fixed, public dataset size)
    # the dataset's budget over all runs in the ledger (default: this run's budget)
    c.ledger = dict(enabled=True)
    c.ledger.path = config_dict.placeholder(
        str
    )  # default $DPTUNE_LEDGER or ~/.dptune/ledger.sqlite
    c.ledger.budget_epsilon = config_dict.placeholder(float)
    c.ledger.budget_delta = config_dict.placeholder(float)
    c.executor = dict(group_size=1)  # >1: candidates trained together (vectorised where it pays)
    return c
