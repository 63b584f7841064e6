"""Flax NNX: the CNN of Flax's own ``examples/mnist`` (an ``nnx.Module``), tuned privately.

The model is Flax's, as written there, but for two things: its ``nnx.BatchNorm`` layers become
``nnx.GroupNorm`` (batch statistics mix the examples of a batch; ``dptune.fix_model`` does the
swap, gcd(32, channels) groups as in Opacus), and its dropout layers are left out (a short run;
``nnx.Dropout`` would train with per-example, per-step masks, docs/your_model.md). Every
parametrised layer is an ``nnx.Conv``, ``nnx.GroupNorm`` or ``nnx.Linear``, so per-example
clipping takes the ghost / book-keeping path. The best candidate is released, loaded back into
the module with ``nnx.update`` and used for prediction.

    python examples/user_nnx_mnist.py          # DPTUNE_EXAMPLES_QUICK=1: a short run (tests)
"""

from __future__ import annotations

import logging
import os
import tempfile
from functools import partial

import numpy as np
from flax import nnx

import dptune
from dptune import space
from dptune.data import MNIST_10K_NUM_TRAIN, load_mnist_10k
from selection import RandomStopping

QUICK = bool(os.environ.get("DPTUNE_EXAMPLES_QUICK"))
logging.basicConfig(format="%(message)s")
logging.getLogger("dptune").setLevel(logging.INFO)  # says which clipping path was chosen, once


class CNN(nnx.Module):
    """Flax's examples/mnist CNN (BatchNorm as in Flax; dropout left out)."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm1 = nnx.BatchNorm(32, rngs=rngs)
        self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
        self.batch_norm2 = nnx.BatchNorm(64, rngs=rngs)
        self.avg_pool = partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
        self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
        self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
        x = self.avg_pool(nnx.relu(self.batch_norm1(self.conv1(x))))
        x = self.avg_pool(nnx.relu(self.batch_norm2(self.conv2(x))))
        x = x.reshape(x.shape[0], -1)  # flatten
        return self.linear2(nnx.relu(self.linear1(x)))


model, replaced = dptune.fix_model(CNN(nnx.Rngs(0)))  # BatchNorm -> GroupNorm, listed
print("replaced:", [str(r) for r in replaced])

x_train, y_train, x_test, y_test = load_mnist_10k()  # NumPy arrays: (8000, 28, 28, 1), (8000,)
n = 2000 if QUICK else MNIST_10K_NUM_TRAIN  # the quick run declares (publicly) fewer records
data = dptune.Dataset.from_arrays(
    x_train[:n], y_train[:n], num_examples=n, validation_fraction=0.1,
    x_test=x_test, y_test=y_test,
)  # fmt: skip
trainer = dptune.DpSgdTrainer(
    data, model=model, epoch_progress=False,
    base=dict(batch_size=128 if QUICK else 256, epochs=1 if QUICK else 5, clip_norm=1.0),
)  # fmt: skip
workdir = tempfile.mkdtemp(prefix="dptune-nnx-")
release = dptune.tune(
    trainer,
    {"learning_rate": space.log_uniform(0.05, 1.0), "noise_multiplier": "auto"},
    RandomStopping.logarithmic(mean=2 if QUICK else 4),
    budget=(3.0, 1e-5),  # total (epsilon, delta), tuning included
    workdir=workdir,
    progress=False,
)
print(release)

# Restored into the module's own Param state (an nnx.State), then merged into the module.
loaded = dptune.load_release(workdir, like=model)
if loaded.released:
    nnx.update(model, loaded.params)
    predictions = np.argmax(np.asarray(model(x_test[:500])), axis=1)
    print("predictions", predictions[:8].tolist(), "labels", y_test[:8].tolist())
    print(f"test accuracy of the loaded model: {np.mean(predictions == y_test[:500]):.3f}")
