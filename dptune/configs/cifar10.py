"""CIFAR-10 (50k/10k), CPU-feasible: DP-SGD with the 550,570-parameter tanh CIFAR CNN
(book-keeping per-example clipping), random stopping (logarithmic, mean 8) over learning rate,
clipping norm and augmentation multiplicity; total (epsilon, delta) = (8, 1e-5), tuning included.

Budget first: the noise multiplier is calibrated to the total ("auto"); augmentation multiplicity
does not change a candidate's privacy (each example still contributes one clipped gradient).
No accuracy has been measured with it; docs/performance.md has its step time.

    dptune --config=cifar10 --workdir=runs/cifar10
    dptune --config=cifar10 --workdir=runs/cifar10 \
        --config.data.dir=/data/cifar-10-batches-py --config.data.source=cifar_pickle
"""

from dptune import space
from dptune.configs import base


def get_config():
    c = base.get_config()
    c.data.name = "cifar10"
    # B = 512 and 30 epochs keep one candidate well under an hour on a 2-core CPU without
    # augmentation (docs/performance.md).
    c.train.update(model="cifar_cnn", batch_size=512, epochs=30)
    c.space.learning_rate.update(low=0.05, high=2.0)
    c.space.clip_norm.update(low=0.1, high=3.0)
    # K augmented copies (crop + flip) per example; K times the compute of a step
    del c.train.augmult  # searched below, so not also a fixed training setting
    c.space.augmult = space.choice(0, 2, 4)
    # the logarithmic count: the default (docs/accounting.md, "Which count")
    c.selection.update(method="logarithmic", mean_trials=8.0)
    c.privacy.epsilon = 8.0
    return c
