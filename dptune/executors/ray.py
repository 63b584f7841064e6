"""The ``"ray"`` executor: one Ray task per candidate, on a local machine or a Ray cluster.

The driver (the ``dptune`` process) keeps everything that decides the release: the plan and every
seed (the journal), the journaling of each result as it comes back, the selection; Ray only runs
``train_one(trainer, job)`` elsewhere, with the task ``(index, 128-bit seed, hyperparameters)``.

* Workers load the data: a trainer's ``remote_factory`` (picklable, no arguments) is rebuilt once
  per worker process, and one whose fingerprint differs from ``expected_fingerprint`` stops the run;
  a trainer without a factory is put in the object store once per run.
* A lost worker is retried by Ray with the same task (same seed, same noise); a trainer exception
  is that candidate's failure (NaN). A killed driver's rerun retrains only what its journal lacks.
* Nothing private stays in Ray: a result's reference is dropped once journaled; ``close`` frees
  the trainer object and shuts down a Ray instance this executor started. Workers never log scores.

Bad input (Ray not installed, an address that does not answer, more CPUs or GPUs per candidate than
any node has) raises :class:`RayExecutorError` from :meth:`RayExecutor.connect`, which ``dptune``
calls before it loads any data.
"""

from __future__ import annotations

import importlib.util
import math
import socket
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from dptune.errors import TuningConfigError
from dptune.execution import Job, train_one

#: How long to wait for a TCP answer from ``HOST:PORT`` before calling the address unreachable (s).
CONNECT_TIMEOUT_S = 5.0


class RayExecutorError(TuningConfigError):
    """The Ray executor cannot run as configured; nothing private has run."""


def _refused(field: str, value: Any, why: str) -> RayExecutorError:
    """``field=value`` refused, as the keyword and (for the command) as the config field."""
    command = f"--config.executor.{field}={value} {why}"
    return RayExecutorError(f"{field}={value!r} {why}", command=command)


