"""Vectorised or one after another: train K structurally identical candidates with one ``vmap``-ed
step or with K single steps, whichever a short measurement on this device finds faster.

Whether ``vmap`` over candidates pays depends on the model and the device, not on the platform's
name: on the project's CPUs the book-keeping step vmapped over K = 4 candidates ran at 0.38-0.46x
of K single steps (docs/performance.md), on an accelerator it is expected to win. :func:`choose`
times both on PUBLIC inputs only (zeros of the model's input shape, one chunk), so the choice is a
function of the model, the device and its load, never of the data; a fixed probe size
(``PROBE_K`` candidates) makes it independent of how many candidates a run trains. The result is
kept per process and, when :func:`set_cache_file` names a file, on disk, so that later runs skip
the probe.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from trainers import models
from trainers.spec import Hyperparams
from trainers.step import default_grad_impl, default_microbatch_size, get_step_functions

log = logging.getLogger(__name__)

#: Candidates in the probe's vmapped step (fixed: the choice must not depend on a run's K).
PROBE_K = 4
#: Timed rounds (each: one vmapped step of PROBE_K candidates, then PROBE_K single steps).
PROBE_ROUNDS = 3
#: vmap must be at least this much faster to be chosen (sequential is the simpler, leaner path).
MARGIN = 1.1


@dataclasses.dataclass(frozen=True)
class Choice:
    """The outcome of a probe.

    Attributes:
      vectorize: train structurally identical candidates with the vmapped step.
      vmapped_s: median seconds of one vmapped step of ``k`` candidates (one chunk).
      sequential_s: median seconds of ``k`` single steps.
      k: candidates in the probe.
      device: the device kind the probe ran on (e.g. "cpu", "NVIDIA H100 80GB HBM3").
      source: "probe" (measured now) or "cache" (an earlier measurement).
    """

    vectorize: bool
    vmapped_s: float
    sequential_s: float
    k: int
    device: str
    source: str = "probe"

    @property
    def speedup(self) -> float:
        """sequential_s / vmapped_s: how much faster the vmapped step is (< 1: slower)."""
        return self.sequential_s / self.vmapped_s if self.vmapped_s > 0 else float("inf")

    def describe(self) -> str:
        how = "vectorised (vmap)" if self.vectorize else "one after another"
        return (
            f"{how}: {self.k} candidates vmapped ran {self.speedup:.2f}x the speed of "
            f"{self.k} single steps on {self.device} ({self.source})"
        )


_lock = threading.Lock()
_memo: dict[str, Choice] = {}
_cache_file: Path | None = None


def set_cache_file(path: str | os.PathLike | None) -> None:
    """Keeps probe results in the JSON file ``path`` across processes (None: in this process)."""
    global _cache_file
    _cache_file = None if path is None else Path(path)


def _device_kind() -> str:
    dev = jax.devices()[0]
    return f"{dev.platform}:{dev.device_kind}"


def _key(hp: Hyperparams, num_classes: int, image_shape: tuple, impl: str, chunk: int) -> str:
    parts = (
        _device_kind(), jax.__version__, hp.model, num_classes, tuple(image_shape), hp.optimizer,
        impl, hp.augmult, hp.ema_decay is not None, chunk, PROBE_K,
    )  # fmt: skip
    return repr(parts)


def _read_file() -> dict[str, Any]:
    if _cache_file is None or not _cache_file.exists():
        return {}
    try:
        return json.loads(_cache_file.read_text())
    except (OSError, ValueError):  # a damaged cache is re-measured, never trusted
        return {}


def _write_file(key: str, choice: Choice) -> None:
    if _cache_file is None:
        return
    try:
        entries = _read_file()
        entries[key] = dataclasses.asdict(choice)
        tmp = _cache_file.with_name(_cache_file.name + f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
        os.replace(tmp, _cache_file)  # atomic: a concurrent reader sees the old or the new file
    except OSError as e:  # a cache is a convenience
        log.warning("could not save the vectorisation probe to %s: %s", _cache_file, e)


def _time_steps(hp: Hyperparams, num_classes: int, impl: str, chunk: int):
    """Median seconds of one vmapped step of PROBE_K candidates and of PROBE_K single steps, on
    zeros (public inputs) of one chunk."""
    fns = get_step_functions(
        hp.model, num_classes, hp.optimizer, impl, hp.augmult, hp.ema_decay is not None
    )
    x = np.zeros((chunk, *fns.spec.input_shape), fns.spec.input_dtype)
    y = np.zeros((chunk, *fns.spec.label_shape), fns.spec.label_dtype)  # labels' public shape
    chunks = [(np.arange(chunk, dtype=np.int32), np.ones(chunk, np.float32))]
    # Zeros shaped like the parameters and optimiser state: the step does the same arithmetic on
    # any values, and building them costs no compilation (flax's eager init would).
    state_shapes = jax.eval_shape(
        lambda key: (lambda p: (p, fns.optimizer.init(p)))(models.init_params(fns.spec, key)),
        jax.random.PRNGKey(0),
    )

    def zeros(k: int, tree: Any = state_shapes) -> Any:
        # The layout of trainers.step.Group: a leading candidate axis when k > 1.
        lead = (k,) if k > 1 else ()
        return jax.tree_util.tree_map(lambda s: np.zeros(lead + tuple(s.shape), s.dtype), tree)

    def runner(k: int):
        g = fns.group(k)
        state = list(zeros(k))
        gsum = zeros(k, state_shapes[0])
        loss0 = np.zeros((k,) if k > 1 else (), np.float32)
        keys = np.zeros((k, 2) if k > 1 else (2,), np.uint32)
        clip = sigma = np.ones((k,) if k > 1 else (), np.float32)
        idx, mask = g.chunk([chunks] * k, 0)

        def run():
            p, o, loss = g.step(
                state[0], state[1], gsum, loss0, x, y, idx, mask, keys, np.int32(0), clip, sigma,
                np.float32(chunk),
            )  # fmt: skip
            state[0], state[1] = p, o
            return loss

        return run

    vmapped, single = runner(PROBE_K), runner(1)
    jax.block_until_ready(vmapped())  # compile and warm up both
    jax.block_until_ready(single())
    tv, ts = [], []
    for _ in range(PROBE_ROUNDS):  # interleaved: background load hits both alike
        t0 = time.perf_counter()
        jax.block_until_ready(vmapped())
        tv.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(PROBE_K):
            out = single()
        jax.block_until_ready(out)
        ts.append(time.perf_counter() - t0)
    return statistics.median(tv), statistics.median(ts)


def choose(
    hp: Hyperparams, num_classes: int, image_shape: Sequence[int], *, grad_impl: str | None = None
) -> Choice:
    """Whether candidates shaped like ``hp`` (model, optimiser, augmentation, EMA, chunk size)
    train faster vmapped or one after another on the default device: measured once, then read
    from the process's memo or the cache file.

    Args:
      hp: any candidate of the group (only its structural fields matter).
      num_classes: the dataset's number of classes.
      image_shape: one training example's shape in the dataset (the images, also for the scatter
        models, whose step reads features computed from them).
      grad_impl: "bookkeeping" or "naive" (default: ``trainers.step.default_grad_impl``).
    """
    image_shape = tuple(int(d) for d in image_shape)
    impl = grad_impl or default_grad_impl(hp.model, image_shape, hp.augmult)
    chunk = min(hp.microbatch_size or default_microbatch_size(hp.model, hp.augmult), hp.batch_size)
    key = _key(hp, num_classes, image_shape, impl, chunk)
    # A user's model (a ModelSpec) is one object of this process: its choice is kept in memory
    # only, never under its name in the cache file (another model may carry the same name).
    shared = isinstance(hp.model, str)
    if not shared:
        key += f"#{id(hp.model)}"
    with _lock:  # one probe at a time (a probe is a measurement: concurrent ones disturb it)
        if key in _memo:
            return _memo[key]
        saved = _read_file().get(key) if shared else None
        if saved is not None:
            try:
                _memo[key] = dataclasses.replace(Choice(**saved), source="cache")
                return _memo[key]
            except TypeError:  # an entry of another version: measure again
                pass
        vmapped_s, sequential_s = _time_steps(hp, num_classes, impl, chunk)
        choice = Choice(
            vectorize=vmapped_s * MARGIN < sequential_s, vmapped_s=vmapped_s,
            sequential_s=sequential_s, k=PROBE_K, device=_device_kind(),
        )  # fmt: skip
        _memo[key] = choice
        if shared:
            _write_file(key, choice)
        return choice


def choose_for(
    hps: Sequence[Hyperparams], num_classes: int, image_shape: Sequence[int], *,
    grad_impl: str | None = None,
) -> Choice | None:  # fmt: skip
    """The choice for a call that trains ``hps``: None when no two of them share a structure
    (model, optimiser, batch size, epochs, augmentation, EMA, chunk: nothing to vectorise), else
    :func:`choose` for the first such pair's structure."""
    seen: set[tuple] = set()
    for hp in hps:
        sig = (
            hp.model, hp.optimizer, hp.batch_size, hp.epochs, hp.augmult, hp.ema_decay is None,
            hp.microbatch_size,
        )  # fmt: skip
        if sig in seen:
            return choose(hp, num_classes, image_shape, grad_impl=grad_impl)
        seen.add(sig)
    return None
