"""Privacy-utility curves: released test accuracy against the TOTAL epsilon (tuning included).

For every total epsilon (default 1, 2, 3, 4, 8; delta from the config) and every repetition, three
ways of spending the same budget on the same config are run through ``dptune.cli.main.run_config``
(noise multiplier calibrated by dptune so that the total meets the budget):

* ``dptune``: the config's private tuning (random stopping over its search space);
* ``untuned``: one run at a default setting (the centre of every search range: geometric mean of a
  log-uniform range, midpoint of a uniform / integer one, first value of a choice), priced as a
  single run (best of k = 1);
* ``best_of_k``: the best of k = round(mean_trials) random candidates from the same space, priced
  honestly by composition (k runs; Liu & Talwar 2019, App. B.1);
* ``subsampled``: the config's private tuning run on a per-record Poisson subset of rate
  ``--sub_fraction`` with the budget ``--sub_tuning_share`` x the total epsilon, the selected
  setting retrained once on all the data, both accounted as one composition (strategy
  ``subsampled``, Koskela & Kulkarni 2023; ``dptune.subsampled``).

Output in ``--out``: ``privacy_utility.json`` (every run: accuracy, sigma, wall time),
``privacy_utility.md`` (table, mean +- sd over repetitions) and ``privacy_utility.png``.

Every run uses OS entropy (no seed). The runs' test accuracies are released here many times, and
their epsilons compose: a benchmark on data without a privacy budget to protect (public benchmark
data), not a private release. The ledger is disabled for the same reason.

    PYTHONPATH=. python scripts/privacy_utility.py --config fashion_mnist \\
        --set data.dir=../shared/data/fashion-mnist --out results/privacy_utility
    PYTHONPATH=. python scripts/privacy_utility.py --config smoke --eps 4 --reps 1 \\
        --set train.epochs=1 --out /tmp/pu        # the small version CI runs
"""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.util
import json
import math
import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

METHODS = ("dptune", "untuned", "best_of_k", "subsampled")
LABELS = {
    "dptune": "dptune (random stopping, tuning included)",
    "untuned": "one untuned run (centre of the space)",
    "best_of_k": "naive best-of-k (composition)",
    "subsampled": "subsampled tuning + one final run (composition)",
}

#: Defaults of the ``subsampled`` method: the subset's Poisson rate, and the tuning phase's share of
#: the total epsilon (0.2 keeps the tuning candidates' noisy validation count affordable down to a
#: total epsilon of 1 on the MNIST-10k study: a share of 0.15 is infeasible there).
SUB_FRACTION, SUB_TUNING_SHARE = 0.3, 0.2


