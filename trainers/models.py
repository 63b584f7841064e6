"""Flax (linen) models: the tanh CNNs of Papernot et al. 2021 / Tramer & Boneh 2021, and Tramer &
Boneh's linear model and CNN on scattering features (``scatter_linear``, ``scatter_cnn``).

Max-pools are written as the maximum of shifted slices rather than ``nn.max_pool``: on XLA CPU the
gradient of a ``reduce_window`` max lowers to select-and-scatter, which dominated the step time
(``../shared/notes/cpu-dpsgd-performance.md``); the slice form has an elementwise gradient. The
forward values are identical; on exact ties the gradient is split instead of going to the first
maximum (ties have measure zero after tanh).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Sequence
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from trainers import train_mode
from trainers.finetune import overlay
from trainers.reparam import Reparametrized
from trainers.spec import MODEL_NAMES  # one list of model names, JAX-free

#: Models that train on scattering features (``trainers.scatter``) instead of raw images.
SCATTER_MODELS = ("scatter_linear", "scatter_cnn")
#: Input of the scatter models: (7, 7, 81) NHWC features of a 28x28 image (J = 2, L = 8).
SCATTER_SHAPE = (7, 7, 81)
#: Group normalisation groups of the scatter models (81 channels -> groups of 3 channels).
SCATTER_GROUPS = 27


def max_pool_2x2_stride1(x: jax.Array) -> jax.Array:
    """2x2 max-pool, stride 1, VALID, on NHWC: (b, h, w, c) -> (b, h-1, w-1, c)."""
    return jnp.maximum(
        jnp.maximum(x[:, :-1, :-1], x[:, 1:, :-1]), jnp.maximum(x[:, :-1, 1:], x[:, 1:, 1:])
    )


def max_pool_2x2_stride2(x: jax.Array) -> jax.Array:
    """2x2 max-pool, stride 2, VALID, on NHWC with even h, w: (b, h, w, c) -> (b, h/2, w/2, c)."""
    return jnp.maximum(
        jnp.maximum(x[:, 0::2, 0::2], x[:, 1::2, 0::2]),
        jnp.maximum(x[:, 0::2, 1::2], x[:, 1::2, 1::2]),
    )


def space_to_depth_input(x: jax.Array, s: int, pad_lo: int, extent: int) -> jax.Array:
    """Zero-pads (b, h, w, c) to rows/cols [-pad_lo, extent - pad_lo) and folds s x s blocks into
    channels:
    (b, extent/s, extent/s, s*s*c), channel order (row in block, col in block, c)."""
    b, h, w, c = x.shape
    hi = extent - pad_lo - h
    x = jnp.pad(x, ((0, 0), (pad_lo, max(hi, 0)), (pad_lo, max(hi, 0)), (0, 0)))[
        :, :extent, :extent
    ]
    e = extent // s
    return x.reshape(b, e, s, e, s, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, e, e, s * s * c)


def kernel_space_to_depth(kernel: jax.Array, s: int) -> jax.Array:
    """(k, k, c, o) kernel of a stride-s convolution -> (k/s, k/s, s*s*c, o) kernel of the
    equivalent stride-1 convolution on :func:`space_to_depth_input`."""
    k, _, c, o = kernel.shape
    m = k // s
    return kernel.reshape(m, s, m, s, c, o).transpose(0, 2, 1, 3, 4, 5).reshape(m, m, s * s * c, o)


def conv_stride2_s2d(x: jax.Array, kernel: jax.Array, pad_lo: int, out_hw: int) -> jax.Array:
    """A k x k, stride-2 convolution (k even) as a stride-1 (k/2 x k/2) convolution after
    space-to-depth.

    Same values as ``lax.conv_general_dilated`` (NHWC/HWIO); on XLA CPU a 1-channel 8x8/2
    convolution was ~4x slower than this form (4 input channels, stride 1).
    """
    k = kernel.shape[0]
    xs = space_to_depth_input(x, 2, pad_lo, (out_hw - 1) * 2 + k)
    return jax.lax.conv_general_dilated(
        xs, kernel_space_to_depth(kernel, 2), (1, 1), "VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )  # fmt: skip


class Conv8x8Stride2(nn.Module):
    """nn.Conv(features, (8, 8), strides=2, padding="SAME") on 28x28 inputs (same parameters, same
    initialisers, same values), computed by :func:`conv_stride2_s2d`."""

    features: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if x.shape[1:3] != (28, 28):
            raise ValueError(f"Conv8x8Stride2 expects 28x28 inputs, got {x.shape}")
        kernel = self.param(
            "kernel", nn.initializers.lecun_normal(), (8, 8, x.shape[-1], self.features)
        )
        bias = self.param("bias", nn.initializers.zeros_init(), (self.features,))
        return conv_stride2_s2d(x, kernel, 3, 14) + bias


class MnistCNN(nn.Module):
    """tanh CNN for 28x28x1 images: conv c1@8x8/2 SAME, pool 2x2/1, conv c2@4x4/2 VALID, pool 2x2/1,
    dense d, dense 10.

    With (c1, c2, d) = (16, 32, 32) this is the 26,010-parameter network of Papernot et al. 2021
    ("Tempered sigmoid activations for deep learning with differential privacy", Table 2) and Tramer
    & Boneh 2021. Input: float32 (b, 28, 28, 1); output: logits (b, num_classes).
    """

    conv1_features: int = 16
    conv2_features: int = 32
    dense_features: int = 32
    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = Conv8x8Stride2(self.conv1_features, name="conv1")(x)
        x = max_pool_2x2_stride1(jnp.tanh(x))
        x = nn.Conv(self.conv2_features, (4, 4), strides=(2, 2), padding="VALID", name="conv2")(x)
        x = max_pool_2x2_stride1(jnp.tanh(x))
        x = x.reshape((x.shape[0], -1))
        x = jnp.tanh(nn.Dense(self.dense_features, name="dense1")(x))
        return nn.Dense(self.num_classes, name="dense2")(x)


class CifarCNN(nn.Module):
    """End-to-end tanh CNN for CIFAR-10 of Papernot et al. 2021 (Table 3), 550,570 parameters.

    conv 32,32 / pool / conv 64,64 / pool / conv 128,128 / pool (all 3x3 SAME, pools 2x2/2), dense
    128, dense 10. Input: float32 (b, 32, 32, 3); output: logits (b, num_classes).
    """

    num_classes: int = 10

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, feats in enumerate((32, 64, 128)):
            x = jnp.tanh(nn.Conv(feats, (3, 3), padding="SAME", name=f"conv{2 * i + 1}")(x))
            x = jnp.tanh(nn.Conv(feats, (3, 3), padding="SAME", name=f"conv{2 * i + 2}")(x))
            x = max_pool_2x2_stride2(x)
        x = x.reshape((x.shape[0], -1))
        x = jnp.tanh(nn.Dense(128, name="dense1")(x))
        return nn.Dense(self.num_classes, name="dense2")(x)


def _standardize(kernel: jax.Array, eps: float) -> tuple[jax.Array, jax.Array]:
    axes = tuple(range(kernel.ndim - 1))
    mean = jnp.mean(kernel, axis=axes, keepdims=True)
    inv = jax.lax.rsqrt(jnp.var(kernel, axis=axes, keepdims=True) + eps)
    return (kernel - mean) * inv, inv


def standardize_kernel(kernel: jax.Array, eps: float = 1e-5) -> jax.Array:
    """Weight standardisation of a conv kernel (..., c_in, c_out): each output channel's weights
    minus their mean, divided by sqrt(their variance + eps), over all axes but the last."""
    return _standardize(kernel, eps)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def standardize_kernel_fast_vjp(kernel: jax.Array, eps: float = 1e-5) -> jax.Array:
    """:func:`standardize_kernel` (the same values) with its VJP written out: for a cotangent g
    and w the standardised kernel, per output channel (means over the other axes)
    ``(g - mean(g) - w mean(g w)) / sqrt(var + eps)``, two reductions and one elementwise pass.
    The ghost path applies this VJP to every example's kernel gradient
    (:meth:`WSConv.as_known_layer`); autodiff's VJP of the mean/var formula was up to 7x slower
    there on XLA CPU (b = 32 examples of a 3x3x256x256 kernel: 113 ms against 16 ms)."""
    return _standardize(kernel, eps)[0]


def _standardize_fwd(kernel, eps):
    w, inv = _standardize(kernel, eps)
    return w, (w, inv)


def _standardize_bwd(eps, res, g):
    w, inv = res
    axes = tuple(range(g.ndim - 1))
    mean_g = jnp.mean(g, axis=axes, keepdims=True)
    mean_gw = jnp.mean(g * w, axis=axes, keepdims=True)
    return ((g - mean_g - w * mean_gw) * inv,)


standardize_kernel_fast_vjp.defvjp(_standardize_fwd, _standardize_bwd)


class WSConv(nn.Module):
    """Weight-standardised convolution (Qiao et al. 2019, "Micro-Batch Training with Batch-Channel
    Normalization and Weight Standardization"), as used by De et al. 2022 ("Unlocking
    high-accuracy differentially private image classification through scale", §3).

    The raw kernel (k, k, c_in, c_out) is standardised per output channel over (k, k, c_in) to
    mean 0 and variance 1 (:func:`standardize_kernel`) before the (SAME, no bias) convolution; the
    parameter is the raw kernel, so per-example gradients flow through the standardisation.
    :meth:`as_known_layer` declares this structure to the ghost path (``trainers.ghost``): an
    ``nn.Conv`` on the standardised kernel, so per-example norms and the clipped sum are computed
    from one batched backward pass (the raw kernel's gradient is the standardisation's VJP
    applied to the conv's per-example kernel gradient).
    """

    features: int
    kernel_size: int = 3
    strides: int = 1
    eps: float = 1e-5

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        k = self.kernel_size
        kernel = self.param(
            "kernel", nn.initializers.lecun_normal(), (k, k, x.shape[-1], self.features)
        )
        w = standardize_kernel(kernel, self.eps)
        return jax.lax.conv_general_dilated(
            x, w, (self.strides, self.strides), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    def as_known_layer(self):
        """This layer as ``nn.Conv`` (same size, stride, SAME padding, no bias) on
        ``{"kernel": standardize_kernel(raw kernel)}`` (:func:`standardize_kernel_fast_vjp`, the
        same values with a faster VJP): a :class:`Reparametrized`."""
        k, s = self.kernel_size, self.strides
        conv = nn.Conv(self.features, (k, k), strides=(s, s), padding="SAME", use_bias=False)
        eps = self.eps
        return Reparametrized(
            conv, lambda raw: {"kernel": standardize_kernel_fast_vjp(raw["kernel"], eps)}
        )


class WideResNet(nn.Module):
    """Wide ResNet (Zagoruyko & Komodakis 2016) for 32x32x3 images with group normalisation and
    weight-standardised convolutions: the WRN-16-4 of De et al. 2022 (CIFAR-10, Table 2) with
    depth 16, width 4 (2,748,890 parameters for 10 classes).

    Stem conv 16; three groups of (depth - 4) / 6 pre-activation blocks with 16w, 32w, 64w channels
    and strides 1, 2, 2 (block: GN -> act -> WSConv3x3 -> GN -> act -> WSConv3x3, plus a 1x1
    WSConv shortcut when the shape changes); GN -> act -> global average pool -> dense. Group norm
    (16 groups) normalises each example on its own, so per-example gradients are well defined (no
    batch statistics). Input: float32 (b, 32, 32, 3); output: logits (b, num_classes).
    """

    depth: int = 16
    width: int = 4
    num_classes: int = 10
    groups: int = 16
    activation: str = "relu"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if (self.depth - 4) % 6:
            raise ValueError(f"WideResNet depth must be 6n + 4, got {self.depth}")
        act = {"relu": nn.relu, "elu": nn.elu, "tanh": jnp.tanh}[self.activation]
        n = (self.depth - 4) // 6
        x = WSConv(16, name="stem")(x)
        for g, (feats, stride) in enumerate(((16, 1), (32, 2), (64, 2))):
            feats *= self.width
            for i in range(n):
                s = stride if i == 0 else 1
                h = act(nn.GroupNorm(self.groups, name=f"g{g}b{i}_gn1")(x))
                shortcut = x
                if s != 1 or x.shape[-1] != feats:
                    shortcut = WSConv(feats, 1, s, name=f"g{g}b{i}_proj")(h)
                h = WSConv(feats, 3, s, name=f"g{g}b{i}_conv1")(h)
                h = act(nn.GroupNorm(self.groups, name=f"g{g}b{i}_gn2")(h))
                x = shortcut + WSConv(feats, 3, 1, name=f"g{g}b{i}_conv2")(h)
        x = act(nn.GroupNorm(self.groups, name="final_gn")(x))
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(self.num_classes, name="head")(x)


def group_norm(x: jax.Array, groups: int, eps: float = 1e-5) -> jax.Array:
    """Per-example group normalisation without learned scale/shift, on NHWC: the channels are
    split into ``groups`` groups and each group of each example is standardised over (h, w,
    channels in the group).

    Tramer & Boneh 2021 (§3, "GroupNorm") normalise scattering features this way: every example is
    normalised with its own statistics, so the map is a fixed function of each record and costs no
    privacy (unlike their data normalisation, which needs DP estimates of dataset statistics).
    """
    b, h, w, c = x.shape
    if c % groups:
        raise ValueError(f"{c} channels cannot be split into {groups} groups")
    g = x.reshape(b, h, w, groups, c // groups)
    mean = jnp.mean(g, axis=(1, 2, 4), keepdims=True)
    var = jnp.mean(jnp.square(g - mean), axis=(1, 2, 4), keepdims=True)
    return ((g - mean) * jax.lax.rsqrt(var + eps)).reshape(b, h, w, c)


class ScatterLinear(nn.Module):
    """Tramer & Boneh 2021's "ScatterNet + linear" model: group normalisation of the (7, 7, 81)
    scattering features, then one dense layer (3,969 x 10 + 10 = 39,700 parameters).

    Input: float32 (b, 7, 7, 81) features (``trainers.scatter``); output: logits (b, classes).
    """

    num_classes: int = 10
    groups: int = SCATTER_GROUPS

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = group_norm(x, self.groups)
        return nn.Dense(self.num_classes, name="dense")(x.reshape((x.shape[0], -1)))


class ScatterCNN(nn.Module):
    """Tramer & Boneh 2021's "ScatterNet + CNN" for 28x28 images: group normalisation, conv
    16@3x3/2 (pad 1), tanh, conv 32@3x3/1 (pad 1), tanh, dense 32, tanh, dense 10 (33,066
    parameters).

    Input: float32 (b, 7, 7, 81) features; output: logits (b, classes).
    """

    num_classes: int = 10
    groups: int = SCATTER_GROUPS

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = group_norm(x, self.groups)
        x = jnp.tanh(nn.Conv(16, (3, 3), strides=(2, 2), padding=((1, 1), (1, 1)), name="conv1")(x))
        x = jnp.tanh(nn.Conv(32, (3, 3), strides=(1, 1), padding=((1, 1), (1, 1)), name="conv2")(x))
        x = jnp.tanh(nn.Dense(32, name="dense1")(x.reshape((x.shape[0], -1))))
        return nn.Dense(self.num_classes, name="dense2")(x)


#: The model classes dptune ships: each acts on every example alone by its own code (no operation
#: along the batch axis; tested against vmap(grad) in tests/trainers), so the ghost path may run
#: them as one batch (``trainers.ghost``); a user's module runs each example under vmap instead.
PER_EXAMPLE_MODULES = (MnistCNN, CifarCNN, WideResNet, ScatterLinear, ScatterCNN)


@dataclasses.dataclass(frozen=True, eq=False)
class ModelSpec:
    """A model, the input it reads, and (for a user's model) its loss and validation metric.

    Compared and hashed by identity: the compiled steps are cached per spec object
    (``trainers.step``), and a flax Module's own equality compares its fields, which may be
    unhashable or compare arrays. :func:`get_model` returns one spec object per (name, classes).

    Attributes:
      name: a shipped name (``MODEL_NAMES``) or a user model's label (e.g. its class name).
      module: the flax (linen) Module, or None for an ``(init_fn, apply_fn)`` pair.
      input_shape: shape of one example (without the batch axis): (height, width, channels) for
        images, (features,) for tabular rows, (length,) for token ids, ...
      features: None when the model reads the dataset's arrays; "scatter" when it reads the
        images' scattering features (``trainers.scatter``; ``input_shape`` is then the features'
        shape and the images must be 28x28x1).
      input_dtype: dtype name of one example ("float32", "int32", ...).
      init_fn, apply_fn: the pair for non-linen JAX code: ``init_fn(key, x) -> params`` for a
        batch x of one example, ``apply_fn(params, x) -> outputs`` (b, ...).
      loss: ``loss(outputs, labels) -> (b,)`` per-example losses; None: softmax cross-entropy on
        integer labels.
      metric: a ``trainers.evaluate.BoundedMetric`` scoring candidates; None: accuracy.
      shipped: whether this is one of the shipped models (with their hand-tuned fast paths).
      input_layout: for dict inputs, how the stored (b, width) inputs unpack into the dict the
        model is called with (``trainers.data.InputLayout``); None: the array as it is.
      label_shape, label_dtype: one record's label (without the batch axis): () and "int32" for
        class ids; what the loss and metric are probed with (shapes and dtypes, never values).
      call_keyword: "train" or "deterministic" when the module's ``__call__`` takes it
        (``trainers.train_mode``): called in training mode, with per-example dropout keys, while
        it trains, and in evaluation mode otherwise; None: always called as it is.
      init: None (the module's initialisers), or initial parameters as {'/'-joined path: array}
        (``trainers.finetune.match_init``: checked, public); paths it lacks (fresh adapters) keep
        the initialisers' values.
      trainable: None (every parameter trains), or a pytree of Python bools shaped like the
        parameters (``trainers.finetune.trainable_mask``): only those leaves are clipped,
        noised and updated.
    """

    name: str
    module: Any
    input_shape: tuple[int, ...]
    features: str | None = None
    input_dtype: str = "float32"
    init_fn: Callable | None = None
    apply_fn: Callable | None = None
    loss: Callable | None = None
    metric: Any = None
    shipped: bool = True
    input_layout: Any = None
    label_shape: tuple[int, ...] = ()
    label_dtype: str = "int32"
    call_keyword: str | None = None
    init: Any = None
    trainable: Any = None

    def __repr__(self) -> str:
        return f"ModelSpec({self.name!r}, input {self.input_dtype}{self.input_shape})"

    def apply(self, variables: dict, x: jax.Array) -> Any:
        """Outputs for a batch x, flax-style: ``variables = {"params": params}``; a module with a
        ``train`` / ``deterministic`` keyword is called in evaluation mode."""
        x = self.model_input(x)
        if self.module is not None:
            kwargs = train_mode.call_kwargs(self.call_keyword, False)
            return self.module.apply(variables, x, **kwargs)
        return self.apply_fn(variables["params"], x)

    def model_input(self, x: Any) -> Any:
        """Stored inputs as the model reads them: the dict of a dict input, else x itself."""
        return x if self.input_layout is None else self.input_layout.unpack(x)

    def init_variables(self, key: jax.Array) -> dict:
        """The module's variables from one example of zeros (evaluation mode; a ``dropout`` rng
        is supplied in case the module draws one while initialising)."""
        x = self.model_input(self.example_input(1))
        if self.module is None:
            return {"params": self.init_fn(key, x)}
        if not isinstance(self.module, nn.Module):  # an NnxModel: its own values, no key needed
            return self.module.init(key, x)
        rngs = {"params": key, "dropout": jax.random.fold_in(key, 1)}
        return self.module.init(rngs, x, **train_mode.call_kwargs(self.call_keyword, False))

    @property
    def stochastic(self) -> bool:
        """Whether training calls the module in training mode (with dropout keys): a linen
        module with a call keyword, an NNX model with rng state or a dropout switch."""
        if self.module is None:
            return False
        if isinstance(self.module, nn.Module):
            return self.call_keyword is not None
        return bool(getattr(self.module, "stochastic", False))

    def training(self, rng: jax.Array) -> train_mode.TrainingCall:
        """The module in training mode with root dropout key ``rng`` (``trainers.train_mode``)."""
        return train_mode.TrainingCall(self, rng)

    def apply_recording(self, params: Any, x: jax.Array, recorder: Callable) -> Any:
        """:meth:`apply` with ``variables = {"params": params}`` and every known layer's call
        handed to ``recorder`` (a ``trainers.ghost`` recorder): a linen module through
        ``nn.intercept_methods``, an NNX one through its own ``apply_recording``."""
        if isinstance(self.module, nn.Module):
            with nn.intercept_methods(recorder):
                return self.apply({"params": params}, x)
        return self.module.apply_recording(params, self.model_input(x), recorder)

    def example_input(self, batch: int = 1) -> jax.Array:
        """Zeros shaped like ``batch`` examples (what parameters are initialised from)."""
        return jnp.zeros((batch, *self.input_shape), self.input_dtype)


@functools.cache
def get_model(name: str, num_classes: int = 10) -> ModelSpec:
    """Returns the model called ``name`` (one of ``MODEL_NAMES``); one spec object per arguments.

    "cnn52k" widens the 26k CNN to conv 32 / conv 48 / dense 32 (51,642 parameters): the
    ~52k-parameter comparison of the DP feature-selection paper's appendix A.1, whose exact widths
    are not published.
    """
    if name == "cnn26k":
        return ModelSpec(name, MnistCNN(16, 32, 32, num_classes), (28, 28, 1))
    if name == "cnn52k":
        return ModelSpec(name, MnistCNN(32, 48, 32, num_classes), (28, 28, 1))
    if name == "cifar_cnn":
        return ModelSpec(name, CifarCNN(num_classes), (32, 32, 3))
    if name == "wrn16_4":
        return ModelSpec(name, WideResNet(16, 4, num_classes), (32, 32, 3))
    if name == "scatter_linear":
        return ModelSpec(name, ScatterLinear(num_classes), SCATTER_SHAPE, "scatter")
    if name == "scatter_cnn":
        return ModelSpec(name, ScatterCNN(num_classes), SCATTER_SHAPE, "scatter")
    raise ValueError(f"unknown model {name!r}; expected one of {MODEL_NAMES}")


def resolve(model: str | ModelSpec, num_classes: int = 10) -> ModelSpec:
    """The spec of ``model``: a shipped name (with ``num_classes`` outputs) or a spec as it is."""
    if isinstance(model, ModelSpec):
        return model
    return get_model(model, num_classes)


#: Collections a user's module may have besides "params": "intermediates" is only written when
#: the caller asks for it (``sow``), so applying the module with it immutable changes nothing.
_HARMLESS_COLLECTIONS = ("params", "intermediates")


def user_model(
    model: Any,
    input_shape: Sequence[int],
    input_dtype: Any = "float32",
    *,
    loss: Callable | None = None,
    metric: Any = None,
    num_classes: int | None = None,
    name: str | None = None,
    label_shape: Sequence[int] = (),
    label_dtype: Any = "int32",
    input_layout: Any = None,
    check_metric: bool = True,
) -> ModelSpec:
    """A user's model as a :class:`ModelSpec`, checked before anything trains.

    Args:
      model: a flax (linen) Module instance (unbound), an ``nnx.Module`` instance (its
        ``nnx.Param`` state trains: ``trainers.nnx_model.NnxModel``; wrap it yourself to choose
        another filter), or an ``(init_fn, apply_fn)`` pair.
      input_shape, input_dtype: one example's shape and dtype (from the data; for a dict input,
        the stored (width,) row and ``input_layout`` says how it unpacks).
      loss: ``loss(outputs, labels) -> (b,)``, outputs any pytree; None: softmax cross-entropy on
        integer class labels and (b, classes) logits.
      metric: a ``trainers.evaluate.BoundedMetric``; None: accuracy (class labels only).
      num_classes: with the default loss, the outputs must be (b, C) logits with C >=
        num_classes.
      name: a label for reports (default: the module's class name).
      label_shape, label_dtype: one record's label (public shapes: the loss and metric are
        probed with zeros shaped like them).
      input_layout: ``trainers.data.InputLayout`` of a dict input.
      check_metric: whether the validation metric (``metric`` or the default accuracy) must fit
        the outputs and labels (False for the own-loop pieces, which score nothing).

    Raises:
      ValueError: the model keeps state other than its parameters (e.g. ``nn.BatchNorm``'s
        batch statistics: they mix the examples of a batch), needs an rng to evaluate, mixes
        examples (one example's output moves when another example changes), its loss / metric
        is not one value per example, or the default loss / metric do not fit the labels. The
        message starts with ``dptune:`` and names the layer or function and the fix. The
        checks run on synthetic inputs (zeros, and random inputs for the mixing check), never
        on data.
    """
    input_shape = tuple(int(d) for d in input_shape)
    dtype = np.dtype(input_dtype).name
    extra = dict(
        input_layout=input_layout, label_shape=tuple(int(d) for d in label_shape),
        label_dtype=np.dtype(jax.dtypes.canonicalize_dtype(label_dtype)).name,
    )  # fmt: skip
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, str):
        return get_model(model, num_classes or 10)
    spec = _unchecked_spec(
        model, name, input_shape=input_shape, input_dtype=dtype, loss=loss, metric=metric, **extra
    )
    _check_user_model(spec, num_classes, check_metric)
    return spec


def _unchecked_spec(model: Any, name: str | None, **fields: Any) -> ModelSpec:
    """The :class:`ModelSpec` of a user's NNX or linen module or ``(init_fn, apply_fn)`` pair
    (``shipped=False``), labelled ``name`` or after the model; ``fields``: the spec's other
    fields (input shape and dtype, loss, metric, label shape and dtype, input layout)."""
    from trainers import nnx_model  # lazy: flax.nnx is only imported for an NNX model

    if nnx_model.is_nnx(model):
        model = nnx_model.NnxModel(model)
    if isinstance(model, nnx_model.NnxModel):
        return ModelSpec(name or model.name, model, shipped=False, **fields)
    if isinstance(model, nn.Module):
        if model.scope is not None:
            raise ValueError(f"model={type(model).__name__}: pass an unbound flax Module")
        keyword = train_mode.call_keyword(model)
        name = name or type(train_mode.unwrapped(model)).__name__
        return ModelSpec(name, model, shipped=False, call_keyword=keyword, **fields)
    if isinstance(model, tuple) and len(model) == 2 and all(callable(f) for f in model):
        init_fn, apply_fn = model
        name = name or getattr(apply_fn, "__name__", "apply_fn")
        return ModelSpec(name, None, init_fn=init_fn, apply_fn=apply_fn, shipped=False, **fields)
    raise TypeError(
        f"model={model!r:.80}: expected a shipped model name {MODEL_NAMES}, a flax.linen "
        "or flax.nnx Module instance, or an (init_fn, apply_fn) pair"
    )


def _one_line(e: Exception) -> str:
    """``type: message`` of an exception, its whitespace runs (newlines) collapsed."""
    return f"{type(e).__name__}: {' '.join(str(e).split())}"


def _rng_hint(e: Exception, spec: ModelSpec | None = None) -> str:
    """The call convention, for an error that asks for an rng (dropout outside training) or for
    another positional argument."""
    if isinstance(e, TypeError) and "positional argument" in str(e):
        return (
            ". dptune calls the model with one positional argument, the batch: wrap a model of "
            "several inputs in a module that takes a dict of them (Dataset.from_arrays with x a "
            "dict of arrays; docs/your_model.md) and draws any randomness from its rngs"
        )
    if "PRNG" not in str(e) and "rng" not in str(e).lower():
        return ""
    if spec is not None and spec.module is not None and not isinstance(spec.module, nn.Module):
        return (
            ". dptune calls an NNX module in evaluation mode (model.eval()) to initialise and "
            "evaluate it and in training mode (model.train()) with rngs of its own while it "
            "trains: build dropout as nnx.Dropout(rate, rngs=rngs), or give __call__ an `rngs` "
            "argument and hand it on (Flax's examples/mnist)"
        )
    stream = re.search(r'needs PRNG for "(\w+)"', str(e))
    if stream and stream.group(1) not in ("dropout", "params"):
        return (
            f". While it trains, dptune gives a module one rng stream, 'dropout' (per chunk, from "
            f"the candidate's secret key): draw from self.make_rng('dropout') instead of "
            f"{stream.group(1)!r}"
        )
    return (
        ". dptune calls a module whose __call__ has a `train` (or `deterministic`) keyword with "
        "train=False (deterministic=True) to initialise and evaluate it, and with train=True "
        "and per-example dropout rngs while it trains: give it that keyword and use "
        "nn.Dropout(rate, deterministic=not train)"
    )


def _leaf_name(path: tuple) -> str:
    return "outputs" + jax.tree_util.keystr(path) if path else "outputs"


def _check_user_model(spec: ModelSpec, num_classes: int | None, check_metric: bool = True) -> None:
    """Refuses a user's model (ValueError naming the layer or function and the fix) that keeps
    state besides its parameters, fails or needs an rng to evaluate, mixes examples, or whose
    loss / metric does not fit its outputs and labels; on synthetic inputs only, never data."""
    label = f"model={spec.name}"
    params = _initial_params(spec, label)
    base, variants = mixing_probe_batches(spec.input_shape, spec.input_dtype)
    out = jax.jit(lambda p, x: spec.apply({"params": p}, x))
    try:
        o1 = jax.tree_util.tree_map(np.asarray, out(params, base))
    except Exception as e:
        raise ValueError(
            f"dptune: {label} failed on a batch of shape {base.shape}: {_one_line(e)}"
            f"{_rng_hint(e, spec)}"
        ) from None
    n = len(base)
    for path, a in jax.tree_util.tree_flatten_with_path(o1)[0]:
        if a.ndim < 1 or a.shape[0] != n:
            raise ValueError(
                f"dptune: {label}: {_leaf_name(path)} has shape {a.shape} for a batch of {n}: "
                f"every output array needs a leading example axis, ({n}, ...)"
            )
    _refuse_mixing(out, params, base, variants, label)
    _refuse_single_value_groups(spec, params, base, label)
    _check_training_call(spec, params, base, label)
    _check_default_loss_and_metric(spec, label, o1, num_classes, check_metric)
    _check_loss_and_metric_shapes(spec, o1, n)


def _initial_params(spec: ModelSpec, label: str) -> Any:
    """The model's parameters from one example of zeros; refused when it cannot be initialised
    or keeps state in another collection (batch statistics mix a batch's examples)."""
    x1 = spec.example_input(1)
    try:
        variables = spec.init_variables(jax.random.PRNGKey(0))
    except Exception as e:
        raise ValueError(
            f"dptune: {label} could not be initialised on an input of shape {x1.shape} "
            f"({x1.dtype}): {_one_line(e)}{_rng_hint(e, spec)}"
        ) from None
    for col, tree in variables.items():
        if col in _HARMLESS_COLLECTIONS:
            continue
        flat = flax.traverse_util.flatten_dict(flax.core.unfreeze(tree))
        where = "/".join(next(iter(flat))[:-1]) if flat else "?"
        raise ValueError(
            f"dptune: model={spec.name}: layer {where!r} keeps state in the {col!r} collection "
            "(for example nn.BatchNorm's batch statistics). DP-SGD needs each example's gradient "
            "to depend on that example alone, and batch statistics mix the examples of a batch: "
            "use nn.GroupNorm or nn.LayerNorm instead (model, replaced = "
            "dptune.fix_model(model, x) swaps every BatchNorm, x an example batch)"
        )
    return variables["params"]


def _check_training_call(spec: ModelSpec, params: Any, base: Any, label: str) -> None:
    """Refuses a module that evaluates but cannot be called in training mode (e.g. an
    ``nnx.Dropout`` with no rngs): traced once on the synthetic batch, before anything is
    charged, instead of failing every candidate."""
    if not spec.stochastic:
        return
    key = jax.random.PRNGKey(0)
    try:
        jax.eval_shape(lambda p, x: spec.training(key).apply({"params": p}, x), params, base)
    except Exception as e:
        raise ValueError(
            f"dptune: {label} failed in training mode on a batch of shape {base.shape}: "
            f"{_one_line(e)}{_rng_hint(e, spec)}"
        ) from None


class _GroupSizes:
    """A ``trainers.ghost``-style recorder that runs every call as it is and notes each
    ``GroupNorm`` (linen, or an NNX one's linen twin) whose groups hold one value per example:
    (path, groups, input shape)."""

    frozen = None

    def __init__(self):
        self.unsupported: list[str] = []
        self.single: list[tuple[str, int, tuple[int, ...]]] = []

    def __call__(self, next_fun, args, kwargs, context):
        m = context.module
        if (
            isinstance(m, nn.GroupNorm)
            and context.method_name == "__call__"
            and args
            and m.reduction_axes is None
        ):
            shape = tuple(args[0].shape)
            groups = m.num_groups or shape[-1] // m.group_size
            if len(shape) >= 2 and math.prod(shape[1:]) == groups:
                path = getattr(context, "path", None) or m.path
                self.single.append(("/".join(map(str, path)), groups, shape))
        return next_fun(*args, **kwargs)


def _refuse_single_value_groups(spec: ModelSpec, params: Any, base: Any, label: str) -> None:
    """Refuses a GroupNorm whose every group holds a single value of an example (e.g. 32 groups
    of 32 features without positions): it normalises each to 0, so its output is its bias
    whatever its input and the layers before it never learn. Traced on synthetic inputs."""
    if spec.module is None:
        return
    spy = _GroupSizes()
    try:
        jax.eval_shape(lambda p, x: spec.apply_recording(p, x, spy), params, base)
    except Exception:  # the model ran above; a trace this check cannot make proves nothing
        return
    if spy.single:
        path, groups, shape = spy.single[0]
        raise ValueError(
            f"dptune: model={spec.name}: layer {path!r} (GroupNorm, {groups} groups on inputs "
            f"of shape {shape}) normalises every value on its own, so its output is its bias "
            "whatever its input and the layers before it never learn: give it fewer groups "
            "(1 for features without positions, or nn.LayerNorm); for a BatchNorm replaced "
            "by dptune.fix_model, fix_model(model, x) with an example batch x picks them"
        )


def _refuse_mixing(out: Callable, params: Any, base, variants, label: str) -> None:
    """Refuses a model whose outputs ``out(params, x)`` mix examples: every position replaced in
    turn (``variants``), at the initial parameters and at random draws around them (mixing that
    is off at initialisation), every output leaf compared. What no probe can exclude, mixing that
    appears only for other parameters or inputs, cannot reach the clipped sums or the validation
    count either: those run each example on its own (docs/privacy-model.md, "Per example by
    construction")."""
    for p in probe_parameter_draws(params):
        try:
            mixed = moved_rows(lambda x, p=p: jax.tree_util.tree_leaves(out(p, x)), base, variants)
        except Exception as e:
            raise ValueError(
                f"dptune: {label} failed on a batch of shape {base.shape} at random parameters: "
                f"{_one_line(e)}"
            ) from None
        if mixed is not None:
            raise ValueError(
                f"{label} mixes examples: the output of example {mixed[1]} of a batch changes "
                f"when example {mixed[0]} changes (batch statistics, e.g. nn.BatchNorm in "
                "training mode, or an operation along the batch axis: a mean, a shift, attention "
                "across examples). DP-SGD needs each example's output to depend on that example "
                "alone: use nn.GroupNorm or nn.LayerNorm, and act on the other axes only"
            )


def _check_default_loss_and_metric(
    spec: ModelSpec, label: str, o1: Any, num_classes: int | None, check_metric: bool
) -> None:
    """Refuses the default loss (softmax cross-entropy) or metric (accuracy) where they do not fit:
    labels that are not class ids (n,), or outputs ``o1`` that are not (b, classes) logits."""
    single = isinstance(o1, np.ndarray)
    classes = spec.label_shape == () and np.issubdtype(np.dtype(spec.label_dtype), np.integer)
    labels = f"{spec.label_dtype}{spec.label_shape} labels per record"
    if spec.loss is None:
        if not classes:
            raise ValueError(
                f"dptune: {label}: the default loss (softmax cross-entropy) needs integer class "
                f"labels of shape (n,), and the data has {labels}: pass loss=fn(outputs, labels) "
                "-> (b,) per-example losses (e.g. the squared error for regression, sigmoid "
                "cross-entropy summed over k labels, or token cross-entropy summed or averaged "
                "over a sequence) and metric=dptune.Metric(fn, lo, hi)"
            )
        if not single:
            raise ValueError(
                f"dptune: {label} returns a {type(o1).__name__} of arrays; the default loss "
                "needs one (b, classes) logits array: pass loss=fn(outputs, labels) -> (b,) "
                "that picks the logits (and metric=dptune.Metric(...))"
            )
        if num_classes is not None and (o1.ndim != 2 or o1.shape[1] < num_classes):
            raise ValueError(
                f"dptune: {label}: outputs of shape {o1.shape[1:]} per example; the default loss "
                f"(softmax cross-entropy) needs (num_classes,) = ({num_classes},) logits, or "
                "pass loss=..."
            )
    if check_metric and spec.metric is None and not (classes and single and o1.ndim == 2):
        what = labels if not classes else f"outputs {type(o1).__name__}"
        raise ValueError(
            f"dptune: {label}: the default metric (accuracy) needs integer class labels (n,) and "
            f"(b, classes) outputs, and here are {what}: pass metric=dptune.Metric(fn, lo, hi) "
            "with fn(outputs, labels) -> one value per record in [lo, hi] (e.g. minus the "
            "squared error clipped to [-4, 0], or a token accuracy in [0, 1])"
        )


def _check_loss_and_metric_shapes(spec: ModelSpec, o1: Any, n: int) -> None:
    """Refuses a user's loss or metric that fails on the outputs ``o1`` of a batch of ``n`` and
    zero labels, or does not return one value per example (shapes only: ``jax.eval_shape``)."""
    y = np.zeros((n, *spec.label_shape), spec.label_dtype)
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), o1)
    for what, fn in (("loss", spec.loss), ("metric", getattr(spec.metric, "fn", None))):
        if fn is None:
            continue
        try:
            v = jax.eval_shape(fn, abstract, y)
        except Exception as e:
            raise ValueError(
                f"dptune: {what} failed on outputs {jax.tree_util.tree_map(lambda a: a.shape, o1)} "
                f"and labels of shape {y.shape} ({y.dtype}): {_one_line(e)}"
            ) from None
        if tuple(getattr(v, "shape", ())) != (n,):
            raise ValueError(
                f"{what}(outputs, labels) must return one value per example, shape (b,); for a "
                f"batch of {n} it returned shape {getattr(v, 'shape', None)}"
            )


#: Examples in a mixing probe's batch: each position is replaced in turn, so a model whose
#: example j reads example i is caught for every pair (i, j), earlier or later rows alike.
PROBE_BATCH = 3


def mixing_probe_batches(
    input_shape: Sequence[int], input_dtype: Any, b: int = PROBE_BATCH, seed: int = 0
) -> tuple[np.ndarray, list[np.ndarray]]:
    """A synthetic batch (b, *input_shape) and b variants of it, variant i with example i
    replaced (a fresh normal draw; integer ids 0/1 flipped): the inputs of the mixing probes,
    never data."""
    rng = np.random.default_rng(seed)
    shape = (b, *tuple(input_shape))
    integer = np.issubdtype(np.dtype(input_dtype), np.integer)
    if integer:
        base = rng.integers(0, 2, size=shape).astype(input_dtype)
    else:
        base = rng.standard_normal(shape).astype(input_dtype)
    variants = []
    for i in range(b):
        v = base.copy()
        v[i] = 1 - base[i] if integer else rng.standard_normal(shape[1:]).astype(input_dtype)
        variants.append(v)
    return base, variants


def probe_parameter_draws(params: Any, draws: int = 2, seed: int = 1) -> list[Any]:
    """``params`` itself, then ``draws`` random perturbations of it: each leaf plus N(0, s²) with
    s = 1/sqrt(fan-in) (the product of all but the last axis; 1 for vectors and scalars), so that
    a branch that is zero (or otherwise inactive) at initialisation, e.g. a zero-initialised
    Dense after a mix of examples, is active in some draw. Data-independent."""
    rng = np.random.default_rng(seed)
    leaves, tree = jax.tree_util.tree_flatten(params)
    out = [params]
    for _ in range(draws):
        noisy = []
        for v in leaves:
            shape = np.shape(v)
            s = 1.0 / np.sqrt(max(int(np.prod(shape[:-1])), 1)) if len(shape) > 1 else 1.0
            if jnp.issubdtype(jnp.result_type(v), jnp.inexact):
                v = jnp.asarray(np.asarray(v) + rng.normal(0.0, s, shape), jnp.result_type(v))
            noisy.append(v)
        out.append(jax.tree_util.tree_unflatten(tree, noisy))
    return out


def moved_rows(
    fn: Callable[[np.ndarray], Sequence[Any]], base: np.ndarray, variants: Sequence[np.ndarray]
) -> tuple[int, int] | None:
    """(i, j) for the first replaced example i and other example j whose row of some array of
    ``fn(batch)`` (arrays with a leading example axis) moves with example i; None when every row
    depends on its own example only (on these inputs, at float32 rounding; NaN equals NaN)."""

    def rows(x):
        return [np.asarray(a).astype(np.float64) for a in fn(x)]

    ref = rows(base)
    b = len(base)
    for i, v in enumerate(variants):
        for u, w in zip(ref, rows(v), strict=True):
            scale = float(np.max(np.abs(u[np.isfinite(u)]), initial=1.0))
            for j in range(b):
                if j != i and not np.allclose(
                    u[j], w[j], rtol=1e-5, atol=1e-6 * scale, equal_nan=True
                ):
                    return i, j
    return None


def init_params(spec: ModelSpec, key: jax.Array) -> dict:
    """Initial parameters of ``spec`` (its initialisers) from a PRNG key.

    A module's initialisation runs as one compiled program (cached per spec, and by JAX's
    persistent cache across runs): run eagerly, flax's ``init`` compiles every operation on its own,
    which was most of what a warm-started run still compiled. An ``(init_fn, apply_fn)`` pair is
    called as it is (it may not be traceable). A spec with ``init`` starts from those values
    (bitwise), its other leaves from the initialisers."""
    if spec.module is None:
        params = spec.init_variables(key)["params"]
    else:
        params = _compiled_init(spec)(key)
    if spec.init is not None:
        params = overlay(params, spec.init)
    return params


@functools.lru_cache(maxsize=64)
def _compiled_init(spec: ModelSpec) -> Callable:
    # partitioning boxes (nn.with_logical_partitioning) removed: training reads plain arrays,
    # which apply takes as well; the boxes stay with the module's own init for sharding
    return jax.jit(lambda key: nn.meta.unbox(spec.init_variables(key)["params"]))


def param_count(params) -> int:
    """Total number of scalar parameters in a pytree."""
    return sum(int(p.size) for p in jax.tree_util.tree_leaves(params))
