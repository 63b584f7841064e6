"""A tabular MLP on scikit-learn's bundled breast-cancer data (569 records, 30 features), tuned
privately. Needs scikit-learn (``pip install 'dptune[examples]'``); nothing is downloaded.

Preprocessing must not look at the private data as a whole (a mean or a standard deviation of the
records is itself a release): each record is transformed on its own, by log1p (all features are
non-negative) and a fixed, public scale.

    python examples/user_tabular.py            # DPTUNE_EXAMPLES_QUICK=1: a short run (tests)
"""

from __future__ import annotations

import os
import sys
import tempfile

import flax.linen as nn
import numpy as np

import dptune
from dptune import space
from selection import RandomStopping

try:
    from sklearn.datasets import load_breast_cancer
except ImportError:  # optional dependency of this example only
    sys.exit("dptune: this example needs scikit-learn: pip install 'dptune[examples]'")

QUICK = bool(os.environ.get("DPTUNE_EXAMPLES_QUICK"))


class TabularMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.tanh(nn.Dense(16)(nn.LayerNorm()(x))))


features, labels = load_breast_cancer(return_X_y=True)
features = np.log1p(features) / 4.0  # per record, public constants: no statistics of the data
rng = np.random.default_rng(0)  # a public shuffle to hold out a test split
order = rng.permutation(len(features))
test, private = order[:69], order[69:]
data = dptune.Dataset.from_arrays(
    features[private], labels[private],
    num_examples=500,  # public: the size we would publish (569 records, 69 held out)
    validation_fraction=0.2, num_classes=2,
    x_test=features[test], y_test=labels[test],
)  # fmt: skip
trainer = dptune.DpSgdTrainer(
    data, model=TabularMLP(), base=dict(batch_size=64, epochs=2 if QUICK else 30),
    epoch_progress=False,
)  # fmt: skip
workdir = tempfile.mkdtemp(prefix="dptune-tabular-")
release = dptune.tune(
    trainer,
    {"learning_rate": space.log_uniform(0.1, 3.0), "clip_norm": space.choice(0.5, 1.0),
     "noise_multiplier": "auto"},
    RandomStopping.logarithmic(mean=2 if QUICK else 4),
    budget=(5.0, 1e-5),
    workdir=workdir,
    progress=False,
)  # fmt: skip
print(release)

loaded = dptune.load_release(workdir)
if loaded.released:
    probs = np.asarray(nn.softmax(TabularMLP().apply({"params": loaded.params}, features[test])))
    print("P(benign) of the first test records:", [round(float(p), 3) for p in probs[:5, 1]])
