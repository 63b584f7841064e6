"""Private tuning of YOUR OWN JAX training loop with dptune's DP-SGD pieces (no config, no built-in
trainer).

The loop below trains a softmax regression (a flax nn.Dense) with DP-SGD on the 10,000 MNIST
digits shipped with dptune. The DP machinery is four public pieces (docs/your_model.md):

* ``dptune.DpSgdSchedule``: Poisson sampling from the PUBLIC size (q = B / N, epochs x ceil(N / B)
  steps), as padded, masked chunks of fixed shapes (nothing recompiles);
* ``dptune.clipped_grad_sum(model)``: the sum of per-example gradients clipped to norm C, for any
  flax Module or apply function (ghost clipping where it applies, else vmap(grad));
* ``dptune.add_noise``: Gaussian noise of std sigma * C, divided by the expected batch size;
* ``dptune.dpsgd_privacy(schedule, sigma, ...)``: the run's privacy declaration, built from the same
  schedule the loop samples with, so the accountant and the loop cannot disagree.

Because the noise multiplier is ``"auto"`` in the space, dptune calls ``privacy`` with candidate
noise multipliers and calibrates sigma so that the TOTAL epsilon (tuning included) meets the budget.

    python examples/tune_custom_jax.py
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import dptune
from dptune import space
from dptune.data import MNIST_10K_NUM_TRAIN, load_mnist_10k
from selection import RandomStopping

x_train, y_train, _, _ = load_mnist_10k()
data = dptune.Dataset.from_arrays(
    x_train.reshape(len(x_train), -1), y_train, num_examples=MNIST_10K_NUM_TRAIN,
    validation_fraction=0.125, num_classes=10,
)  # fmt: skip
X, Y = data.train_x, data.train_y  # the private training records, (~7000, 784) float32
SCORE_STD = 10.0  # Gaussian noise (in counts) on the number of correct validation predictions
model = nn.Dense(10)

# --- the DP machinery ---------------------------------------------------------------------------
schedule = dptune.DpSgdSchedule(num_examples=data.public_num_train, batch_size=500, epochs=5)
grad_sum = dptune.clipped_grad_sum(model)  # (params, x, y, mask, C) -> (clipped sum, loss sum)


def privacy(hp: dict):
    """schedule.steps Poisson-subsampled Gaussian steps, and (in parallel: the per-record split
    puts each person in one part) the noisy validation count."""
    return dptune.dpsgd_privacy(schedule, hp["noise_multiplier"], score_noise_std=SCORE_STD)


# score_kind="covered": the score below is a noisy count whose noise `privacy` declares; the
# fingerprint is the dataset's id in the budget ledger (tune() charges the default ledger)
@dptune.trainer(
    privacy=privacy, num_examples=schedule.num_examples, score_kind="covered",
    fingerprint=data.fingerprint(),
)  # fmt: skip
def train(hp: dict, rng: np.random.Generator):
    params = model.init(jax.random.PRNGKey(0), X[:1])["params"]
    # All 64 bits of a threefry key from the candidate's generator: the noise must not be guessable.
    key = jnp.asarray(rng.integers(0, 2**32, size=2, dtype=np.uint32))
    for step, chunks in enumerate(schedule.batches(len(X), rng)):
        sums = [grad_sum(params, X[idx], Y[idx], mask, hp["clip_norm"])[0] for idx, mask in chunks]
        g = jax.tree_util.tree_map(lambda *parts: sum(parts), *sums)
        g = dptune.add_noise(g, jax.random.fold_in(key, step), hp["noise_multiplier"],
                             hp["clip_norm"], expected_batch_size=schedule.batch_size)  # fmt: skip
        params = jax.tree_util.tree_map(lambda p, d: p - hp["learning_rate"] * d, params, g)
    # -------------------------------------------------------------------------------------------
    logits = model.apply({"params": params}, data.val_x)
    correct = float(np.sum(np.argmax(logits, axis=1) == data.val_y))
    # the validation split is private: a noisy count divided by the PUBLIC expected size
    return (correct + SCORE_STD * rng.standard_normal()) / data.public_num_val, {"params": params}


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
