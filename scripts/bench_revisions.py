r"""Training speed of this checkout against another checkout of dptune (e.g. before a refactor),
interleaved round by round so that background load hits both alike.

Each round runs one fresh process per checkout (A = this one, B = ``--other``) that trains the
26,010-parameter CNN on the shipped MNIST-10k (8,000 public training records, expected batch 256,
Poisson sampling, the real ``trainers`` loop through ``train_candidate``) for ``--epochs`` epochs
and reports the seconds of every epoch after the first (the first includes compilation). The table
gives each side's median epoch time over the rounds and the ratio B / A (> 1: this checkout is
faster).

    git worktree add /tmp/before <revision>
    python scripts/bench_revisions.py --other /tmp/before            # 3 rounds x 3 epochs
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

# Runs inside the checkout under test, with only the public API both sides share.
_CHILD = r"""
import json, sys, jax
from dptune.data import MNIST_10K_DIR, MNIST_10K_NUM_TRAIN
from trainers import Hyperparams, load_dataset, train_candidate
data = load_dataset("mnist", source="idx", data_dir=MNIST_10K_DIR, validation_size=1000,
                    num_examples=MNIST_10K_NUM_TRAIN)
hp = Hyperparams(model="cnn26k", batch_size=256, epochs=int(sys.argv[1]), learning_rate=2.0,
                 clip_norm=1.0, noise_multiplier=1.1, optimizer="momentum")
res = train_candidate(hp, data, jax.random.PRNGKey(0))
print(json.dumps([h["seconds"] for h in res.history[1:]]))
"""


def _epoch_seconds(checkout: Path, epochs: int) -> list[float]:
    # The checkout first, then whatever the caller's PYTHONPATH holds (e.g. installed wheels).
    path = [str(checkout), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(epochs)],
        cwd=checkout, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", required=True, type=Path, help="the other checkout (B)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per run (>= 2)")
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    times: dict[str, list[float]] = {"A (this checkout)": [], "B (--other)": []}
    sides = [("A (this checkout)", here), ("B (--other)", args.other)]
    round_ratios = []
    for r in range(args.rounds):
        # Alternate which side goes first, so that an order effect hits both alike.
        medians = {}
        for label, checkout in sides if r % 2 == 0 else sides[::-1]:
            secs = _epoch_seconds(checkout.resolve(), args.epochs)
            times[label] += secs
            medians[label] = statistics.median(secs)
            print(f"round {r + 1}: {label}: " + ", ".join(f"{s:.2f}" for s in secs), flush=True)
        round_ratios.append(medians["B (--other)"] / medians["A (this checkout)"])
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\n{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs")
    print(f"{'checkout':<20} {'median s/epoch':>15} {'epochs timed':>13}")
    for k, v in times.items():
        print(f"{k:<20} {med[k]:>15.3f} {len(v):>13}")
    ratio = med["B (--other)"] / med["A (this checkout)"]
    print(f"ratio B / A (speed of A relative to B): {ratio:.3f}")
    rr = sorted(round_ratios)
    print(
        f"per-round ratios B / A: median {statistics.median(rr):.3f}, "
        f"range {rr[0]:.3f}-{rr[-1]:.3f}, A faster in {sum(x > 1 for x in rr)} of {len(rr)} rounds"
    )


if __name__ == "__main__":
    main()
