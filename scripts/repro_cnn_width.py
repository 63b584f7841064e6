"""Reproduction (b): 26k- vs 52k-parameter CNN under DP-SGD across total epsilon, each run tuned
privately by dptune (docs/reproductions/cnn-width.md declares it; the lead runs it, once).

    python scripts/repro_cnn_width.py --out=runs/repro-b --config=mnist \
        --data_dir=/path/to/mnist-idx                         # full MNIST (IDX files), GPU
    python scripts/repro_cnn_width.py --out=runs/repro-b --config=smoke   # MNIST-10k, CPU variant

For each model in (cnn26k, cnn52k), total epsilon in (1, 2, 3, 8) and repetition in (1, 2, 3):
one ``dptune`` run of the config with ``train.model`` and ``privacy.epsilon`` overridden, OS
entropy, its own workdir and a ledger per run (each repetition is a separate release: see the page
for why their epsilons are not added). ``--only MODEL:EPS`` runs one cell (3 repetitions), for
machines with a per-command time limit. Appends one JSON line per run to ``results.jsonl`` and
draws ``cnn_width.png`` from all lines with ``--plot``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

MODELS = ("cnn26k", "cnn52k")
EPSILONS = (1.0, 2.0, 3.0, 8.0)
REPS = 3


def run_one(args, model: str, eps: float, rep: int) -> dict:
    work = Path(args.out) / f"{model}-eps{eps:g}-rep{rep}"
    cmd = [
        sys.executable, "-m", "dptune.cli.main", f"--config={args.config}", f"--workdir={work}",
        f"--config.train.model={model}", f"--config.privacy.epsilon={eps}",
        f"--config.ledger.path={work}.ledger.sqlite", "--noprogress",
    ]  # fmt: skip
    if args.data_dir:
        cmd += [f"--config.data.dir={args.data_dir}", "--config.data.source=idx"]
    t0 = time.time()
    proc = subprocess.run(cmd)
    row = {"model": model, "epsilon_budget": eps, "rep": rep, "rc": proc.returncode,
           "wall_s": round(time.time() - t0, 1)}  # fmt: skip
    if proc.returncode == 0:
        result = json.loads((work / "release" / "result.json").read_text())
        privacy = json.loads((work / "release" / "privacy.json").read_text())
        row.update(
            released=result.get("released"),
            test_accuracy=result.get("test_accuracy"),
            total_epsilon=privacy["total_epsilon"],
        )
    return row


def plot(out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for model in MODELS:
        pts = [(r["epsilon_budget"], r["test_accuracy"]) for r in rows
               if r["model"] == model and r.get("test_accuracy") is not None]  # fmt: skip
        if pts:
            e, a = np.array(pts).T
            ax.scatter(e, a, label=model, alpha=0.7)
            means = [(x, a[e == x].mean()) for x in sorted(set(e))]
            ax.plot(*np.array(means).T)
    ax.set_xlabel("total epsilon (tuning included)")
    ax.set_ylabel("released test accuracy")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "cnn_width.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="runs/repro-b")
    ap.add_argument("--config", default="mnist")
    ap.add_argument("--data_dir", default=None)
    ap.add_argument("--only", default=None, help="MODEL:EPS, e.g. cnn52k:2")
    ap.add_argument("--plot", action="store_true", help="only draw the plot from results.jsonl")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.plot:
        plot(out)
        return
    cells = [(m, e) for m in MODELS for e in EPSILONS]
    if args.only:
        m, e = args.only.split(":")
        cells = [(m, float(e))]
    for model, eps in cells:
        for rep in range(1, REPS + 1):
            row = run_one(args, model, eps, rep)
            print(json.dumps(row), flush=True)
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
