"""A user's own DP-SGD, written by hand as a ``@dptune.trainer`` function (numpy, no JAX): softmax
regression on MNIST-10k's flattened digits, Poisson batches, per-example clipping, Gaussian noise.
``noise=False`` is the bug the audit must catch: the same declaration, no noise added.

Canaries for it: single-pixel images on pixels that no training image uses, each with a random
label. For a linear model such a canary's gradient lives on its own row of the weights, which no
real record touches: without noise, that row is exactly zero unless the canary was included (and
sampled).
"""

from __future__ import annotations

import dp_accounting
import numpy as np

import dptune

#: Expected batch size and steps of the user's run.
BATCH = 512
STEPS = 40


def load_flat():
    """MNIST-10k as (train_x (n, 784), train_y, test_x, test_y), all training-file records kept in
    training (the user's own split: the test split scores candidates, it is public)."""
    from dptune.learners.dpsgd import load_dataset
    from tests.paths import mnist_10k

    d = load_dataset(
        "mnist", data_dir=str(mnist_10k()), source="idx", validation_size=1, num_examples=8000
    )
    flat = lambda a: a.reshape(len(a), -1).astype(np.float64)  # noqa: E731
    return flat(d.train_x), d.train_y, flat(d.test_x), d.test_y


def make_trainer(x, y, x_test, y_test, *, noise: bool = True) -> dptune.FunctionTrainer:
    n = len(x)
    q = BATCH / n

    def event(hp):
        return dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(
                q, dp_accounting.GaussianDpEvent(hp["noise_multiplier"])
            ),
            STEPS,
        )

    # the score is accuracy on the public test split: covered (it reads no private record)
    @dptune.trainer(privacy=event, num_examples=n, score_kind="covered")
    def train(hp, rng, canaries=None):
        xs, ys = x, y
        if canaries is not None and len(canaries[1]):
            xs = np.concatenate([x, canaries[0].reshape(len(canaries[0]), -1)])
            ys = np.concatenate([y, canaries[1]])
        w = np.zeros((xs.shape[1], 10))
        b = np.zeros(10)
        c, sigma, lr = hp["clip_norm"], hp["noise_multiplier"], hp["learning_rate"]
        for _ in range(STEPS):
            idx = np.flatnonzero(rng.random(len(ys)) < q)
            xb, yb = xs[idx], ys[idx]
            logits = xb @ w + b
            p = np.exp(logits - logits.max(1, keepdims=True))
            p /= p.sum(1, keepdims=True)
            g = p - np.eye(10)[yb]  # d loss / d logits
            norms = np.sqrt((np.sum(xb**2, 1) + 1.0) * np.sum(g**2, 1))  # ||[x 1] g^T||
            g = g * np.minimum(1.0, c / np.maximum(norms, 1e-12))[:, None]
            gw, gb = xb.T @ g, g.sum(0)
            if noise:
                gw = gw + rng.normal(0.0, sigma * c, gw.shape)
                gb = gb + rng.normal(0.0, sigma * c, gb.shape)
            w -= lr * gw / BATCH
            b -= lr * gb / BATCH
        accuracy = float(np.mean(np.argmax(x_test @ w + b, 1) == y_test))  # public test split
        return accuracy, {"w": w, "b": b}

    return train


def pixel_canaries(x: np.ndarray, m: int, seed: int = 0):
    """m single-pixel canaries on pixels no training image uses, with random labels."""
    free = np.flatnonzero((x == 0).all(axis=0))
    assert len(free) >= m, f"only {len(free)} unused pixels"
    cx = np.zeros((m, x.shape[1]))
    cx[np.arange(m), free[:m]] = 1.0
    cy = np.random.default_rng(seed).integers(0, 10, size=m)
    return cx, cy


def margin_score(payload, cx, cy):
    """Membership score: how much more the model prefers the canary's label than the others."""
    logits = cx @ payload["w"]  # the bias is the same for every canary
    own = logits[np.arange(len(cy)), cy]
    return own - (logits.sum(1) - own) / 9.0
