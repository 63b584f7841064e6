r"""What a tuning run costs beyond its candidates' training: ``dptune.tune`` wall time against the
sum of the same candidates' pure training time, measured in one process, interleaved.

One round: (a) a whole tuning run (``dptune.tune`` on a shipped config with a fixed seed: plan and
calibration, journal, ledger, candidates, selection, release folder) in a fresh workdir, timed
per step; (b) each of its candidates trained alone with the same hyperparameters and key through
``trainers.loop.train_candidates`` (what a user pays to train those models outside dptune). A
warm-up candidate first compiles the step, so neither side pays compilation; the accountant's
caches are cleared before each round, so every plan is computed as in a new process. Ratios are
of medians over the rounds.

    python scripts/bench_tuning_overhead.py                     # smoke config, 3 rounds
    python scripts/bench_tuning_overhead.py --epochs 5 --rounds 5 --json

Columns: ``tune`` (whole run), ``plan`` (accounting and calibration, once per run), ``train`` (the
executor's candidates), ``release`` (selection, the released model's test accuracy, the curve's
epsilon per epoch, the release folder), ``pure`` (the candidates alone); the overhead ratio is
tune / pure (goal <= 1.1 where the candidates' training dominates: the plan and the release are
fixed costs, a few seconds, that a longer run amortises).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np


@contextmanager
def _timed(module, name: str, into: dict[str, float]):
    """Wraps ``module.name`` so that its wall time adds to ``into[name]``."""
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            into[name] = into.get(name, 0.0) + time.perf_counter() - t0

    setattr(module, name, wrapper)
    try:
        yield
    finally:
        setattr(module, name, real)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="smoke", help="a shipped config's name")
    parser.add_argument("--epochs", type=int, default=None, help="override config.train.epochs")
    parser.add_argument("--seed", type=int, default=9, help="fixed seed (the same K every round)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--test_curve", action="store_true",
        help="every candidate evaluates the test split after every epoch (the curator's view; "
        "dptune's behaviour before candidates computed only what selection needs)",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args(argv)

    import dptune
    from dptune import tuner
    from dptune._state.journal import Journal
    from dptune.accounting import epsilon as accounting_epsilon
    from dptune.cli import build
    from dptune.space import Space
    from trainers import loop

    cfg = build._plain(_config(args.config))
    if args.epochs:
        cfg["train"]["epochs"] = args.epochs
    data = build.load_data(cfg)
    trainer = build.build_trainer(cfg, data)
    trainer.test_curve = args.test_curve
    method = build.build_selection(cfg)
    space = Space.from_config(cfg["space"])
    budget = (cfg["privacy"]["epsilon"], cfg["privacy"]["delta"])

    # Warm-up: compile the step and the evaluation once, for both sides.
    hp0 = trainer.hyperparams({**space.example(), "noise_multiplier": 1.0})
    loop.train_candidates([hp0], data, [np.array([0, 1], np.uint32)])

    rows: list[dict[str, float]] = []
    k = None
    for _ in range(args.rounds):
        # Every round's accounting starts cold, as in a new process (its caches are per process).
        accounting_epsilon.clear_caches()
        parts: dict[str, float] = {}
        with tempfile.TemporaryDirectory() as work:
            with (
                _timed(tuner, "make_privacy_plan", parts),
                _timed(tuner, "run_candidates", parts),
                _timed(tuner, "release_selected", parts),
                _timed(tuner, "write_release", parts),
            ):
                t0 = time.perf_counter()
                rel = dptune.tune(
                    trainer, space, method, budget, workdir=Path(work) / "run", seed=args.seed,
                    progress=False, accountant=cfg["privacy"].get("accountant", "auto"),
                    ledger=Path(work) / "ledger.sqlite",  # a fresh ledger per round, charged
                )  # fmt: skip
                t_tune = time.perf_counter() - t0
            assert rel is not None
            with Journal(Path(work) / "run" / "private") as j:
                done = [r for r in j.candidates() if r.status == "done"]
                calibrated = dict(j.get("calibrated") or {})
            k = len(done)
            # The same candidates alone: same hyperparameters, same keys (the trainer's key from
            # the journaled seed, as dptune.execution.Job.rng gives it), no tuner around them.
            t0 = time.perf_counter()
            for r in done:
                hp = trainer.hyperparams({**r.hparams, **calibrated})
                rng = np.random.default_rng(r.seed)
                loop.train_candidates([hp], data, [rng.integers(0, 2**32, 2, dtype=np.uint32)])
            t_pure = time.perf_counter() - t0
        rows.append(
            {
                "tune": t_tune,
                "pure": t_pure,
                "plan": parts.get("make_privacy_plan", 0.0),
                "train": parts.get("run_candidates", 0.0),
                "release": parts.get("release_selected", 0.0) + parts.get("write_release", 0.0),
            }
        )
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    ratio = statistics.median(r["tune"] / r["pure"] for r in rows)
    per_candidate = (med["train"] - med["pure"]) / max(k or 1, 1)
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
        f"load {os.getloadavg()[0]:.2f}; config {args.config}, epochs "
        f"{cfg['train'].get('epochs')}, seed {args.seed} ({k} candidates), {args.rounds} rounds"
        + (", test curves" if args.test_curve else "")
    )
    print(f"{'':10s} " + " ".join(f"{c:>8s}" for c in med))
    print(f"{'median s':10s} " + " ".join(f"{v:8.2f}" for v in med.values()))
    print(f"tune / pure training: {ratio:.3f} (goal <= 1.1 where training dominates)")
    print(
        f"fixed costs: plan {med['plan']:.2f} s, release {med['release']:.2f} s; in-run training "
        f"minus pure training: {per_candidate:+.2f} s per candidate"
    )
    out = {"rounds": rows, "median": med, "ratio": ratio, "candidates": k,
           "per_candidate_overhead_s": per_candidate}  # fmt: skip
    if args.json:
        print(json.dumps(out))
    return out


def _config(name: str):
    import importlib.util

    from dptune import configs

    spec = importlib.util.spec_from_file_location("cfg", configs.path_of(name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


if __name__ == "__main__":
    main()
