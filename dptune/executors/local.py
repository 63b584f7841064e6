"""The in-process executors: one candidate at a time (the default), or groups of candidates through
``trainer.train_many`` (vectorised)."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from dptune.executors.base import Job, train_one
from dptune.trainer_protocol import checked_result

log = logging.getLogger("dptune")


class SequentialExecutor:
    """One candidate at a time, in this process (the default; fastest on CPU)."""

    parallelism = 1

    def run(self, trainer: Any, jobs: Sequence[Job]) -> Iterator[tuple[int, float, Any]]:
        for job in jobs:
            score, payload = train_one(trainer, job)
            yield job.index, score, payload


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
        try:
            results = list(
                trainer.train_many([dict(j.hparams) for j in jobs], [j.rng() for j in jobs])
            )
        except Exception as e:  # noqa: BLE001 - retried one by one: one bad member must not fail all
            log.warning(
                "a group of candidates failed (%s); training them one by one", type(e).__name__
            )
            yield from SequentialExecutor().run(trainer, jobs)
            return
        for job, (score, payload) in zip(jobs, results, strict=True):
            yield (job.index, *checked_result(score, payload))
