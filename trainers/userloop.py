"""DP-SGD pieces for users who keep their own training loop (the Opacus habit): the per-example
clipped gradient sum of any model, the noise, and (in ``trainers.spec``) the Poisson schedule whose
numbers the privacy declaration is built from. The built-in loop (``trainers.loop``) uses the same
functions; ``docs/your_model.md`` shows a complete loop.

A DP-SGD step with them (Abadi et al. 2016, Algorithm 1, with Poisson sampling)::

    grad_sum = clipped_grad_sum(module)                 # any flax Module or apply function
    for chunks in schedule.batches(len(x), rng):        # Poisson batches, padded + masked
        g = sum(grad_sum(params, x[i], y[i], m, C) for i, m in chunks)
        g = add_noise(g, key_t, sigma, C, expected_batch_size=B)
        params = optimiser update with g
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from trainers import dpsgd, ghost, models, nnx_model, step


class clipped_grad_sum:  # noqa: N801 - used like a function: clipped_grad_sum(model)(...)
    """``clipped_grad_sum(model, loss=None)(params, x, y, mask, clip_norm) -> (sum, loss_sum)``.

    The sum over a batch of per-example gradients, each clipped to L2 norm ``clip_norm``:
    ``Σ_i mask_i g_i min(1, C / ‖g_i‖)``; adding or removing one example moves it by at most C (the
    sensitivity the Gaussian noise is calibrated to). Masked rows (padding of a Poisson batch)
    contribute exactly zero. ``loss_sum`` is the sum of the masked per-example losses.

    Args:
      model: a ``flax.linen.Module`` (its bound ``.apply`` works too), an ``nnx.Module`` or
        ``dptune.NnxModel`` (params: ``dptune.NnxModel(module).params()``, a dict), or an apply
        function ``apply_fn(params, x) -> outputs`` for other JAX code.
      loss: ``loss(outputs, labels) -> (b,)`` (outputs any pytree, labels any (b, ...) array);
        default softmax cross-entropy on integer class labels (b,).
      grad_impl: "auto" (the ghost / book-keeping path when every parametrised layer of the module
        is known to ``trainers.ghost``, else ``vmap(grad)``), "ghost" or "vmap".

    The path is chosen and the module checked (no batch statistics, no mixing of examples; the
    loss probed with zeros shaped like the labels) on the first call for each input and label
    shape and dtype, from the shapes alone; ``impl(x, y)`` tells which. Each returned function
    is jitted (``clip_norm`` is traced: changing it does not recompile).

    A module whose ``__call__`` has a ``train`` (or ``deterministic``) keyword is called in
    training mode when a ``key`` is passed (``grad_sum(params, x, y, mask, C, key=k)``, a fresh
    secret key per step and chunk): per-example dropout masks keyed by each example's position
    in the batch (``trainers.train_mode``); without ``key``, in evaluation mode. Inputs are
    arrays (for several inputs, pass an apply function that takes them packed).
    """

    def __init__(self, model: Any, loss: Callable | None = None, *, grad_impl: str = "auto"):
        if grad_impl not in step.GRAD_IMPLS:
            raise ValueError(f"grad_impl={grad_impl!r}: expected one of {step.GRAD_IMPLS[:3]}")
        owner = getattr(model, "__self__", None)
        if isinstance(owner, nn.Module) and getattr(model, "__name__", "") == "apply":
            model = owner  # module.apply: the module itself, so the ghost path can apply
        if nnx_model.is_nnx(model):  # its Param state as a dict: NnxModel(model).params()
            model = nnx_model.NnxModel(model)
        if not isinstance(model, (nn.Module, nnx_model.NnxModel)) and not callable(model):
            raise TypeError(f"model={model!r:.60}: expected a flax Module or an apply function")
        self.model = model
        self.loss = loss
        self.grad_impl = grad_impl
        self._fns: dict[tuple, tuple[str, Callable]] = {}

    def _resolve(self, x: Any, y: Any = None) -> tuple[str, Callable]:
        y_shape = () if y is None else tuple(y.shape[1:])
        y_dtype = "int32" if y is None else np.dtype(y.dtype).name
        key = (tuple(x.shape[1:]), np.dtype(x.dtype).name, y_shape, y_dtype)
        hit = self._fns.get(key)
        if hit is not None:
            return hit
        if isinstance(self.model, (nn.Module, nnx_model.NnxModel)):
            # The checks run on synthetic inputs, eagerly even when the first call is traced
            # (a train step under the user's own jax.jit).
            with jax.ensure_compile_time_eval():
                spec = models.user_model(
                    self.model, key[0], key[1], loss=self.loss, label_shape=y_shape,
                    label_dtype=y_dtype, check_metric=False,
                )  # fmt: skip
                impl = step.resolve_grad_impl(spec, self.grad_impl, key[0])
            loss = self.loss or dpsgd.per_example_loss

            def fn(p, x, y, m, c, rng=None):
                if rng is not None and spec.stochastic:
                    call = spec.training(rng)
                    if impl == "ghost":
                        return ghost.clipped_sum_ghost(call, loss, p, x, y, m, c)
                    return dpsgd.clipped_sum_naive(
                        call.apply_slots, p, x, y, m, c, loss, copies=False, per_slot=True
                    )
                if impl == "ghost":  # the spec applies the module in evaluation mode
                    return ghost.clipped_sum_ghost(spec, loss, p, x, y, m, c)
                return dpsgd.clipped_sum_naive(spec.apply, p, x, y, m, c, loss, copies=False)
        else:
            if self.grad_impl == "ghost":
                raise ValueError("grad_impl='ghost' needs a flax Module, not an apply function")
            impl, apply_fn, loss_fn = "vmap", self.model, self.loss

            def fn(p, x, y, m, c, rng=None):  # an apply function has no training mode
                return dpsgd.clipped_sum_naive(
                    lambda v, x: apply_fn(v["params"], x), p, x, y, m, c, loss_fn, copies=False
                )

        compiled = jax.jit(lambda p, x, y, m, c, rng=None: fn(p, x, y, m, c, rng)[:2])
        self._fns[key] = (impl, compiled)
        return impl, compiled

    def impl(self, x: Any, y: Any = None) -> str:
        """ "ghost" or "vmap": the path used for inputs shaped like ``x`` and labels like ``y``
        (batches; default integer class labels)."""
        return self._resolve(x, y)[0]

    def __call__(
        self, params: Any, x: Any, y: Any, mask: Any, clip_norm: Any, *, key: Any = None
    ) -> tuple[Any, Any]:
        """(clipped gradient sum with the parameters' structure, sum of masked losses). ``x``:
        (b, ...) inputs, ``y``: (b, ...) labels, ``mask``: (b,) with 1 for a real example and 0
        for padding; ``clip_norm`` C > 0 (L2, in gradient units). ``key``: a fresh secret PRNG
        key for this call's dropout (training mode); None: evaluation mode."""
        _check_positive("clip_norm", clip_norm)
        if mask is None:
            raise ValueError("mask=None: pass a (b,) array of ones (zeros for padded rows)")
        rows = np.shape(x)[0] if np.ndim(x) else None
        for name, v in (("y", y), ("mask", mask)):
            n = np.shape(v)[0] if np.ndim(v) else None
            if n != rows:
                raise ValueError(
                    f"clipped_grad_sum: {name} has {n} rows but x has {rows}: one row per "
                    "example (mask: (b,))"
                )
        return self._resolve(x, y)[1](params, x, y, mask, jnp.float32(clip_norm), key)


def _check_positive(name: str, value: Any) -> None:
    """ValueError unless a concrete ``value`` is a finite number > 0 (a traced one passes)."""
    if isinstance(value, jax.core.Tracer):
        return
    try:
        ok = np.ndim(value) == 0 and math.isfinite(float(value)) and float(value) > 0
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ValueError(f"{name}={value!r} must be a finite number > 0")


def add_noise(
    grad_sum: Any,
    key: jax.Array,
    noise_multiplier: float,
    clip_norm: float,
    *,
    expected_batch_size: float | None = None,
) -> Any:
    """``grad_sum + N(0, (noise_multiplier * clip_norm)² I)``: the Gaussian mechanism on a clipped
    sum of sensitivity ``clip_norm`` (Abadi et al. 2016, Algorithm 1). With
    ``expected_batch_size`` B, divided by B: the noisy average gradient (divide by the EXPECTED
    batch size, never the realised one, whose value would leak). ``key``: a fresh key per step,
    from secret entropy (``jax.random.key(seed)`` or ``jax.random.PRNGKey``), split or folded
    per step. A zero or negative ``noise_multiplier``, ``clip_norm`` or ``expected_batch_size`` is
    refused (ValueError): with no noise nothing is private."""
    _check_positive("noise_multiplier", noise_multiplier)
    _check_positive("clip_norm", clip_norm)
    if expected_batch_size is not None:
        _check_positive("expected_batch_size", expected_batch_size)
    if not isinstance(key, (jax.Array, jax.core.Tracer)):
        raise ValueError(
            f"key={key!r:.60}: pass a JAX PRNG key from secret entropy, e.g. "
            "jax.random.key(seed) or jax.random.PRNGKey(seed), a fresh one per step"
        )
    noisy = dpsgd.add_noise(grad_sum, key, noise_multiplier, clip_norm)
    if expected_batch_size is None:
        return noisy
    return jax.tree_util.tree_map(lambda g: g / expected_batch_size, noisy)
