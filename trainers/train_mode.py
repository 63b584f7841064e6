"""How a user's module is called at training and at evaluation time, and its per-example dropout.

Convention: a module whose ``__call__`` has a ``train`` keyword is called with ``train=True``
while it trains and ``train=False`` otherwise (initialisation, validation, test, release); one
with a ``deterministic`` keyword (Flax's own spelling) with ``deterministic=False`` / ``True``.
A module with neither is called as it is, always (deterministically).

At training time the module gets ``rngs={"dropout": key}``, one key per (candidate, step, chunk)
drawn from the candidate's secret key on a stream of its own, and every ``nn.Dropout`` call in
it draws its mask per example: row i's mask is Bernoulli(1 - rate) from
``fold_in(layer key, slot_i)``, where ``slot_i`` is the example's position in the chunk (with K
augmented copies, ``i K + j`` for copy j). So an example's mask depends on the step, the chunk,
its slot and the layer, never on another example: removing one example (masking its slot) leaves
every other example's forward pass, and so its gradient, unchanged, and the clipped sum moves by
at most C. (When removing a record shifts the others to other slots, the slots' masks are i.i.d.
draws from a secret key, independent of the data, so each record's mask can be coupled across
the two datasets: the same bound.) The ghost path and ``vmap(grad)`` both run each example on
its own (under ``vmap``) with its slots, so they draw the same masks and give the same clipped
sums; :meth:`TrainingCall.apply` (a whole batch, slots 0..rows-1) draws them too.

Other code that calls ``make_rng("dropout")`` itself (e.g. the attention-weight dropout of
``nn.MultiHeadDotProductAttention``) gets keys per (step, chunk, layer): on both clipping paths
every example of a chunk draws the same values (in a batched call, one row per example). Neither
depends on any example's data.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

#: ``fold_in`` constant that separates the dropout stream from the noise (``fold_in(key, step)``)
#: and augmentation (0x41554755) streams of a candidate's key ("DROP").
DROPOUT_STREAM = 0x44524F50

#: The call keywords dptune recognises, with their value at (training, evaluation).
CALL_KEYWORDS = {"train": (True, False), "deterministic": (False, True)}


def unwrapped(module: Any) -> Any:
    """The module a wrapper that forwards its call and keywords unchanged (``forwards_call``
    set on its class, e.g. ``dptune.fix_model``'s linen wrapper) calls: what names it and
    whose ``__call__`` keywords count."""
    while getattr(type(module), "forwards_call", False):
        module = module.inner
    return module


def call_keyword(module: Any) -> str | None:
    """ "train" or "deterministic" when ``module.__call__`` (a forwarding wrapper's inner
    module's) takes that keyword, else None."""
    try:
        params = inspect.signature(type(unwrapped(module)).__call__).parameters
    except (TypeError, ValueError):
        return None
    for kw in CALL_KEYWORDS:
        p = params.get(kw)
        if p is not None and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD):
            return kw
    return None


#: ``fold_in`` constant of the ``nnx.Rngs`` passed to an NNX module that takes ``rngs`` at call
#: time ("RNGS"): apart from the module's own streams, reseeded with ``fold_in(key, i)``.
CALL_RNGS_STREAM = 0x52474E53


def takes_rngs(module: Any) -> bool:
    """Whether an NNX module's ``__call__`` has an ``rngs`` parameter (Flax's ``examples/mnist``
    CNN: ``__call__(self, x, rngs)``, handing it to ``nnx.Dropout`` layers built without one)."""
    try:
        p = inspect.signature(type(module).__call__).parameters.get("rngs")
    except (TypeError, ValueError):
        return False
    return p is not None and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)


def call_rngs(key: jax.Array | None) -> Any:
    """The ``rngs`` an NNX module taking them at call time gets: seeded from the chunk's secret
    dropout ``key`` at training time (each call draws the stream's next key, so each dropout
    layer its own), a fixed seed at evaluation (``key`` None: evaluation mode turns dropout off;
    anything else drawing from it is deterministic and independent of the data)."""
    from flax import nnx  # lazy: flax.nnx is only imported for an NNX model

    if key is None:
        return nnx.Rngs(0)
    return nnx.Rngs(jax.random.fold_in(key, CALL_RNGS_STREAM))


def call_kwargs(keyword: str | None, train: bool) -> dict[str, bool]:
    """The keyword arguments of a training (``train``) or an evaluation call."""
    if keyword is None:
        return {}
    return {keyword: CALL_KEYWORDS[keyword][0 if train else 1]}


