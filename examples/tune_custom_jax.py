"""Private tuning of YOUR OWN JAX training function with dptune (no dptune config, no trainers).

The function below trains a DP-SGD softmax regression on the 10,000 MNIST digits shipped with
dptune. dptune needs two things from it:

1. ``privacy(hparams)``: what one run costs, declared *before* it runs, as a dp_accounting DpEvent
   (here: ``steps`` compositions of the Poisson-subsampled Gaussian mechanism). Because the noise
   multiplier is ``"auto"`` in the space, dptune calls it with candidate noise multipliers and
   calibrates sigma so that the TOTAL epsilon (tuning included) meets the budget.
2. ``train(hparams, rng) -> (score, payload)``: one private run with the randomness of ``rng``,
   returning a score (higher is better; here accuracy on a validation split that we treat as
   public) and a payload (the parameters).

    python examples/tune_custom_jax.py
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from dp_accounting import dp_event

import dptune
from dptune import accounting, space
from dptune.data import MNIST_10K_DIR
from selection import RandomStopping
from trainers.data import load_dataset

data = load_dataset(
    "mnist", str(MNIST_10K_DIR), validation_size=1000, source="idx", num_examples=8000
)
X = data.train_x.reshape(len(data.train_x), -1)  # (~7000, 784) float32 in [0, 1]
Y = data.train_y
# Privacy uses PUBLIC sizes, never len() of the private arrays (which changes with one person):
N_PUBLIC = data.public_num_train  # 7000 = the declared 8000 minus the expected 1000 validation
BATCH, EPOCHS = 500, 5
Q = BATCH / N_PUBLIC  # Poisson sampling rate
STEPS = EPOCHS * int(np.ceil(N_PUBLIC / BATCH))
SCORE_STD = 10.0  # Gaussian noise (in counts) on the number of correct validation predictions


def privacy(hp: dict) -> accounting.EventCandidate:
    """One run = STEPS Poisson-subsampled Gaussian mechanisms (Abadi et al. 2016) on the training
    records, and in parallel (the per-record split puts each person in one part) the noisy
    validation count, a Gaussian mechanism of sensitivity 1."""
    train = dp_event.SelfComposedDpEvent(
        dp_event.PoissonSampledDpEvent(Q, dp_event.GaussianDpEvent(hp["noise_multiplier"])), STEPS
    )
    return accounting.EventCandidate(train, parallel=(dp_event.GaussianDpEvent(SCORE_STD),))


def loss(w, x, y):
    logits = x @ w["W"] + w["b"]
    return -jax.nn.log_softmax(logits)[y]


@jax.jit
def clipped_sum(w, x, y, mask, clip):
    """Sum over the batch of per-example gradients clipped to L2 norm `clip` (masked rows: 0)."""
    g = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(w, x, y)
    norms = jnp.sqrt(sum(jnp.sum(v.reshape(len(x), -1) ** 2, axis=1) for v in g.values()))
    factor = mask * jnp.minimum(1.0, clip / jnp.maximum(norms, 1e-12))
    return {name: jnp.tensordot(factor, v, axes=1) for name, v in g.items()}


@jax.jit
def noisy_update(w, grads, key, lr, clip, sigma):
    """SGD step on (clipped sum + N(0, (sigma clip)^2)) / expected batch size."""
    keys = jax.random.split(key, len(grads))
    return {
        name: w[name]
        - lr * (grads[name] + sigma * clip * jax.random.normal(k_, grads[name].shape)) / BATCH
        for k_, name in zip(keys, sorted(grads), strict=True)
    }


# score_kind="covered": the score below is a noisy count whose noise `privacy` declares; the
# fingerprint is the dataset's id in the budget ledger (tune() charges the default ledger)
@dptune.trainer(
    privacy=privacy, num_examples=N_PUBLIC, score_kind="covered", fingerprint=data.fingerprint()
)
def train(hp: dict, rng: np.random.Generator):
    w = {"W": jnp.zeros((784, 10)), "b": jnp.zeros(10)}
    # All 64 bits of a threefry key from the candidate's generator: the noise must not be guessable.
    key = jnp.asarray(rng.integers(0, 2**32, size=2, dtype=np.uint32))
    cap = int(BATCH + 5 * np.sqrt(BATCH))  # fixed shape: pad the Poisson batch to a capacity
    for _ in range(STEPS):
        idx = np.flatnonzero(rng.random(len(X)) < Q)  # Poisson sampling: each record w.p. Q
        # Never truncate a batch (that would change the mechanism): the rare batch above the
        # capacity is processed in several capacity-sized chunks whose clipped sums add up.
        chunks = [idx[i : i + cap] for i in range(0, max(len(idx), 1), cap)]
        key, sub = jax.random.split(key)
        grads = None
        for chunk in chunks:
            pad = np.zeros(cap, dtype=np.int64)
            pad[: len(chunk)] = chunk
            mask = (np.arange(cap) < len(chunk)).astype(np.float32)
            # noise once per step (in the first chunk), clipped sums from every chunk
            g = clipped_sum(w, X[pad], Y[pad], mask, hp["clip_norm"])
            grads = g if grads is None else jax.tree_util.tree_map(jnp.add, grads, g)
        w = noisy_update(w, grads, sub, hp["learning_rate"], hp["clip_norm"],
                         hp["noise_multiplier"])  # fmt: skip
    val_x = data.val_x.reshape(len(data.val_x), -1)
    correct = float(jnp.sum(jnp.argmax(val_x @ w["W"] + w["b"], axis=1) == data.val_y))
    # the validation split is private: a noisy count divided by the PUBLIC expected size
    return (correct + SCORE_STD * rng.standard_normal()) / data.public_num_val, {"params": w}


if __name__ == "__main__":
    release = dptune.tune(
        train,
        space={
            "learning_rate": space.log_uniform(0.1, 10.0),
            "clip_norm": space.log_uniform(0.1, 10.0),
            "noise_multiplier": "auto",  # calibrated to the total budget
        },
        selection=RandomStopping.logarithmic(mean=4),
        budget=(2.0, 1e-5),  # total (epsilon, delta), tuning included
    )
    print(release)
