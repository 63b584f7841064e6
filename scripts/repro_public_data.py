"""Reproduction (c): accuracy of the oracle-efficient private learner against the amount of public
unlabelled data (docs/reproductions/public-data-amount.md declares the settings; run once).

    nice -n 10 python scripts/repro_public_data.py --out=runs/repro-c

For each dataset and each public pool size m, ``dptune.tune`` tunes
``dptune.learners.public_data``'s trainer (eta, pca_dim searched; the noise multiplier calibrated)
at total (epsilon, delta) = (4, 1e-5), random stopping (logarithmic, mean 2.5), OS entropy. The
public pool is the first m records of the test file (labels dropped); every m is evaluated on the
same held-out test records.
Writes ``results.json`` and ``public_data_amount.png`` to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import _plots

import dptune
from dptune import space
from dptune.data import MNIST_10K_DIR, MNIST_10K_NUM_TRAIN
from dptune.learners.public_data import PublicDataTrainer
from selection import RandomStopping
from trainers.data import load_dataset

EPSILON, DELTA, MEAN_TRIALS = 4.0, 1e-5, 2.5
SPACE = {
    "eta": space.choice(100.0, 1000.0, 10000.0),
    "pca_dim": space.choice(10, 20, 40),
    "noise_multiplier": "auto",
}
#: dataset -> (loader kwargs, public pool sizes, first test record used for evaluation)
SETTINGS = {
    "mnist-10k": (
        dict(name="mnist", data_dir=str(MNIST_10K_DIR), validation_size=1000, source="idx",
             num_examples=MNIST_10K_NUM_TRAIN),
        (50, 100, 250, 500, 1000),
        1000,
    ),
    "fashion-mnist": (
        dict(name="fashion_mnist", data_dir=str(Path(__file__).resolve().parents[2] / "shared"
             / "data" / "fashion-mnist"), validation_size=5000, source="idx"),
        (50, 100, 250, 500, 1000, 2500, 5000),
        5000,
    ),
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="runs/repro-c")
    ap.add_argument("--datasets", nargs="*", default=list(SETTINGS))
    ap.add_argument("--fashion_dir", default=None, help="Fashion-MNIST IDX folder")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.datasets:
        kwargs, sizes, test_from = SETTINGS[name]
        if name == "fashion-mnist" and args.fashion_dir:
            kwargs = {**kwargs, "data_dir": args.fashion_dir}
        data = load_dataset(**kwargs)
        for m in sizes:
            t0 = time.time()
            trainer = PublicDataTrainer(data, m, {"score_noise_std": 5.0}, test_from=test_from)
            rel = dptune.tune(
                trainer, SPACE, RandomStopping.logarithmic(mean=MEAN_TRIALS), (EPSILON, DELTA),
                workdir=str(out / f"{name}-m{m}"), progress=False,
                ledger=None,  # a benchmark of many runs on data with no budget to protect
            )  # fmt: skip
            rows.append(
                {
                    "dataset": name,
                    "num_public": len(trainer.pool.x),
                    "num_test": len(trainer.pool.test_y),
                    "released": rel.released,
                    "test_accuracy": rel.test_accuracy,
                    "hparams": rel.hparams,
                    "total_epsilon": rel.privacy["total_epsilon"],
                    "wall_s": round(time.time() - t0, 1),
                }
            )
            print(json.dumps(rows[-1], default=str), flush=True)
            (out / "results.json").write_text(json.dumps(rows, indent=1, default=str))
    plot(rows, out / "public_data_amount.png")


def plot(rows: list[dict], path: Path) -> None:
    _plots.lines_by(
        rows, "dataset", "num_public", "test_accuracy", path, xscale="log", legend_size=8,
        xlabel="public unlabelled records m", ylabel="released test accuracy",
        title="Oracle-efficient learner, total eps = 4 (tuned by dptune)",
    )  # fmt: skip


if __name__ == "__main__":
    main()
