"""A regression MLP on scikit-learn's bundled diabetes data (442 records, 10 features, a float
target: disease progression after one year), tuned privately. Needs scikit-learn (``pip install
'dptune[examples]'``); nothing is downloaded.

Float labels have no default loss or metric: the model declares its own, one value per record:
the squared error to train on, and minus the absolute error (clipped to [-2, 0], in units of the
scaled target) to score candidates. Preprocessing uses each record alone and public constants
(no mean or deviation of the private records, which would itself be a release).

    python examples/user_regression_diabetes.py  # DPTUNE_EXAMPLES_QUICK=1: a short run (tests)
"""

from __future__ import annotations

import os
import sys
import tempfile

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

import dptune
from dptune import space
from selection import RandomStopping

try:
    from sklearn.datasets import load_diabetes
except ImportError:  # optional dependency of this example only
    sys.exit("dptune: this example needs scikit-learn: pip install 'dptune[examples]'")

QUICK = bool(os.environ.get("DPTUNE_EXAMPLES_QUICK"))
TARGET_CENTER, TARGET_SCALE = 150.0, 80.0  # public constants (the documented range is 25-346)


class RegressionMLP(nn.Module):
    """One float output per record, (b,)."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(1)(nn.tanh(nn.Dense(32)(nn.LayerNorm()(x))))[:, 0]


def squared_error(pred, y):
    return (pred - y) ** 2


def neg_abs_error(pred, y):
    return -jnp.abs(pred - y)


features, target = load_diabetes(return_X_y=True, scaled=False)
features = np.log1p(features) / 5.0  # per record, public constants
target = (target - TARGET_CENTER) / TARGET_SCALE
rng = np.random.default_rng(0)  # a public shuffle to hold out a test split
order = rng.permutation(len(features))
test, private = order[:42], order[42:]
data = dptune.Dataset.from_arrays(
    features[private], target[private],  # float labels: a regression target
    num_examples=400,  # public: the size we would publish (442 records, 42 held out)
    validation_fraction=0.25,
    x_test=features[test], y_test=target[test],
)  # fmt: skip
trainer = dptune.DpSgdTrainer(
    data, model=RegressionMLP(), loss=squared_error,
    metric=dptune.Metric(neg_abs_error, lo=-2.0, hi=0.0, name="neg_mae"),
    # score noise 4 over ~100 validation records: 0.04 of the metric's range (dptune warns
    # above 0.05: selection would be mostly noise)
    base=dict(batch_size=32, epochs=2 if QUICK else 40, optimizer="adam", score_noise_std=4.0),
    epoch_progress=False,
)  # fmt: skip
workdir = tempfile.mkdtemp(prefix="dptune-diabetes-")
release = dptune.tune(
    trainer,
    {"learning_rate": space.log_uniform(1e-3, 3e-2), "noise_multiplier": "auto"},
    RandomStopping.logarithmic(mean=2),
    budget=(5.0, 1e-5),
    workdir=workdir,
    progress=False,
)  # fmt: skip
print(release)

loaded = dptune.load_release(workdir)
if loaded.released:
    pred = np.asarray(RegressionMLP().apply({"params": loaded.params}, features[test]))
    pred = pred * TARGET_SCALE + TARGET_CENTER
    print("predicted progression of the first test records:", [round(float(p)) for p in pred[:5]])
