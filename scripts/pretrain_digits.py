r"""Pretrains the `finetune` config's public start: cnn26k (5 classes) trained NON-privately on the
shipped MNIST digits 0-4, the records declared public (docs/finetune.md says why they may be).

Deterministic (fixed seeds, fixed order, float32 on CPU): rerunning it rebuilds the shipped file
bit for bit, and it prints the fingerprint the privacy statement will name.

    python scripts/pretrain_digits.py                      # writes dptune/data/pretrained/...
    python scripts/pretrain_digits.py --out=/tmp/start.npz --check   # compare with the shipped one
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the shipped bytes were built on XLA CPU

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags

from dptune.configs.finetune import PRETRAINED, PUBLIC_DIGITS, digits
from trainers import finetune
from trainers.models import MnistCNN

flags.DEFINE_string("out", str(PRETRAINED), "where to write the .npz of '/'-joined paths")
flags.DEFINE_integer("epochs", 4, "passes over the public digits")
flags.DEFINE_integer("batch_size", 128, "examples per step")
flags.DEFINE_float("learning_rate", 1e-3, "Adam's step size")
flags.DEFINE_bool("check", False, "compare the result with the shipped file's bytes")
FLAGS = flags.FLAGS


def pretrain(epochs: int, batch_size: int, learning_rate: float) -> tuple[dict, float]:
    """(parameters as NumPy arrays, accuracy on the public test digits)."""
    x, y, x_test, y_test = digits(PUBLIC_DIGITS)
    model = MnistCNN(num_classes=len(PUBLIC_DIGITS))
    params = model.init(jax.random.PRNGKey(0), x[:1])["params"]
    opt = optax.adam(learning_rate)
    state = opt.init(params)

    @jax.jit
    def step(params, state, xb, yb):
        def loss(p):
            logits = model.apply({"params": p}, xb)
            return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, yb))

        g = jax.grad(loss)(params)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(0)
    for _ in range(epochs):
        order = rng.permutation(len(y))
        for i in range(0, len(order) - batch_size + 1, batch_size):  # full batches: one shape
            idx = order[i : i + batch_size]
            params, state = step(params, state, x[idx], y[idx])
    logits = jax.jit(lambda p, xs: model.apply({"params": p}, xs))(params, x_test)
    acc = float(np.mean(np.argmax(np.asarray(logits), axis=1) == y_test))
    return jax.tree_util.tree_map(np.asarray, params), acc


def main(_):
    params, acc = pretrain(FLAGS.epochs, FLAGS.batch_size, FLAGS.learning_rate)
    flat = finetune.flat_paths(params)
    print(f"public test accuracy (digits 0-4): {acc:.4f}")
    print(f"fingerprint: {finetune.fingerprint(params)}")
    if FLAGS.check:
        shipped = finetune.read_init(PRETRAINED)
        same = finetune.fingerprint(shipped) == finetune.fingerprint(params)
        print(f"the shipped {PRETRAINED.name} is {'identical' if same else 'DIFFERENT'}")
        if not same:
            raise SystemExit(1)
    out = FLAGS.out
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    np.savez(out, **flat)
    print(f"wrote {out} ({os.path.getsize(out)} bytes)")


if __name__ == "__main__":
    app.run(main)
