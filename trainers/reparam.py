"""How a layer that reads its parameters through a data-independent map declares the known
layer it computes (``trainers.ghost`` forms its per-example norms): its own module, so that
``trainers.models`` and ``trainers.nnx_model`` (which ``models`` imports) both read it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn


@dataclasses.dataclass(frozen=True)
class Reparametrized:
    """How a layer that reads its parameters through a data-independent map computes its output:
    ``layer`` (an unbound ``nn.Dense`` / ``nn.Conv``, a known layer) applied to
    ``transform(raw)``, where ``raw`` is the layer's own parameter subtree (what is trained and
    clipped) and ``transform(raw)`` is ``layer``'s parameter subtree (e.g. ``{"kernel": ...}``).

    A module declares this with a method ``as_known_layer(self) -> Reparametrized`` (see
    ``trainers.ghost.REPARAM_METHOD``; ``trainers.models.WSConv``, the weight-standardised
    convolution, is one); its ``__call__(x)`` must then equal
    ``layer.apply({"params": transform(raw)}, x)`` (its axes permuted by ``out_permutation``
    when that is set), which ``trainers.ghost.analyze`` checks on a synthetic batch.
    ``transform`` must be a pure function of the parameters (no data, no module state: it is
    called after the module's ``apply``); its VJP is applied to every example's gradient, so a
    hand-written VJP (``jax.custom_vjp``) can pay off
    (``trainers.models.standardize_kernel_fast_vjp``).

    Example i's gradient with respect to ``raw`` is the transform's transposed Jacobian (VJP)
    applied to its gradient with respect to the layer's parameters; norms are of the former,
    the gradient of the actual parameters.
    """

    layer: nn.Module
    transform: Callable[[Any], Any]
    #: The kernel's axes in ``layer``'s order when the map only permutes them (``transform(raw)``
    #: is ``{**raw, "kernel": jnp.transpose(raw["kernel"], permutation)}``, e.g. an NNX einsum
    #: whose kernel holds the output axes before the contracted one): ``trainers.ghost`` then
    #: uses the permutation itself, forms the norms as ``layer``'s (a permutation keeps every
    #: norm) and transposes the clipped sum back, with no per-example gradient of ``raw``.
    permutation: tuple[int, ...] | None = None
    #: The module's output is ``layer``'s with its axes permuted, ``jnp.transpose(y,
    #: out_permutation)`` (e.g. an NNX einsum that puts an added axis before the batch axes,
    #: ``"BTD,CKDH->CBTKH"``); ``trainers.ghost`` taps ``y`` itself, so the output gradients it
    #: records are ``layer``'s, batch first. None: the output is ``layer``'s as it is.
    out_permutation: tuple[int, ...] | None = None
