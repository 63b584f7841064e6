"""What ``dptune audit`` needs from the engine, in one place: canary records, the gradient-canary
model and per-record scores of released parameters. Nothing here runs in an ordinary training run.

Three kinds of canaries (one record each: adding or removing a canary is adding or removing one
record, the adjacency the guarantee is stated for):

* **gradient** (white-box audit of the DP-SGD step): an image whose pixel (0, 0, 0) is the marker
  ``-(j + 1)`` (real images are in [0, 1]). :class:`GradientCanaries` wraps the model so that on
  canary j the loss is ``OFFSET + GAIN * w[j]`` to float precision, where ``w`` is a block of
  parameters no real record touches: canary j's per-example gradient is ``GAIN * e_j`` on that
  block and exactly zero on the model's own parameters (a Dirac canary, Steinke, Nasr &
  Jagielski 2023, §6), clipped to ``C e_j`` like any example. ``w`` after each epoch is what the
  auditor reads.
* **input** (black-box): out-of-distribution images (uniform noise) with random labels, scored by
  their loss under the released parameters.
* **score**: input canaries chosen to fall in the validation split, read from the released
  validation score.

The audit's negative controls break training through arguments of the loop (``noise_step`` of
``trainers.loop.train_candidates``), never through state of this module.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from trainers.data import Dataset, record_digests, record_split_uniforms
from trainers.dpsgd import per_example_loss
from trainers.models import ModelSpec
from trainers.spec import AUDIT_MODEL_SUFFIX

#: Size of the gradient-canary parameter block: the most gradient canaries one audit can insert.
GRADIENT_CANARY_SLOTS = 4096
#: Norm of a gradient canary's per-example gradient before clipping. Far above any clipping norm in
#: use, so clipping always binds on a canary and a missing clip shows.
GAIN = 100.0
#: Logit offset that keeps a canary's loss linear in its parameter (softmax saturated to 1.0 in
#: float32) while ``|GAIN * w[j]|`` stays far below it.
OFFSET = 1.0e4


class GradientCanaries(nn.Module):
    """``base`` on real records; on gradient canary j (marker pixel ``-(j + 1)``), logits whose
    cross-entropy for label 0 is ``OFFSET + GAIN * w[j]``, so its gradient is ``GAIN e_j`` on the
    ``canaries`` block and zero on ``base``'s parameters (``jnp.where`` passes no gradient to the
    branch it does not select). Real records never touch ``w``: the block moves only by the
    canaries' clipped gradients and the DP noise."""

    base: nn.Module
    slots: int = GRADIENT_CANARY_SLOTS

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        logits = self.base(x)
        w = self.param("canaries", nn.initializers.zeros_init(), (self.slots,))
        code = x[:, 0, 0, 0]
        is_canary = code < -0.5
        j = jnp.clip(jnp.round(-code - 1.0).astype(jnp.int32), 0, self.slots - 1)
        canary = jnp.full_like(logits, -OFFSET)
        canary = canary.at[:, 0].set(0.0).at[:, 1].set(OFFSET + GAIN * w[j])
        return jnp.where(is_canary[:, None], canary, logits)


@functools.cache
def gradient_canary_spec(base: ModelSpec) -> ModelSpec:
    """The model ``base.name + AUDIT_MODEL_SUFFIX``: ``base`` wrapped by :class:`GradientCanaries`
    (image models only: the marker is a pixel); one spec object per base, so every candidate of
    an audit shares one compiled step."""
    if base.features is not None:
        raise ValueError(
            f"gradient canaries need a model that reads images; {base.name!r} reads "
            f"{base.features} features"
        )
    name = base.name + AUDIT_MODEL_SUFFIX
    return ModelSpec(name, GradientCanaries(base.module), base.input_shape)


def canary_block(params: dict) -> np.ndarray:
    """The gradient-canary block ``w`` (GRADIENT_CANARY_SLOTS,) of a wrapped model's parameters."""
    return np.asarray(params["canaries"], dtype=np.float64)


# --- canary records ------------------------------------------------------------------------------


