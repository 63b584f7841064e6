"""Fashion-MNIST (60k/10k): DP-SGD 26k-parameter CNN, random stopping (Poisson, mean 8) over
learning rate and clipping norm, total (epsilon, delta) = (3, 1e-5) tuning included.

    dptune --config=fashion_mnist --workdir=runs/fmnist                  # tensorflow-datasets
    dptune --config=fashion_mnist --workdir=runs/fmnist \
        --config.data.dir=/path/to/fashion-mnist                          # local IDX files, offline
"""

from dptune.configs import base


def get_config():
    c = base.get_config()
    c.data.name = "fashion_mnist"
    c.train.update(batch_size=2048, epochs=40)
    # B, epochs, momentum and the centres of the ranges (lr 4, C 0.1) are the published settings
    # for this tanh CNN (Tramer & Boneh 2021, ICLR, "Differentially Private Learning Needs Better
    # Features"); nothing was tuned on this data outside dptune.
    c.space.learning_rate.update(low=1.5, high=10.0)
    c.space.clip_norm.update(low=0.04, high=0.25)
    c.selection.update(method="poisson", mean_trials=8.0)
    return c
