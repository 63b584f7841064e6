"""``report.md``: a one-page, plain-language summary of a release folder for a newcomer.

Written by :func:`dptune.release.write_release` next to the files it describes. It only restates
what the folder already releases (the selected candidate, its public test accuracy, its noisy
validation score and the privacy statement) and links the folder's plots; it adds nothing about the
other candidates, not even how many there were."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any

from dptune.trainer_protocol import FUNCTION_TRAINER
from selection import counts


def single_candidate_odds(selection: Mapping[str, Any]) -> tuple[float, float] | None:
    """(P[K = 0], P[K = 1]) of a random-stopping count, from the statement's ``selection``
    parameters (public: a property of the configuration, never of a run's K); None for other
    methods. Truncated negative binomial (Papernot & Steinke 2022, Def. 1: ``shape``, ``gamma``),
    Poisson (``shape`` "inf", ``mean``), or the hard-capped geometric count min(K, T)
    (``gamma``, ``max_trials``: P[min(K, T) = 1] = P[K = 1] = gamma for T >= 2)."""
    try:
        if selection.get("shape") == "inf":
            mean = float(selection["mean"])
            return math.exp(-mean), mean * math.exp(-mean)
        if "shape" in selection and "gamma" in selection:
            shape, gamma = float(selection["shape"]), float(selection["gamma"])
            return 0.0, float(counts.TruncatedNegativeBinomial(shape, gamma).pmf(1))
        if "gamma" in selection and "eps0" not in selection and "max_trials" in selection:
            gamma, cap = float(selection["gamma"]), int(selection["max_trials"])
            return 0.0, (gamma if cap >= 2 else 1.0)
    except (KeyError, TypeError, ValueError):
        return None
    return None


def num(x: Any) -> str:
    """A float to 4 significant digits ("n/a" when not finite); anything else as text."""
    if isinstance(x, float):
        return f"{x:.4g}" if math.isfinite(x) else "n/a"
    return str(x)


def _pct(x: Any) -> str:
    """A fraction as a percentage; "n/a" when missing or not finite (never "nan %")."""
    ok = isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
    return f"{100.0 * x:.2f} %" if ok else "n/a"


def report_markdown(release: Any, files: set[str]) -> str:
    """The report of ``release`` (a :class:`dptune.release.Release`) as Markdown; ``files`` are the
    names present in the release folder (plots are linked only if there)."""
    p = release.privacy or {}
    eps, delta = p.get("total_epsilon"), p.get("delta")
    trainer = getattr(release, "trainer_name", None) or "a private trainer"
    lines = ["# dptune release report", "", release.headline, "", *_released(release, trainer)]
    seeded = ("the run used a fixed seed, so the guarantee holds only while it is secret"
              if p.get("seeded") else "randomness from OS entropy")  # fmt: skip
    count = []  # how often a run of this configuration trains a single candidate
    if (odds := single_candidate_odds(p.get("selection") or {})) is not None:
        none = (f", and none at all (nothing released) with probability {100 * odds[0]:.0f} %"
                if odds[0] > 0 else "")  # fmt: skip
        count.append(
            f"- What to expect from this configuration (public, not a fact about this run): its "
            f"random count of candidates trains exactly one with probability {100 * odds[1]:.0f} "
            f"%{none}; such a run releases an untuned candidate, so judge the configuration by "
            "several runs' releases, not by one."
        )
    lines += [
        "",
        "## Privacy",
        "",
        f"Everything in this folder, tuning included, is **({num(eps)}, {num(delta)})-"
        "differentially private** with respect to one record of the training data"
        + ("" if p.get("private", True) else " -- NO: this run was a non-private debug run")
        + ".",
        "",
        f"- Selection: `{p.get('method', '?')}`; theorem: {p.get('theorem', '?')}",
        f"- One training run alone would be ({num(p.get('single_run_epsilon'))}, "
        f"{num(p.get('single_run_delta', delta))})-DP; the difference is the price of tuning.",
        f"- Accountant: `{p.get('accountant', '?')}`; {seeded}",
        *count,
        "",
        "In words: an observer of this folder learns almost the same whether or not any one "
        "person's record was in the training data (the epsilon bounds the change in the odds of "
        "any conclusion; delta is the small probability that the bound fails).",
        "",
        "```text",
        (release.privacy_text or "").rstrip(),
        "```",
        "",
        "## Plots",
        "",
    ]
    if "epsilon.png" in files:
        lines.append("- [`epsilon.png`](epsilon.png): where the total epsilon comes from.")
    if "training_curve.png" in files:
        lines.append(
            "- [`training_curve.png`](training_curve.png): the released model's epsilon of its "
            "one training run so far (the dashed line is the total above, tuning included), and "
            "its test accuracy when test curves were asked for, per epoch."
        )
    saved = ("`checkpoint/` (the model" if "checkpoint" in files else
             "`payload.pkl` (the released payload" if "payload.pkl" in files else None)  # fmt: skip
    saved = "" if saved is None else (
        f", {saved}; `dptune.load_release(folder)` restores it with its hyperparameters and "
        "statement)")  # fmt: skip
    lines += [
        "",
        "## Files",
        "",
        f"`result.json` (the result), `privacy.json` / `privacy.txt` (the statement){saved}.",
        "",
        "Not released, by design: the other candidates, their scores and how many there were "
        "(revealing them would void the selection theorem's guarantee).",
        "",
    ]
    return "\n".join(lines)


def _released(release: Any, trainer: str) -> list[str]:
    """The report's "What was released" section."""
    head = ["## What was released", ""]
    if release.released:
        lines = [
            *head,
            "One trained model, chosen privately among candidates trained by "
            f"{trainer} on the private training split.",
            "",
        ]
        metric = getattr(release, "test_metric", None)
        test: str | None
        if metric is not None:  # a model scored by its own metric: its units, not a percentage
            name, value = metric.get("name", "metric"), metric.get("value")
            test = "n/a" if value is None else num(value)
            score = f"{num(release.validation_score)} ({name})"
        elif trainer.startswith(FUNCTION_TRAINER) and release.test_accuracy is None:
            # a user function's score is in its own units (not necessarily an accuracy)
            name, test = "", None
            score = f"{num(release.validation_score)} (the function's own score)"
        else:
            name, test = "accuracy", _pct(release.test_accuracy)
            score = _pct(release.validation_score)
        if test is not None:
            lines.append(f"- **Test {name}** (public test split, never used to choose): {test}")
        if "score" in getattr(release, "published", ("payload", "score")):
            lines.append(
                "- Validation score the selection saw (noisy when the validation split is "
                f"private): {score}"
            )
        lines += ["", "| hyperparameter | value |", "|---|---|"]
        lines += [f"| `{k}` | {num(v)} |" for k, v in sorted((release.hparams or {}).items())]
        return lines
    if release.outcome == "no_candidate_succeeded":
        return [
            *head,
            f"Nothing: no candidate succeeded (every candidate trained by {trainer} failed), so "
            "no model is released. The candidates touched the private data, so the run's "
            "(epsilon, delta) below stays charged to the dataset's budget. The curator can see "
            "why each failed with `dptune inspect WORKDIR` (private: never publish it).",
        ]
    return [
        *head,
        "Nothing: the private selection chose no candidate. This is a legitimate outcome of "
        "random stopping (it may train zero candidates) and is covered by the same guarantee.",
    ]
