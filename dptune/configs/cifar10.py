"""CIFAR-10 (50k/10k): the ~0.55M-parameter tanh CNN, random stopping (Poisson, mean 8) over
learning rate and clipping norm, total (epsilon, delta) = (8, 1e-5) tuning included.

    dptune --config=cifar10 --workdir=runs/cifar10
    dptune --config=cifar10 --workdir=runs/cifar10 \
        --config.data.dir=/data/cifar-10-batches-py --config.data.source=cifar_pickle
"""

from dptune.configs import base


def get_config():
    c = base.get_config()
    c.data.name = "cifar10"
    c.train.update(model="cifar_cnn", batch_size=512, epochs=30)
    c.space.learning_rate.update(low=0.05, high=2.0)
    c.space.clip_norm.update(low=0.1, high=3.0)
    c.selection.update(method="poisson", mean_trials=8.0)
    c.privacy.epsilon = 8.0
    return c