def _non_negative(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise _refused(name, value, "must be a finite number >= 0")
    return float(value)


class RayExecutor:
    """One Ray task per candidate (``config.executor.kind = "ray"``).

    Args:
      address: None or "local": start a local Ray instance (``ray.init()``); "auto": the cluster
        this machine belongs to (``ray start`` ran here); "HOST:PORT": that cluster's head (GCS);
        "ray://HOST:PORT": Ray Client.
      cpus_per_candidate: CPUs reserved per task (Ray's ``num_cpus``).
      gpus_per_candidate: GPUs per task (Ray's ``num_gpus``; JAX then sees only those).
      max_retries: how often Ray reruns a task whose worker died (same task: same seed).
      num_cpus: only for a local instance: how many CPUs it offers (default: all).
    """

    def __init__(
        self,
        address: str | None = None,
        cpus_per_candidate: float = 1.0,
        gpus_per_candidate: float = 0.0,
        max_retries: int = 3,
        num_cpus: int | None = None,
        expected_fingerprint: str | None = None,
    ) -> None:
        if importlib.util.find_spec("ray") is None:
            raise RayExecutorError(
                "executor kind 'ray' needs Ray, which is not installed: pip install 'dptune[ray]' "
                "(or pip install ray), or use --config.executor.kind=sequential"
            )
        if address is not None and not isinstance(address, str):
            raise _refused("address", address, "must be None, 'auto' or 'HOST:PORT'")
        self.address = None if address in (None, "", "local") else address
        self.cpus = _non_negative("cpus_per_candidate", cpus_per_candidate)
        self.gpus = _non_negative("gpus_per_candidate", gpus_per_candidate)
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise _refused("max_retries", max_retries, "must be an integer >= 0")
        self.max_retries = max_retries
        if num_cpus is not None and self.address is not None:
            raise _refused("num_cpus", num_cpus, "needs a local Ray instance (no address)")
        self.num_cpus = num_cpus
        self.parallelism = 1  # until connect(): how many candidates the cluster fits at once
        self.expected_fingerprint = expected_fingerprint
        self._started_ray = False
        self._connected = False
        self._spec: tuple | None = None
        self._spec_trainer: Any = None  # the trainer ``_spec`` runs
        self._remote: Any = None

    # --- connection ---------------------------------------------------------------------------
    def connect(self) -> RayExecutor:
        """Connects to (or starts) Ray and checks that one candidate fits on some node; sets
        ``parallelism`` to how many fit at once. Public work only: no data, no training."""
        if self._connected:
            return self
        import ray  # optional: the [ray] extra, checked in __init__

        if not ray.is_initialized():
            if self.address not in (None, "auto") and not self.address.startswith("ray://"):
                _check_reachable(self.address)
            try:  # num_cpus is None unless a local instance is started (checked in __init__)
                ray.init(address=self.address, num_cpus=self.num_cpus, include_dashboard=False,
                         log_to_driver=True)  # fmt: skip
            except (ConnectionError, RuntimeError, ValueError, TimeoutError) as e:
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                raise _refused("address", self.address, f"cannot connect to Ray ({why}): is the "
                               "cluster up? `ray status` on the head node; the address is the "
                               "head's HOST:6379, 'auto' on a cluster node, or unset for a new "
                               "local instance") from None  # fmt: skip
            self._started_ray = self.address is None
        self._connected = True
        try:
            self.parallelism = self._slots(ray.nodes())
        except RayExecutorError:
            self.close()
            raise
        return self

    def _slots(self, nodes: Sequence[dict]) -> int:
        """How many candidates fit at once over the alive nodes; an error if none fits anywhere."""
        alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", n.get("alive", True))]
        total = 0
        for res in alive:  # a candidate that asks for no CPU and no GPU: one per node
            fit = [
                res.get(k, 0.0) / n for k, n in (("CPU", self.cpus), ("GPU", self.gpus)) if n > 0
            ]
            total += math.floor(min(fit) + 1e-9) if fit else 1
        if total == 0:
            most_gpu = max((r.get("GPU", 0.0) for r in alive), default=0.0)
            most_cpu = max((r.get("CPU", 0.0) for r in alive), default=0.0)
            why = (f"(and cpus_per_candidate={self.cpus:g}): no node of the Ray cluster can run "
                   f"one candidate: the largest node has {most_gpu:g} GPUs and {most_cpu:g} CPUs "
                   f"({len(alive)} nodes); lower them or add nodes")  # fmt: skip
            raise _refused("gpus_per_candidate", self.gpus, why)
        return total

    # --- running ------------------------------------------------------------------------------
    def run(self, trainer: Any, jobs: Sequence[Job]) -> Iterator[tuple[int, float, Any]]:
        """Submits one task per job and yields ``(index, score, payload)`` as tasks finish."""
        import ray  # optional: the [ray] extra, checked in __init__

        self.connect()
        # Once per trainer, not per task: one executor may serve two runs with different trainers
        # (subsampled tuning: the subset's, then the one on all the data).
        if self._spec is None or self._spec_trainer is not trainer:
            # A trainer exception is already the candidate's NaN (train_one); anything raised out
            # of the task is infrastructure and must stop the run, not redraw.
            self._remote = ray.remote(_train_task).options(
                num_cpus=self.cpus, num_gpus=self.gpus, max_retries=self.max_retries,
                retry_exceptions=False,
            )  # fmt: skip
            factory = getattr(trainer, "remote_factory", None)
            ref = ray.put(trainer) if factory is None else None  # freed with the spec in close()
            self._spec = (uuid.uuid4().hex, factory, [ref], self.expected_fingerprint)
            self._spec_trainer = trainer
        pending = {self._remote.remote(self._spec, job): job.index for job in jobs}
        try:
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                ref = ready[0]
                index = pending.pop(ref)
                score, payload = ray.get(ref)
                del ref, ready  # the last references: Ray frees the private result now
                yield index, float(score), payload
        finally:
            for ref in pending:  # an abandoned run (driver error): stop what is in flight
                ray.cancel(ref, force=True)

    def close(self) -> None:
        """Frees what this executor put in Ray; shuts down a local Ray instance it started."""
        if not self._connected:
            return
        import ray  # optional: the [ray] extra, checked in __init__

        self._spec = self._spec_trainer = self._remote = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._connected = self._started_ray = False

    def __enter__(self) -> RayExecutor:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_reachable(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise _refused("address", address, "must be 'auto', 'HOST:PORT' (the head's GCS, "
                       "usually port 6379) or 'ray://HOST:PORT'")  # fmt: skip
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        why = e.strerror or type(e).__name__
        raise _refused("address", address, f"cannot reach a Ray cluster there ({why}): start one "
                       f"with `ray start --head --port={port}` there, or check the address and "
                       "firewall") from None  # fmt: skip


# --- the worker side ----------------------------------------------------------------------------

#: Per worker process: the trainer of the current run (token -> trainer). One entry: a worker serves
#: one run at a time, and a new run's token replaces the old trainer (and its data).
_WORKER_TRAINERS: dict[str, Any] = {}


def _worker_trainer(spec: tuple) -> Any:
    token, factory, refs, fingerprint = spec
    trainer = _WORKER_TRAINERS.get(token)
    if trainer is None:
        _WORKER_TRAINERS.clear()
        if factory is None:
            import ray  # optional: the [ray] extra, checked in __init__

            trainer = ray.get(refs[0])
        else:
            trainer = factory()
            if fingerprint is not None and getattr(trainer, "fingerprint", None) != fingerprint:
                # Different records on this node: training on them would not be the run that was
                # accounted and charged. An infrastructure error: the run stops.
                raise RuntimeError(
                    "this Ray worker loaded a dataset whose fingerprint differs from the driver's: "
                    "give every node the same data (a shared path or the same files)"
                )
        _WORKER_TRAINERS[token] = trainer
    return trainer


def _train_task(spec: tuple, job: Job) -> tuple[float, Any]:
    """A Ray task: the candidate ``job`` behind the failure guard. Loading the trainer is outside
    the guard on purpose: a worker that cannot load the data is an infrastructure error."""
    return train_one(_worker_trainer(spec), job)
