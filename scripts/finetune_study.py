r"""The declared fine-tuning study on the `finetune` task (docs/finetune.md): released test accuracy
of five arms at total epsilon 1 and 3 (tuning included), three runs per arm, run once and reported
whatever it shows.

Arms (each a whole `dptune` run through the command, the shipped `finetune` config otherwise):
  scratch        no pretrained start (--config.init=''): dptune's tuning from random initialisation
  full           the public start, every parameter fine-tuned
  lora           the public start, rank-4 LoRA adapters on conv2 / dense1 / dense2 trained
                 (config.model = dptune.configs.finetune:lora_cnn)
  last_layer     the public start, dense2 trained (config.learner.trainable = "dense2")
  public_recipe  the public start, every parameter, NOT tuned: one run (best_of_k, k = 1) at the
                 untuned public recipe -- Adam at its default learning rate 1e-3 (optax / Keras)
                 and C = 1e-3 (jax_privacy's Gemma LoRA example) -- with the whole budget

Everything else is the shipped config (search space, batch 512, 4 epochs, mean 3 candidates).
Every run draws its randomness from OS entropy (no seed), as a user's run does; a finished run
is never rerun (rerunning the script skips the runs in OUT/results.json). Goal (issue text): a
pretrained arm >= 5 points above `scratch` at epsilon 1.

    python scripts/finetune_study.py --out=/tmp/finetune-study          # all 30 runs
    python scripts/finetune_study.py --arms=full,lora --epsilons=3 --runs=1   # a subset

Writes OUT/results.json (every run: arm, epsilon, run, released, test accuracy, validation
score, hyperparameters) and prints a table (mean and standard deviation over the runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ARMS = ("scratch", "full", "lora", "last_layer", "public_recipe")
EPSILONS = (1.0, 3.0)

#: What each arm changes in the shipped `finetune` config (Python lines appended to a config file
#: whose ``c`` is ``dptune.configs.finetune.get_config()``).
ARM_EDITS = {
    "scratch": ['c.init = ""'],
    "full": [],
    "lora": ['c.model = "dptune.configs.finetune:lora_cnn"'],
    "last_layer": ['c.learner.trainable = "dense2"'],
    "public_recipe": [
        # one value each (a one-value choice: an empty space is refused as nothing to tune)
        "c.space = dict(learning_rate=space.choice(1e-3), clip_norm=1e-3, noise_multiplier='auto')",
        'c.selection.update(method="best_of_k", k=1)',
    ],
}


def config_file(folder: Path, arm: str, epsilon: float) -> Path:
    lines = [
        "from dptune import space",
        "from dptune.configs import finetune",
        "",
        "",
        "def get_config():",
        "    c = finetune.get_config()",
        f"    c.privacy.epsilon = {epsilon!r}",
        *(f"    {edit}" for edit in ARM_EDITS[arm]),
        "    return c",
        "",
    ]
    path = folder / f"config_{arm}_eps{epsilon:g}.py"
    path.write_text("\n".join(lines))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="/tmp/dptune-finetune-study")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--epsilons", default=",".join(f"{e:g}" for e in EPSILONS))
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()

    from dptune.cli.main import cli

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "results.json"
    results = json.loads(store.read_text()) if store.is_file() else []  # resume, never rerun
    done = {(r["arm"], r["epsilon"], r["run"]) for r in results}
    arms = [a for a in args.arms.split(",") if a]
    epsilons = [float(e) for e in args.epsilons.split(",") if e]
    for epsilon in epsilons:
        for run in range(args.runs):
            for arm in arms:
                if (arm, epsilon, run) in done:
                    continue
                cfg = config_file(out, arm, epsilon)
                work = out / f"{arm}_eps{epsilon:g}_run{run}"
                t0 = time.perf_counter()
                code = cli([
                    "dptune", f"--config={cfg}", f"--workdir={work}",
                    "--noprogress", f"--config.ledger.path={out / 'ledger.sqlite'}",
                ])  # fmt: skip
                row = {"arm": arm, "epsilon": epsilon, "run": run, "exit": code,
                       "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
                result = work / "release" / "result.json"
                if result.is_file():
                    r = json.loads(result.read_text())
                    row.update(
                        released=r.get("released"), test_accuracy=r.get("test_accuracy"),
                        validation_score=r.get("validation_score"), hparams=r.get("hparams"),
                    )  # fmt: skip
                results.append(row)
                store.write_text(json.dumps(results, indent=2) + "\n")
                print(json.dumps(row), flush=True)
    print(f"\n{'arm':15s} {'epsilon':>7s} {'test accuracy (mean +- sd over runs)':>40s}")
    for epsilon in epsilons:
        for arm in arms:
            accs = [r["test_accuracy"] for r in results if r["arm"] == arm and
                    r["epsilon"] == epsilon and r.get("test_accuracy") is not None]  # fmt: skip
            if not accs:
                print(f"{arm:15s} {epsilon:7g} {'no release':>40s}")
                continue
            sd = statistics.stdev(accs) if len(accs) > 1 else 0.0
            cell = f"{100 * statistics.mean(accs):.1f} +- {100 * sd:.1f} ({len(accs)} runs)"
            print(f"{arm:15s} {epsilon:7g} {cell:>40s}")


if __name__ == "__main__":
    main()
