"""Fine-tune privately (docs/finetune.md): the shipped cnn26k, pretrained NON-privately on the
shipped MNIST digits 0-4 (declared public), tuned privately on the digits 5-9 of the same file,
relabelled 0-4 (the private task). The two splits are disjoint records: each training record is in
exactly one of them, by its label. Offline, about 10 s on 2 CPU cores (the number of candidates is
random, and so is the time):

    dptune --config=finetune --workdir=/tmp/dptune-finetune

The pretrained start ships with dptune (``dptune/data/pretrained/``, 104 KB) and is rebuilt
bit for bit by ``python scripts/pretrain_digits.py``. Variants (the arms of docs/finetune.md):

    --config.init=''                                       from scratch (no pretrained start)
    --config.learner.trainable=dense2                      the last layer only
    --config.model=dptune.configs.finetune:lora_cnn        LoRA adapters (rank 4) on conv2, dense1,
                                                           dense2 (a config of your own may search
                                                           space.lora_rank: privacy-irrelevant)

The search space, and the large-model recipe one override away, are explained in docs/finetune.md.
"""

from pathlib import Path

import numpy as np

from dptune import space
from dptune.configs import base

#: The digits declared public (pretraining) and private (fine-tuning) in the shipped MNIST file.
PUBLIC_DIGITS = (0, 1, 2, 3, 4)
PRIVATE_DIGITS = (5, 6, 7, 8, 9)
#: Records of the private digits in the shipped 8,000-record training file: its published
#: content, so a public number (it sets the sampling rate).
PRIVATE_NUM_TRAIN = 3933
#: cnn26k (5 classes) pretrained on the public digits by scripts/pretrain_digits.py.
PRETRAINED = Path(__file__).resolve().parents[1] / "data" / "pretrained" / "cnn26k-digits0-4.npz"


def digits(which: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """The shipped MNIST records whose label is in ``which``, relabelled 0..len(which)-1:
    ``(x_train, y_train, x_test, y_test)`` (float32 images in [0, 1], int32 labels)."""
    from dptune.data import load_mnist_10k

    x_train, y_train, x_test, y_test = load_mnist_10k()
    relabel = np.full(10, -1, np.int32)
    relabel[list(which)] = np.arange(len(which), dtype=np.int32)
    keep_train, keep_test = np.isin(y_train, which), np.isin(y_test, which)
    return (
        x_train[keep_train], relabel[y_train[keep_train]],
        x_test[keep_test], relabel[y_test[keep_test]],
    )  # fmt: skip


def private_digits() -> tuple[np.ndarray, ...]:
    """The private task's arrays (``config.data.loader``): digits 5-9 as labels 0-4."""
    return digits(PRIVATE_DIGITS)


def lora_cnn(num_classes: int = 5):
    """cnn26k with rank-4 LoRA adapters on conv2, dense1 and dense2 (``config.model``); conv1 is
    frozen with the base, as every base parameter is."""
    from dptune import shipped_with_lora  # dptune's lazy export: the engine through its learner

    return shipped_with_lora("cnn26k", num_classes, rank=4, targets=["conv2", "dense"])


def get_config():
    c = base.get_config()
    c.data.update(
        name="mnist-10k-digits5-9", loader="dptune.configs.finetune:private_digits",
        num_examples=PRIVATE_NUM_TRAIN, num_classes=len(PRIVATE_DIGITS), validation_size=500,
    )  # fmt: skip
    c.init = str(PRETRAINED)
    c.train.update(model="cnn26k", batch_size=64, epochs=10, optimizer="sgd", score_noise_std=10.0)
    c.space = dict(
        # 64 x learners.dpsgd.LEARNING_RATE_RANGES["sgd"] (per record of the batch)
        learning_rate=space.log_uniform(0.032, 0.64),
        clip_norm=space.log_uniform(0.5, 2.0),  # the `user` config's: lr * C sets the step
        noise_multiplier="auto",
    )
    c.selection.update(method="geometric", mean_trials=4.0)
    c.privacy.epsilon = 3.0
    # A demo dataset: its ledger budget allows many runs (a real dataset's would not).
    c.ledger.update(budget_epsilon=1000.0, budget_delta=1e-3)
    return c
