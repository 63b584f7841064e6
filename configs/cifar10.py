"""CIFAR-10 (45k train / 5k validation / 10k test), CPU-feasible: DP-SGD with the 550,570-parameter
tanh CIFAR CNN (book-keeping per-example clipping), random stopping (Poisson, mean 8) over learning
rate, clipping norm and augmentation multiplicity; total (epsilon, delta) = (8, 1e-5), tuning
included.

Budget first: the privacy budget below is the total for everything released; the noise multiplier
is calibrated to it ("auto"), and the search space holds only fields that do not change a
candidate's privacy (augmentation multiplicity does not: each example still contributes one
clipped gradient).

No CIFAR-10 accuracy has been measured with this config (no CIFAR-10 files were available where it
was written); see docs/performance.md for its step time.

    dptune --config=configs/cifar10.py --workdir=runs/cifar10
    dptune --config=configs/cifar10.py --workdir=runs/cifar10 \
        --config.data.dir=/data/cifar-10-batches-py --config.data.source=cifar_pickle
"""

from ml_collections import config_dict

from dptune import space


def get_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    # the total budget, tuning included; every candidate's noise is calibrated to it
    c.privacy = dict(epsilon=8.0, delta=1e-5, accountant="auto")
    # data: tensorflow-datasets by default; a local CIFAR-10 python folder with --config.data.dir
    c.data = dict(name="cifar10", source="auto", validation_size=5000)
    c.data.dir = config_dict.placeholder(str)
    # fixed DP-SGD settings (trainers.train.Hyperparams fields). B = 512 and 30 epochs keep one
    # candidate to well under an hour on a 2-core CPU without augmentation (docs/performance.md).
    c.train = dict(
        model="cifar_cnn", batch_size=512, epochs=30, optimizer="momentum", momentum=0.9,
        score_noise_std=10.0,  # Gaussian noise (in counts) on the number of correct val predictions
    )  # fmt: skip
    # the search; noise_multiplier="auto" calibrates sigma so the TOTAL meets the budget
    c.space = dict(
        learning_rate=space.log_uniform(0.05, 2.0),
        clip_norm=space.log_uniform(0.1, 3.0),
        # K augmented copies (crop + flip) per example; K times the compute of a step
        augmult=space.choice(0, 2, 4),
        noise_multiplier="auto",
    )
    c.selection = dict(method="random_stopping", distribution="poisson", mean_trials=8.0)
    c.selection.shape = config_dict.placeholder(float)  # truncated_negative_binomial's eta
    c.selection.threshold = config_dict.placeholder(float)  # thresholding
    c.selection.stop_probability = config_dict.placeholder(float)  # thresholding
    c.selection.max_trials = config_dict.placeholder(int)
    c.selection.k = config_dict.placeholder(int)  # best_of_k / non_private_best
    # the dataset's budget over all runs in the ledger (default: this run's budget)
    c.ledger = dict(enabled=True)
    # default $DPTUNE_LEDGER or ~/.dptune/ledger.sqlite
    c.ledger.path = config_dict.placeholder(str)
    c.ledger.budget_epsilon = config_dict.placeholder(float)
    c.ledger.budget_delta = config_dict.placeholder(float)
    c.executor = dict(group_size=1)  # >1: candidates trained together (vectorised where it pays)
    return c
