"""The ``"devices"`` executor: candidates spread over the local accelerators of one host.

Each candidate runs whole on one device (``jax.default_device``), in its own thread: JAX releases
the GIL while a device computes, so K devices train K candidates at once. A candidate's result
does not depend on which device ran it (same program, same key), so the release is the one
``"sequential"`` gives for the same seed (``tests/test_executors_devices.py`` checks this on 4
forced CPU devices).

For ONE candidate too large for one device, the data-parallel DP-SGD step is
``trainers.parallel`` (per-example clipping on each shard of a ``jax.sharding.Mesh``, the clipped
sums reduced across devices, the Gaussian noise added once with std ``noise_multiplier *
clip_norm`` whatever the device count).
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

from dptune.executors import Job, train_one


class DevicesExecutor:
    """One candidate per local device at a time (``config.executor.kind = "devices"``).

    Args:
      devices: how many of ``jax.local_devices()`` to use (default: all of them).
    """

    def __init__(self, devices: int | None = None) -> None:
        import jax

        local = jax.local_devices()
        if devices is None:
            devices = len(local)
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices={devices!r} must be an integer >= 1")
        if devices > len(local):
            raise ValueError(
                f"devices={devices} but this host has {len(local)} JAX devices "
                f"({local[0].platform}); lower config.executor.devices"
            )
        self.devices = list(local[:devices])
        self.parallelism = len(self.devices)

    def run(self, trainer: Any, jobs: Sequence[Job]) -> Iterator[tuple[int, float, Any]]:
        """Trains ``jobs`` on the devices (each device runs one candidate at a time) and yields
        ``(index, score, payload)`` as candidates finish."""
        if len(self.devices) == 1 or len(jobs) == 1:
            import jax

            with jax.default_device(self.devices[0]):
                for job in jobs:
                    yield (job.index, *train_one(trainer, job))
            return
        free: queue.Queue = queue.Queue()
        for d in self.devices:
            free.put(d)

        def one(job: Job) -> tuple[float, Any]:
            import jax

            device = free.get()
            try:
                # default_device is thread-local: this thread's arrays and jitted calls go there.
                with jax.default_device(device):
                    return train_one(trainer, job)
            finally:
                free.put(device)

        with ThreadPoolExecutor(max_workers=len(self.devices)) as pool:
            pending = {pool.submit(one, job): job.index for job in jobs}
            while pending:
                done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                for fut in done:
                    index = pending.pop(fut)
                    score, payload = fut.result()
                    yield index, float(score), payload
