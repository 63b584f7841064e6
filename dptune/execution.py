"""How candidates are trained: the executor seam between the tuner and the trainers, and the
in-process executors (one candidate at a time, the default; groups through ``trainer.train_many``);
``dptune.executors`` names them all, with those that spread candidates over devices or Ray.

The tuner hands an executor its next ``parallelism`` candidates as :class:`Job` s and journals each
``(index, score, payload)`` as it comes back, in any order (the selection reads the journaled
scores in index order). Two rules every executor keeps:

* A trainer exception is that candidate's failure (score NaN, payload a
  ``dptune.errors.CandidateFailure``), never an abort: whether a run fails can depend on the
  private data (DESIGN.md). A non-finite or non-numeric score is a failure too.
* An infrastructure error (a lost machine, a dead cluster) propagates: the run stops, and a rerun
  retrains the unfinished candidates with the *same* seeds (the journal never draws them again).
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
        # Not on the console (debug): one line per failure would count candidates there, and
        # the console's log may be shared; the journal keeps each failure (`dptune inspect`).
        log.debug("a candidate failed (%s); `dptune inspect` shows why", type(e).__name__)
        return float("nan"), CandidateFailure.from_exception(e)
    return checked_result(score, payload)


class SequentialExecutor:
    """One candidate at a time, in this process (the default; fastest on CPU)."""

    parallelism = 1

    def run(self, trainer: Any, jobs: Sequence[Job]) -> Iterator[tuple[int, float, Any]]:
        for job in jobs:
            yield (job.index, *train_one(trainer, job))


class VectorizedExecutor:
    """``group_size`` candidates at once through ``trainer.train_many`` (``jax.vmap`` where it pays:
    accelerators); a group that raises is retried one candidate at a time, same seeds."""

    def __init__(self, group_size: int = 4) -> None:
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
            raise ValueError(f"group_size={group_size!r} must be an integer >= 1")
        self.parallelism = group_size

    def run(self, trainer: Any, jobs: Sequence[Job]) -> Iterator[tuple[int, float, Any]]:
        if len(jobs) == 1 or not hasattr(trainer, "train_many"):
            yield from SequentialExecutor().run(trainer, jobs)
            return
        hparams, rngs = [dict(j.hparams) for j in jobs], [j.rng() for j in jobs]
        try:
            results = list(trainer.train_many(hparams, rngs))
        except Exception as e:  # noqa: BLE001 - retried one by one: one bad member must not fail all
            log.debug("a group failed (%s); training its candidates one by one", type(e).__name__)
            yield from SequentialExecutor().run(trainer, jobs)
            return
        for job, (score, payload) in zip(jobs, results, strict=True):
            yield (job.index, *checked_result(score, payload))
