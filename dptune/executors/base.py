"""How candidates are trained: the executor seam between the tuner and the trainers.

The tuner hands an executor the next candidates as :class:`Job` s (index, 128-bit seed,
hyperparameters with the calibrated values filled in) and journals each ``(index, score, payload)``
as it comes back; the selection decides from the journaled scores, in index order, so an executor
may finish candidates in any order. Two rules every executor keeps:

* A trainer exception is that candidate's failure (score NaN, payload a
  ``dptune.errors.CandidateFailure`` with the exception's type, message and traceback, which the
  tuner journals in ``private/``), never an abort: whether a run fails can depend on the private
  data (DESIGN.md). A non-finite or non-numeric score is a failure too.
* An infrastructure error (a lost machine, a dead cluster) propagates: the run stops, and a rerun
  retrains the unfinished candidates with the *same* seeds (the journal never draws them again).

``parallelism`` is how many candidates the tuner hands over at once: random stopping's K are all
needed, so they run as they can; thresholding's extra candidates are speculative and their scores
are consumed in order.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from dptune.errors import CandidateFailure
from dptune.trainer_protocol import checked_result

log = logging.getLogger("dptune")


@dataclass(frozen=True)
class Job:
    """One candidate to train: its index in the plan, its secret seed and its hyperparameters."""

    index: int
    seed: int
    hparams: Mapping[str, Any]

    def rng(self) -> np.random.Generator:
        """The candidate's generator (the same on every retry: same seed, same noise)."""
        return np.random.default_rng(self.seed)


class Executor(Protocol):
    """Trains jobs and yields ``(index, score, payload)`` as they finish."""

    parallelism: int

    def run(self, trainer: Any, jobs: Sequence[Job]) -> Iterator[tuple[int, float, Any]]: ...


def train_one(trainer: Any, job: Job) -> tuple[float, Any]:
    """``trainer(hparams, rng)`` behind the failure guard: an exception, or a non-finite score,
    scores NaN with a :class:`CandidateFailure` as the payload."""
    try:
        score, payload = trainer(dict(job.hparams), job.rng())
    except Exception as e:  # noqa: BLE001 - failure depends on the data; it must not abort
        log.warning(
            "a candidate failed (%s); it counts as a failure (`dptune inspect` shows why)",
            type(e).__name__,
        )
        return float("nan"), CandidateFailure.from_exception(e)
    return checked_result(score, payload)
