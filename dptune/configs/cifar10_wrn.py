"""CIFAR-10 on an accelerator: DP-SGD with WRN-16-4 (group norm, weight-standardised convolutions),
augmentation multiplicity, parameter EMA, expected batch 4096, in the setting of De et al. 2022
("Unlocking high-accuracy differentially private image classification through scale", CIFAR-10
WRN-16-4: 56.8 / 65.9 / 73.5 % test accuracy at epsilon = 1 / 2 / 4 untuned, 79.5 % at 8), with
random stopping (logarithmic, mean 4) over learning rate, clipping norm and augmentation
multiplicity; total (epsilon, delta) = (8, 1e-5), tuning included.

Budget first: sigma is calibrated to the total ("auto"); augmult, learning rate and clipping norm do
not change a candidate's privacy. The per-example work of each step runs in micro-batches
(Hyperparams.microbatch_size), so B = 4096 with K = 16 fits in 16 GB (docs/performance.md). One
candidate is ~2,200 steps of 65,536 images: meant for a GPU/TPU, not for a CPU. No accuracy has been
measured with it.

    dptune --config=cifar10_wrn --workdir=runs/cifar10_wrn
"""

from dptune import space
from dptune.configs import base


def get_config():
    c = base.get_config()
    c.data.name = "cifar10"
    # De et al.'s batch 4096, plain SGD, parameter EMA; 200 epochs = 200 * ceil(45000 / 4096) =
    # 2,200 steps (they use 2,468 at eps 8 on 50k examples).
    c.train.update(model="wrn16_4", batch_size=4096, epochs=200, optimizer="sgd")
    c.train.ema_decay = 0.999
    c.space.learning_rate.update(low=1.0, high=8.0)  # De et al.: 4
    c.space.clip_norm.update(low=0.5, high=2.0)  # De et al.: 1
    del c.train.augmult  # searched below, so not also a fixed training setting
    c.space.augmult = space.choice(8, 16)  # De et al.: 16
    # the logarithmic count: the default (docs/accounting.md, "Which count")
    c.selection.update(method="logarithmic", mean_trials=4.0)
    c.privacy.epsilon = 8.0
    return c
