"""Evaluation: accuracy of parameters on a split, and a candidate's validation score (the Gaussian
mechanism on the count of correct predictions, divided by a public constant)."""

from __future__ import annotations

import dataclasses
import functools
import math
import weakref
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from trainers import models, scatter
from trainers.data import Dataset
from trainers.spec import Hyperparams

_DEVICE_DATA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FEATURE_DATA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_data(data: Dataset, model: str) -> Dataset:
    """The dataset as ``model`` reads it: ``data`` itself, or for the scatter models a Dataset
    whose three splits hold the images' scattering features (n, 7, 7, 81) (``trainers.scatter``,
    cached on disk per record; computed once per Dataset object in this process). The records,
    labels and every other field stay the same, so sampling rates and privacy are unchanged."""
    spec = models.resolve(model, data.num_classes)
    if spec.features is None:
        return data
    cached = _FEATURE_DATA.get(data)
    if cached is None:
        n_tr, n_va = len(data.train_x), len(data.val_x)
        feats = scatter.features(np.concatenate([data.train_x, data.val_x, data.test_x]))
        cached = dataclasses.replace(
            data,
            train_x=feats[:n_tr],
            val_x=feats[n_tr : n_tr + n_va],
            test_x=feats[n_tr + n_va :],
        )
        _FEATURE_DATA[data] = cached
    return cached


_INPUTS: dict[int, tuple[weakref.ref, np.ndarray]] = {}


def _inputs_for(model, x: np.ndarray) -> np.ndarray:
    """``x`` as ``model`` reads it: images become scattering features for the scatter models
    (memoised per array object, so per-epoch test evaluations do not rehash the test set)."""
    if _spec_of(model).features != "scatter":
        return x
    if tuple(x.shape[1:]) == models.SCATTER_SHAPE:
        return x
    hit = _INPUTS.get(id(x))
    if hit is not None and hit[0]() is x:
        return hit[1]
    feats = scatter.features(x)
    try:
        _INPUTS[id(x)] = (weakref.ref(x), feats)
        weakref.finalize(x, _INPUTS.pop, id(x), None)
    except TypeError:  # an array view that cannot be weakly referenced: just not memoised
        pass
    return feats


def device_arrays(data: Dataset) -> tuple[jax.Array, jax.Array]:
    """Training arrays placed on the default device once per Dataset object."""
    arrays = _DEVICE_DATA.get(data)
    if arrays is None:
        arrays = (jax.device_put(data.train_x), jax.device_put(data.train_y))
        _DEVICE_DATA[data] = arrays
    return arrays


_EVAL_BATCH = 1000


@dataclasses.dataclass(frozen=True, eq=False)
class BoundedMetric:
    """A per-record validation metric declared bounded in [lo, hi].

    ``fn(outputs, labels) -> (b,)``: one value per record. Each value is clipped to [lo, hi] and
    rescaled to u = (clip(m) - lo) / (hi - lo) in [0, 1], so the sum of u over the validation
    records moves by at most 1 when one record is added or removed: the same sensitivity as the
    number of correct predictions, so a candidate's noisy score is the same Gaussian mechanism
    (std ``score_noise_std`` on a sensitivity-1 sum) and the accountant is unchanged. (Without
    the rescaling, adding or removing a record moves the raw sum by up to max(|lo|, |hi|).) The
    score is mapped back to the metric's units, lo + (hi - lo) * (noisy sum / public size):
    post-processing. Higher is better; negate a metric where lower is better.
    """

    fn: Callable
    lo: float
    hi: float
    name: str = "metric"

    def __post_init__(self):
        lo, hi = float(self.lo), float(self.hi)
        if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
            raise ValueError(f"metric bounds [{self.lo}, {self.hi}]: need finite lo < hi")

    def unit(self, outputs: jax.Array, labels: jax.Array) -> jax.Array:
        """Each record's value clipped to [lo, hi] and rescaled to [0, 1], (b,); a NaN value
        counts as ``lo`` (0), so one record cannot make the sum NaN."""
        m = self.fn(outputs, labels)
        m = jnp.clip(jnp.where(jnp.isnan(m), self.lo, m), self.lo, self.hi)
        return (m - self.lo) / (self.hi - self.lo)

    def from_unit(self, u: float) -> float:
        """A mean of rescaled values back in the metric's units."""
        return float(self.lo + (self.hi - self.lo) * u)


def _accuracy_unit(outputs: jax.Array, labels: jax.Array) -> jax.Array:
    return (jnp.argmax(outputs, axis=-1) == labels).astype(jnp.float32)


