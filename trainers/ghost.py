"""Per-example clipping for any Flax (linen) module built from known layers: ghost norms and
book-keeping clipped sums, without per-example gradients where they are not needed.

One batched forward and one backward pass give, for every call of a parametrised layer, its
input ``a`` (per example: T positions x d_in) and the gradient ``g`` of the summed loss with
respect to its output (T x d_out). A zero "tap" is added to each layer's output; the gradient
with respect to the taps is ``g`` (``nn.intercept_methods`` wraps the layers' calls, so the
user's module is used as written). Example i's parameter gradient is a function of ``(a_i, g_i)``
alone:

* ``nn.Dense`` / ``nn.DenseGeneral`` (on vectors or sequences, hence attention built from them,
  e.g. ``nn.MultiHeadDotProductAttention``) and ``nn.Conv`` (after im2col: T output positions,
  d_in = kernel volume x input channels): ``G_i = A_iᵀ G'_i``. Its squared norm is
  ``‖a_i‖²‖g_i‖²`` when T = 1 (Goodfellow 2015), else either ``<A_i A_iᵀ, G'_i G'_iᵀ>`` (ghost
  norm, O(T²(d_in + d_out)); Li, Tramèr, Liang & Hashimoto 2022) or ``‖G_i‖²`` of the
  materialised per-example gradient (O(T d_in d_out)), chosen per layer (:func:`matmul_form`;
  Bu, Mao & Xu 2022, "mixed ghost clipping"). Dense layers that read one traced input (an
  attention's query, key and value projections) share that input's per-example Gram matrix.
* ``nn.Embed`` (token ids t_1..t_T): ``‖G_i‖² = Σ_{s,s'} [t_s = t_s'] <g_s, g_s'>`` (ghost); its
  ``attend`` (a tied output layer, logits ``q @ table.T``) as a Dense layer on the transposed
  table, plus the cross term of the two uses (:func:`_embed_terms`).
* ``nn.LayerNorm`` / ``nn.GroupNorm`` / ``nn.RMSNorm`` scale and bias: per-example gradients are
  sums over positions of ``g * x̂`` and ``g``, formed directly.
* A module that declares itself a Dense/conv on a data-independent map of its own parameters
  (:class:`Reparametrized`, e.g. the weight-standardised ``trainers.models.WSConv``): example i's
  gradient with respect to its parameters is the map's VJP applied to the known layer's
  ``G_i``; the norms are those of the actual parameters' gradients, the clipped sum is the VJP
  of the book-keeping sum (the VJP is linear and the same for every example).

With the clip factors ``c_i = min(1, C / ‖G_i‖)`` known, every layer's clipped sum is one more
contraction (``Σ_i c_i A_iᵀ G'_i = (c A)ᵀ G'``, or ``Σ_i c_i G_i`` of the materialised gradients):
book-keeping (Bu, Wang, Zha & Karypis 2023), no second backward pass. A layer shared between calls
(the same module called twice) has its calls' positions concatenated. Small-window max-pools
(``nn.max_pool``) are evaluated as maxima of slices with XLA's first-maximum gradient
(:func:`with_fast_pools`): the same values and gradients, without XLA CPU's slow select-and-scatter.

Whether a module can take this path is decided by :func:`analyze` before anything trains, from the
module and the input's shape alone (never from data): every parameter must be read only by a known
layer's ``__call__`` (checked on the traced program: the module's own parameter inputs must be
unused when the known layers read theirs from a separate copy), and every recorded input and output
gradient must have one leading row per example that depends on that example alone (checked on a
synthetic probe batch). Anything else takes the generic path (``vmap(grad)``,
``trainers.dpsgd.clipped_sum_naive``), which is always correct.

Shapes: x (b, ...) any dtype, y (b,) labels, mask (b,) float32 in {0, 1}; with ``copies`` x is (b,
K, ...) and example i's loss is the mean over its K copies. The clipped sum has the parameters'
pytree structure; masked examples contribute exactly zero.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from flax.linen.dtypes import promote_dtype as _flax_promote_dtype
from jax.extend.core import Literal

from trainers import models
from trainers.dpsgd import clip_factors, im2col_s2d, keep_rows, kept_loss_sum, kernel_from_s2d
from trainers.models import Reparametrized

#: Layer types with a per-example gradient formula here (exact types: a subclass may change the
#: computation, so it is treated as unknown).
KNOWN_LAYERS: dict[type, str] = {
    nn.Dense: "dense",
    nn.DenseGeneral: "dense",
    nn.Conv: "conv",
    nn.Embed: "embed",
    nn.LayerNorm: "norm",
    nn.GroupNorm: "norm",
    nn.RMSNorm: "norm",
}


class GhostUnsupported(Exception):
    """The module cannot take the ghost path; the message says why (a layer path and a reason)."""


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call of a known layer: where its parameters live, how to treat it, and the unbound
    layer (its attributes)."""

    path: tuple[str, ...]
    kind: str
    layer: nn.Module
    reparam: Reparametrized | None = None
    #: index of the first recorded call whose recorded input is this call's input (the same
    #: traced value, e.g. an attention's query, key and value projections of one sequence)
    source: int = -1
    #: the layer's one parameter name (e.g. "kernel") when ``path`` names that parameter's array
    #: rather than a dict of parameters (an ``nnx.LoRA`` factor, ``lora_a``, read as a Dense
    #: kernel: ``trainers.nnx_model``)
    leaf: str | None = None
    #: the layer's method: "__call__", or "attend" for an embedding's tied output projection
    #: (logits ``query @ table.T``)
    method: str = "__call__"


#: The method by which a module declares itself a known layer on reparametrised parameters.
REPARAM_METHOD = "as_known_layer"


