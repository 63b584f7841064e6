"""Plots for the release folder: the released candidate's training curve and the epsilon breakdown.

Both show only what is released: the selected candidate's own history and the privacy statement's
numbers. The figures are drawn through matplotlib's object-oriented API (``Figure``, rendered by
the Agg canvas when saved), never through pyplot: plotting needs no display, leaves the caller's
pyplot backend and figures alone (a notebook's included), and skips pyplot's import (~0.2 s).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: Panel titles of the per-epoch quantities the release holds (others show their key).
_TITLES = {
    "epsilon_one_run": "epsilon of this one training run so far\n(tuning costs more: the total)",
    "test_accuracy": "test accuracy (public test split)",
}


def training_curve(
    history: Sequence[Mapping[str, Any]], path: str | Path, total_epsilon: float | None = None
) -> Path | None:
    """Plots every numeric quantity of ``history`` (the released candidate's per-epoch dicts of
    releasable quantities, e.g. ``{"epoch": 1, "epsilon_one_run": 0.8}``: the caller drops the
    non-private ones such as exact losses), one panel each, to ``path`` (``.png``). The release's
    ``total_epsilon`` (tuning included) is a labelled line on the epsilon panel, so one run's
    epsilon is never read as the total. Returns the path, or None without a numeric metric."""
    rows = [dict(h) for h in history if isinstance(h, Mapping)]
    keys = sorted(
        {k for h in rows for k, v in h.items() if k != "epoch" and isinstance(v, (int, float))}
    )
    if not rows or not keys:
        return None
    from matplotlib.figure import Figure  # heavy: loads only when a release draws its plots
    from matplotlib.ticker import MaxNLocator

    xs = [h.get("epoch", i + 1) for i, h in enumerate(rows)]
    fig = Figure(figsize=(4 * len(keys), 3))
    axes = fig.subplots(1, len(keys), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        ax.plot(xs, [h.get(key, float("nan")) for h in rows], marker="o", label=key)
        if key == "epsilon_one_run" and total_epsilon is not None:
            ax.axhline(total_epsilon, color="tab:red", linestyle="--",
                       label=f"total epsilon, tuning included: {total_epsilon:.3g}")  # fmt: skip
            ax.legend(fontsize=7)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole numbers
        ax.set_title(_TITLES.get(key, key), fontsize=9)
        ax.grid(alpha=0.3)
    fig.suptitle("released candidate (public quantities)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)


def epsilon_breakdown(privacy: Mapping[str, Any], path: str | Path) -> Path:
    """Bar chart of the statement ``privacy`` (its JSON) to ``path`` (``.png``): one candidate's
    epsilon, the selection's overhead, the total, and the budget (``budget_epsilon``) if any."""
    single = float(privacy.get("single_run_epsilon") or 0.0)
    total = float(privacy["total_epsilon"])
    overhead = max(total - single, 0.0)
    rows = [("one candidate", single, "tab:blue"), ("selection overhead", overhead, "tab:orange"),
            ("total (released)", total, "tab:green")]  # fmt: skip
    if privacy.get("budget_epsilon") is not None:
        rows.append(("budget", float(privacy["budget_epsilon"]), "tab:gray"))
    labels, values, colors = zip(*rows, strict=True)
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6, 3))
    ax = fig.subplots()
    bars = ax.barh(labels, values, color=colors)
    ax.bar_label(bars, fmt="%.3g")
    ax.invert_yaxis()
    ax.set_xlabel(f"epsilon (delta = {privacy.get('delta')})")
    ax.set_title(str(privacy.get("method", "")))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)