@functools.lru_cache(maxsize=32)
def _sum_fn(spec: models.ModelSpec, unit: Callable | None):
    """Sum over a batch of each record's score (correct or not, or ``unit``), masked.

    A user's model and metric are evaluated on each record as a batch of its own, under vmap:
    record i's score is then a function of record i alone whatever the model or metric does
    along the batch axis, so adding or removing one record moves the sum by at most 1, the
    sensitivity the accountant assumes (a model that mixes the examples of a batch would
    otherwise move other records' scores too). The shipped models act on each example alone."""

    def scores(params, x, y):
        outputs = spec.apply({"params": params}, x)
        if unit is None:  # exact integer count of correct predictions
            return (jnp.argmax(outputs, axis=-1) == y).astype(jnp.int32)
        return unit(outputs, y)

    if not spec.shipped:
        batched = scores

        def scores(params, x, y):
            one = jax.vmap(lambda xi, yi: batched(params, xi[None], yi[None])[0])
            return one(x, y)

    @jax.jit
    def total(params, x, y, mask):
        return jnp.sum(jnp.where(mask > 0, scores(params, x, y), 0))

    return total


def _batched_sum(fn, params, x: np.ndarray, y: np.ndarray):
    """Sum of ``fn`` over (x, y) in batches of ``_EVAL_BATCH``, the last one padded to a power of
    two (at least 8): a handful of shapes in all, and 40 validation records cost 64 forward
    passes, not 1,000 (5 of a transformer candidate's 7.7 seconds in bench_dpsgd --lora)."""
    total = 0
    for start in range(0, len(x), _EVAL_BATCH):
        xb, yb = x[start : start + _EVAL_BATCH], y[start : start + _EVAL_BATCH]
        n = len(xb)
        size = min(_EVAL_BATCH, max(8, 1 << (n - 1).bit_length()))
        mask = np.zeros(size, np.float32)
        mask[:n] = 1
        if n < size:
            xb = np.concatenate([xb, np.zeros((size - n, *xb.shape[1:]), xb.dtype)])
            yb = np.concatenate([yb, np.zeros((size - n, *yb.shape[1:]), yb.dtype)])
        total += fn(params, xb, yb, mask)
    return total


def count_correct(params, model, x: np.ndarray, y: np.ndarray) -> int:
    """Number of examples whose arg-max output equals the label; fixed-size batches so nothing
    recompiles."""
    spec = _spec_of(model)
    x = _inputs_for(spec, x)
    return int(_batched_sum(lambda *a: int(_sum_fn(spec, None)(*a)), params, x, y))


def metric_unit_sum(params, model, x: np.ndarray, y: np.ndarray) -> float:
    """Sum over the records of the model's metric rescaled to [0, 1] (``BoundedMetric.unit``;
    accuracy: the number of correct predictions): a sum of sensitivity 1 per record."""
    spec = _spec_of(model)
    if spec.metric is None:
        return float(count_correct(params, spec, x, y))
    x = _inputs_for(spec, x)
    fn = _sum_fn(spec, spec.metric.unit)
    return float(_batched_sum(lambda *a: float(fn(*a)), params, x, y))


def evaluate(params, model, x: np.ndarray, y: np.ndarray) -> float:
    """Accuracy in [0, 1] of ``params`` on (x, y). ``model``: a model name, a ModelSpec or a flax
    Module."""
    if len(x) == 0:
        raise ValueError("evaluate() needs at least one example")
    return count_correct(params, model, x, y) / len(x)


def evaluate_metric(params, model, x: np.ndarray, y: np.ndarray) -> float:
    """The model's validation metric on (x, y), exact, in its units: accuracy by default, else
    the mean of the clipped user metric."""
    if len(x) == 0:
        raise ValueError("evaluate_metric() needs at least one example")
    spec = _spec_of(model)
    mean = metric_unit_sum(params, spec, x, y) / len(x)
    return mean if spec.metric is None else spec.metric.from_unit(mean)


_MODULE_SPECS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _spec_of(model) -> models.ModelSpec:
    if isinstance(model, (str, models.ModelSpec)):
        return models.resolve(model)
    if isinstance(model, nn.Module):  # a bare module: a spec per module object, shape unknown
        spec = _MODULE_SPECS.get(model)
        if spec is None:
            spec = models.ModelSpec(type(model).__name__, model, (), shipped=False)
            _MODULE_SPECS[model] = spec
        return spec
    raise TypeError(f"model={model!r}: expected a model name, a ModelSpec or a flax Module")


def validation_score(hp: Hyperparams, params, data: Dataset, key: jax.Array) -> float:
    """Validation score: accuracy, or the model's bounded metric (``BoundedMetric``). With
    score_noise_std: (S + N(0, std^2)) / public_num_val, where S is the sum over validation records
    of the per-record score in [0, 1] (the correct count for accuracy): the Gaussian mechanism on a
    sum of sensitivity 1, divided by a public constant (the expected validation size), never by
    the private split's length; a user metric is then mapped back to its units. Exact (public
    validation set only): S / len(val)."""
    spec = models.resolve(hp.model, data.num_classes)
    total = metric_unit_sum(params, spec, data.val_x, data.val_y)
    if hp.score_noise_std is None:
        mean = float(total) / len(data.val_x)
    else:
        total = total + hp.score_noise_std * float(jax.random.normal(key, (), jnp.float32))
        mean = float(total) / float(data.public_num_val)
    return mean if spec.metric is None else spec.metric.from_unit(mean)
