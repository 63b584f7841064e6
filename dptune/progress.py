"""Progress display on the curator's console: elapsed time and epochs, never K or a score.

Bars appear only on an interactive terminal (``disable=None``), never in a redirected log, and are
erased when done (``leave=False``), so the screen does not accumulate one bar per candidate (the
number of bars would reveal K).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from tqdm.auto import tqdm


class NullBar:
    """A bar that shows nothing."""

    def update(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def tuning_bar(enabled: bool) -> Iterator[Any]:
    """Elapsed time of the whole run (a count of candidates would put K on screen)."""
    if not enabled:
        yield NullBar()
        return
    bar = tqdm(
        desc="tuning", bar_format="{desc}: {elapsed}", file=sys.stderr, leave=False, disable=None
    )
    try:
        yield bar
    finally:
        bar.close()


@contextlib.contextmanager
def epoch_bar(enabled: bool, total_epochs: int) -> Iterator[Callable[[dict], None] | None]:
    """A per-epoch bar fed by a trainer's progress dicts (public counts only)."""
    if not enabled:
        yield None
        return
    bar = tqdm(
        total=total_epochs,
        desc="training",
        unit="epoch",
        leave=False,
        file=sys.stderr,
        disable=None,
    )

    def update(event: dict) -> None:
        if event.get("event") == "epoch":
            bar.update(1)

    try:
        yield update
    finally:
        bar.close()
