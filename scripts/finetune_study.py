r"""The declared fine-tuning study on the `finetune` task (docs/finetune.md): released test accuracy
of seven arms at total epsilon 1 and 3 (tuning included), three runs per arm, run once and reported
whatever it shows.

Arms (each a whole `dptune` run through the command, the shipped `finetune` config otherwise: plain
SGD at batch 64 for 10 epochs, learning rate 0.032-0.64, C 0.5-2, geometric count of mean 4):
  scratch        no pretrained start (--config.init=''): the same space and schedule, only the
                 start differs
  scratch_recipe no pretrained start, dptune's shipped cnn26k recipe from scratch (momentum SGD,
                 learning rate 0.5-4, clip 0.1-2, batch 512, 4 epochs, logarithmic count of mean
                 3): the first study's scratch arm, the strongest scratch baseline seen so far
  full           the public start, every parameter fine-tuned
  lora           the public start, rank-4 LoRA adapters on conv2 / dense1 / dense2 trained
                 (config.model = dptune.configs.finetune:lora_cnn)
  last_layer     the public start, dense2 trained (config.learner.trainable = "dense2")
  public_recipe  the public start, every parameter, NOT tuned: one run (best_of_k, k = 1) at
                 Opacus's MNIST example defaults (SGD, learning rate 0.1, C = 1, batch 64, 10
                 epochs) with the whole budget
  full_subsampled
                 the public start, every parameter, strategy `subsampled` (Koskela & Kulkarni
                 2023; docs/finetune.md "Cheaper candidates"): candidates on a per-record Poisson
                 subset of rate SUBSET_FRACTION = 0.25 (each a quarter of a full candidate's
                 work), tuning_epsilon = TUNING_SHARE = 0.4 of the total epsilon, the selected
                 setting retrained once on all the data.

The first study (declared in b12cb13, run once, docs/finetune.md) used the large-model space
(Adam, C 1e-4 to 1e-2, batch 512, 4 epochs); its configs are in results/finetune_study/. Every run
draws its randomness from OS entropy (no seed), as a user's run does; a finished run is never rerun
(rerunning the script skips the runs in OUT/results.json). Goal (issue text): a pretrained arm >= 5
points above scratch at epsilon 1 (here: above both scratch arms).

    python scripts/finetune_study.py --out=/tmp/finetune-study          # all 42 runs
    python scripts/finetune_study.py --arms=full,lora --epsilons=3 --runs=1   # a subset
    python scripts/finetune_study.py --dry_run    # every arm's `dptune --dry_run`: nothing trained

Writes OUT/results.json (every run: arm, epsilon, run, released, test accuracy, validation
score, hyperparameters) and prints a table (mean and standard deviation over the runs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ARMS = ("scratch", "scratch_recipe", "full", "lora", "last_layer", "public_recipe",
        "full_subsampled")  # fmt: skip
#: The `full_subsampled` arm's public strategy options (module docstring).
SUBSET_FRACTION = 0.25
TUNING_SHARE = 0.4
EPSILONS = (1.0, 3.0)

#: What each arm changes in the shipped `finetune` config (Python lines appended to a config file
#: whose ``c`` is ``dptune.configs.finetune.get_config()``).
ARM_EDITS = {
    "scratch": ['c.init = ""'],
    # dptune/configs/base.py's cnn26k recipe, as the first study's scratch arm ran it
    "scratch_recipe": [
        'c.init = ""',
        'c.train.update(optimizer="momentum", momentum=0.9, batch_size=512, epochs=4)',
        "c.space = dict(learning_rate=space.log_uniform(0.5, 4.0), "
        "clip_norm=space.log_uniform(0.1, 2.0), noise_multiplier='auto')",
        'c.selection.update(method="logarithmic", mean_trials=3.0)',
    ],
    "full": [],
    "lora": ['c.model = "dptune.configs.finetune:lora_cnn"'],
    "last_layer": ['c.learner.trainable = "dense2"'],
    "public_recipe": [
        # one value each (a one-value choice: an empty space is refused as nothing to tune)
        "c.space = dict(learning_rate=space.choice(0.1), clip_norm=1.0, noise_multiplier='auto')",
        'c.selection.update(method="best_of_k", k=1)',
    ],
    "full_subsampled": [
        f'c.strategy.update(name="subsampled", fraction={SUBSET_FRACTION!r}, '
        f"tuning_epsilon={TUNING_SHARE!r} * c.privacy.epsilon)",
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
    parser.add_argument(
        "--dry_run", action="store_true",
        help="check every arm and epsilon with `dptune --dry_run` (nothing trained or charged)",
    )  # fmt: skip
    args = parser.parse_args()

    from dptune.cli.main import cli

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms = [a for a in args.arms.split(",") if a]
    epsilons = [float(e) for e in args.epsilons.split(",") if e]
    if args.dry_run:
        failed = []
        for epsilon in epsilons:
            for arm in arms:
                code = cli([
                    "dptune", f"--config={config_file(out, arm, epsilon)}", "--dry_run",
                    f"--workdir={out / 'dry_run'}", "--noprogress",
                    f"--config.ledger.path={out / 'dry_run_ledger.sqlite'}",
                ])  # fmt: skip
                if code:
                    failed.append((arm, epsilon))
        print(f"dry runs failed: {failed}" if failed else "every arm's dry run passed")
        raise SystemExit(1 if failed else 0)
    store = out / "results.json"
    results = json.loads(store.read_text()) if store.is_file() else []  # resume, never rerun
    done = {(r["arm"], r["epsilon"], r["run"]) for r in results}
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
