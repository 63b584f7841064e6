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


def _bar(enabled: bool, **kwargs: Any) -> Any:
    return tqdm(file=sys.stderr, leave=False, disable=None if enabled else True, **kwargs)


def tuning_bar(enabled: bool) -> Any:
    """Elapsed time of the whole run (a count of candidates would put K on screen), as a context
    manager yielding the bar (a disabled bar shows nothing)."""
    return _bar(enabled, desc="tuning", bar_format="{desc}: {elapsed}")


@contextlib.contextmanager
def epoch_bar(enabled: bool, total_epochs: int) -> Iterator[Callable[[dict], None] | None]:
    """A per-epoch bar fed by a trainer's progress dicts (public counts only); None if disabled."""
    if not enabled:
        yield None
        return
    with _bar(True, total=total_epochs, desc="training", unit="epoch") as bar:

        def update(event: dict) -> None:
            if event.get("event") == "epoch":
                bar.update(1)

        yield update
