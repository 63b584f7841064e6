"""Where the public tasks of ``scripts/tuning_value.py`` train well: exact test accuracy of fixed
(learning rate, clip norm) candidates at the noise multiplier a dptune run would use at total
epsilon 1. Exploratory evidence for the default ranges (docs/privacy_utility.md, "Better
defaults"); every number here is about public or generated data and none is a release.

    PYTHONPATH=. python scripts/tuning_landscape.py --out results/tuning_landscape \
        --jobs tabular:momentum:3.4 text:momentum:3.4 finetune:sgd_finetune:2.3 \
        lm:momentum:5.5 cnn:momentum:2.8
    python scripts/tuning_landscape.py --out results/tuning_landscape --simulate

``--simulate`` reads the grid back and estimates, per task, what a run would release from a
space: each candidate's score read off the grid (linear in log(lr x C), plain SGD's products
divided by 10 and by its batch's ratio to 256, in momentum-at-batch-256 units), K from a geometric
count, the best of K released (selection's own noise ignored). Median and 10th percentile of
4,000 simulated runs, fixed seed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import tuning_value as tv  # noqa: E402

#: (optimizer, batch, epochs or None for the user defaults, learning rates, clip norms) per family
GRIDS = {
    "momentum": ("momentum", None, None, (0.05, 0.15, 0.5, 1.5), (0.1, 0.4, 1.6)),
    "sgd_finetune": ("sgd", 64, 10, (0.03, 0.1, 0.3, 1.0), (0.3, 1.0, 3.0)),
}


def run(task: str, family: str, sigma: float, lr: float, clip: float, fashion_dir: str) -> float:
    import dptune
    from dptune import space
    from selection import BestOfK

    t = tv.TASKS[task]
    arrays = t.load(fashion_dir)
    defaults = tv.finetune_defaults() if t.finetune else tv.user_defaults(len(arrays[0]))
    opt, batch, epochs, _, _ = GRIDS[family]
    base = dict(
        batch_size=batch or int(defaults["train"]["batch_size"]),
        epochs=epochs or int(defaults["train"]["epochs"]),
        optimizer=opt,
        momentum=0.9,
    )
    if t.finetune:
        base["model"] = defaults["train"]["model"]
    trainer = tv.task_trainer(task, arrays, defaults, base)
    sp = {
        "learning_rate": space.choice(lr),
        "clip_norm": space.choice(clip),
        "noise_multiplier": space.choice(sigma),
    }
    with tempfile.TemporaryDirectory() as work:
        rel = dptune.tune(
            trainer, sp, BestOfK(1), (1e3, 1e-5), workdir=work, ledger=None, progress=False
        )
    if not rel.released:
        return float("nan")
    return float(tv._score({"test_accuracy": rel.test_accuracy, "test_metric": rel.test_metric}))


#: Spaces compared by --simulate: name -> (learning-rate range, clip-norm range), momentum, B 256
SPACES = {
    "before (lr 0.05-2, C 0.1-2)": ((0.05, 2.0), (0.1, 2.0)),
    "now (lr 5e-5 B to 1e-3 B, C 0.5-2)": ((0.0128, 0.256), (0.5, 2.0)),
    "twice the step (lr 1e-4 B to 2e-3 B, C 0.5-2)": ((0.0256, 0.512), (0.5, 2.0)),
    "now, C fixed at 1": ((0.0128, 0.256), (1.0, 1.0)),
}


def simulate(rows: list[dict], mean: float = 4.0, runs: int = 4000) -> str:
    import numpy as np

    seen: dict[str, dict[float, list[float]]] = {}
    for r in rows:
        step = r["learning_rate"] * r["clip_norm"]
        if r["family"] == "sgd_finetune":  # plain SGD at batch 64 -> momentum 0.9 at batch 256
            step = step / 10 * 256 / GRIDS["sgd_finetune"][1]
        seen.setdefault(r["task"], {}).setdefault(math.log(step), []).append(r["test_score"])
    rng = np.random.default_rng(0)
    lines = ["| space | " + " | ".join(seen) + " |", "|---|" + "---:|" * len(seen)]
    for name, (lr, clip) in SPACES.items():
        cells = []
        for points in seen.values():
            xs = np.array(sorted(points))
            ys = np.array([np.mean(points[x]) for x in xs])
            best = []
            for _ in range(runs):
                k = rng.geometric(1 / mean)
                logs = rng.uniform(*np.log(lr), k) + rng.uniform(*np.log(clip), k)
                best.append(np.interp(logs, xs, ys).max())
            cells.append(f"{100 * np.median(best):.1f} [{100 * np.percentile(best, 10):.1f}]")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    best_row = " | ".join(f"{100 * max(max(v) for v in p.values()):.1f}" for p in seen.values())
    lines.append(f"| best grid point | {best_row} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--jobs", nargs="+", default=[], help="task:family:sigma, e.g. tabular:momentum:3.4"
    )
    ap.add_argument("--fashion_dir", default="../shared/data/fashion-mnist")
    ap.add_argument("--simulate", action="store_true", help="the table of simulated releases")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "landscape.jsonl"
    if a.simulate:
        table = simulate([json.loads(line) for line in store.read_text().splitlines()])
        (out / "simulated.md").write_text(table)
        print(table)
        return
    for job in a.jobs:
        task, family, sigma = job.split(":")
        _, _, _, lrs, clips = GRIDS[family]
        for lr, clip in itertools.product(lrs, clips):
            acc = run(task, family, float(sigma), lr, clip, a.fashion_dir)
            row = dict(
                task=task,
                family=family,
                sigma=float(sigma),
                learning_rate=lr,
                clip_norm=clip,
                test_score=acc,
            )
            print(json.dumps(row), flush=True)
            with store.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
