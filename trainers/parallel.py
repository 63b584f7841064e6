"""Data-parallel DP-SGD for ONE candidate over the devices of a ``jax.sharding.Mesh``.

A batch (its examples, labels and Poisson mask) is split along the mesh axis ``"data"``; each device
clips ITS examples' gradients (per-example clipping needs nothing from other shards), the clipped
sums are reduced across devices (``jax.lax.psum``), and the Gaussian noise is added ONCE, to the
reduced sum, outside the per-shard function:

    noisy = sum_{devices d} sum_{i in shard d} mask_i clip_C(g_i)  +  N(0, (sigma C)^2 I)

so the noise's std is ``sigma * C`` whatever the device count (adding noise on each shard would
give ``sqrt(D) sigma C``, which the accountant does not assume; adding none would not be private).
The sum is the same function of the batch as the single-device ``trainers.dpsgd`` clipped sum (up
to float summation order), so the privacy of a step is exactly the single-device step's (Abadi et
al. 2016, Alg. 1: sensitivity C of the clipped sum, Gaussian mechanism with multiplier sigma).

Shapes: x (b, h, w, c), y (b,), mask (b,) with b divisible by the number of devices on the axis;
``tests/dptune/executors/test_devices.py`` checks the reduction against one device (4 forced CPU
devices) and the noise's std statistically.

The training loop (``trainers.loop``) trains a candidate this way while a mesh is set with
:func:`data_parallel` (the ``"devices"`` executor with ``data_parallel=True`` does so): its chunks
are padded to a multiple of the device count (padding slots have mask 0 and add nothing), the data
and parameters are replicated, and each chunk's clipped sum is reduced across the mesh before the
step adds the noise once.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainers import dpsgd

#: The mesh axis that the batch is split along.
AXIS = "data"


def data_mesh(devices: Sequence[Any] | None = None) -> Mesh:
    """A 1-D mesh over ``devices`` (default: all of ``jax.devices()``) with axis ``"data"``."""
    devs = np.asarray(list(devices) if devices is not None else jax.devices())
    return Mesh(devs, (AXIS,))


def shard_batch(mesh: Mesh, *arrays: Any) -> tuple[jax.Array, ...]:
    """Places each array split along its first (batch) axis over the mesh."""
    sharding = NamedSharding(mesh, P(AXIS))
    return tuple(jax.device_put(a, sharding) for a in arrays)


def clipped_sum_sharded(
    clipped_sum: Callable, mesh: Mesh, params: Any, x: jax.Array, y: jax.Array, mask: jax.Array,
    clip_norm: Any,
) -> tuple[Any, jax.Array]:  # fmt: skip
    """The clipped gradient sum over a batch split across the mesh.

    Args:
      clipped_sum: ``(params, x, y, mask, clip_norm) -> (sum, loss sum, norms)`` for one shard,
        e.g. ``functools.partial(trainers.dpsgd.clipped_sum_naive, apply_fn)`` or
        ``trainers.dpsgd.clipped_sum_bookkeeping``.
      params: the parameters (replicated on every device).
    Returns:
      (clipped sum pytree, replicated; loss sum over the batch, a scalar).
    """
    summed, loss, _ = _sharded_sum(clipped_sum, mesh, params, x, y, mask, clip_norm)
    return summed, loss


def _sharded_sum(clipped_sum, mesh, params, x, y, mask, clip_norm):
    """:func:`clipped_sum_sharded`'s sums and the per-example norms (b,), sharded as the batch."""

    def local(p, xs, ys, ms):
        s, loss, norms = clipped_sum(p, xs, ys, ms, clip_norm)
        # Per-example clipping was local; the sum over examples becomes a sum over devices.
        return jax.lax.psum(s, AXIS), jax.lax.psum(loss, AXIS), norms

    # check_vma=False: the per-shard code is exactly the single-device code. With JAX's
    # varying-axes checking on, differentiating w.r.t. a replicated value (the parameters, or the
    # zero "taps" of the book-keeping path) inside shard_map sums that gradient over the devices
    # (the transpose of a broadcast), so each "per-example" gradient would mix examples of every
    # shard before clipping: a wrong sum with a sensitivity that is no longer C.
    fn = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P(AXIS), P(AXIS), P(AXIS)),
        out_specs=(P(), P(), P(AXIS)),
        check_vma=False,
    )  # fmt: skip
    return fn(params, x, y, mask)