def dropout_key(key: jax.Array, step: Any, chunk: Any) -> jax.Array:
    """The root dropout key of one chunk of one step, from a candidate's secret key."""
    stream = jax.random.fold_in(key, DROPOUT_STREAM)
    return jax.random.fold_in(jax.random.fold_in(stream, step), chunk)


@contextlib.contextmanager
def per_example_dropout(slots: jax.Array):
    """Within this context, ``nn.Dropout`` layers (called on arrays whose leading axis has
    ``len(slots)`` rows, i.e. one row per example or copy) draw row r's mask from
    ``fold_in(make_rng(rng_collection), slots[r])``. Calls with an explicit ``rng``, a
    broadcast over the leading axis or another leading size keep Flax's own draw (one key for
    the whole array: still independent of the data)."""

    def interceptor(next_fun, args, kwargs, context):
        m = context.module
        if not isinstance(m, nn.Dropout) or context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        bound = dict(zip(("inputs", "deterministic", "rng"), args, strict=False), **kwargs)
        inputs = bound["inputs"]
        det = nn.merge_param("deterministic", m.deterministic, bound.get("deterministic"))
        dims = {d % max(1, jnp.ndim(inputs)) for d in m.broadcast_dims}
        if (
            det
            or m.rate == 0.0
            or m.rate == 1.0
            or bound.get("rng") is not None
            or jnp.ndim(inputs) == 0
            or inputs.shape[0] != slots.shape[0]
            or 0 in dims
        ):
            return next_fun(*args, **kwargs)
        return slot_dropout(inputs, slots, m.make_rng(m.rng_collection), m.rate, dims)

    with nn.intercept_methods(interceptor):
        yield


def slot_dropout(
    inputs: jax.Array, slots: jax.Array, layer_key: jax.Array, rate: float, dims: set[int]
) -> jax.Array:
    """Inverted dropout of ``inputs`` (rows, ...) with row r's mask Bernoulli(1 - ``rate``) from
    ``fold_in(layer_key, slots[r])``, shared along the broadcast axes ``dims`` (never 0); kept
    values are scaled by 1 / (1 - rate)."""
    keep = 1.0 - rate
    row = tuple(1 if d + 1 in dims else n for d, n in enumerate(inputs.shape[1:]))
    mask = jax.vmap(lambda s: jax.random.bernoulli(jax.random.fold_in(layer_key, s), keep, row))(
        slots
    )
    mask = jnp.broadcast_to(mask, inputs.shape)
    return jax.lax.select(mask, inputs / keep, jnp.zeros_like(inputs))


class TrainingCall:
    """A spec's module in training mode with a fixed root dropout key, shaped like a module for
    the clipping paths: ``apply(variables, x)`` runs the batch with slots 0..rows-1, and
    ``apply_slots(variables, x, slots)`` with given slots (one example of a ``vmap(grad)``)."""

    def __init__(self, spec: Any, rng: jax.Array):
        self.spec = spec
        self.rng = rng

    def apply_slots(self, variables: dict, x: jax.Array, slots: jax.Array) -> Any:
        spec = self.spec
        if not isinstance(spec.module, nn.Module):  # an NNX model: its own per-example dropout
            return spec.module.apply_training(variables, spec.model_input(x), self.rng, slots)
        with per_example_dropout(slots):
            return spec.module.apply(
                variables, spec.model_input(x), rngs={"dropout": self.rng},
                **call_kwargs(spec.call_keyword, True),
            )  # fmt: skip

    def apply(self, variables: dict, x: jax.Array) -> Any:
        return self.apply_slots(variables, x, jnp.arange(x.shape[0], dtype=jnp.int32))

    def apply_recording(
        self, params: Any, x: jax.Array, recorder: Any, slots: jax.Array | None = None
    ) -> Any:
        """:meth:`apply_slots` (slots 0..rows-1 when None) with every known layer's call handed
        to ``recorder`` (a ``trainers.ghost`` recorder): the ghost path's forward pass."""
        if slots is None:
            slots = jnp.arange(x.shape[0], dtype=jnp.int32)
        if not isinstance(self.spec.module, nn.Module):  # an NNX model: its layers record
            return self.spec.module.apply_recording(
                params, self.spec.model_input(x), recorder, rng=self.rng, slots=slots
            )
        with nn.intercept_methods(recorder):
            return self.apply_slots({"params": params}, x, slots)
