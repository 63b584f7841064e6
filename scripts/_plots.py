"""The reproduction scripts' figures: matplotlib's file-only Agg backend, 5 x 3.5 in, 120 dpi.

Imported as ``_plots`` by the scripts next to it (``python scripts/NAME.py`` puts this folder on
``sys.path``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def figure() -> tuple[Any, Any]:
    """A new ``(figure, axes)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(5, 3.5))


def save(fig: Any, ax: Any, path: str | Path, *, xlabel: str, ylabel: str, title: str,
         xscale: str | None = None, yscale: str | None = None, legend_size: int | None = None,
         ) -> None:  # fmt: skip
    """Labels, scales, legend and title on ``ax``; ``fig`` written to ``path``."""
    if xscale:
        ax.set_xscale(xscale)
    if yscale:
        ax.set_yscale(yscale)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=legend_size)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def lines_by(rows: list[dict], key: str, x: str, y: str, path: str | Path, **labels: Any) -> None:
    """One line with markers per value of ``row[key]``, through its rows' ``(row[x], row[y])``
    (rows whose ``y`` is None left out); ``labels`` go to :func:`save`."""
    fig, ax = figure()
    for name in dict.fromkeys(r[key] for r in rows):
        pts = [(r[x], r[y]) for r in rows if r[key] == name and r[y] is not None]
        if pts:
            ax.plot(*np.array(pts).T, marker="o", label=name)
    save(fig, ax, path, **labels)