class _Recorder:
    """Method interceptor: runs each known layer's ``__call__`` on parameters read from
    ``params`` (a separate copy), records its input, and adds the next tap to its output."""

    def __init__(self, params: Any, taps: list | None = None, frozen: Callable | None = None):
        self.params = params
        self.taps = taps
        # frozen(layer path) -> bool: a frozen layer's call runs as written (its parameters get
        # no gradient, so nothing is recorded for it and no tap is added).
        self.frozen = frozen
        self.calls: list[_Call] = []
        self.inputs: list[jax.Array] = []
        self.outputs: list[jax.Array] = []
        self.unsupported: list[str] = []
        #: layer path -> why its parameters would be read outside a known layer's call, where
        #: the model can tell (``trainers.nnx_model``: an NNX module's class), for the plan's
        #: reason
        self.notes: dict[tuple[str, ...], str] = {}
        self._inside = False

    def __call__(self, next_fun, args, kwargs, context):
        m = context.module
        if self._inside or context.method_name == "setup":
            return next_fun(*args, **kwargs)
        if self.frozen is not None and m.scope is not None and self.frozen(tuple(m.path)):
            return next_fun(*args, **kwargs)
        if callable(getattr(type(m), REPARAM_METHOD, None)):
            return self._reparametrized(next_fun, args, kwargs, context)
        kind = KNOWN_LAYERS.get(type(m))
        if kind is None:
            return next_fun(*args, **kwargs)
        # an NNX layer's linen twin is unbound: its path comes with the call (trainers.nnx_model)
        path = tuple(getattr(context, "path", None) or m.path)
        method = context.method_name
        if method != "__call__" and (kind, method) != ("embed", "attend"):
            self.unsupported.append(f"{'/'.join(path)}: method {method!r}")
            return next_fun(*args, **kwargs)
        if len(args) != 1 or kwargs:
            self.unsupported.append(f"{'/'.join(path)}: called with extra arguments")
            return next_fun(*args, **kwargs)
        why = _layer_unsupported(kind, m, args[0])
        if why:
            self.unsupported.append(f"{'/'.join(path)}: {why}")
            return next_fun(*args, **kwargs)
        leaf = getattr(context, "leaf", None)
        layer_params = _params_at(self.params, path, leaf)
        if not layer_params:  # e.g. a LayerNorm without scale and bias: nothing to clip
            return next_fun(*args, **kwargs)
        x = args[0]
        layer = m.clone(parent=None)
        self._inside = True
        try:
            if kind == "norm":
                off = {"use_scale": False}
                if hasattr(layer, "use_bias"):
                    off["use_bias"] = False
                xhat = layer.clone(**off).apply({}, x)
                y = xhat
                if "scale" in layer_params:
                    y = y * layer_params["scale"]
                if "bias" in layer_params:
                    y = y + layer_params["bias"]
                y = y.astype(xhat.dtype)
                recorded = xhat
            else:
                y = layer.apply({"params": layer_params}, x, method=method)
                recorded = x
        finally:
            self._inside = False
        if self.taps is not None:
            y = y + self.taps[len(self.calls)]
        source = self._source(recorded)
        self.calls.append(_Call(path, kind, layer, source=source, leaf=leaf, method=method))
        self.inputs.append(recorded)
        self.outputs.append(y)
        return y

    def _source(self, recorded: jax.Array) -> int:
        """The first recorded call whose input is ``recorded`` (the same traced value, by
        identity), else the call about to be recorded: Dense layers share a Gram only when their
        sources agree."""
        return next((i for i, v in enumerate(self.inputs) if v is recorded), len(self.calls))

    def _reparametrized(self, next_fun, args, kwargs, context):
        """A module that declared itself a known layer on ``transform(raw)``
        (:class:`Reparametrized`): the known layer runs on the transformed copy of the recorder's
        raw parameters, so the backward pass reaches the raw parameters through the transform."""
        m = context.module
        # an NNX layer's linen twin is unbound: its path comes with the call (trainers.nnx_model)
        path = tuple(getattr(context, "path", None) or m.path)
        where = "/".join(path)
        if context.method_name != "__call__":
            if context.method_name != REPARAM_METHOD:
                self.unsupported.append(f"{where}: method {context.method_name!r}")
            return next_fun(*args, **kwargs)
        if len(args) != 1 or kwargs:
            self.unsupported.append(f"{where}: called with extra arguments")
            return next_fun(*args, **kwargs)
        self._inside = True
        try:
            rep = getattr(m, REPARAM_METHOD)()
        finally:
            self._inside = False
        kind = KNOWN_LAYERS.get(type(rep.layer)) if isinstance(rep, Reparametrized) else None
        if kind not in ("dense", "conv"):
            self.unsupported.append(
                f"{where}: {REPARAM_METHOD}() must return a Reparametrized nn.Dense or nn.Conv"
            )
            return next_fun(*args, **kwargs)
        x = args[0]
        why = _layer_unsupported(kind, rep.layer, x)
        if why:
            self.unsupported.append(f"{where}: {why}")
            return next_fun(*args, **kwargs)
        raw = _subtree(self.params, path)
        if not raw:
            self.unsupported.append(f"{where}: no parameters")
            return next_fun(*args, **kwargs)
        self._inside = True
        try:
            y = rep.layer.apply({"params": _known_params(rep, raw)}, x)
        finally:
            self._inside = False
        if self.taps is not None:
            y = y + self.taps[len(self.calls)]
        self.calls.append(_Call(path, kind, rep.layer, rep, source=self._source(x)))
        self.inputs.append(x)
        self.outputs.append(y)
        if rep.out_permutation is not None:
            # the tap (whose gradient is the recorded output gradient) is on the known layer's
            # own output, one leading row per example; the module reads it with its axes moved
            return jnp.transpose(y, rep.out_permutation)
        return y


def _layer_unsupported(kind: str, m: nn.Module, x: Any) -> str | None:
    """Why this call of a known layer has no formula here (None if it has one)."""
    if kind in ("dense", "conv", "embed") and m.promote_dtype is not _flax_promote_dtype:
        return "a custom promote_dtype"
    if kind == "dense" and (m.dot_general is not None or m.dot_general_cls is not None):
        return "a custom dot_general"
    if isinstance(m, nn.DenseGeneral):
        if m.batch_dims not in ((), None):
            return "batch_dims (parameters per batch entry)"
        axis = (m.axis,) if isinstance(m.axis, int) else tuple(m.axis)
        axis = tuple(a % x.ndim for a in axis)
        if axis != tuple(range(x.ndim - len(axis), x.ndim)):
            return f"axis={m.axis!r} (only trailing input axes, in order)"
    if kind == "conv":
        if m.conv_general_dilated is not None or m.conv_general_dilated_cls is not None:
            return "a custom conv_general_dilated"
        if m.feature_group_count != 1:
            return "feature_group_count != 1 (grouped convolution)"
        if m.mask is not None:
            return "a kernel mask"
        ks = (m.kernel_size,) if isinstance(m.kernel_size, int) else tuple(m.kernel_size)
        if x.ndim != len(ks) + 2:
            return f"input of rank {x.ndim} (one batch axis expected for a {len(ks)}-D conv)"
    if kind == "norm":
        if getattr(m, "axis_name", None) is not None:
            return "axis_name (statistics across devices mix examples)"
        fa = getattr(m, "feature_axes", -1)
        if fa not in (-1, (-1,)) and fa != (x.ndim - 1,) and fa != x.ndim - 1:
            return f"feature_axes={fa!r} (only the last axis is supported)"
    if kind == "embed" and m.num_embeddings == 1:
        return "num_embeddings == 1"
    return None


def _subtree(params: Any, path: tuple[str, ...]) -> Any:
    node = params
    for name in path:
        if not hasattr(node, "get") or name not in node:
            return None
        node = node[name]
    return node


def _params_at(params: Any, path: tuple[str, ...], leaf: str | None) -> Any:
    """A layer's parameters: the dict at ``path``, or ``{leaf: the array at path}``."""
    node = _subtree(params, path)
    return node if leaf is None or node is None else {leaf: node}


# --- per-layer per-example quantities ---------------------------------------------------------


def _as_rows(a: jax.Array, b: int, last: int) -> jax.Array:
    """(b * K, ..., last) or (b, ..., last) -> (b, positions, last)."""
    return a.reshape(b, -1, last)


