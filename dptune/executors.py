"""How candidates are trained: the executor seam between the tuner and the trainers.

The tuner hands an executor the next candidates as :class:`Job` s (index, 128-bit seed,
hyperparameters with the calibrated values filled in) and journals each ``(index, score, payload)``
as it comes back; the selection decides from the journaled scores, in index order, so an executor
may finish candidates in any order. Two rules every executor keeps:

* A trainer exception is that candidate's failure (score NaN), never an abort: whether a run fails
  can depend on the private data (DESIGN.md).
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

log = logging.getLogger("dptune")

#: Names accepted by ``make_executor`` (``config.executor.kind``).
KINDS = ("sequential", "vectorized", "devices", "ray")


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
    """``trainer(hparams, rng)`` behind the failure guard: an exception scores NaN."""
    try:
        score, payload = trainer(dict(job.hparams), job.rng())
        return float(score), payload
    except Exception as e:  # noqa: BLE001 - failure depends on the data; it must not abort
        log.warning("a candidate failed (%s); it counts as a failure", type(e).__name__)
        return float("nan"), None


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
            yield job.index, float(score), payload


def make_executor(kind: str = "sequential", *, group_size: int = 1, **options: Any) -> Any:
    """The executor ``kind`` (``config.executor``); ValueError naming the problem otherwise.

    ``"ray"`` takes ``address``, ``cpus_per_candidate``, ``gpus_per_candidate``, ``max_retries``,
    ``num_cpus`` (``dptune.executors_ray``; it raises a clear error if Ray is not installed);
    ``"devices"`` takes ``devices`` (a count; default all of ``jax.devices()``) and
    ``data_parallel`` (one candidate at a time over all of them; ``dptune.executors_devices``).
    Options another kind does not use are refused."""
    if kind == "ray":
        from dptune.executors_ray import RayExecutor

        ray_options = {"address", "cpus_per_candidate", "gpus_per_candidate", "max_retries"}
        return RayExecutor(**_own_options(kind, options, ray_options | {"num_cpus"}))
    if kind == "devices":
        from dptune.executors_devices import DevicesExecutor

        return DevicesExecutor(**_own_options(kind, options, {"devices", "data_parallel"}))
    _own_options(kind, options, set())
    if kind == "sequential":
        if group_size != 1:
            return VectorizedExecutor(group_size)  # the pre-0.2 spelling: group_size > 1
        return SequentialExecutor()
    if kind == "vectorized":
        return VectorizedExecutor(group_size if group_size > 1 else 4)
    raise ValueError(f"executor kind {kind!r} is unknown; choose one of {', '.join(KINDS)}")


#: The base config's executor fields with their defaults: a kind that does not take one ignores it
#: at its default (every kind receives every field of ``config.executor``).
_BASE_DEFAULTS = {
    "cpus_per_candidate": 1.0,
    "gpus_per_candidate": 0.0,
    "max_retries": 3,
    "data_parallel": False,
}


def _own_options(kind: str, options: Mapping[str, Any], known: set[str]) -> dict[str, Any]:
    """``options`` that ``kind`` takes (``known``); other kinds' fields are dropped at their base
    defaults and refused otherwise (ValueError naming them)."""
    own = {k: v for k, v in options.items() if k in known or _BASE_DEFAULTS.get(k, object()) != v}
    _refuse_unknown(kind, own, known)
    return own


def _refuse_unknown(kind: str, options: Mapping[str, Any], known: set[str]) -> None:
    unknown = set(options) - known
    if unknown:
        raise ValueError(
            f"executor {kind!r} takes no options {sorted(unknown)} (it takes {sorted(known)})"
        )