def load_config(path: str | Path) -> dict[str, Any]:
    """``get_config()`` of a shipped config name (``fashion_mnist``) or a config file, as a dict."""
    from dptune import configs

    if str(path) in configs.NAMES:
        path = configs.path_of(str(path))
    spec = importlib.util.spec_from_file_location("_pu_config", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    cfg = mod.get_config()
    return json.loads(json.dumps(cfg.to_dict() if hasattr(cfg, "to_dict") else cfg))


def apply_overrides(cfg: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """``a.b=value`` assignments (value parsed as a Python literal, else kept as a string)."""
    cfg = copy.deepcopy(cfg)
    for item in overrides:
        key, _, raw = item.partition("=")
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        cur = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            cur = cur.setdefault(p, {})
        cur[parts[-1]] = value
    return cfg


def centre(spec: Any) -> Any:
    """The default setting of one search-space entry: the centre of its range."""
    if not isinstance(spec, Mapping) or "distribution" not in spec:
        return spec  # a constant or "auto"
    kind = spec["distribution"]
    if kind == "log_uniform":
        return math.sqrt(spec["low"] * spec["high"])
    if kind == "uniform":
        return (spec["low"] + spec["high"]) / 2
    if kind == "integer":
        return (spec["low"] + spec["high"]) // 2
    if kind == "choice":
        return spec["values"][0]
    raise ValueError(f"unknown distribution {kind!r}")


def method_config(
    cfg: dict[str, Any],
    method: str,
    epsilon: float,
    sub_fraction: float = SUB_FRACTION,
    sub_tuning_share: float = SUB_TUNING_SHARE,
) -> dict[str, Any]:
    """The config that spends total ``epsilon`` the way ``method`` does."""
    c = copy.deepcopy(cfg)
    c["privacy"]["epsilon"] = float(epsilon)
    c["ledger"] = {"enabled": False}
    k = max(1, round(float(cfg["selection"].get("mean_trials") or 1)))
    if method == "untuned":
        # A one-value choice rather than a constant: dptune refuses a space with nothing drawn.
        c["space"] = {
            name: {"distribution": "choice", "values": [centre(spec)]}
            if isinstance(spec, Mapping) and "distribution" in spec
            else spec
            for name, spec in cfg["space"].items()
        }
        c["selection"] = {"method": "best_of_k", "k": 1}
    elif method == "best_of_k":
        c["selection"] = {"method": "best_of_k", "k": k}
    elif method == "subsampled":
        c["strategy"] = {
            "name": "subsampled",
            "fraction": float(sub_fraction),
            "tuning_epsilon": float(sub_tuning_share) * float(epsilon),
        }
    elif method != "dptune":
        raise ValueError(f"unknown method {method!r}")
    return c


def run_one(cfg: dict[str, Any]) -> dict[str, Any]:
    """One tuning run (OS entropy) -> released test accuracy, sigma, total epsilon, seconds."""
    from dptune.cli.main import run_config

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dptune-pu-") as work:
        rel = run_config(cfg, work, seed=None, progress=False)
    return {
        "released": bool(rel.released),
        "test_accuracy": rel.test_accuracy if rel.released else None,
        "hparams": rel.hparams,
        "total_epsilon": rel.privacy.get("total_epsilon"),
        "seconds": time.perf_counter() - t0,
    }


def summarise(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, float], dict[str, Any]]:
    """(method, epsilon) -> mean, sd (ddof 1) of released test accuracy, runs, nothing-released.

    A run that releases nothing counts as chance accuracy (0.1 for 10 classes) in the mean: a
    user who gets no model has no better predictor than a guess.
    """
    out: dict[tuple[str, float], dict[str, Any]] = {}
    for r in rows:
        out.setdefault((r["method"], r["epsilon"]), {"acc": [], "empty": 0})
        acc = r["test_accuracy"]
        if acc is None:
            out[(r["method"], r["epsilon"])]["empty"] += 1
            acc = 0.1
        out[(r["method"], r["epsilon"])]["acc"].append(acc)
    for v in out.values():
        a = np.asarray(v["acc"])
        v["mean"] = float(a.mean())
        v["sd"] = float(a.std(ddof=1)) if len(a) > 1 else float("nan")
        v["n"] = len(a)
    return out


def markdown_table(summary: dict, epsilons: Sequence[float], methods: Sequence[str]) -> str:
    head = "| total epsilon | " + " | ".join(LABELS[m] for m in methods) + " |"
    lines = [head, "|---:|" + "---:|" * len(methods)]
    for e in epsilons:
        cells = []
        for m in methods:
            s = summary.get((m, e))
            if s is None:
                cells.append("not run")
                continue
            sd = "" if math.isnan(s["sd"]) else f" ± {100 * s['sd']:.2f}"
            empty = f" ({s['empty']} released nothing)" if s["empty"] else ""
            cells.append(f"{100 * s['mean']:.2f}{sd} (n={s['n']}){empty}")
        lines.append(f"| {e:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, epsilons: Sequence[float], methods: Sequence[str], path: Path, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in methods:
        es = [e for e in epsilons if (m, e) in summary]
        mean = np.array([summary[(m, e)]["mean"] for e in es]) * 100
        sd = np.nan_to_num(np.array([summary[(m, e)]["sd"] for e in es]) * 100)
        ax.errorbar(es, mean, yerr=sd, marker="o", capsize=3, label=LABELS[m])
    ax.set_xscale("log")
    ax.set_xticks(list(epsilons), [f"{e:g}" for e in epsilons])
    ax.set_xlabel("total epsilon (tuning included), delta fixed")
    ax.set_ylabel("released test accuracy (%)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a shipped config name or a config file")
    ap.add_argument("--set", action="append", default=[], help="config override a.b=value")
    ap.add_argument("--eps", type=float, nargs="+", default=[1, 2, 3, 4, 8])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--out", required=True, help="output folder")
    ap.add_argument("--sub_fraction", type=float, default=SUB_FRACTION,
                    help="subsampled: the tuning subset's Poisson rate")  # fmt: skip
    ap.add_argument("--sub_tuning_share", type=float, default=SUB_TUNING_SHARE,
                    help="subsampled: tuning epsilon as a share of the total")  # fmt: skip
    ap.add_argument(
        "--report_only", action="store_true",
        help="write the table and plot from the runs already in --out; train nothing",
    )  # fmt: skip
    ap.add_argument(
        "--only_rep", type=int, default=None,
        help="run repetition R only (0-based), e.g. one process per repetition in parallel, each "
        "with its own --out; combine them afterwards with --merge",
    )  # fmt: skip
    ap.add_argument(
        "--merge", nargs="+", default=None, metavar="DIR",
        help="combine the runs of these output folders (same config) into --out; train nothing",
    )  # fmt: skip
    args = ap.parse_args(argv)
    cfg = apply_overrides(load_config(args.config), args.set)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    meta = {"config": args.config, "overrides": args.set, "epsilons": args.eps,
            "reps": args.reps, "delta": cfg["privacy"]["delta"]}  # fmt: skip
    if "subsampled" in args.methods:
        meta["subsampled"] = {"fraction": args.sub_fraction, "tuning_share": args.sub_tuning_share}
    sources = [Path(d) for d in args.merge] if args.merge else [out]
    for src in sources:
        if not (src / "privacy_utility.json").exists():  # resume: never rerun a finished point
            continue
        old = json.loads((src / "privacy_utility.json").read_text())
        same = ("config", "overrides", "delta")
        sub = old["meta"].get("subsampled")  # folders from before the method existed lack it
        if any(old["meta"].get(k) != meta[k] for k in same) or (
            sub is not None and "subsampled" in meta and sub != meta["subsampled"]
        ):
            raise SystemExit(f"{src} holds runs of another config ({old['meta']}); use a new --out")
        seen = {(r["method"], r["epsilon"], r["rep"]) for r in rows}
        if any((r["method"], r["epsilon"], r["rep"]) in seen for r in old["runs"]):
            raise SystemExit(f"{src} repeats a (method, epsilon, repetition) already merged")
        rows.extend(old["runs"])
    if args.merge:
        (out / "privacy_utility.json").write_text(
            json.dumps({"meta": meta, "runs": rows}, indent=1, default=str)
        )
    done = {(r["method"], r["epsilon"], r["rep"]) for r in rows}
    reps = range(args.reps) if args.only_rep is None else [args.only_rep]
    if args.report_only or args.merge:
        reps = []
    # Repetition-major: an interrupted study has whole curves with fewer repetitions.
    for rep in reps:
        for e in args.eps:
            for m in args.methods:
                if (m, float(e), rep) in done:
                    continue
                r = run_one(method_config(cfg, m, e, args.sub_fraction, args.sub_tuning_share))
                rows.append({"method": m, "epsilon": float(e), "rep": rep, **r})
                print(json.dumps(rows[-1], default=str), flush=True)
                # Atomically (temporary file, then rename): a study killed by a time limit keeps
                # every finished run, and rerunning the command resumes after them.
                tmp = out / "privacy_utility.json.tmp"
                tmp.write_text(json.dumps({"meta": meta, "runs": rows}, indent=1, default=str))
                os.replace(tmp, out / "privacy_utility.json")
    summary = summarise(rows)
    table = markdown_table(summary, [float(e) for e in args.eps], args.methods)
    (out / "privacy_utility.md").write_text(table)
    title = f"{Path(args.config).stem} {' '.join(args.set)} delta={cfg['privacy']['delta']:g}"
    plot(summary, [float(e) for e in args.eps], args.methods, out / "privacy_utility.png", title)
    print(table)
    return {"rows": rows, "summary": summary, "table": table}


if __name__ == "__main__":
    main()
