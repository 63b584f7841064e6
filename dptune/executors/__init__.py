"""How candidates are trained: ``make_executor`` and the one vocabulary of executor names.

``sequential`` and ``vectorized`` run in process (``dptune.execution``); ``devices`` (one candidate
per local accelerator) and ``ray`` (one Ray task per candidate) are imported only when asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dptune.execution import Executor, Job, SequentialExecutor, VectorizedExecutor, train_one

__all__ = ["KINDS", "Executor", "Job", "SequentialExecutor", "VectorizedExecutor", "make_executor",
           "train_one"]  # fmt: skip

#: Names accepted by ``make_executor`` (``config.executor.kind``).
KINDS = ("sequential", "vectorized", "devices", "ray")

#: The base config's executor fields with their defaults: every kind receives every field of
#: ``config.executor``, and a kind that does not take one ignores it at its default.
_BASE_DEFAULTS = {"cpus_per_candidate": 1.0, "gpus_per_candidate": 0.0, "max_retries": 3,
                  "data_parallel": False}  # fmt: skip


def make_executor(kind: str = "sequential", *, group_size: int = 1, **options: Any) -> Any:
    """The executor ``kind`` (``config.executor``) with the options its class takes
    (``RayExecutor``, ``DevicesExecutor``); ValueError naming the problem otherwise. Options another
    kind does not use are refused."""
    if kind == "ray":
        from dptune.executors.ray import RayExecutor  # optional: the [ray] extra

        known = {"address", "cpus_per_candidate", "gpus_per_candidate", "max_retries", "num_cpus"}
        return RayExecutor(**_own_options(kind, options, known))
    if kind == "devices":
        from dptune.executors.devices import DevicesExecutor  # heavy: JAX loads for this kind

        return DevicesExecutor(**_own_options(kind, options, {"devices", "data_parallel"}))
    _own_options(kind, options, set())
    if kind == "sequential":
        if group_size != 1:
            return VectorizedExecutor(group_size)  # the pre-0.2 spelling: group_size > 1
        return SequentialExecutor()
    if kind == "vectorized":
        return VectorizedExecutor(group_size if group_size > 1 else 4)
    raise ValueError(f"executor kind {kind!r} is unknown; choose one of {', '.join(KINDS)}")


def _own_options(kind: str, options: Mapping[str, Any], known: set[str]) -> dict[str, Any]:
    """``options`` that ``kind`` takes (``known``); other kinds' fields are dropped at their base
    defaults and refused otherwise (ValueError naming them)."""
    own = {k: v for k, v in options.items() if k in known or _BASE_DEFAULTS.get(k, object()) != v}
    if unknown := set(own) - known:
        raise ValueError(
            f"executor {kind!r} takes no options {sorted(unknown)} (it takes {sorted(known)})"
        )
    return own