def _conv_patches(
    layer: nn.Conv, x: jax.Array, allow_s2d: bool = True
) -> tuple[jax.Array, Callable]:
    """im2col of ``layer``'s input: (n, *spatial, c) -> (n, P, K * c), and the map from a
    (K * c, o) matrix in the patches' feature order to the layer's kernel shape.

    A square 2-D convolution whose kernel size is a multiple of its stride (> 1) uses
    space-to-depth plus contiguous slices (``trainers.dpsgd.im2col_s2d``, the layout of the
    hand-tuned cnn26k path, measured faster on XLA CPU than strided slices); otherwise strided
    slices, features ordered (kernel position row-major, input channel) like the kernel itself."""
    ks = (layer.kernel_size,) if isinstance(layer.kernel_size, int) else tuple(layer.kernel_size)
    nd = len(ks)

    def bcast(v):
        v = 1 if v is None else v
        return (v,) * nd if isinstance(v, int) else tuple(v)

    strides, in_dil, k_dil = (
        bcast(layer.strides),
        bcast(layer.input_dilation),
        bcast(layer.kernel_dilation),
    )
    padding = nn.linear.canonicalize_padding(layer.padding, nd)
    if padding in ("CIRCULAR", "REFLECT"):
        dilated = [(k - 1) * d + 1 for k, d in zip(ks, k_dil, strict=True)]
        pads = [(0, 0)] + [((k - 1) // 2, k // 2) for k in dilated] + [(0, 0)]
        x = jnp.pad(x, pads, mode={"CIRCULAR": "wrap", "REFLECT": "reflect"}[padding])
        padding = "VALID"
    elif padding == "CAUSAL":
        x = jnp.pad(x, [(0, 0), (k_dil[0] * (ks[0] - 1), 0), (0, 0)])
        padding = "VALID"
    n, c = x.shape[0], x.shape[-1]
    o = layer.features

    def as_kernel(flat):
        return flat.reshape(*ks, c, o)

    if any(d != 1 for d in in_dil):
        spatial = "".join("HWDXYZ"[i] for i in range(nd))
        dn = (f"N{spatial}C", f"{spatial}IO", f"N{spatial}C")
        p = jax.lax.conv_general_dilated_patches(
            x, ks, strides, padding, lhs_dilation=in_dil, rhs_dilation=k_dil,
            dimension_numbers=dn, precision=jax.lax.Precision.HIGHEST,
        )  # fmt: skip
        # features ordered (channel, kernel positions): reorder to (kernel positions, channel)
        k = int(np.prod(ks))
        return p.reshape(n, -1, c, k).swapaxes(-1, -2).reshape(n, -1, k * c), as_kernel
    in_spatial = x.shape[1:-1]
    dilated = tuple((k - 1) * d + 1 for k, d in zip(ks, k_dil, strict=True))
    if isinstance(padding, str):
        pads = jax.lax.padtype_to_pads(in_spatial, dilated, strides, padding)
    else:
        pads = padding
    pads = [tuple(int(v) for v in p) for p in pads]
    if (
        allow_s2d and nd == 2 and ks[0] == ks[1] and strides[0] == strides[1] > 1
        and ks[0] % strides[0] == 0 and k_dil == (1, 1)
        and in_spatial[0] == in_spatial[1] and pads[0] == pads[1]
    ):  # fmt: skip
        k, st = ks[0], strides[0]
        out_hw = (in_spatial[0] + sum(pads[0]) - k) // st + 1
        if (out_hw - 1) * st + k - pads[0][0] <= in_spatial[0] + pads[0][1]:
            return im2col_s2d(x, k, st, pads[0][0], out_hw), lambda flat: kernel_from_s2d(
                flat, k, st, c
            )
    x = jnp.pad(x, [(0, 0), *[tuple(p) for p in pads], (0, 0)])
    padded = x.shape[1:-1]
    out = tuple((p - d) // s + 1 for p, d, s in zip(padded, dilated, strides, strict=True))
    slices = []
    for offset in np.ndindex(*ks):
        start = (0, *(o * d for o, d in zip(offset, k_dil, strict=True)), 0)
        limit = (
            n,
            *(st + (o - 1) * s + 1 for st, o, s in zip(start[1:-1], out, strides, strict=True)),
            c,
        )
        slices.append(jax.lax.slice(x, start, limit, (1, *strides, 1)))
    return jnp.stack(slices, axis=-2).reshape(n, int(np.prod(out)), len(slices) * c), as_kernel


def _sq(a: jax.Array) -> jax.Array:
    return jnp.sum(a.reshape(a.shape[0], -1) ** 2, axis=1)


#: Largest materialised per-example gradient of one layer, in floats over a chunk (256 MiB in
#: float32): below it the per-example gradients are formed, above it ghost norms are used.
MATERIALISE_FLOATS = 2**26


def matmul_form(t: int, d_in: int, d_out: int, b: int = 1, kind: str = "conv") -> str:
    """How a Dense/conv layer's per-example norms are computed for T positions per example and b
    examples in a chunk: "rank1" (T = 1: ‖a‖²‖g‖²), "materialise" (form each example's gradient,
    O(T d_in d_out) per example, then the clipped sum is a cheap O(d_in d_out) weighted sum) or
    "ghost" (Gram matrices, O(T²(d_in + d_out)) per example, then the clipped sum is an
    O(T d_in d_out) contraction).

    A Dense (``kind="dense"``) on a sequence takes ghost norms whenever a Gram matrix is smaller
    than its gradient, T² < d_in d_out (Bu, Mao & Xu 2022, mixed ghost clipping): on XLA CPU the
    batched product that forms b gradients of d_in x d_out, and the transposed copy of them that
    the weighted sum reads, cost more than the Grams plus one unbatched contraction (a transformer
    LM's 128 x 512 MLP layer at T = 64, batch 64: 24 ms materialised against 10-14 ms ghost; its
    whole clipped sum 17% faster). A conv's im2col patches keep the rule measured for CNNs:
    counting both steps, materialising never costs more multiply-adds than ghost norms unless
    d_in d_out > T²(d_in + d_out), so it is used whenever its memory (b d_in d_out floats) fits
    ``MATERIALISE_FLOATS``; beyond that the form with the smaller per-example memory, T² against
    d_in d_out."""
    if t == 1:
        return "rank1"
    if kind == "dense" and t * t < d_in * d_out:
        return "ghost"
    if b * d_in * d_out <= MATERIALISE_FLOATS:
        return "materialise"
    return "ghost" if t * t < d_in * d_out else "materialise"


class _MatmulLayer:
    """Per-example gradient of ``A_iᵀ G'_i`` (+ bias ``Σ_t g``): squared norms now, the clipped sum
    once the clip factors are known; the form (rank-1, ghost or materialised) is chosen by cost."""

    def __init__(
        self, a: jax.Array, g: jax.Array, has_bias: bool, kind: str = "conv",
        input_grams: dict | None = None, input_key: Any = None,
    ):  # fmt: skip
        self.a, self.g, self.has_bias = a, g.astype(jnp.result_type(g, a)), has_bias
        self.a = self.a.astype(self.g.dtype)
        self.form = matmul_form(a.shape[1], a.shape[2], g.shape[2], a.shape[0], kind)
        # layers that read the same input (an attention's query, key and value) share its Gram
        self.input_grams = {} if input_grams is None else input_grams
        self.input_key = None if input_key is None else (input_key, a.shape, a.dtype)

    def sq_norms(self) -> jax.Array:
        a, g = self.a, self.g
        if self.form == "rank1":
            sq = jnp.sum(a[:, 0] ** 2, axis=1) * jnp.sum(g[:, 0] ** 2, axis=1)
        elif self.form == "ghost":
            gram = self.input_grams.get(self.input_key) if self.input_key is not None else None
            if gram is None:
                gram = jnp.einsum("bti,bsi->bts", a, a)
                if self.input_key is not None:
                    self.input_grams[self.input_key] = gram
            sq = jnp.sum(gram * jnp.einsum("bto,bso->bts", g, g), axis=(1, 2))
        else:
            # The larger of d_in and d_out as the minor axis of the per-example gradients:
            # with the gradient as the first operand (d_out major) a conv's patches took about
            # half the time on XLA CPU (cpu-dpsgd-performance note); with d_in major, a LoRA B
            # factor (d_in = rank 8, d_out 1024, T = 128) took 2.5 ms against 16 ms.
            self.w_io = a.shape[2] < g.shape[2]
            self.w = (
                jnp.einsum("bti,bto->bio", a, g) if self.w_io else jnp.einsum("bto,bti->boi", g, a)
            )
            sq = _sq(self.w)
        if self.has_bias:
            self.bias = jnp.sum(g, axis=1)
            sq = sq + _sq(self.bias)
        return sq

    def clipped(self, c: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """(kernel sum (d_in, d_out), bias sum (d_out,) or None)."""
        if self.form == "materialise":
            kernel = jnp.einsum("b,bio->io" if self.w_io else "b,boi->io", c, keep_rows(c, self.w))
        else:
            ca = keep_rows(c, self.a * c[:, None, None].astype(self.a.dtype))
            kernel = jnp.einsum("bti,bto->io", ca, keep_rows(c, self.g))
        bias = c @ keep_rows(c, self.bias) if self.has_bias else None
        return kernel, bias


def _matmul_rows(kind: str, calls: list[_Call], ins: list, gs: list, kernel_shape, b: int):
    """A Dense/conv layer's per-example factors over all its calls: ``a`` (b, T, d_in) (im2col
    patches for a conv), ``g`` (b, T, d_out), and the map from a (d_in, d_out) matrix in the
    patches' feature order to the kernel's shape."""
    layer = calls[0].layer
    ndim = len(kernel_shape)
    # output features: the last axis, or DenseGeneral's `features` axes
    n_out = (
        len(layer.features)
        if isinstance(layer, nn.DenseGeneral) and not isinstance(layer.features, int)
        else 1
    )
    d_out = int(np.prod(kernel_shape[ndim - n_out :]))

    def to_kernel(flat):
        return flat.reshape(kernel_shape)

    if kind == "conv":
        # one feature order for every call of a shared layer: space-to-depth for one call only
        unfolded = [
            _conv_patches(call.layer, a, allow_s2d=len(calls) == 1)
            for call, a in zip(calls, ins, strict=True)
        ]
        ins = [u[0] for u in unfolded]
        to_kernel = unfolded[0][1]
    d_in = int(np.prod(kernel_shape[: ndim - n_out]))
    a = jnp.concatenate([_as_rows(x, b, d_in) for x in ins], axis=1)
    g = jnp.concatenate([_as_rows(x, b, d_out) for x in gs], axis=1)
    return a, g, to_kernel


def _layer_terms(
    kind: str, calls: list[_Call], ins: list, gs: list, params: Any, b: int,
    input_grams: dict | None = None,
):  # fmt: skip
    """Squared per-example norms (b,) of one layer (all its calls) and a function from the clip
    factors to its clipped-sum subtree. ``input_grams``: the per-example Gram matrices of the
    Dense inputs seen so far, keyed by their calls' ``source`` (shared with later layers that
    read the same inputs)."""
    rep = calls[0].reparam
    if rep is not None and rep.permutation is not None:
        # a permutation keeps every norm: the known layer's terms, its clipped kernel permuted back
        sq, fin = _layer_terms(
            kind, [dataclasses.replace(c, reparam=None) for c in calls], ins, gs,
            _known_params(rep, params), b, input_grams,
        )  # fmt: skip
        back = tuple(int(i) for i in np.argsort(rep.permutation))

        def permuted_back(c):
            out = fin(c)
            return {**out, "kernel": jnp.transpose(out["kernel"], back)}

        return sq, permuted_back
    layer = calls[0].layer
    if calls[0].reparam is not None:
        return _reparam_terms(kind, calls, ins, gs, params, b)
    if kind in ("dense", "conv"):
        kernel = params["kernel"]
        a, g, to_kernel = _matmul_rows(kind, calls, ins, gs, kernel.shape, b)
        key = tuple(call.source for call in calls) if kind == "dense" else None
        mm = _MatmulLayer(a, g, "bias" in params, kind, input_grams, key)
        sq = mm.sq_norms()

        def clipped(c):
            k, bias = mm.clipped(c)
            out = {"kernel": to_kernel(k).astype(kernel.dtype)}
            if bias is not None:
                out["bias"] = bias.reshape(params["bias"].shape).astype(params["bias"].dtype)
            return out

        return sq, clipped
    if kind == "embed":
        return _embed_terms(calls, ins, gs, params["embedding"], b)
    # normalisation layers: elementwise scale and bias on the last axis
    d = gs[0].shape[-1]
    xhat = jnp.concatenate([_as_rows(x, b, d) for x in ins], axis=1)
    g = jnp.concatenate([_as_rows(x, b, d) for x in gs], axis=1)
    per = {}
    if "scale" in params:
        per["scale"] = jnp.sum(g * xhat, axis=1)
    if "bias" in params:
        per["bias"] = jnp.sum(g, axis=1)
    del layer
    sq = sum(_sq(v) for v in per.values())

    def clipped(c):
        return {k: (c @ keep_rows(c, v)).astype(params[k].dtype) for k, v in per.items()}

    return sq, clipped


def _embed_terms(calls: list[_Call], ins: list, gs: list, table: jax.Array, b: int):
    """An embedding table's squared per-example norms (b,) and clipped-sum function, over its
    lookups (token ids t_s, output gradients g_s: ``Σ_s e_{t_s} g_sᵀ``) and its ``attend``
    calls (a tied output projection: queries q_u, logit gradients h_u, ``Σ_u h_u q_uᵀ``).

    ``‖G_i‖² = Σ_{s,s'} [t_s = t_s'] <g_s, g_s'> + ‖Σ_u h_u q_uᵀ‖²
    + 2 Σ_{s,u} h_u[t_s] <g_s, q_u>``: the lookups' term (ghost), the projection's as a Dense
    layer's (rank-1, ghost or materialised, :class:`_MatmulLayer`) and the cross term of a table
    read both ways."""
    v, d = table.shape
    look = [i for i, call in enumerate(calls) if call.method == "__call__"]
    attend = [i for i, call in enumerate(calls) if call.method == "attend"]
    sq = jnp.zeros((b,), table.dtype)
    if look:
        ids = jnp.concatenate([ins[i].reshape(b, -1) for i in look], axis=1)  # (b, T)
        g = jnp.concatenate([_as_rows(gs[i], b, d) for i in look], axis=1).astype(table.dtype)
        same = ids[:, :, None] == ids[:, None, :]
        sq = sq + jnp.sum(jnp.where(same, jnp.einsum("bsd,btd->bst", g, g), 0.0), axis=(1, 2))
    if attend:
        q = jnp.concatenate([_as_rows(ins[i], b, d) for i in attend], axis=1)  # (b, U, d)
        h = jnp.concatenate([_as_rows(gs[i], b, v) for i in attend], axis=1)  # (b, U, v)
        mm = _MatmulLayer(q, h, False, "dense")  # the (d, v) kernel qᵀ h: the table transposed
        sq = sq + mm.sq_norms()
        if look:
            at_ids = jnp.take_along_axis(
                h, jnp.broadcast_to(ids[:, None, :], (b, h.shape[1], ids.shape[1])), axis=2
            )  # (b, U, T): h_u[t_s]
            gq = jnp.einsum("bsd,bud->bus", g, q.astype(g.dtype))
            sq = sq + 2 * jnp.sum(at_ids.astype(gq.dtype) * gq, axis=(1, 2))

    def clipped(c):
        out = jnp.zeros_like(table)
        if look:
            out = out.at[ids.reshape(-1)].add(keep_rows(c, g * c[:, None, None]).reshape(-1, d))
        if attend:
            out = out + mm.clipped(c)[0].T.astype(table.dtype)
        return {"embedding": out}

    return sq, clipped


def _known_params(rep: Reparametrized, raw: Any) -> Any:
    """The known layer's parameters: ``raw`` with its kernel's axes permuted when ``rep``
    declares a permutation (ghost's own transpose, so the norms and the forward pass cannot
    disagree), else ``rep.transform(raw)``."""
    if rep.permutation is None:
        return rep.transform(raw)
    return {**raw, "kernel": jnp.transpose(raw["kernel"], rep.permutation)}


def _reparam_terms(kind: str, calls: list[_Call], ins: list, gs: list, raw: Any, b: int):
    """Squared per-example norms (b,) and the clipped-sum function of a :class:`Reparametrized`
    layer, whose known layer reads ``transform(raw)``.

    Example i's gradient with respect to ``raw`` is ``vjp(G_i)``, the transform's VJP at ``raw``
    applied to its gradient ``G_i = A_iᵀ G'_i`` with respect to the transformed parameters. The
    norms need each ``vjp(G_i)`` (no Gram identity holds through a general transform), so
    ``G_i`` is formed from im2col patches, in blocks of examples whose patches and gradients
    hold at most about :data:`MATERIALISE_FLOATS` floats (nothing per example outlives its
    block). The VJP is linear and the same for every example, so the clipped sum is the layer's
    own batched VJP on its inputs with example i's output gradient scaled by ``c_i``
    (book-keeping: for a conv, XLA's weight gradient, no patches), through the transform."""
    rep = calls[0].reparam
    params, vjp = jax.vjp(rep.transform, raw)
    kernel = params["kernel"]
    has_bias = "bias" in params

    def layer_grads(kernel_rows, bias_rows):
        out = {"kernel": kernel_rows.astype(kernel.dtype)}
        if has_bias:
            out["bias"] = bias_rows.astype(params["bias"].dtype)
        return out

    def block_sq(lo: int, n: int) -> jax.Array:
        """Squared raw-gradient norms of examples lo..lo+n-1."""
        rows = [x.shape[0] // b for x in ins]  # K copies per example (1 without augmult)
        a, g, to_kernel = _matmul_rows(
            kind, calls, [x[lo * r : (lo + n) * r] for x, r in zip(ins, rows, strict=True)],
            [v[lo * r : (lo + n) * r] for v, r in zip(gs, rows, strict=True)], kernel.shape, n,
        )  # fmt: skip
        dtype = jnp.result_type(g, a)
        # (n, i, o), the kernel's own order: the transform's VJP then needs no transpose of the
        # per-example gradients (the transposes cost more than the einsum's slower operand order)
        w = jnp.einsum("bti,bto->bio", a.astype(dtype), g.astype(dtype))
        k = jax.vmap(to_kernel)(w)
        bias = jnp.sum(g, axis=1).reshape(n, *params["bias"].shape) if has_bias else None
        per = jax.vmap(lambda k_, b_: vjp(layer_grads(k_, b_))[0])(k, bias)
        return sum(_sq(v).astype(jnp.float32) for v in jax.tree_util.tree_leaves(per))

    d_in = int(np.prod(kernel.shape[:-1]))
    positions = sum(int(np.prod(v.shape[1:-1])) * (v.shape[0] // b) for v in gs)
    per_example = positions * d_in + 2 * kernel.size  # patches, gradient, its VJP
    per_block = max(1, min(b, MATERIALISE_FLOATS // per_example))
    sq = jnp.concatenate([block_sq(lo, min(per_block, b - lo)) for lo in range(0, b, per_block)])

    def clipped(c):
        kept_ins = [keep_rows(c, x) for x in ins]

        def outputs(r):
            p = rep.transform(r)
            return [rep.layer.apply({"params": p}, x) for x in kept_ins]

        cot = [
            keep_rows(c, (v.reshape(b, -1) * c[:, None].astype(v.dtype)).reshape(v.shape))
            for v in gs
        ]
        return jax.vjp(outputs, raw)[1](cot)[0]

    return sq, clipped


# --- max-pools with an elementwise gradient ----------------------------------------------------


@functools.cache
def _slice_pool(window: tuple, strides: tuple, padding: tuple) -> Callable:
    """``reduce_window`` max as the maximum of strided slices, with a custom gradient that goes to
    the first maximal element of each window in row-major order (XLA's select-and-scatter rule), so
    its values and gradients are those of ``nn.max_pool``. On XLA CPU the select-and-scatter
    gradient of a small-window max took most of a DP step (``cpu-dpsgd-performance`` note); this
    gradient is a few elementwise selects and pads."""
    offsets = list(np.ndindex(*window))

    def padded(x):
        return jnp.pad(x, padding, constant_values=-jnp.inf)

    def windows(xp, out_shape):
        for off in offsets:
            limit = tuple(
                o + (n - 1) * s + 1 for o, n, s in zip(off, out_shape, strides, strict=True)
            )
            yield off, jax.lax.slice(xp, off, limit, strides)

    def out_shape_of(x):
        size = [n + lo + hi for n, (lo, hi) in zip(x.shape, padding, strict=True)]
        return tuple((p - w) // s + 1 for p, w, s in zip(size, window, strides, strict=True))

    @jax.custom_vjp
    def pool(x):
        y = None
        for _, part in windows(padded(x), out_shape_of(x)):
            y = part if y is None else jnp.maximum(y, part)
        return y

    def fwd(x):
        y = pool(x)
        return y, (x, y)

    def bwd(res, g):
        x, y = res
        xp = padded(x)
        taken = jnp.zeros(y.shape, bool)
        grad = jnp.zeros(xp.shape, g.dtype)
        for off, part in windows(xp, y.shape):
            hit = (part == y) & ~taken
            taken = taken | hit
            pads = [
                (o, p - o - (n - 1) * s - 1, s - 1)
                for o, p, n, s in zip(off, xp.shape, y.shape, strides, strict=True)
            ]
            grad = grad + jax.lax.pad(jnp.where(hit, g, 0).astype(g.dtype), 0.0, pads)
        inner = tuple(slice(lo, lo + n) for (lo, _), n in zip(padding, x.shape, strict=True))
        return (grad[inner],)

    pool.defvjp(fwd, bwd)
    return pool


def _fast_pool_eqn(eqn) -> Callable | None:
    """The slice form for a ``reduce_window_max`` equation it covers (float, no dilation)."""
    if eqn.primitive.name != "reduce_window_max":
        return None
    p = eqn.params
    if any(d != 1 for d in (*p["base_dilation"], *p["window_dilation"])):
        return None
    if not jnp.issubdtype(eqn.invars[0].aval.dtype, jnp.floating):
        return None
    if int(np.prod(p["window_dimensions"])) > 16:  # large windows: keep XLA's reduction
        return None
    return _slice_pool(
        tuple(p["window_dimensions"]), tuple(p["window_strides"]),
        tuple(tuple(q) for q in p["padding"]),
    )  # fmt: skip


def _eval_with_fast_pools(jaxpr, consts, *args) -> list:
    """``jax.core.eval_jaxpr`` with :func:`_slice_pool` for the max-pools (also inside nested
    ``jit`` calls); every other equation is bound as it was traced."""
    env: dict = {}

    def read(v):
        return v.val if isinstance(v, Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = c
    for v, a in zip(jaxpr.invars, args, strict=True):
        env[v] = a
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        fast = _fast_pool_eqn(eqn)
        if fast is not None:
            outvals = [fast(invals[0])]
        elif eqn.primitive.name in ("pjit", "jit") and _has_pool(eqn.params["jaxpr"].jaxpr):
            inner = eqn.params["jaxpr"]
            outvals = _eval_with_fast_pools(inner.jaxpr, inner.consts, *invals)
        else:
            with eqn.ctx.manager:
                ans = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
            outvals = ans if eqn.primitive.multiple_results else [ans]
        for v, val in zip(eqn.outvars, outvals, strict=True):
            env[v] = val
    return [read(v) for v in jaxpr.outvars]


def _has_pool(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if _fast_pool_eqn(eqn) is not None:
            return True
        if eqn.primitive.name in ("pjit", "jit") and _has_pool(eqn.params["jaxpr"].jaxpr):
            return True
    return False


def with_fast_pools(fun: Callable) -> Callable:
    """``fun`` with its small-window max-pools (``nn.max_pool``) computed by :func:`_slice_pool`:
    the same values and gradients, a faster backward pass on XLA CPU."""

    def run(*args):
        closed, shapes = jax.make_jaxpr(fun, return_shape=True)(*args)
        if not _has_pool(closed.jaxpr):
            return fun(*args)
        out = _eval_with_fast_pools(closed.jaxpr, closed.consts, *jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shapes), out)

    return run


# --- analysis and the clipped sum -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GhostPlan:
    """The outcome of :func:`analyze` for one module and input shape: ``reason`` is None when the
    ghost path applies, else why not (a layer path and what is unknown about it). ``layers``:
    (path, kind, number of calls) of every known layer, for reports."""

    reason: str | None
    layers: tuple[tuple[tuple[str, ...], str, int], ...] = ()

    @property
    def supported(self) -> bool:
        return self.reason is None


def _apply_recording(
    module: Any, params: Any, x: jax.Array, rec: _Recorder, slots: jax.Array | None = None
) -> Any:
    """``module`` applied to ``x`` with ``params``, its known layers' calls handed to ``rec``.

    ``module``: a linen Module (applied as it is), or anything with ``apply_recording(params, x,
    rec)``: a ``trainers.models.ModelSpec`` (its module as training calls it: a dict input
    unpacked, evaluation mode), a ``trainers.nnx_model.NnxModel``, or a
    ``trainers.train_mode.TrainingCall`` (training mode), which also takes ``slots`` (the
    examples' positions in their chunk, which key their dropout masks)."""
    if isinstance(module, nn.Module):
        with nn.intercept_methods(rec):
            return module.apply({"params": params}, x)
    if slots is None:
        return module.apply_recording(params, x, rec)
    return module.apply_recording(params, x, rec, slots=slots)


def _has_boxes(params: Any) -> bool:
    leaves = jax.tree_util.tree_leaves(params, is_leaf=nn.meta.is_axis_metadata)
    return any(isinstance(v, nn.meta.AxisMetadata) for v in leaves)


def unboxed(params: Any) -> Any:
    """``params`` with partitioning metadata (``nn.Partitioned``, ``nn.LogicallyPartitioned``)
    removed: the arrays the formulas read."""
    return nn.meta.unbox(params) if _has_boxes(params) else params


def _record(
    module: Any, params: Any, x: jax.Array, taps: list | None = None,
    frozen: Callable | None = None, slots: jax.Array | None = None,
):  # fmt: skip
    """Runs ``module`` (see :func:`_apply_recording`) with the known layers intercepted; returns
    (output, recorder). The module's own parameter argument is ``params`` too (its known layers
    read the recorder's copy); layers for which ``frozen(path)`` holds are run as written,
    unrecorded."""
    rec = _Recorder(params, taps, frozen)
    out = _apply_recording(module, params, x, rec, slots)
    return out, rec


def analyze(
    module: Any,
    params: Any,
    x_example: jax.ShapeDtypeStruct | jax.Array,
    loss_fn: Callable,
    y_example: jax.ShapeDtypeStruct | jax.Array,
    probe: bool = True,
    trainable: Any = None,
) -> GhostPlan:
    """Decides whether ``module`` (a linen Module, or a model as :func:`_apply_recording` takes
    it) can take the ghost path for inputs shaped like ``x_example`` (leading axis: examples);
    ``y_example``: labels of any shape and dtype (leading axis: examples). Data-independent: it
    traces the program and runs it once on a synthetic batch (random inputs, label 0), never on
    the user's data.

    Checks, in order: every known-layer call has a formula (:data:`KNOWN_LAYERS`, supported
    attributes); the module reads no parameter outside those calls (its parameter inputs are
    unused in the traced program when the known layers read a separate copy); the module's
    batched output, and each recorded layer input and output gradient as
    :func:`clipped_sum_ghost` computes them, have rows that move only with their own example (a
    synthetic batch of 3, every position replaced in turn, at ``params`` and at random draws
    around them, ``trainers.models.probe_parameter_draws``; ``probe=False`` skips this check,
    which compiles the forward and backward pass once: for tests of the formulas only); layers
    that declare a reparametrisation (:class:`Reparametrized`) compute, as declared, the module's
    own output (the same synthetic batch, random parameters; skipped with ``probe=False`` too).

    The clipped sum runs every example as a batch of its own under ``vmap``, so its rows are per
    example by construction, whatever the parameters; the probe of the batched output keeps a
    module that mixes examples (at the probed parameters) on ``vmap(grad)``, whose per-example
    gradients are those of the same per-example function.

    ``trainable``: None, or a pytree of Python bools shaped like ``params`` (a model with frozen
    parameters, ``trainers.finetune``): only trainable parameters need a known layer; a frozen
    layer's calls are not recorded (any computation may read frozen parameters); a layer whose
    parameters are partly trainable is refused.
    """
    x_shape = tuple(x_example.shape[1:])
    x_dtype = x_example.dtype
    params = unboxed(params)
    try:
        abstract = jax.tree_util.tree_map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
        # one example as a batch of its own: how clipped_sum_ghost runs the module (under vmap)
        xs = jax.ShapeDtypeStruct((1, *x_shape), x_dtype)

        frozen = None
        if trainable is not None:
            frozen, why = frozen_layers(params, trainable)
            if why:
                return GhostPlan(why)

        def forward(outer, inner, x):
            rec = _Recorder(inner, frozen=frozen)
            out = _apply_recording(module, outer, x, rec)
            forward.rec = rec
            return out

        closed = jax.make_jaxpr(forward)(abstract, abstract, xs)
        rec = forward.rec
        if rec.unsupported:
            return GhostPlan(f"unsupported layer call {rec.unsupported[0]}")
        n_outer = len(jax.tree_util.tree_leaves(abstract))
        outer_vars = {id(v): i for i, v in enumerate(closed.jaxpr.invars[:n_outer])}
        used = set()
        for eqn in closed.jaxpr.eqns:
            used.update(id(v) for v in eqn.invars)
        used.update(id(v) for v in closed.jaxpr.outvars)
        keypaths = [k for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
        trains = [True] * len(keypaths)
        if trainable is not None:
            trains = jax.tree_util.tree_leaves(trainable)
        read = sorted(i for vid, i in outer_vars.items() if vid in used and trains[i])
        if read:
            return GhostPlan(_read_outside([keypaths[i] for i in read], rec.notes))
        layers: dict[tuple[str, ...], list] = {}
        for call in rec.calls:
            layers.setdefault(call.path, [call.kind, 0])[1] += 1
        summary = tuple((p, k, n) for p, (k, n) in layers.items())
        # The probes compare two computations of the same function at float32 rounding: their
        # products must be float32 too. A GPU's default for float32 matmuls and convolutions is
        # TF32 (10-bit mantissa), under which a 16-layer WRN's two outputs differed by more than
        # the tolerance and a correct declaration was refused (seen on an H100).
        with jax.default_matmul_precision("highest"):
            why = probe and (
                _probe_rows(module, params, x_shape, x_dtype, loss_fn, y_example, frozen)
                or _probe_reparam(module, params, x_shape, x_dtype, rec.calls)
            )
        if why:
            return GhostPlan(why, summary)
        return GhostPlan(None, summary)
    except Exception as e:  # tracing failed under interception (lifted transforms, ...)
        lifted = (
            "a known layer is called inside a lifted transform (nnx.scan, nnx.vmap, nn.scan), "
            "which hands it a slice of its parameters: "
            if type(e).__name__ == "ScopeParamShapeError"
            else ""
        )
        return GhostPlan(
            f"the module could not be traced with its layers intercepted ({lifted}{e!r:.200})"
        )


def _read_outside(keypaths: list, notes: dict[tuple[str, ...], str]) -> str:
    """The plan's reason when parameters (their key paths, in parameter order) are read outside
    the known layers' calls: the first one, the class of the layer holding it where ``notes``
    says, and the other layers whose parameters are read so (at most three named)."""
    owners = list(dict.fromkeys(tuple(str(getattr(k, "key", k)) for k in p[:-1]) for p in keypaths))

    def owner(o: tuple[str, ...]) -> str:
        where = "/".join(o) or "the top-level module"
        return f"{where} ({notes[o]})" if o in notes else where

    why = (
        f"parameter {jax.tree_util.keystr(keypaths[0])} is used outside the known layers "
        f"({', '.join(sorted(set(KNOWN_LAYERS.values())))})"
    )
    if owners[0] in notes:
        why += f": {owner(owners[0])}"
    if len(owners) > 1:
        more = ", ".join(owner(o) for o in owners[1:4]) + (", ..." if len(owners) > 4 else "")
        why += f"; so are the parameters of {len(owners) - 1} more layers: {more}"
    return why


def _probe_batch(x_shape, x_dtype, b: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.issubdtype(np.dtype(x_dtype), np.integer):
        return rng.integers(0, 2, size=(b, *x_shape)).astype(x_dtype)
    return rng.standard_normal((b, *x_shape)).astype(x_dtype)


def _probe_rows(module, params, x_shape, x_dtype, loss_fn, y_example, frozen=None) -> str | None:
    """None if the module's batched output, and every recorded input and output gradient of
    :func:`_example_rows`, have rows that move only with their own example, on a synthetic batch
    with each position replaced in turn, at ``params`` and random draws around them; else what
    is not."""
    base, variants = models.mixing_probe_batches(x_shape, x_dtype)
    b = len(base)
    y = jnp.zeros((b, *tuple(y_example.shape[1:])), y_example.dtype)
    own = jax.jit(lambda p, x: jax.tree_util.tree_leaves(module.apply({"params": p}, x)))

    @jax.jit
    def rows(p, x):
        _, _, ins, gs = _example_rows(module, loss_fn, p, x, y, copies=False, frozen=frozen)
        return ins, gs

    # dptune's own model classes act on each example by their code: their plan (e.g. a 16-layer
    # WideResNet's, at the start of every run) probes the given parameters only
    shipped = _per_example_by_code(module)
    for p in [params] if shipped else models.probe_parameter_draws(params):
        mixed = models.moved_rows(lambda x, p=p: own(p, x), base, variants)
        if mixed is not None:
            return (
                f"the output of one example depends on the others (the model mixes examples: "
                f"example {mixed[1]}'s output moves with example {mixed[0]})"
            )
        mixed = models.moved_rows(lambda x, p=p: jax.tree_util.tree_leaves(rows(p, x)), base,
                                  variants)  # fmt: skip
        if mixed is not None:
            return (
                f"a recorded layer input or output gradient of example {mixed[1]} moves with "
                f"example {mixed[0]} (rows not per example)"
            )
    return None


def _probe_reparam(module, params, x_shape, x_dtype, calls: list[_Call]) -> str | None:
    """None if the module's output with its :class:`Reparametrized` layers replaced by their
    declared known layer equals its own output on a synthetic batch, with random parameters (the
    plan's may be zeros, which would hide a wrong declaration); else which layer disagrees. Only
    modules that declare such layers are checked (a known layer is run as itself)."""
    declared = list(dict.fromkeys(call.path for call in calls if call.reparam is not None))
    if not declared:
        return None
    x = _probe_batch(x_shape, x_dtype, 3, 0)
    rng = np.random.default_rng(2)
    leaves, tree = jax.tree_util.tree_flatten(params)
    noisy = jax.tree_util.tree_unflatten(
        tree, [jnp.asarray(rng.normal(0.0, 0.5, np.shape(v)), jnp.result_type(v)) for v in leaves]
    )
    both = jax.jit(lambda p, x: (module.apply({"params": p}, x), _record(module, p, x)[0]))
    own, declared_out = both(noisy, jnp.asarray(x))
    if not all(
        _close(u, v)
        for u, v in zip(
            jax.tree_util.tree_leaves(own), jax.tree_util.tree_leaves(declared_out), strict=True
        )
    ):
        paths = ", ".join("/".join(p) for p in declared)
        return (
            f"the output with the layers that declare {REPARAM_METHOD}() ({paths}) computed as "
            "declared differs from the module's own output"
        )
    return None


def _close(u: Any, v: Any) -> bool:
    """Whether two computations of one output agree up to float32 rounding: every difference
    within 1e-4 of the output's largest finite magnitude (plus 1e-5), equal non-finite values
    agreeing. Relative to the whole output, not to each element: in a deep model (Flax's gemma
    at its tiny config's four 256-wide layers, random parameters) an element near 0 differed by
    3.6e-5 of outputs up to 4.8, rounding; a wrong declaration moves outputs by their own size."""
    u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
    diff = np.where((u == v) | (np.isnan(u) & np.isnan(v)), 0.0, np.abs(u - v))
    scale = np.max(np.abs(np.where(np.isfinite(v), v, 0.0)), initial=0.0)
    return not np.isnan(diff).any() and float(np.max(diff, initial=0.0)) <= 1e-4 * scale + 1e-5


def _example_rows(
    module: Any,
    loss_fn: Callable,
    params: Any,
    x: jax.Array,
    y: jax.Array,
    copies: bool,
    frozen: Callable | None = None,
) -> tuple[list[_Call], jax.Array, list, list]:
    """One forward and one backward pass with every example run as a batch of its own (its K
    copies with ``copies``, x (b, K, ...); else a batch of 1) under ``vmap``: (the known-layer
    calls, per-example losses (b,), each call's recorded inputs and output gradients with example
    i's rows in block i of the leading axis).

    Per example by construction: vmap gives the module no axis to reach the other examples by,
    so example i's rows are a function of example i and the parameters alone, for every
    parameter value (what a probe cannot check). XLA batches the vmapped layers back into the
    same batched matmuls and convolutions. The model classes dptune ships
    (``trainers.models.PER_EXAMPLE_MODULES``, per example by their own code) run as one batch
    instead: the same values, about 7% less CPU time for a WideResNet's clipped sum. A module in
    training mode (``trainers.train_mode.TrainingCall``) is told each example's slots in the
    chunk (copy j of example i at ``i K + j``), which key its per-example dropout masks: the
    masks of the ``vmap(grad)`` path (``trainers.dpsgd.per_example_grads_naive`` with
    ``per_slot``)."""
    b = x.shape[0]
    k = x.shape[1] if copies else 1
    calls: list[_Call] = []

    def forward(params, taps, xi, si):
        out, rec = _record(module, params, xi, taps, frozen, si)
        calls[:] = rec.calls
        return out, rec.inputs

    fast_forward = with_fast_pools(forward)

    def run(taps, xi, yi, si):  # the mean loss of each group of k copies, the recorded inputs
        out, inputs = fast_forward(params, taps, xi, si)
        return jnp.mean(loss_fn(out, yi).reshape(-1, k), axis=1), inputs

    xs = x if copies else x[:, None]  # (b, k, ...): each example's group of k
    ys = jnp.repeat(y[:, None], k, axis=1)
    slots = None
    if hasattr(module, "apply_slots"):
        slots = jnp.arange(b * k, dtype=jnp.int32).reshape(b, k)
    vmapped = not _per_example_by_code(module)
    if vmapped:
        shapes = jax.eval_shape(
            lambda p, x: _record(module, p, x, frozen=frozen)[1].outputs, params, xs[0]
        )
        taps = [jnp.zeros((b, *s.shape), s.dtype) for s in shapes]
        run = jax.vmap(run)
    else:
        xs, ys = xs.reshape(b * k, *xs.shape[2:]), ys.reshape(b * k, *ys.shape[2:])
        slots = None if slots is None else slots.reshape(b * k)
        shapes = jax.eval_shape(
            lambda p, x: _record(module, p, x, frozen=frozen)[1].outputs, params, xs
        )
        taps = [jnp.zeros(s.shape, s.dtype) for s in shapes]

    def total(taps):
        losses, inputs = run(taps, xs, ys, slots)
        losses = losses.reshape(b)
        return jnp.sum(losses), (losses, inputs)

    gs, (losses, ins) = jax.grad(total, has_aux=True)(taps)

    def merged(v):  # (b, n, ...) -> (b * n, ...): the batch-first layout of the formulas
        return v.reshape(b * v.shape[1], *v.shape[2:]) if vmapped and v.ndim > 2 else v

    return list(calls), losses, [merged(v) for v in ins], [merged(v) for v in gs]


def _per_example_by_code(module: Any) -> bool:
    """Whether ``module`` (or the module of a ``ModelSpec``) is one of dptune's own model classes
    (``trainers.models.PER_EXAMPLE_MODULES``): per example by their code, so run as one batch."""
    if isinstance(module, models.ModelSpec):
        module = module.module
    return type(module) in models.PER_EXAMPLE_MODULES


def clipped_sum_ghost(
    module: Any,
    loss_fn: Callable,
    params: Any,
    x: jax.Array,
    y: jax.Array,
    mask: jax.Array,
    clip_norm,
    copies: bool = False,
    trainable: Any = None,
) -> tuple[Any, jax.Array, jax.Array]:
    """Clipped per-example gradient sum for a module that :func:`analyze` accepted.

    Same contract and return value as ``trainers.dpsgd.clipped_sum_naive``: (clipped sum pytree,
    sum of masked per-example losses, per-example gradient norms (b,)). ``module``: what
    :func:`analyze` accepted (a linen Module, a ``ModelSpec``, an ``NnxModel`` or a
    ``TrainingCall``). ``loss_fn(outputs, labels) -> (n,)`` per-example losses (outputs any
    pytree, labels any (n, ...) array); with ``copies``, x is (b, K, ...) and example i's loss
    is the mean over its K copies. ``trainable``: None, or the pytree of Python bools
    :func:`analyze` was given: frozen layers get no tap and no norm terms (the backward pass
    stops at the lowest trainable layer), and their part of the sum is zero.
    """
    boxed, params = params, unboxed(params)
    frozen = None if trainable is None else frozen_layers(params, trainable)[0]
    b = x.shape[0]
    calls, losses, ins, gs = _example_rows(module, loss_fn, params, x, y, copies, frozen)
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, call in enumerate(calls):
        groups.setdefault(call.path, []).append(i)
    sq = jnp.zeros((b,), jnp.float32)
    finishers = []
    input_grams: dict = {}
    for path, idx in groups.items():
        layer_params = _params_at(params, path, calls[idx[0]].leaf)
        layer_ins = [ins[i] for i in idx]
        if calls[idx[0]].reparam is not None:
            # A data dependency on the norms so far (adding min(their sum, 0), which is 0 but
            # which XLA keeps) orders the layers' norms one after another, so their per-block
            # temporaries (im2col patches, per-example gradients) are not alive together: XLA
            # CPU otherwise scheduled them side by side (WRN-16-4, batch 256: 7.7 GB for the
            # norms against 1.9 GB for the non-private gradient). Non-finite norms count as 0
            # here: one example's NaN must not reach the other examples' inputs.
            after = jnp.minimum(jnp.sum(jnp.where(sq >= 0, sq, 0.0)), 0.0)
            layer_ins = [x + after.astype(x.dtype) for x in layer_ins]
        s, fin = _layer_terms(
            calls[idx[0]].kind, [calls[i] for i in idx], layer_ins, [gs[i] for i in idx],
            layer_params, b, input_grams,
        )  # fmt: skip
        sq = sq + s.astype(jnp.float32)
        finishers.append((path, calls[idx[0]].leaf, fin))
    c = clip_factors(sq, mask, clip_norm)
    flat = {k_: jnp.zeros_like(v) for k_, v in traverse_util.flatten_dict(params).items()}
    for path, leaf, fin in finishers:
        for name, value in traverse_util.flatten_dict(fin(c.astype(jnp.float32))).items():
            flat[path if leaf else (*path, *name)] = value
    summed = traverse_util.unflatten_dict(flat)
    if _has_boxes(boxed):  # the caller's partitioning metadata, around the sums
        summed = nn.meta.replace_boxed(boxed, summed)
    return summed, kept_loss_sum(losses, mask, sq), jnp.sqrt(sq)


def frozen_layers(params: Any, trainable: Any) -> tuple[Callable, str | None]:
    """(frozen(layer path) -> bool, why not): a layer (a path prefix of parameter leaves, or a
    leaf's own path) is frozen when none of its leaves trains. ``why`` names a layer whose
    parameters are partly trainable (no formula here splits one layer's gradient), else None."""
    below: dict[tuple[str, ...], set[bool]] = {}  # a module's leaves and its submodules'
    own: dict[tuple[str, ...], set[bool]] = {}  # the leaves a module holds itself
    for keypath, m in jax.tree_util.tree_flatten_with_path(trainable)[0]:
        names = tuple(str(getattr(k, "key", k)) for k in keypath)
        own.setdefault(names[:-1], set()).add(bool(m))
        for i in range(len(names) + 1):
            below.setdefault(names[:i], set()).add(bool(m))
    why = None
    for layer, flags in own.items():
        if len(flags) > 1:
            where = "/".join(layer) or "the top-level module"
            why = f"layer {where} is partly trainable (train all its parameters or none)"
            break

    def frozen(path: tuple[str, ...]) -> bool:
        return below.get(tuple(path)) == {False}

    return frozen, why
