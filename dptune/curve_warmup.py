"""The released curve's epsilons, computed while the candidates train.

The release shows the selected candidate's epsilon after each epoch (``epsilon_one_run``): one
PLD composition per epoch, 0.05-0.2 s each at a few hundred DP-SGD steps, which used to run after
training, on the critical path. These numbers are public functions of public hyperparameters
(sampling rate, step count, noise multiplier, score noise), known as soon as the plan is, so a
background thread computes them while the candidates train, for each distinct privacy setting
among the drawn candidates (usually one: the privacy-relevant fields are rarely searched).

It only fills the accountant's caches (``dptune.accounting.epsilon``): the release still computes
every number it shows from the selected candidate's own payload, through the same function
(``PrivacyPlan.single_run_epsilon``), so what it shows is exactly what it showed before, whether
the warm-up finished, was stopped, guessed a setting wrong or failed. The thread reads nothing
private and writes nothing but those caches.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("dptune")

#: Distinct privacy settings warmed at most (each costs one PLD composition per epoch).
MAX_SETTINGS = 4


class CurveWarmup:
    """A daemon thread computing ``plan.single_run_epsilon`` of each epoch's privacy of the drawn
    candidates (``trainer.planned_privacy_by_epoch(hparams)``, a list of accounting candidates,
    one per epoch). :meth:`stop` ends it between two epsilons and waits for it; call it before
    the release computes its curve (so the two never compute the same number at once) and before
    the run returns (the thread runs inside the run's accounting-warning filter)."""

    def __init__(self, trainer: Any, plan: Any, drawn: Sequence[Mapping[str, Any]]):
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        hook = getattr(trainer, "planned_privacy_by_epoch", None)
        if hook is None or not drawn:
            return
        self._thread = threading.Thread(
            target=self._run, args=(hook, plan, list(drawn)), name="dptune-curve", daemon=True
        )
        self._thread.start()

    def _run(self, hook: Any, plan: Any, drawn: list[Mapping[str, Any]]) -> None:
        seen: list[tuple] = []
        try:
            for hparams in drawn:
                settings = tuple(hook(plan.hparams(hparams)))
                if settings in seen:
                    continue
                if len(seen) == MAX_SETTINGS:
                    return
                seen.append(settings)
                for candidate in settings:
                    if self._stop.is_set():
                        return
                    plan.single_run_epsilon(candidate)
        except Exception as e:  # the release computes whatever is missing, and says why if it fails
            log.debug("the curve's warm-up stopped: %s", e)

    def stop(self) -> None:
        """Stops the thread after the epsilon it is computing and waits for it."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
