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

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

log = logging.getLogger("dptune")

#: Distinct privacy settings warmed at most (each costs one PLD composition per epoch).
MAX_SETTINGS = 4

#: Seconds the interpreter's exit waits for a warm-up thread to end (it stops after the epsilon
#: it is computing: well under a second at a few hundred steps).
EXIT_WAIT_S = 60.0

# Warm-up threads still running in this process, with their stop flags.
_RUNNING: dict[threading.Thread, threading.Event] = {}
_RUNNING_LOCK = threading.Lock()


class CurveWarmup:
    """A daemon thread computing ``plan.single_run_epsilon`` of each epoch's privacy of the drawn
    candidates (``trainer.planned_privacy_by_epoch(hparams)``, a list of accounting candidates,
    one per epoch), at the lowest CPU priority (Linux: nice 19, this thread only).

    Low priority because the candidates' training must not wait for it: on 2 busy cores, at the
    default priority it slowed a 5 s training by the ~1 s it computed; at nice 19 it runs on the
    cycles training leaves idle (nothing measurable), and where there are none it simply has not
    finished when the release needs the numbers. :meth:`stop` therefore does not wait for it: the
    release computes whatever is not cached yet itself (at worst, one number twice)."""

    def __init__(self, trainer: Any, plan: Any, drawn: Sequence[Mapping[str, Any]]):
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.nice: int | None = None  # the thread's nice value once it runs (Linux)
        hook = getattr(trainer, "planned_privacy_by_epoch", None)
        if hook is None or not drawn:
            return
        self._thread = threading.Thread(
            target=self._run, args=(hook, plan, list(drawn)), name="dptune-curve", daemon=True
        )
        with _RUNNING_LOCK:
            _RUNNING[self._thread] = self._stop
        self._thread.start()

    def _run(self, hook: Any, plan: Any, drawn: list[Mapping[str, Any]]) -> None:
        try:
            self._warm(hook, plan, drawn)
        finally:
            with _RUNNING_LOCK:
                _RUNNING.pop(threading.current_thread(), None)

    def _warm(self, hook: Any, plan: Any, drawn: list[Mapping[str, Any]]) -> None:
        self.nice = _lowest_priority()
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
            # The type only: a message could name a drawn candidate's hyperparameters, and what
            # was drawn besides the released candidate stays in the private folder.
            log.debug("the curve's warm-up stopped early (%s)", type(e).__name__)

    def stop(self) -> None:
        """Tells the thread to end after the epsilon it is computing; returns at once."""
        self._stop.set()
        self._thread = None


def stop_all_and_wait(timeout: float = EXIT_WAIT_S) -> None:
    """Stops every warm-up thread of this process and waits (up to ``timeout`` seconds in all) for
    each to finish the epsilon it is computing.

    Registered to run at the interpreter's exit: a daemon thread still inside the accountant's
    numerical code when Python finalises is stopped where it stands, and the C++ below it can
    then abort the whole process ("terminate called without an active exception", exit status
    134), seen about once in 12 runs of a user's script that ended right after ``dptune.tune``
    returned. ``dptune`` itself ends with ``os._exit`` (``dptune.cli.exits.leave``), which has no
    finalisation, and takes this handler off first, so a command never waits for the thread."""
    with _RUNNING_LOCK:
        running = list(_RUNNING.items())
    for _, stop in running:
        stop.set()
    deadline = time.monotonic() + timeout
    for thread, _ in running:
        thread.join(max(0.0, deadline - time.monotonic()))


atexit.register(stop_all_and_wait)


def _lowest_priority() -> int | None:
    """Puts the calling thread at nice 19 (Linux, where a thread has its own nice value) and
    returns its nice value; elsewhere, or where refused, it keeps the process's priority."""
    if not sys.platform.startswith("linux"):
        return None
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:
        return None
