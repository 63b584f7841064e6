"""Evaluation: accuracy of parameters on a split, and a candidate's validation score (the Gaussian
mechanism on the count of correct predictions, divided by a public constant)."""

from __future__ import annotations

import dataclasses
import functools
import weakref

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from trainers import models
from trainers.data import Dataset
from trainers.spec import Hyperparams

_DEVICE_DATA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_FEATURE_DATA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def model_data(data: Dataset, model: str) -> Dataset:
    """The dataset as ``model`` reads it: ``data`` itself, or for the scatter models a Dataset
    whose three splits hold the images' scattering features (n, 7, 7, 81) (``trainers.scatter``,
    cached on disk per record; computed once per Dataset object in this process). The records,
    labels and every other field stay the same, so sampling rates and privacy are unchanged."""
    spec = models.get_model(model, data.num_classes)
    if spec.features is None:
        return data
    cached = _FEATURE_DATA.get(data)
    if cached is None:
        from trainers import scatter

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
    module = _module_of(model)
    if not isinstance(module, (models.ScatterLinear, models.ScatterCNN)):
        return x
    if tuple(x.shape[1:]) == models.SCATTER_SHAPE:
        return x
    hit = _INPUTS.get(id(x))
    if hit is not None and hit[0]() is x:
        return hit[1]
    from trainers import scatter

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


@functools.lru_cache(maxsize=32)
def _count_correct_fn(module: nn.Module):
    @jax.jit
    def count(params, x, y, mask):
        logits = module.apply({"params": params}, x)
        return jnp.sum(mask * (jnp.argmax(logits, axis=-1) == y))

    return count


def count_correct(params, model, x: np.ndarray, y: np.ndarray) -> int:
    """Number of examples whose arg-max logit equals the label; fixed-size batches so nothing
    recompiles."""
    module = _module_of(model)
    fn = _count_correct_fn(module)
    x = _inputs_for(module, x)
    total = 0
    for start in range(0, len(x), _EVAL_BATCH):
        xb, yb = x[start : start + _EVAL_BATCH], y[start : start + _EVAL_BATCH]
        n = len(xb)
        mask = np.zeros(_EVAL_BATCH, np.float32)
        mask[:n] = 1
        if n < _EVAL_BATCH:
            xb = np.concatenate([xb, np.zeros((_EVAL_BATCH - n, *xb.shape[1:]), xb.dtype)])
            yb = np.concatenate([yb, np.zeros(_EVAL_BATCH - n, yb.dtype)])
        total += int(fn(params, xb, yb, mask))
    return total


def evaluate(params, model, x: np.ndarray, y: np.ndarray) -> float:
    """Accuracy in [0, 1] of ``params`` on (x, y). ``model``: a model name, a ModelSpec or a flax
    Module."""
    if len(x) == 0:
        raise ValueError("evaluate() needs at least one example")
    return count_correct(params, model, x, y) / len(x)


def _module_of(model) -> nn.Module:
    if isinstance(model, str):
        return models.get_model(model).module
    if isinstance(model, models.ModelSpec):
        return model.module
    if isinstance(model, nn.Module):
        return model
    raise TypeError(f"model={model!r}: expected a model name, a ModelSpec or a flax Module")


def validation_score(hp: Hyperparams, params, data: Dataset, key: jax.Array) -> float:
    """Validation accuracy. With score_noise_std: (correct + N(0, std^2)) / public_num_val, the
    Gaussian mechanism on a count of sensitivity 1, divided by a public constant (the expected
    validation size), never by the private split's length. Exact (public validation set only):
    correct / len(val)."""
    correct = count_correct(params, hp.model, data.val_x, data.val_y)
    if hp.score_noise_std is None:
        return float(correct) / len(data.val_x)
    correct = correct + hp.score_noise_std * float(jax.random.normal(key, (), jnp.float32))
    return float(correct) / float(data.public_num_val)
