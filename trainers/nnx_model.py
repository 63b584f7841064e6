"""Flax NNX models as the ``init`` / ``apply`` pair the rest of dptune uses, and their known layers
for the ghost clipping path (``trainers.ghost``).

An ``nnx.Module`` is split once into its graph definition, the trainable state (``nnx.Param``
by default; any NNX filter, e.g. ``nnx.LoRAParam``, through ``trainable=``) and the rest (frozen
parameters, rng state), which is kept as it is. The trainable state travels as a nested dict of
arrays keyed by attribute names (list indices as strings, so orbax and optax see plain dicts):
``apply({"params": p}, x)`` merges ``p`` into a fresh copy of the module and calls it. Variable
metadata (``nnx.with_partitioning``'s sharding names) stays on the module's own Variables, so the
arrays dptune clips are plain and :meth:`NnxModel.state` gives them back with it.

For the ghost path each known NNX layer (``nnx.Linear``, ``LinearGeneral``, ``Conv``, ``Embed`` with
its ``attend``, ``LayerNorm``, ``RMSNorm``, ``GroupNorm``, and ``Einsum`` when it is a dense map of
trailing axes; ``MultiHeadAttention`` through its ``LinearGeneral`` parts) is computed by its linen
twin, which ``trainers.ghost`` already has formulas for: the same parameter names and shapes and the
same computation. The copy of the module being traced has the class of each known layer swapped for
a subclass whose ``__call__`` (and ``attend``) hands the call to the ghost recorder (NNX has no
method interceptor like linen's ``nn.intercept_methods``); the classes of the user's own objects are
never touched, and nothing global changes. A known layer with no trainable parameter (the recorder's
``frozen``, from a ``trainable=`` mask) runs as written, unrecorded, as a frozen linen layer does.
``nnx.LoRA`` (``x @ lora_a @ lora_b``, plus ``base_module(x)`` when it wraps one) is recorded as two
bias-free Dense layers whose kernels are its factors, so its per-example norms are formed in rank
space (an ``nnx.LoRALinear`` holds one; its own Linear kernel is not a known layer's, so training
that kernel keeps a model on ``vmap(grad)``).
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
from flax import nnx, traverse_util
from flax.nnx.nn.dtypes import promote_dtype as _nnx_promote_dtype

from trainers import train_mode
from trainers.reparam import Reparametrized


def is_nnx(model: Any) -> bool:
    """Whether ``model`` is a Flax NNX module instance."""
    return isinstance(model, nnx.Module)


def _where(path: tuple) -> str:
    return "/".join(str(k) for k in path) or "(the model itself)"


class NnxModel:
    """A Flax NNX module seen as ``init(key, x) -> {"params": p}`` and ``apply({"params": p}, x)``.

    Args:
      module: an ``nnx.Module`` instance (already initialised: NNX creates parameters in
        ``__init__``). It is not modified; every ``apply`` works on a fresh copy.
      trainable: an NNX filter choosing the trained state (default ``nnx.Param``); everything
        else is held fixed at the module's values (e.g. frozen base weights when the filter is
        ``nnx.LoRAParam``).

    Evaluation (:meth:`apply`, :meth:`apply_recording` without ``rng``) calls a copy in
    evaluation mode (``module.eval()``: dropout off, deterministic). Training
    (:meth:`apply_training`, through ``trainers.train_mode.TrainingCall``) calls a copy in
    training mode (``module.train()``) whose rng streams are reseeded from the step's key, the
    i-th stream in graph order with ``fold_in(rng, i)``, so every step draws afresh; each
    ``nnx.Dropout`` draws row r's mask from ``fold_in(layer key, slots[r])`` (the layer key: its
    stream's next key), as linen's dropout does (``trainers.train_mode``): one example's mask
    never depends on another example, and the ghost and ``vmap(grad)`` paths draw the same
    masks. Other code drawing from a stream itself gets keys per (step, chunk, stream, call),
    the same for every example of a chunk, never dependent on the data.

    Raises:
      ValueError: the module keeps batch statistics (``nnx.BatchStat``, e.g. ``nnx.BatchNorm``):
        they mix the examples of a batch. The message names the layer and points at
        ``dptune.fix_model``.
    """

    def __init__(self, module: nnx.Module, trainable: Any = nnx.Param):
        graphdef, params, rest = nnx.split(module, trainable, ...)
        for path, var in [*nnx.to_flat_state(params), *nnx.to_flat_state(rest)]:
            if isinstance(var, nnx.BatchStat):
                layer = _module_at(module, path[:-1])
                raise ValueError(
                    f"dptune: model={type(module).__name__}: layer {_where(path[:-1])!r} "
                    f"({type(layer).__name__}) keeps batch statistics (nnx.BatchStat), which mix "
                    "the examples of a batch; DP-SGD needs each example's gradient to depend on "
                    "that example alone: model, replaced = dptune.fix_model(model, x) swaps "
                    "BatchNorm for GroupNorm (x: an example batch)"
                )
        self.graphdef = graphdef
        self.name = type(module).__name__
        self.module_class = type(module)
        self._params = params
        self._rest = rest
        self._paths = [(path, tuple(str(k) for k in path)) for path, _ in nnx.to_flat_state(params)]
        #: Whether ``__call__`` takes ``rngs`` (then given ``train_mode.call_rngs``).
        self.takes_rngs = train_mode.takes_rngs(module)
        #: Whether training differs from evaluation: the module takes rngs at call time, holds
        #: rng state or a layer with a ``deterministic`` switch (what ``train()`` / ``eval()`` set).
        self.stochastic = self.takes_rngs or any(
            isinstance(node, nnx.RngStream)
            or (isinstance(node, nnx.Module) and hasattr(node, "deterministic"))
            for _, node in nnx.iter_graph(module)
        )

    def __repr__(self) -> str:
        return f"NnxModel({self.name})"

    def params(self) -> dict:
        """The module's trainable arrays as a nested dict (string keys), metadata dropped: plain
        arrays on the default device (a module made under a mesh holds arrays whose type names
        mesh axes, which dptune's per-example computations do not carry)."""
        flat = {keys: jnp.asarray(np.asarray(_value(var))) for (_, keys), (_, var) in zip(
            self._paths, nnx.to_flat_state(self._params), strict=True)}  # fmt: skip
        return traverse_util.unflatten_dict(flat)

    def held_params(self) -> dict[str, np.ndarray]:
        """The ``nnx.Param`` arrays the filter leaves out, held at the module's values (e.g. the
        frozen base under ``NnxModel(module, trainable=nnx.LoRAParam)``), as {'/'-joined path:
        array}; empty under the default filter."""
        return {
            "/".join(str(k) for k in path): np.asarray(_value(var))
            for path, var in nnx.to_flat_state(self._rest)
            if issubclass(getattr(var, "type", type(var)), nnx.Param)
        }

    def init(self, key: Any, x: Any) -> dict:
        """``{"params": self.params()}``: the module's own initial values, the same for every
        candidate (``key`` and ``x`` are accepted for the linen signature; NNX initialised the
        parameters at construction, from the module's own rngs, never from data)."""
        del key, x
        return {"params": self.params()}

    def selects(self, nnx_filter: Any) -> Callable[[str, Any], bool]:
        """``(path, leaf) -> bool`` over the '/'-joined paths of :meth:`params`: whether the NNX
        filter (e.g. ``nnx.LoRAParam``, ``nnx.PathContains("head")``) selects that parameter's
        Variable (what ``trainers.finetune.trainable_mask`` takes as ``trainable``)."""
        return _Selected(nnx_filter, self._matching(nnx.filterlib.to_predicate(nnx_filter)))

    def is_adapter(self, path: str) -> bool:
        """Whether the '/'-joined parameter path is an ``nnx.LoRAParam`` (an ``nnx.LoRA`` /
        ``nnx.LoRALinear`` factor: it starts at the module's own value when ``init=`` holds the
        base model's parameters without it)."""
        return path in self._matching(nnx.filterlib.OfType(nnx.LoRAParam))

    def has_adapters(self) -> bool:
        """Whether the trained state holds ``nnx.LoRAParam`` factors (then they train by
        default, as a ``with_lora`` model's adapters do)."""
        return bool(self._matching(nnx.filterlib.OfType(nnx.LoRAParam)))

    def _matching(self, predicate: Callable) -> frozenset[str]:
        return frozenset(
            "/".join(keys)
            for (path, keys), (_, var) in zip(
                self._paths, nnx.to_flat_state(self._params), strict=True
            )
            if predicate(path, var)
        )

    def trainable_state(self) -> nnx.State:
        """The module's trainable ``nnx.State`` as constructed (what ``load_release(like=...)``
        restores a release into)."""
        return self._params

    def state(self, params: Any) -> nnx.State:
        """``params`` (a nested dict as :meth:`params` returns) as the module's trainable
        ``nnx.State``, Variable metadata included: what ``nnx.update(module, state)`` and
        ``nnx.merge(graphdef, state, ...)`` take."""
        flat = traverse_util.flatten_dict(params)
        return nnx.from_flat_state(
            [
                (path, var.replace(value=flat[keys]))
                for (path, keys), (_, var) in zip(
                    self._paths, nnx.to_flat_state(self._params), strict=True
                )
            ]  # fmt: skip
        )

    def merge(self, params: Any) -> nnx.Module:
        """A fresh module with the trainable state ``params`` and the rest as constructed (fresh
        Variables: a layer that updates its state when called, such as an rng counter, updates
        the copy, inside the trace that made it)."""
        rest = jax.tree_util.tree_map(lambda v: v, self._rest)
        return nnx.merge(self.graphdef, self.state(params), rest)

    def _copy(self, params: Any, rng: jax.Array | None, slots: jax.Array | None) -> nnx.Module:
        """A fresh module with ``params``: in evaluation mode when ``rng`` is None, else in
        training mode with its rng streams reseeded from ``rng`` and its ``nnx.Dropout`` layers
        drawing per example, row r from ``slots[r]`` ((rows,) int32)."""
        module = self.merge(params)
        if rng is None:
            module.eval()
            return module
        module.train()
        if not jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
            rng = jax.random.wrap_key_data(rng)
        streams = [node for _, node in nnx.iter_graph(module) if isinstance(node, nnx.RngStream)]
        for i, stream in enumerate(streams):
            shape = stream.key.shape
            key = jax.random.fold_in(rng, i)
            stream.key.set_value(jax.random.split(key, shape) if shape else key)
            stream.count.set_value(jnp.zeros(shape, jnp.uint32))
        for _, node in nnx.iter_graph(module):
            if type(node) is nnx.Dropout:
                node.__class__ = _PerExampleDropout
                object.__setattr__(node, _SLOTS, slots)
        return module

    def apply(self, variables: dict, x: Any) -> Any:
        """The module's outputs on a batch ``x`` with ``variables["params"]``, in evaluation
        mode (deterministic)."""
        return self._call(self._copy(variables["params"], None, None), x, None)

    def apply_training(self, variables: dict, x: Any, rng: jax.Array, slots: jax.Array) -> Any:
        """The module's outputs in training mode with root key ``rng``, example r's dropout
        mask drawn from its slot ``slots[r]`` ((rows,) int32)."""
        return self._call(self._copy(variables["params"], rng, slots), x, rng)

    def apply_recording(
        self, params: Any, x: Any, recorder: Callable, rng: jax.Array | None = None,
        slots: jax.Array | None = None,
    ) -> Any:  # fmt: skip
        """:meth:`apply` (or :meth:`apply_training` with ``rng`` and ``slots``) with every known
        layer's call handed to ``recorder`` (a ``trainers.ghost`` recorder:
        ``recorder(next_fun, args, kwargs, context)``)."""
        module = self._copy(params, rng, slots)
        # why a module's own parameters would be read outside a known layer's call, for the
        # ghost plan's reason (read only when one is)
        notes = getattr(recorder, "notes", None)
        for path, node in nnx.iter_graph(module):
            keys = tuple(str(k) for k in path)
            if type(node) in NNX_LAYERS:
                node.__class__ = _recording_class(type(node))
                object.__setattr__(node, _RECORDING, (keys, recorder))
            elif notes is not None and isinstance(node, nnx.Module):
                notes[keys] = _not_known(type(node))
        return self._call(module, x, rng)

    def _call(self, module: nnx.Module, x: Any, rng: jax.Array | None) -> Any:
        """``module(x)``, with ``rngs=`` (``train_mode.call_rngs(rng)``) when it takes them."""
        return module(x, rngs=train_mode.call_rngs(rng)) if self.takes_rngs else module(x)


@dataclasses.dataclass(frozen=True)
class _Selected:
    """An NNX filter as ``trainable=``'s ``(path, leaf) -> bool``: the '/'-joined paths it
    selects."""

    nnx_filter: Any
    paths: frozenset[str]

    def __call__(self, path: str, leaf: Any) -> bool:
        del leaf
        return path in self.paths

    def __repr__(self) -> str:
        f = self.nnx_filter
        return f.__name__ if isinstance(f, type) else repr(f)


def _value(var: Any) -> Any:
    return var.get_value() if hasattr(var, "get_value") else var.value


def _module_at(module: Any, path: tuple) -> Any:
    node = module
    for k in path:
        node = node[k] if isinstance(k, int) else getattr(node, k)
    return node


#: Attribute on a training copy of an ``nnx.Dropout``: the examples' slots, (rows,) int32.
_SLOTS = "_dptune_slots"


class _PerExampleDropout(nnx.Dropout):
    """``nnx.Dropout`` drawing row r's mask from ``fold_in(layer key, slots[r])`` (the layer key:
    the next key of the rngs it would use); a call on another leading size, with a broadcast
    over the leading axis, or off, keeps Flax's own behaviour."""

    def __call__(self, inputs, *, deterministic=None, rngs=None):
        slots = self.__dict__[_SLOTS]
        det = self.deterministic if deterministic is None else deterministic
        source = self.rngs if rngs is None else rngs
        dims = {d % max(1, jnp.ndim(inputs)) for d in self.broadcast_dims}
        if (
            det is not False
            or self.rate in (0.0, 1.0)
            or source is None
            or jnp.ndim(inputs) == 0
            or inputs.shape[0] != slots.shape[0]
            or 0 in dims
        ):
            return super().__call__(inputs, deterministic=deterministic, rngs=rngs)
        if isinstance(source, nnx.Rngs):
            layer_key = source[self.rng_collection]()
        elif isinstance(source, nnx.RngStream):
            layer_key = source()
        else:
            layer_key = source
        return train_mode.slot_dropout(inputs, slots, layer_key, self.rate, dims)


# --- the known NNX layers and their linen twins -----------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Context:
    """What ``trainers.ghost``'s recorder reads from linen's interceptor context."""

    module: nn.Module
    method_name: str
    path: tuple[str, ...]
    #: the twin's one parameter when ``path`` names an array (an ``nnx.LoRA`` factor)
    leaf: str | None = None


#: Attribute on a traced copy of a known layer: (its path, the recorder).
_RECORDING = "_dptune_recording"


@functools.cache
def _recording_class(cls: type) -> type:
    """``cls`` with its ``__call__`` (and an ``nnx.Embed``'s ``attend``, a tied output layer)
    handed to the recorder stored on the instance (a subclass, made once per layer class: the
    copies being traced are switched to it)."""

    def recorded(name: str) -> Callable:
        base = getattr(cls, name)

        def method(self, *args, **kwargs):
            path, recorder = self.__dict__[_RECORDING]

            def next_fun(*a, **k):
                return base(self, *a, **k)

            frozen = getattr(recorder, "frozen", None)
            if frozen is not None and frozen(path):
                # a frozen layer (no trainable parameter) runs as written, unrecorded: what
                # trainers.ghost does for a linen layer, which it recognises by its bound path
                return next_fun(*args, **kwargs)

            twin, why = linen_twin(self)
            if twin is None:
                recorder.unsupported.append(f"{'/'.join(path)}: {why}")
                return next_fun(*args, **kwargs)
            if isinstance(self, nnx.LoRA):
                return _lora_call(self, path, recorder, twin, *args, **kwargs)
            # keyword arguments that change nothing (e.g. MultiHeadAttention passes
            # out_sharding=None to its projections) are dropped; any other reaches the
            # recorder, which refuses it
            same = {"out_sharding": None, "einsum_str": getattr(self, "einsum_str", None)}
            kwargs = {k: v for k, v in kwargs.items() if k not in same or v != same[k]}
            return recorder(next_fun, args, kwargs, _Context(twin, name, path))

        return method

    methods = {"__call__": recorded("__call__"), "__module__": cls.__module__}
    if issubclass(cls, nnx.Embed):
        methods["attend"] = recorded("attend")
    return type(cls.__name__, (cls,), methods)


def _not_known(cls: type) -> str:
    """An NNX module of class ``cls`` (not a known layer) in words: its class, and when it
    subclasses a known layer, why that is not enough."""
    base = next((k for k in cls.__mro__[1:] if k in NNX_LAYERS), None)
    if base is not None:
        return (
            f"a {cls.__name__}: a subclass of nnx.{base.__name__}, whose own code may compute "
            "something else"
        )
    return f"a {cls.__module__}.{cls.__qualname__}"


def _common(layer: Any) -> str | None:
    if getattr(layer, "promote_dtype", _nnx_promote_dtype) is not _nnx_promote_dtype:
        return "a custom promote_dtype"
    if getattr(layer, "preferred_element_type", None) is not None:
        return "preferred_element_type"
    return None


def _linear(layer: nnx.Linear) -> tuple[nn.Module | None, str | None]:
    if layer.dot_general is not jax.lax.dot_general:
        return None, "a custom dot_general"
    return nn.Dense(
        layer.out_features, use_bias=layer.use_bias, dtype=layer.dtype,
        param_dtype=layer.param_dtype, precision=layer.precision,
    ), None  # fmt: skip


def _linear_general(layer: nnx.LinearGeneral) -> tuple[nn.Module | None, str | None]:
    if layer.batch_axis:
        return None, "batch_axis (parameters per batch entry)"
    if layer.dot_general is not None or layer.dot_general_cls is not None:
        return None, "a custom dot_general"
    return nn.DenseGeneral(
        layer.out_features, axis=layer.axis, use_bias=layer.use_bias, dtype=layer.dtype,
        param_dtype=layer.param_dtype, precision=layer.precision,
    ), None  # fmt: skip


def _conv(layer: nnx.Conv) -> tuple[nn.Module | None, str | None]:
    if layer.conv_general_dilated is not jax.lax.conv_general_dilated:
        return None, "a custom conv_general_dilated"
    return nn.Conv(
        layer.out_features, layer.kernel_size, strides=layer.strides, padding=layer.padding,
        input_dilation=layer.input_dilation, kernel_dilation=layer.kernel_dilation,
        feature_group_count=layer.feature_group_count, use_bias=layer.use_bias,
        mask=layer.mask, dtype=layer.dtype, param_dtype=layer.param_dtype,
        precision=layer.precision,
    ), None  # fmt: skip


def _embed(layer: nnx.Embed) -> tuple[nn.Module | None, str | None]:
    return nn.Embed(
        layer.num_embeddings, layer.features, dtype=layer.dtype, param_dtype=layer.param_dtype
    ), None


def _norm_args(layer: Any) -> dict:
    return dict(
        epsilon=layer.epsilon, dtype=layer.dtype, param_dtype=layer.param_dtype,
        use_scale=layer.use_scale, axis_name=layer.axis_name,
        axis_index_groups=layer.axis_index_groups, use_fast_variance=layer.use_fast_variance,
    )  # fmt: skip


def _layer_norm(layer: nnx.LayerNorm) -> tuple[nn.Module | None, str | None]:
    return nn.LayerNorm(
        use_bias=layer.use_bias, reduction_axes=layer.reduction_axes,
        feature_axes=layer.feature_axes, **_norm_args(layer),
    ), None  # fmt: skip


def _rms_norm(layer: nnx.RMSNorm) -> tuple[nn.Module | None, str | None]:
    return nn.RMSNorm(
        reduction_axes=layer.reduction_axes, feature_axes=layer.feature_axes, **_norm_args(layer)
    ), None


def _group_norm(layer: nnx.GroupNorm) -> tuple[nn.Module | None, str | None]:
    if layer.feature_axis not in (-1,):
        return None, f"feature_axis={layer.feature_axis!r} (only the last axis)"
    return nn.GroupNorm(
        num_groups=layer.num_groups, use_bias=layer.use_bias,
        reduction_axes=layer.reduction_axes, **_norm_args(layer),
    ), None  # fmt: skip


def einsum_as_dense(einsum_str: str, kernel_shape: tuple, bias_shape: tuple | None):
    """``(features, axis, permutation, out_permutation)`` of the ``nn.DenseGeneral`` that computes
    ``einsum(einsum_str, x, kernel) (+ bias)`` up to the order of the kernel's and the output's
    axes, when the kernel contracts the input's trailing axes and adds output axes: e.g.
    ``"btd,dnh->btnh"``, ``"btnh,nhd->btd"``; with the kernel's axes in another order, gemma's
    ``"BTD,NDH->BTNH"``; with the output's axes in another order, gemma's key-value projection
    ``"BTD,CKDH->CBTKH"`` (the dense map to ``BTCKH``, its output axes then moved).

    ``permutation`` puts the kernel's axes in the dense order (contracted in the input's order,
    then added in the output's); ``out_permutation`` takes the dense output (the input's leading
    axes, then the added ones, each in their einsum order) to the einsum's output order
    (``jnp.transpose(dense_out, out_permutation)``); each is None when already in that order.
    ``features``: the added axes' sizes in the output's order (a bias must have this shape).
    Else a string saying why not: a kernel axis shared with the input and the output (a per-head
    kernel) makes the parameters per batch entry; an input axis missing from the output is a
    reduction over it; repeated axes take diagonals."""
    s = einsum_str.replace(" ", "")
    if "..." in s or "->" not in s or s.count(",") != 1:
        return f"einsum {einsum_str!r} (two operands, explicit output, no ellipsis)"
    ins, out = s.split("->")
    a, k = ins.split(",")
    n_c = sum(1 for c in k if c in a and c not in out)
    contracted, batch = a[len(a) - n_c :], a[: len(a) - n_c]
    added = "".join(c for c in out if c in k)
    if (
        not n_c
        or any(len(set(t)) != len(t) for t in (a, k, out))
        or sorted(k) != sorted(contracted + added)
        or sorted(out) != sorted(batch + added)
        or any(c in batch for c in k)
    ):
        return (
            f"einsum {einsum_str!r} is not a dense map of the input's trailing axes (kernel "
            "axes: the input's contracted trailing axes and output axes not in the input; the "
            "input's other axes all in the output)"
        )
    order = tuple(k.index(c) for c in contracted + added)
    features = tuple(int(kernel_shape[k.index(c)]) for c in added)
    if bias_shape is not None and tuple(bias_shape) != features:
        return f"einsum bias of shape {tuple(bias_shape)} (expected {features})"
    dense_out = batch + added
    out_order = tuple(dense_out.index(c) for c in out)

    def unless_identity(p: tuple[int, ...]) -> tuple[int, ...] | None:
        return None if p == tuple(range(len(p))) else p

    return features, tuple(range(-n_c, 0)), unless_identity(order), unless_identity(out_order)


class _PermutedDense(nn.Module):
    """The linen twin of an NNX einsum that is a dense map with its kernel's or its output's axes
    in another order: a ``Reparametrized`` ``nn.DenseGeneral`` on the kernel with its axes
    permuted, its output's axes then permuted (the norms are the dense layer's, from its
    batch-first output; ``trainers.ghost`` permutes the clipped kernel back)."""

    features: tuple[int, ...]
    axis: tuple[int, ...]
    permutation: tuple[int, ...]
    out_permutation: tuple[int, ...] | None
    use_bias: bool
    dtype: Any = None
    param_dtype: Any = jnp.float32
    precision: Any = None

    def as_known_layer(self) -> Reparametrized:
        perm = self.permutation
        dense = nn.DenseGeneral(
            self.features, axis=self.axis, use_bias=self.use_bias, dtype=self.dtype,
            param_dtype=self.param_dtype, precision=self.precision, parent=None,
        )  # fmt: skip
        return Reparametrized(
            dense, lambda raw: {**raw, "kernel": jnp.transpose(raw["kernel"], perm)}, perm,
            self.out_permutation,
        )  # fmt: skip


def _einsum(layer: nnx.Einsum) -> tuple[nn.Module | None, str | None]:
    if layer.einsum_op is not jnp.einsum:
        return None, "a custom einsum_op"
    bias = None if layer.bias is None or _value(layer.bias) is None else layer.bias_shape
    dense = einsum_as_dense(layer.einsum_str, tuple(layer.kernel_shape), bias)
    if isinstance(dense, str):
        return None, dense
    features, axis, permutation, out_permutation = dense
    common = dict(use_bias=bias is not None, dtype=layer.dtype, param_dtype=layer.param_dtype,
                  precision=layer.precision)  # fmt: skip
    if permutation is None and out_permutation is None:
        return nn.DenseGeneral(features, axis=axis, **common), None
    # an identity kernel permutation keeps ghost's permuted path (the dense norms, no VJP)
    permutation = permutation or tuple(range(len(layer.kernel_shape)))
    return _PermutedDense(features, axis, permutation, out_permutation, **common), None


def _lora(layer: nnx.LoRA) -> tuple[Any, str | None]:
    # x @ lora_a @ lora_b (nnx.LoRA has no scale) is two bias-free Dense layers, x -> rank ->
    # out, in the dtype flax's promote_dtype gives (x, lora_a, lora_b) (see _lora_call)
    dense = functools.partial(nn.Dense, use_bias=False, dtype=layer.dtype,
                              param_dtype=layer.param_dtype)  # fmt: skip
    return (dense(layer.lora_b.shape[0]), dense(layer.out_features)), None


def _lora_call(
    layer: nnx.LoRA, path: tuple[str, ...], recorder: Callable, twin: tuple, x: Any, **kwargs
) -> Any:
    """``nnx.LoRA.__call__`` with each factor recorded as its Dense twin's kernel: the
    per-example norms are formed from the rank-r activations (never a d_in x d_out matrix);
    ``base_module(x, **kwargs)`` is added as flax adds it (a known layer in it is recorded on
    its own, or runs as written when frozen)."""
    dtype = layer.dtype or jnp.result_type(x, layer.lora_a.dtype, layer.lora_b.dtype)
    # frozen factors (both or neither: ghost refuses a partly trainable layer) run as written
    frozen = getattr(recorder, "frozen", None)
    as_written = frozen is not None and frozen((*path, "lora_a"))
    out = x = jnp.asarray(x, dtype)
    for dense, name in zip(twin, ("lora_a", "lora_b"), strict=True):

        def next_fun(v, name=name):
            return v @ jnp.asarray(getattr(layer, name)[...], dtype)

        context = _Context(dense, "__call__", (*path, name), "kernel")
        out = next_fun(out) if as_written else recorder(next_fun, (out,), {}, context)
    if layer.base_module is not None:
        out = out + layer.base_module(x, **kwargs)
    return out


#: Known NNX layer types (exact: a subclass may compute something else) -> their linen twin.
NNX_LAYERS: dict[type, Callable] = {
    nnx.Linear: _linear,
    nnx.LinearGeneral: _linear_general,
    nnx.Conv: _conv,
    nnx.Embed: _embed,
    nnx.LayerNorm: _layer_norm,
    nnx.RMSNorm: _rms_norm,
    nnx.GroupNorm: _group_norm,
    nnx.Einsum: _einsum,
    nnx.LoRA: _lora,
}


def linen_twin(layer: Any) -> tuple[Any, str | None]:
    """The unbound linen layer computing what the known NNX ``layer`` computes, from parameters
    with the same names and shapes (for ``nnx.LoRA``: the Dense layers of its two factors, whose
    kernels are ``lora_a`` and ``lora_b``); or (None, why not)."""
    why = _common(layer)
    if why:
        return None, why
    for cls in type(layer).__mro__:
        make = NNX_LAYERS.get(cls)
        if make is not None:
            return make(layer)
    return None, f"{type(layer).__name__} is not a known layer"
