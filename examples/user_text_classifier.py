"""A one-block transformer on token ids, tuned privately: your model, your (generated) data.

The task is generated here: sequences of 24 tokens from a vocabulary of 64, where tokens 1-8 are
"positive" and 9-16 "negative"; the label says which kind occurs more often. The model (embedding,
one self-attention block with layer norms, mean pooling, a dense head) is built from nn.Embed,
nn.MultiHeadDotProductAttention, nn.LayerNorm and nn.Dense, so dptune clips per example on the
ghost path (no per-example gradients materialised for the attention's sequence layers).

    python examples/user_text_classifier.py    # DPTUNE_EXAMPLES_QUICK=1: a short run (tests)
"""

from __future__ import annotations

import os
import tempfile

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

import dptune
from dptune import space
from selection import RandomStopping

QUICK = bool(os.environ.get("DPTUNE_EXAMPLES_QUICK"))
VOCAB, LENGTH = 64, 24
N = 2000 if QUICK else 6000


def make_task(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(17, VOCAB, size=(n, LENGTH))
    label = rng.integers(0, 2, size=n)
    for i in range(n):  # 3-6 tokens of the label's kind, 0-2 of the other
        mine, other = (1, 9) if label[i] else (9, 1)
        pos = rng.permutation(LENGTH)
        k, j = rng.integers(3, 7), rng.integers(0, 3)
        ids[i, pos[:k]] = rng.integers(mine, mine + 8, size=k)
        ids[i, pos[k : k + j]] = rng.integers(other, other + 8, size=j)
    return ids.astype(np.int32), label.astype(np.int32)


class TinyTransformer(nn.Module):
    dim: int = 32

    @nn.compact
    def __call__(self, ids):
        h = nn.Embed(VOCAB, self.dim)(ids)
        h = h + nn.MultiHeadDotProductAttention(num_heads=2)(nn.LayerNorm()(h))
        h = h + nn.Dense(self.dim)(nn.gelu(nn.Dense(2 * self.dim)(nn.LayerNorm()(h))))
        return nn.Dense(2)(jnp.mean(nn.LayerNorm()(h), axis=1))


x, y = make_task(N, seed=0)
x_test, y_test = make_task(1000, seed=1)
data = dptune.Dataset.from_arrays(
    x, y, num_examples=N, validation_fraction=0.1, x_test=x_test, y_test=y_test
)
trainer = dptune.DpSgdTrainer(
    data, model=TinyTransformer(),
    base=dict(batch_size=256, epochs=1 if QUICK else 8, optimizer="adam", clip_norm=1.0),
    epoch_progress=False,
)  # fmt: skip
workdir = tempfile.mkdtemp(prefix="dptune-text-")
release = dptune.tune(
    trainer,
    {"learning_rate": space.log_uniform(3e-4, 1e-2), "noise_multiplier": "auto"},
    RandomStopping.logarithmic(mean=2 if QUICK else 5),
    budget=(4.0, 1e-5),
    workdir=workdir,
    progress=False,
)
print(release)

loaded = dptune.load_release(workdir)
if loaded.released:
    logits = TinyTransformer().apply({"params": loaded.params}, x_test)
    print(f"test accuracy of the loaded parameters: {np.mean(np.argmax(logits, 1) == y_test):.3f}")
