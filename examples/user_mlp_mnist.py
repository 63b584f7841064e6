"""Your own Flax model on your own NumPy arrays: a private tuning run end to end.

The 10,000 MNIST digits shipped with dptune stand in for "your data" (plain NumPy arrays); the model
is a small MLP written here. dptune chooses the per-example clipping (the ghost / book-keeping path:
every parametrised layer is an nn.Dense), calibrates the noise so that the whole tuning run meets
the budget, releases the best candidate only, and states one (epsilon, delta).

    python examples/user_mlp_mnist.py          # DPTUNE_EXAMPLES_QUICK=1: a short run (tests)
"""

from __future__ import annotations

import os
import tempfile

import flax.linen as nn
import numpy as np

import dptune
from dptune import space
from dptune.data import MNIST_10K_NUM_TRAIN, load_mnist_10k
from selection import RandomStopping

QUICK = bool(os.environ.get("DPTUNE_EXAMPLES_QUICK"))


class MLP(nn.Module):
    """784 -> 128 -> 10, tanh (bounded activations suit DP-SGD; Papernot et al. 2021)."""

    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        return nn.Dense(10)(nn.tanh(nn.Dense(128)(x)))


x_train, y_train, x_test, y_test = load_mnist_10k()  # NumPy arrays: (8000, 28, 28, 1), (8000,)
data = dptune.Dataset.from_arrays(
    x_train, y_train,
    num_examples=MNIST_10K_NUM_TRAIN,  # PUBLIC size: sampling rates never use len(x_train)
    validation_fraction=0.1,  # a per-record keyed split; the noisy validation score is private
    x_test=x_test, y_test=y_test,  # public, for reporting only
)  # fmt: skip
trainer = dptune.DpSgdTrainer(
    data, model=MLP(), base=dict(batch_size=256, epochs=1 if QUICK else 10, clip_norm=1.0),
    epoch_progress=False,
)  # fmt: skip
workdir = tempfile.mkdtemp(prefix="dptune-mlp-")
release = dptune.tune(
    trainer,
    {"learning_rate": space.log_uniform(0.3, 5.0), "noise_multiplier": "auto"},
    RandomStopping.logarithmic(mean=2 if QUICK else 6),
    budget=(3.0, 1e-5),  # total (epsilon, delta), tuning included
    workdir=workdir,
    progress=False,
)
print(release)

loaded = dptune.load_release(workdir)  # hyperparameters, parameters, privacy statement
if loaded.released:
    predictions = np.argmax(MLP().apply({"params": loaded.params}, x_test[:8]), axis=1)
    print("predictions", predictions.tolist(), "labels", y_test[:8].tolist())
    print(f"released epsilon: {loaded.privacy['total_epsilon']:.3f}")