def noisy_sum_sharded(
    clipped_sum: Callable, mesh: Mesh, params: Any, x: jax.Array, y: jax.Array, mask: jax.Array,
    key: jax.Array, clip_norm: Any, noise_multiplier: Any,
) -> tuple[Any, jax.Array]:  # fmt: skip
    """The private gradient sum: the reduced clipped sum plus ONE draw of N(0, (sigma C)^2 I)
    (``trainers.dpsgd.add_noise``), not one per device. Returns (noisy sum, loss sum)."""
    summed, loss = clipped_sum_sharded(clipped_sum, mesh, params, x, y, mask, clip_norm)
    return dpsgd.add_noise(summed, key, noise_multiplier, clip_norm), loss


def make_step(
    clipped_sum: Callable, optimizer: optax.GradientTransformation, mesh: Mesh
) -> Callable:
    """A jitted data-parallel DP-SGD step, the counterpart of ``trainers.train``'s ``_step``:

    ``step(params, opt_state, x, y, mask, key, step, clip_norm, sigma, expected_batch)``
    -> ``(params, opt_state, loss sum)``: noise keyed by ``fold_in(key, step)``, the noisy sum
    divided by the expected (public) batch size, the optimiser update. ``x, y, mask`` should be
    sharded with :func:`shard_batch`; params and optimiser state stay replicated."""

    @jax.jit
    def step(params, opt_state, x, y, mask, key, step, clip_norm, sigma, expected_batch):
        noisy, loss = noisy_sum_sharded(
            clipped_sum, mesh, params, x, y, mask, jax.random.fold_in(key, step), clip_norm, sigma
        )
        grads = jax.tree_util.tree_map(lambda g: g / expected_batch, noisy)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def sharded_clipped_sum(clipped_sum: Callable, mesh: Mesh) -> Callable:
    """``clipped_sum`` (``(params, x, y, mask, clip_norm) -> (sum, loss sum, norms)``) computed
    over ``mesh``: same signature, the batch split across the devices inside, the sums reduced,
    the per-example norms sharded as the batch (the training loop counts the non-finite ones)."""

    def fn(params, x, y, mask, clip_norm):
        return _sharded_sum(clipped_sum, mesh, params, x, y, mask, clip_norm)

    return fn


_MESH: contextvars.ContextVar[Mesh | None] = contextvars.ContextVar("dptune_mesh", default=None)


@contextlib.contextmanager
def data_parallel(mesh: Mesh) -> Iterator[Mesh]:
    """Within this block (this thread/context), ``trainers.loop`` trains each candidate
    data-parallel over ``mesh`` (a 1-D mesh with axis ``"data"``, e.g. :func:`data_mesh`)."""
    if AXIS not in mesh.axis_names:
        raise ValueError(f"the mesh needs an axis named {AXIS!r}, got {mesh.axis_names}")
    token = _MESH.set(mesh)
    try:
        yield mesh
    finally:
        _MESH.reset(token)


def current_mesh() -> Mesh | None:
    """The mesh set by :func:`data_parallel`, or None (train on the default device)."""
    return _MESH.get()


def naive_clipped_sum(apply_fn: Callable) -> Callable:
    """``trainers.dpsgd.clipped_sum_naive`` bound to a model (works for every model)."""
    return functools.partial(dpsgd.clipped_sum_naive, apply_fn)


__all__ = [
    "AXIS",
    "clipped_sum_sharded",
    "current_mesh",
    "data_mesh",
    "data_parallel",
    "make_step",
    "naive_clipped_sum",
    "noisy_sum_sharded",
    "shard_batch",
    "sharded_clipped_sum",
]
