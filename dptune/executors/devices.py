"""The ``"devices"`` executor: candidates spread over the local accelerators of one host.

Each candidate runs whole on one device (``jax.default_device``) in its own thread (JAX releases
the GIL while a device computes); its result does not depend on the device (same program, same
key), so the release is ``"sequential"``'s for the same seed. ``data_parallel=True`` trains one
candidate at a time over ALL the devices through the trainer's ``data_parallel(devices)`` hook
(``DpSgdTrainer``'s: per-example clipping on each shard, the clipped sums reduced across devices,
the noise added once): the same candidate up to float summation order; a trainer without the
hook trains on the first device.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import Any

import jax

from dptune.execution import Job, train_one


class DevicesExecutor:
    """One candidate per local device at a time (``config.executor.kind = "devices"``).

    Args:
      devices: how many of ``jax.local_devices()`` to use (default: all of them).
      data_parallel: train one candidate at a time over all ``devices`` (data-parallel DP-SGD)
        instead of one candidate per device.
    """

    def __init__(self, devices: int | None = None, data_parallel: bool = False) -> None:
        local = jax.local_devices()
        devices = len(local) if devices is None else devices
        if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
            raise ValueError(f"devices={devices!r} must be an integer >= 1")
        if devices > len(local):
            raise ValueError(
                f"devices={devices} but this host has {len(local)} JAX devices "
                f"({local[0].platform}); lower config.executor.devices"
            )
        if not isinstance(data_parallel, bool):
            raise ValueError(f"data_parallel={data_parallel!r} must be True or False")
        self.devices = list(local[:devices])
        self.data_parallel = data_parallel
        self.parallelism = 1 if data_parallel else len(self.devices)

    def run(self, trainer: Any, jobs: Sequence[Job]) -> Iterator[tuple[int, float, Any]]:
        """Trains ``jobs``, one at a time per slot (a device, or with ``data_parallel`` all
        devices), and yields ``(index, score, payload)`` as candidates finish."""
        hook = getattr(trainer, "data_parallel", None) if self.data_parallel else None
        free: queue.Queue = queue.Queue()
        for slot in [self.devices] if self.data_parallel else [[d] for d in self.devices]:
            free.put(slot)

        def one(job: Job) -> tuple[float, Any]:
            slot = free.get()
            try:
                # Both contexts are thread-local: this thread's arrays and jitted calls go there.
                spread = hook is not None and len(slot) > 1
                with hook(slot) if spread else jax.default_device(slot[0]):
                    return train_one(trainer, job)
            finally:
                free.put(slot)

        with ThreadPoolExecutor(max_workers=free.qsize()) as pool:
            pending = {pool.submit(one, job): job.index for job in jobs}
            while pending:
                done, _ = wait(list(pending), return_when=FIRST_COMPLETED)
                for fut in done:
                    yield (pending.pop(fut), *fut.result())
