"""A tiny next-token transformer language model (linen, causal attention, dropout) on generated
token sequences, tuned privately and scored by its token accuracy.

A sequence is one record: its loss is the mean cross-entropy over its tokens, and adding or
removing one person's sequence is the adjacency the guarantee is about (unchanged). Labels are
the next-token ids, shape (n, length); the model's ``train`` keyword switches dropout on while
it trains (per-example masks keyed by each sequence's place in the batch) and off when it is
scored and released.

    python examples/user_next_token_lm.py      # DPTUNE_EXAMPLES_QUICK=1: a short run (tests)
"""

from __future__ import annotations

import os
import tempfile

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

import dptune
from dptune import space
from selection import RandomStopping

QUICK = bool(os.environ.get("DPTUNE_EXAMPLES_QUICK"))
VOCAB, LENGTH, WIDTH = 16, 12, 32


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP, dropout after each."""

    heads: int = 2

    @nn.compact
    def __call__(self, h, train: bool):
        mask = nn.make_causal_mask(jnp.ones(h.shape[:2]))
        a = nn.MultiHeadDotProductAttention(self.heads)(nn.LayerNorm()(h), mask=mask)
        h = h + nn.Dropout(0.1, deterministic=not train)(a)
        m = nn.Dense(WIDTH)(nn.gelu(nn.Dense(2 * WIDTH)(nn.LayerNorm()(h))))
        return h + nn.Dropout(0.1, deterministic=not train)(m)


class TinyLM(nn.Module):
    """Token ids (b, L) -> next-token logits (b, L, VOCAB)."""

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        h = nn.Embed(VOCAB, WIDTH)(tokens) + nn.Embed(LENGTH, WIDTH)(positions)
        h = Block()(h, train)
        return nn.Dense(VOCAB)(nn.LayerNorm()(h))


def sequence_loss(logits, next_ids):
    """Mean token cross-entropy of each sequence, (b,)."""
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, next_ids), axis=-1)


def token_accuracy(logits, next_ids):
    """Fraction of each sequence's next tokens predicted right, (b,) in [0, 1]."""
    return jnp.mean(jnp.argmax(logits, axis=-1) == next_ids, axis=-1)


def generate(n, rng):
    """Counting sequences mod VOCAB with a per-sequence start and stride (1 to 3)."""
    start = rng.integers(0, VOCAB, size=(n, 1))
    stride = rng.integers(1, 4, size=(n, 1))
    seq = (start + stride * np.arange(LENGTH + 1)) % VOCAB
    return seq[:, :-1], seq[:, 1:]  # inputs and next-token labels, (n, LENGTH) each


rng = np.random.default_rng(0)
num = 600 if QUICK else 4000
x, y = generate(num + 200, rng)
data = dptune.Dataset.from_arrays(
    x[:num], y[:num], num_examples=num, num_classes=VOCAB,  # ids in [0, VOCAB)
    x_test=x[num:], y_test=y[num:], validation_fraction=0.2,
)  # fmt: skip
trainer = dptune.DpSgdTrainer(
    data, model=TinyLM(), loss=sequence_loss,
    metric=dptune.Metric(token_accuracy, lo=0.0, hi=1.0, name="token_accuracy"),
    base=dict(batch_size=64, epochs=1 if QUICK else 20, optimizer="adam"),
    epoch_progress=False,
)  # fmt: skip
workdir = tempfile.mkdtemp(prefix="dptune-lm-")
release = dptune.tune(
    trainer,
    {"learning_rate": space.log_uniform(1e-3, 1e-2), "noise_multiplier": "auto"},
    RandomStopping.logarithmic(mean=1.5 if QUICK else 3),
    budget=(8.0, 1e-5),
    workdir=workdir,
    progress=False,
)  # fmt: skip
print(release)

loaded = dptune.load_release(workdir)
if loaded.released:
    prompt = x[num : num + 1]
    logits = TinyLM().apply({"params": loaded.params}, prompt)  # train=False: no dropout
    print("prompt:", prompt[0].tolist())
    print("predicted next tokens:", np.argmax(np.asarray(logits), axis=-1)[0].tolist())
    print("token accuracy of the loaded parameters:",
          round(float(np.mean(token_accuracy(TinyLM().apply({"params": loaded.params},
                                                             x[num:]), y[num:]))), 3))  # fmt: skip