def in_validation(data: Dataset, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Where the dataset's split would put each record (bool (n,)): the same keyed hash of the
    record alone (``trainers.data.record_split_uniforms``); all False when the validation set is
    separate (the training file is then not split)."""
    split = data.split
    if split.get("kind") != "record_hash":
        return np.zeros(len(x), bool)
    u = record_split_uniforms(record_digests(x, y), int(split["seed"]))
    return u < float(split["fraction"])


def gradient_canary_records(
    m: int, image_shape: tuple[int, ...], data: Dataset
) -> tuple[np.ndarray, np.ndarray]:
    """m gradient canaries (x (m, *image_shape) float32, y (m,) int32 = 0), each falling in the
    training split: canary j has marker ``-(j + 1)`` at pixel (0, 0, 0) and zeros elsewhere, except
    pixel (0, 1, 0) = ``-t`` for the smallest t >= 0 whose record hash lands in training (the
    wrapper ignores it)."""
    if not 1 <= m <= GRADIENT_CANARY_SLOTS:
        raise ValueError(f"gradient canaries: m={m} must be in [1, {GRADIENT_CANARY_SLOTS}]")
    x = np.zeros((m, *image_shape), np.float32)
    x[:, 0, 0, 0] = -(np.arange(m) + 1.0)
    y = np.zeros(m, np.int32)
    return _place(x, y, data, want_validation=False, nudge=lambda xs, t: _set_pixel(xs, -t))


def input_canary_records(
    m: int,
    image_shape: tuple[int, ...],
    num_classes: int,
    data: Dataset,
    rng: np.random.Generator,
    *,
    validation: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """m out-of-distribution canaries: uniform [0, 1) noise images with uniformly random labels,
    redrawn until each falls in the training split (or, with ``validation``, in the validation
    split). The design is public; only which canaries are included is secret."""
    x = rng.random((m, *image_shape), dtype=np.float32)
    y = rng.integers(0, num_classes, size=m).astype(np.int32)
    return _place(
        x, y, data, want_validation=validation,
        nudge=lambda xs, t: rng.random(xs.shape, dtype=np.float32),
    )  # fmt: skip


def _set_pixel(x: np.ndarray, value: float) -> np.ndarray:
    x = x.copy()
    x[:, 0, 1, 0] = value
    return x


def _place(x, y, data, *, want_validation: bool, nudge, max_tries: int = 10_000):
    """Redraws (``nudge(rows, attempt)``) the records whose split is not the wanted one."""
    x = x.copy()
    for t in range(1, max_tries + 1):
        wrong = in_validation(data, x, y) != want_validation
        if not wrong.any():
            return x, y
        x[wrong] = nudge(x[wrong], float(t))
    raise ValueError("could not place the canaries in the wanted split")  # pragma: no cover


# --- scores of released parameters ---------------------------------------------------------------

_BATCH = 256


@functools.lru_cache(maxsize=16)
def _per_record_fn(module: nn.Module):
    @jax.jit
    def fn(params, x, y):
        logits = module.apply({"params": params}, x)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        conf = jnp.take_along_axis(probs, y[:, None], axis=-1)[:, 0]
        return per_example_loss(logits, y), conf

    return fn


def per_record(params, spec: ModelSpec, x: np.ndarray, y: np.ndarray):
    """Per-record (cross-entropy loss, probability of the record's label) under ``params``, both
    float64 (n,). Computed in fixed batches of 256 rows, each row on its own, so a record gets the
    same value wherever it sits (the exact-score control decodes sums of these values)."""
    fn = _per_record_fn(spec.module)
    losses, confs = [], []
    for start in range(0, len(x), _BATCH):
        xb, yb = x[start : start + _BATCH], y[start : start + _BATCH]
        n = len(xb)
        if n < _BATCH:
            xb = np.concatenate([xb, np.zeros((_BATCH - n, *xb.shape[1:]), xb.dtype)])
            yb = np.concatenate([yb, np.zeros(_BATCH - n, yb.dtype)])
        lo, co = fn(params, xb, yb)
        losses.append(np.asarray(lo, np.float64)[:n])
        confs.append(np.asarray(co, np.float64)[:n])
    if not losses:
        return np.zeros(0), np.zeros(0)
    return np.concatenate(losses), np.concatenate(confs)
