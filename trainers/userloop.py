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

import functools
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
      loss: ``loss(outputs, labels) -> (b,)``; default softmax cross-entropy on integer labels.
      grad_impl: "auto" (the ghost / book-keeping path when every parametrised layer of the module
        is known to ``trainers.ghost``, else ``vmap(grad)``), "ghost" or "vmap".

    The path is chosen and the module checked (no batch statistics, no mixing of examples) on the
    first call for each input shape and dtype, from the shapes alone; ``impl(x)`` tells which.
    Each returned function is jitted (``clip_norm`` is traced: changing it does not recompile).
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

    def _resolve(self, x: Any) -> tuple[str, Callable]:
        key = (tuple(x.shape[1:]), np.dtype(x.dtype).name)
        hit = self._fns.get(key)
        if hit is not None:
            return hit
        if isinstance(self.model, (nn.Module, nnx_model.NnxModel)):
            spec = models.user_model(self.model, key[0], key[1], loss=self.loss)
            impl = step.resolve_grad_impl(spec, self.grad_impl, key[0])
            loss = self.loss or dpsgd.per_example_loss
            if impl == "ghost":
                fn = functools.partial(ghost.clipped_sum_ghost, self.model, loss, copies=False)
            else:
                fn = functools.partial(dpsgd.clipped_sum_naive, spec.apply, loss=loss, copies=False)
        else:
            if self.grad_impl == "ghost":
                raise ValueError("grad_impl='ghost' needs a flax Module, not an apply function")
            impl, apply_fn = "vmap", self.model
            fn = functools.partial(
                dpsgd.clipped_sum_naive, lambda v, x: apply_fn(v["params"], x), loss=self.loss,
                copies=False,
            )  # fmt: skip
        compiled = jax.jit(lambda p, x, y, m, c: fn(p, x, y, m, c)[:2])
        self._fns[key] = (impl, compiled)
        return impl, compiled

    def impl(self, x: Any) -> str:
        """ "ghost" or "vmap": the path used for inputs shaped like ``x`` (a batch)."""
        return self._resolve(x)[0]

    def __call__(self, params: Any, x: Any, y: Any, mask: Any, clip_norm: Any) -> tuple[Any, Any]:
        """(clipped gradient sum with the parameters' structure, sum of masked losses)."""
        return self._resolve(x)[1](params, x, y, mask, jnp.float32(clip_norm))


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
    from secret entropy."""
    noisy = dpsgd.add_noise(grad_sum, key, noise_multiplier, clip_norm)
    if expected_batch_size is None:
        return noisy
    return jax.tree_util.tree_map(lambda g: g / expected_batch_size, noisy)
