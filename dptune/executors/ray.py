"""The ``"ray"`` executor: one Ray task per candidate, on a local machine or a Ray cluster.

The driver (the ``dptune`` process) keeps everything that decides the release: it draws the plan
and every seed once (the journal), hands each candidate to Ray as a task ``(index, 128-bit seed,
hyperparameters)``, journals each ``(index, score, payload)`` as it comes back, and selects. Ray is
only an engine that runs ``train_one(trainer, job)`` elsewhere. What this buys and how:

* **The data is loaded by the workers**, from its spec: a trainer with a ``remote_factory`` (a
  picklable zero-argument callable, e.g. ``functools.partial(dptune.cli.main.trainer_from_config,
  cfg)``) is rebuilt once per worker process and cached there; the dataset never travels through
  the object store per task. A trainer without one is put in the object store ONCE per run (and
  freed by :meth:`RayExecutor.close`). With ``expected_fingerprint`` (the driver's dataset
  fingerprint) a worker that loads different records refuses to train (an infrastructure error: the
  run stops, nothing is journaled for that candidate).
* **A lost worker** (a killed process, a lost node) is retried by Ray with the *same* task, so the
  same seed and the same noise (``max_retries``); the plan is never redrawn. A trainer exception is
  that candidate's failure (NaN), as in every executor (``dptune.execution.train_one``).
* **A killed driver**: the journal holds every finished candidate; rerunning the command retrains
  only the unfinished ones, with their journaled seeds (``dptune.tuner``).
* **Nothing private stays in Ray**: each result's reference is dropped as soon as it is journaled
  (Ray frees an object when no reference remains), the trainer object (if any) is freed at
  ``close``, and a Ray instance this executor started is shut down at ``close``. Workers never log
  scores (the trainers log failures by error type only).
* **Selection semantics**: the tuner hands over at most ``parallelism`` candidates at once and
  consumes their scores in index order, so thresholding's speculative candidates change nothing
  (``selection.thresholding``).

Bad input (Ray not installed, an address that does not answer, more CPUs or GPUs per candidate than
any node has) raises :class:`RayExecutorError` from :meth:`RayExecutor.connect`, which ``dptune``
calls before it loads any data.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import socket
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from dptune.errors import TuningConfigError
from dptune.execution import Job, train_one

log = logging.getLogger("dptune")

#: How long to wait for a TCP answer from ``HOST:PORT`` before calling the address unreachable (s).
CONNECT_TIMEOUT_S = 5.0


class RayExecutorError(TuningConfigError):
    """The Ray executor cannot run as configured; nothing private has run."""


def ray_available() -> bool:
    return importlib.util.find_spec("ray") is not None


def _positive(name: str, value: Any, *, allow_zero: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise RayExecutorError(f"{name}={value!r} must be a finite number")
    if value < 0 or (value == 0 and not allow_zero):
        raise RayExecutorError(f"{name}={value!r} must be {'>= 0' if allow_zero else '> 0'}")
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
      parallelism: candidates handed over at once (default: as many as the cluster fits at once).
    """

    def __init__(
        self,
        address: str | None = None,
        cpus_per_candidate: float = 1.0,
        gpus_per_candidate: float = 0.0,
        max_retries: int = 3,
        num_cpus: int | None = None,
        parallelism: int | None = None,
        expected_fingerprint: str | None = None,
    ) -> None:
        if not ray_available():
            raise RayExecutorError(
                "executor kind 'ray' needs Ray, which is not installed: pip install 'dptune[ray]' "
                "(or pip install ray), or use --config.executor.kind=sequential"
            )
        if address is not None and not isinstance(address, str):
            raise RayExecutorError(f"address={address!r} must be None, 'auto' or 'HOST:PORT'")
        self.address = None if address in (None, "", "local") else address
        self.cpus = _positive("cpus_per_candidate", cpus_per_candidate, allow_zero=True)
        self.gpus = _positive("gpus_per_candidate", gpus_per_candidate, allow_zero=True)
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise RayExecutorError(f"max_retries={max_retries!r} must be an integer >= 0")
        self.max_retries = max_retries
        if num_cpus is not None and self.address is not None:
            raise RayExecutorError("num_cpus only applies to a local Ray instance (no address)")
        self.num_cpus = num_cpus
        if parallelism is not None and (not isinstance(parallelism, int) or parallelism < 1):
            raise RayExecutorError(f"parallelism={parallelism!r} must be an integer >= 1")
        self._fixed_parallelism = parallelism
        self.parallelism = parallelism or 1
        self.expected_fingerprint = expected_fingerprint
        self._started_ray = False
        self._connected = False
        self._spec: tuple | None = None
        self._trainer_ref: Any = None
        self._remote: Any = None

    # --- connection ---------------------------------------------------------------------------
    def connect(self) -> RayExecutor:
        """Connects to (or starts) Ray and checks that one candidate fits on some node; sets
        ``parallelism`` to how many fit at once. Public work only: no data, no training."""
        if self._connected:
            return self
        import ray  # optional: the [ray] extra (a clear error if missing: _require_ray)

        if not ray.is_initialized():
            if self.address not in (None, "auto") and not self.address.startswith("ray://"):
                _check_reachable(self.address)
            kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=True)
            if self.address is None:
                if self.num_cpus is not None:
                    kwargs["num_cpus"] = self.num_cpus
            else:
                kwargs["address"] = self.address
            try:
                ray.init(**kwargs)
            except (ConnectionError, RuntimeError, ValueError, TimeoutError) as e:
                raise RayExecutorError(
                    f"cannot connect to Ray at {self.address or 'a new local instance'!r}: "
                    f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''} (is the "
                    "cluster up? `ray status` on the head node; the address is the head's "
                    "HOST:6379, or 'auto' on a cluster node)"
                ) from None
            self._started_ray = self.address is None
        self._connected = True
        try:
            fits = self._slots(ray.nodes())
        except RayExecutorError:
            self.close()
            raise
        self.parallelism = self._fixed_parallelism or fits
        return self

    def _slots(self, nodes: Sequence[dict]) -> int:
        """How many candidates fit at once over the alive nodes; an error if none fits anywhere."""
        alive = [n.get("Resources", {}) for n in nodes if n.get("Alive", n.get("alive", True))]
        total = 0
        for res in alive:
            fit = math.inf
            if self.cpus > 0:
                fit = min(fit, math.floor(res.get("CPU", 0.0) / self.cpus + 1e-9))
            if self.gpus > 0:
                fit = min(fit, math.floor(res.get("GPU", 0.0) / self.gpus + 1e-9))
            total += 1 if fit == math.inf else int(fit)
        if total == 0:
            most_gpu = max((r.get("GPU", 0.0) for r in alive), default=0.0)
            most_cpu = max((r.get("CPU", 0.0) for r in alive), default=0.0)
            raise RayExecutorError(
                "no node of the Ray cluster can run one candidate: "
                f"gpus_per_candidate={self.gpus:g} and cpus_per_candidate={self.cpus:g}, but the "
                "largest node has "
                f"{most_gpu:g} GPUs and {most_cpu:g} CPUs ({len(alive)} nodes); lower "
                "config.executor.gpus_per_candidate / cpus_per_candidate or add nodes"
            )
        return total

    # --- running ------------------------------------------------------------------------------
    def _prepare(self, trainer: Any) -> None:
        import ray  # optional: the [ray] extra (a clear error if missing: _require_ray)

        self.connect()
        if self._remote is None:
            self._remote = ray.remote(_train_task).options(
                num_cpus=self.cpus,
                num_gpus=self.gpus,
                max_retries=self.max_retries,
                # A trainer exception is already the candidate's NaN (train_one); anything
                # raised out of the task is infrastructure and must stop the run, not redraw.
                retry_exceptions=False,
            )
        if self._spec is None:
            token = uuid.uuid4().hex
            factory = getattr(trainer, "remote_factory", None)
            if factory is not None:
                self._spec = ("factory", token, factory, self.expected_fingerprint)
            else:
                # Once per run, not per task; freed in close().
                self._trainer_ref = ray.put(trainer)
                self._spec = ("object", token, [self._trainer_ref], None)

    def run(self, trainer: Any, jobs: Sequence[Job]) -> Iterator[tuple[int, float, Any]]:
        """Submits one task per job and yields ``(index, score, payload)`` as tasks finish."""
        import ray  # optional: the [ray] extra (a clear error if missing: _require_ray)

        self._prepare(trainer)
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
        import ray  # optional: the [ray] extra (a clear error if missing: _require_ray)

        self._trainer_ref = None
        self._spec = None
        self._remote = None
        if self._started_ray and ray.is_initialized():
            ray.shutdown()
        self._connected = False
        self._started_ray = False

    def __enter__(self) -> RayExecutor:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_reachable(address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise RayExecutorError(
            f"address={address!r} must be 'auto', 'HOST:PORT' (the head's GCS, usually port 6379) "
            "or 'ray://HOST:PORT'"
        )
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as e:
        raise RayExecutorError(
            f"cannot reach a Ray cluster at {address} ({e.strerror or type(e).__name__}); start "
            f"one with `ray start --head --port={port}` there, or check the address and firewall"
        ) from None


# --- the worker side ----------------------------------------------------------------------------

#: Per worker process: the trainer of the current run (token -> trainer). One entry: a worker serves
#: one run at a time, and a new run's token replaces the old trainer (and its data).
_WORKER_TRAINERS: dict[str, Any] = {}


def _worker_trainer(spec: tuple) -> Any:
    kind, token, source, fingerprint = spec
    trainer = _WORKER_TRAINERS.get(token)
    if trainer is None:
        _WORKER_TRAINERS.clear()
        if kind == "factory":
            trainer = source()
            if fingerprint is not None and getattr(trainer, "fingerprint", None) != fingerprint:
                # Different records on this node: training on them would not be the run that was
                # accounted and charged. An infrastructure error: the run stops.
                raise RuntimeError(
                    "this Ray worker loaded a dataset whose fingerprint differs from the driver's: "
                    "give every node the same data (a shared path or the same files)"
                )
        else:
            import ray  # optional: the [ray] extra (a clear error if missing: _require_ray)

            trainer = ray.get(source[0])
        _WORKER_TRAINERS[token] = trainer
    return trainer


def _train_task(spec: tuple, job: Job) -> tuple[float, Any]:
    """A Ray task: the candidate ``job`` behind the failure guard. Loading the trainer is outside
    the guard on purpose: a worker that cannot load the data is an infrastructure error."""
    trainer = _worker_trainer(spec)
    return train_one(trainer, job)
