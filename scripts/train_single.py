r"""One DP-SGD training run at a target (epsilon, delta), with a per-epoch test-accuracy curve.

The noise multiplier is the smallest sigma whose PLD epsilon (dp_accounting's PLD accountant on the
Poisson-subsampled Gaussian, self-composed over the run's steps; privacy loss distributions of
Koskela et al. 2020 and Doroshenko et al. 2022 as implemented in dp_accounting) is at most the
target, for the sampling rate and step count that ``trainers.spec.dpsgd_privacy`` reports.

This is a research script, not a private release: it evaluates every epoch on the *test* split and
prints the curve. The hyperparameters are fixed up front (not tuned on this data).

    python scripts/train_single.py --data_dir=../shared/data/fashion-mnist --dataset=fashion_mnist \
        --epsilon=3 --delta=1e-5 --out_json=/tmp/fmnist.json --plot=results/accuracy_fmnist.png
"""

from __future__ import annotations

import json
import os
import platform
import time

import dp_accounting
import jax
import numpy as np
from absl import app, flags

from trainers.data import load_dataset
from trainers.evaluate import evaluate
from trainers.loop import train_candidate
from trainers.spec import Hyperparams, dpsgd_privacy

FLAGS = flags.FLAGS
flags.DEFINE_string("dataset", "fashion_mnist", "mnist | fashion_mnist | cifar10 | synthetic")
flags.DEFINE_string("data_dir", None, "local data folder (IDX / CIFAR pickle) or TFDS data_dir")
flags.DEFINE_integer("validation_size", 5000, "public, fixed validation size carved from train")
flags.DEFINE_string("model", "cnn26k", "cnn26k | cnn52k | cifar_cnn")
flags.DEFINE_float("epsilon", 3.0, "target epsilon of the run")
flags.DEFINE_float("delta", 1e-5, "target delta of the run")
flags.DEFINE_integer("batch_size", 2048, "expected batch size under Poisson sampling")
flags.DEFINE_integer("epochs", 40, "epochs")
flags.DEFINE_float("learning_rate", 4.0, "learning rate")
flags.DEFINE_string("optimizer", "momentum", "sgd | momentum | adam")
flags.DEFINE_float("momentum", 0.9, "momentum")
flags.DEFINE_float("clip_norm", 0.1, "per-example L2 clipping norm C")
flags.DEFINE_integer("seed", None, "PRNG seed (default: OS entropy)")
flags.DEFINE_string("out_json", None, "write hyperparameters, curve and timing here")
flags.DEFINE_string("plot", None, "write a PNG of the test-accuracy curve here")


def pld_epsilon(sampling_rate: float, steps: int, sigma: float, delta: float) -> float:
    """epsilon of `steps` Poisson-subsampled Gaussian mechanisms (dp_accounting PLD accountant)."""
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(sampling_rate, dp_accounting.GaussianDpEvent(sigma)),
        steps,
    )
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
    return accountant.compose(event).get_epsilon(delta)


def calibrate_sigma(sampling_rate: float, steps: int, epsilon: float, delta: float) -> float:
    """Smallest sigma (to 1e-3 relative, by bisection) with PLD epsilon <= target."""
    lo, hi = 0.3, 50.0
    if pld_epsilon(sampling_rate, steps, hi, delta) > epsilon:
        raise ValueError(f"even sigma={hi} does not reach epsilon={epsilon}")
    while hi / lo > 1.001:
        mid = (lo * hi) ** 0.5
        if pld_epsilon(sampling_rate, steps, mid, delta) <= epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def main(argv):
    del argv
    data = load_dataset(FLAGS.dataset, FLAGS.data_dir, validation_size=FLAGS.validation_size)
    n_train = data.public_num_train  # public nominal size, never len() of private arrays
    base = Hyperparams(
        learning_rate=FLAGS.learning_rate,
        clip_norm=FLAGS.clip_norm,
        noise_multiplier=1.0,
        batch_size=FLAGS.batch_size,
        epochs=FLAGS.epochs,
        optimizer=FLAGS.optimizer,
        momentum=FLAGS.momentum,
        model=FLAGS.model,
    )
    priv = dpsgd_privacy(base, n_train)
    sigma = calibrate_sigma(priv.sampling_rate, priv.steps, FLAGS.epsilon, FLAGS.delta)
    eps = pld_epsilon(priv.sampling_rate, priv.steps, sigma, FLAGS.delta)
    hp = Hyperparams(**{**base.__dict__, "noise_multiplier": sigma})
    print(f"data {data}; q={priv.sampling_rate:.5f} steps={priv.steps} sigma={sigma:.4f} -> "
          f"PLD eps={eps:.4f} at delta={FLAGS.delta}", flush=True)  # fmt: skip

    seed = FLAGS.seed if FLAGS.seed is not None else int.from_bytes(os.urandom(4), "little")
    curve = []
    t_start = time.perf_counter()
    t_eval = 0.0

    def on_epoch(_, epoch, params):
        nonlocal t_eval
        t0 = time.perf_counter()
        acc = evaluate(params, hp.model, data.test_x, data.test_y)
        t_eval += time.perf_counter() - t0
        wall = time.perf_counter() - t_start - t_eval
        curve.append({"epoch": epoch, "test_accuracy": acc, "train_seconds": wall})
        print(f"epoch {epoch:3d}  test acc {acc:.4f}  train time {wall:7.1f} s", flush=True)

    result = train_candidate(hp, data, jax.random.PRNGKey(seed), on_epoch=on_epoch)
    train_seconds = time.perf_counter() - t_start - t_eval
    test_acc = evaluate(result.params, hp.model, data.test_x, data.test_y)
    print(
        f"final test accuracy {test_acc:.4f}, validation {result.validation_score:.4f}, "
        f"failed={result.failed}, training wall time {train_seconds:.0f} s",
        flush=True,
    )
    record = {
        "dataset": FLAGS.dataset,
        "num_train": n_train,
        "hyperparams": hp.__dict__,
        "sampling_rate": priv.sampling_rate,
        "steps": priv.steps,
        "epsilon": eps,
        "delta": FLAGS.delta,
        "accountant": "dp_accounting PLD, value_discretization_interval=1e-3",
        "test_accuracy": test_acc,
        "validation_accuracy": result.validation_score,
        "train_seconds": train_seconds,
        "curve": curve,
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_average_at_end": os.getloadavg(),
        "jax": jax.__version__,
    }
    if FLAGS.out_json:
        with open(FLAGS.out_json, "w") as f:
            json.dump(record, f, indent=1)
    if FLAGS.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.plot([c["epoch"] for c in curve], [100 * c["test_accuracy"] for c in curve], "o-", ms=3)
        ax.axhline(86.0, color="grey", ls="--", lw=0.8, label="86% target")
        ax.set_xlabel("epoch")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(f"{FLAGS.dataset}, {hp.model}, eps={eps:.2f}, delta={FLAGS.delta:g}")
        ax.set_ylim(max(0, 100 * min(c["test_accuracy"] for c in curve) - 5), 100)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(FLAGS.plot, dpi=120)
    return 0 if not np.isnan(test_acc) else 1


if __name__ == "__main__":
    app.run(main)
