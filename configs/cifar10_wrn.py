"""CIFAR-10 on an accelerator: DP-SGD with WRN-16-4 (group norm, weight-standardised convolutions),
augmentation multiplicity, parameter EMA, expected batch 4096, in the setting of De et al. 2022
("Unlocking high-accuracy differentially private image classification through scale", CIFAR-10
WRN-16-4: 56.8 / 65.9 / 73.5 % test accuracy at epsilon = 1 / 2 / 4 untuned, 79.5 % at 8), with
random stopping (Poisson, mean 4) over learning rate, clipping norm and augmentation multiplicity;
total (epsilon, delta) = (8, 1e-5), tuning included.

Budget first: the budget below is the total; sigma is calibrated to it ("auto"); augmult, learning
rate and clipping norm do not change a candidate's privacy. The per-example work of each step runs
in micro-batches (Hyperparams.microbatch_size, default 256 images per chunk), so B = 4096 with
K = 16 fits in 16 GB (peak memory per chunk: docs/performance.md). One candidate is ~2,200 steps of
65,536 images: meant for a GPU/TPU, not for a CPU. Not run here: no accuracy has been measured
with it.

    dptune --config=configs/cifar10_wrn.py --workdir=runs/cifar10_wrn
"""

from ml_collections import config_dict

from dptune import space


def get_config() -> config_dict.ConfigDict:
    c = config_dict.ConfigDict()
    # the total budget, tuning included; every candidate's noise is calibrated to it
    c.privacy = dict(epsilon=8.0, delta=1e-5, accountant="auto")
    c.data = dict(name="cifar10", source="auto", validation_size=5000)
    c.data.dir = config_dict.placeholder(str)
    # fixed settings (trainers.train.Hyperparams fields): De et al.'s batch 4096, plain SGD,
    # parameter EMA; 200 epochs = 200 * ceil(45000 / 4096) = 2,200 steps (they use 2,468 at eps 8
    # on 50k examples).
    c.train = dict(
        model="wrn16_4", batch_size=4096, epochs=200, optimizer="sgd", ema_decay=0.999,
        score_noise_std=10.0,  # Gaussian noise (in counts) on the number of correct val predictions
    )  # fmt: skip
    c.space = dict(
        learning_rate=space.log_uniform(1.0, 8.0),  # De et al.: 4
        clip_norm=space.log_uniform(0.5, 2.0),  # De et al.: 1
        augmult=space.choice(8, 16),  # De et al.: 16
        noise_multiplier="auto",
    )
    c.selection = dict(method="random_stopping", distribution="poisson", mean_trials=4.0)
    c.selection.shape = config_dict.placeholder(float)
    c.selection.threshold = config_dict.placeholder(float)
    c.selection.stop_probability = config_dict.placeholder(float)
    c.selection.max_trials = config_dict.placeholder(int)
    c.selection.k = config_dict.placeholder(int)
    c.ledger = dict(enabled=True)
    # default $DPTUNE_LEDGER or ~/.dptune/ledger.sqlite
    c.ledger.path = config_dict.placeholder(str)
    c.ledger.budget_epsilon = config_dict.placeholder(float)
    c.ledger.budget_delta = config_dict.placeholder(float)
    c.executor = dict(group_size=1)
    return c
