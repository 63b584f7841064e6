"""``dptune.fix_model``: batch normalisation replaced by group normalisation, so that a model's
per-example gradients depend on that example alone (the rule of Opacus's ``ModuleValidator.fix``:
``gcd(32, channels)`` groups, the same epsilon, scale and bias), except on features without
positions (a BatchNorm after a dense layer), which get one group: Opacus's groups would hold one
or two values each there, and a group of one value normalises to 0 (:func:`groups_for`).

* Flax NNX: the module graph is walked and every ``nnx.BatchNorm`` attribute (or list entry) is
  replaced by an ``nnx.GroupNorm`` of the same feature count, on a copy of the module.
* Flax linen: layers are built when the module is called (``@nn.compact`` modules such as
  Flax's ResNet construct ``nn.BatchNorm`` inside ``__call__``), so the module is wrapped: while
  the wrapper runs, an interceptor (``nn.intercept_methods``) answers every ``nn.BatchNorm`` call
  with an ``nn.GroupNorm`` that shares the BatchNorm's scope. Its parameters (``scale``,
  ``bias``) sit where the BatchNorm's did, no ``batch_stats`` are created, and the ghost path sees
  a known ``nn.GroupNorm``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
from flax import nnx

from trainers.train_mode import takes_rngs

log = logging.getLogger("dptune")


def groups_for(channels: int, positions: int = 2) -> int:
    """The group count for ``channels`` channels at ``positions`` positions per example (the
    product of the axes between the batch and the channels): Opacus's ``gcd(32, channels)`` for
    feature maps, and 1 (LayerNorm's normalisation, with a scale and bias per channel) for
    features without positions, where those groups would hold one or two values each (a group
    of one value normalises to 0: the layer's output would be its bias, whatever its input)."""
    return math.gcd(32, int(channels)) if positions > 1 else 1


def _positions(shape: tuple[int, ...]) -> int:
    """Positions per example of a (batch, ..., channels) input."""
    return math.prod(shape[1:-1])


@dataclasses.dataclass(frozen=True)
class Replaced:
    """One replaced layer: where it is and the group norm it became."""

    path: str
    channels: int | None
    groups: int | None

    def __str__(self) -> str:
        if self.channels is None:
            return f"{self.path}: BatchNorm -> GroupNorm(gcd(32, channels) groups)"
        groups = f"{self.groups} group{'s' if self.groups != 1 else ''}"
        return f"{self.path}: BatchNorm({self.channels}) -> GroupNorm({groups})"


def fix_model(module: Any, x: Any = None) -> tuple[Any, list[Replaced]]:
    """``module`` with every BatchNorm replaced by a GroupNorm of ``gcd(32, channels)`` groups,
    and the list of replaced layers (also logged at INFO).

    Args:
      module: a flax NNX module (a fixed copy is returned; the original is unchanged) or an
        unbound flax linen module (wrapped: the result's parameters have the original's paths,
        the BatchNorms' ``scale`` and ``bias`` included; ``batch_stats`` disappear).
      x: an example batch (an array or ``jax.ShapeDtypeStruct``; traced, never computed on).
        NNX: it shows which BatchNorms read features without positions (one group, see
        :func:`groups_for`); without it every NNX BatchNorm gets ``gcd(32, channels)`` groups,
        and the model check refuses one whose groups then hold a single value. Linen: it
        lists the replaced layers (linen builds its layers when called; the groups are chosen
        from each call's input, with or without it).

    Returns:
      (fixed module, replaced layers).
    """
    if isinstance(module, nnx.Module):
        fixed, replaced = _fix_nnx(module, x)
    elif isinstance(module, nn.Module):
        if module.scope is not None:
            raise ValueError(
                f"dptune: fix_model(module={type(module).__name__}): pass an unbound module"
            )
        fixed = GroupNormForBatchNorm(module)
        replaced = [] if x is None else _traced_replacements(fixed, x)
    else:
        raise TypeError(
            f"dptune: fix_model(module={module!r:.60}): expected a flax linen or nnx Module"
        )
    if replaced:
        log.info(
            "fix_model: %d BatchNorm layer(s) replaced by GroupNorm: %s",
            len(replaced), "; ".join(map(str, replaced)),
        )  # fmt: skip
    return fixed, replaced


# --- NNX ---------------------------------------------------------------------------------------


def _group_norm_for(bn: nnx.BatchNorm, positions: int) -> nnx.GroupNorm:
    if bn.axis not in (-1,):
        raise ValueError(
            f"dptune: fix_model: a BatchNorm over axis {bn.axis} (GroupNorm normalises the last "
            "axis): move the channels last"
        )
    c = int(bn.num_features)
    gn = nnx.GroupNorm(
        c, num_groups=groups_for(c, positions), epsilon=bn.epsilon, dtype=bn.dtype,
        param_dtype=bn.param_dtype, use_bias=bn.use_bias, use_scale=bn.use_scale,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    # the BatchNorm's learned affine map carries over (ones and zeros when fresh)
    if bn.use_scale:
        gn.scale.set_value(bn.scale.get_value())
    if bn.use_bias:
        gn.bias.set_value(bn.bias.get_value())
    return gn


def _fix_nnx(module: nnx.Module, x: Any = None) -> tuple[nnx.Module, list[Replaced]]:
    fixed = nnx.clone(module)
    found = [(path, node) for path, node in nnx.iter_graph(fixed) if type(node) is nnx.BatchNorm]
    shapes = {} if x is None or not found else _nnx_batchnorm_inputs(module, x)
    replaced = []
    for path, bn in found:
        parent = fixed
        for k in path[:-1]:
            parent = parent[k] if isinstance(k, int) else getattr(parent, k)
        positions = _positions(shapes[path]) if path in shapes else 2  # unseen: feature maps
        gn = _group_norm_for(bn, positions)
        if isinstance(path[-1], int):
            parent[path[-1]] = gn
        else:
            setattr(parent, path[-1], gn)
        c = int(bn.num_features)
        replaced.append(Replaced("/".join(str(k) for k in path), c, gn.num_groups))
    return fixed, replaced


#: Attribute on a probe copy's BatchNorm: its graph path in the module.
_PATH = "_dptune_path"


def _nnx_batchnorm_inputs(module: nnx.Module, x: Any) -> dict[tuple, tuple[int, ...]]:
    """The input shape of each ``nnx.BatchNorm`` of ``module`` (by graph path) when it is called
    on ``x``, traced on a copy in evaluation mode whose BatchNorms record their input and pass it
    through (nothing is computed). Empty when the trace fails."""
    shapes: dict[tuple, tuple[int, ...]] = {}

    class InputShapeOf(nnx.BatchNorm):
        def __call__(self, x, *args, **kwargs):
            shapes[self.__dict__[_PATH]] = tuple(x.shape)
            return x

    probe = nnx.clone(module)
    probe.eval()
    for path, node in nnx.iter_graph(probe):
        if type(node) is nnx.BatchNorm:
            node.__class__ = InputShapeOf
            object.__setattr__(node, _PATH, tuple(path))
    kwargs = {"rngs": nnx.Rngs(0)} if takes_rngs(probe) else {}
    graphdef, state = nnx.split(probe)  # merged inside the trace: lifted transforms trace too

    def call(state, x):
        nnx.merge(graphdef, state)(x, **kwargs)

    try:
        jax.eval_shape(call, state, x)
    except Exception as e:  # the groups fall back to gcd(32, channels); the check guards them
        log.info("fix_model: could not trace the module on x (%s: %.200s)", type(e).__name__, e)
        return {}
    return shapes


# --- linen -------------------------------------------------------------------------------------


class GroupNormForBatchNorm(nn.Module):
    """``inner`` with every ``nn.BatchNorm`` call answered by an ``nn.GroupNorm`` (``gcd(32,
    channels)`` groups, the BatchNorm's epsilon, dtypes, scale and bias settings) in the
    BatchNorm's own scope. The parameters have ``inner``'s paths (the wrapper shares its scope).
    """

    inner: nn.Module
    #: It forwards its call and keywords unchanged: ``train_mode.call_keyword`` reads ``inner``'s.
    forwards_call: ClassVar[bool] = True

    def setup(self):
        nn.share_scope(self, self.inner)

    def __call__(self, *args, **kwargs):
        with nn.intercept_methods(_batchnorm_as_groupnorm):
            return self.inner(*args, **kwargs)


def _batchnorm_as_groupnorm(next_fun, args, kwargs, context):
    bn = context.module
    if type(bn) is not nn.BatchNorm or context.method_name != "__call__":
        return next_fun(*args, **kwargs)
    x = args[0]
    if kwargs.get("mask") is not None or len(args) > 2:
        where = "/".join(bn.path)
        raise ValueError(f"dptune: fix_model: {where}: a BatchNorm mask is not supported")
    if bn.axis not in (-1, x.ndim - 1):
        raise ValueError(
            f"dptune: fix_model: {'/'.join(bn.path)}: a BatchNorm over axis {bn.axis} (GroupNorm "
            "normalises the last axis): move the channels last"
        )
    c = x.shape[-1]
    gn = nn.GroupNorm(
        num_groups=groups_for(c, _positions(x.shape)), epsilon=bn.epsilon, dtype=bn.dtype,
        param_dtype=bn.param_dtype, use_bias=bn.use_bias, use_scale=bn.use_scale,
        bias_init=bn.bias_init, scale_init=bn.scale_init, parent=bn.scope,
    )  # fmt: skip
    return gn(x)


def _traced_replacements(fixed: GroupNormForBatchNorm, x: Any) -> list[Replaced]:
    """The BatchNorm layers of ``fixed.inner`` (paths, channels), by tracing ``init`` on ``x``'s
    shape (nothing is computed)."""
    seen: list[Replaced] = []

    def spy(next_fun, args, kwargs, context):
        m = context.module
        if type(m) is nn.BatchNorm and context.method_name == "__call__":
            c = int(args[0].shape[-1])
            seen.append(Replaced("/".join(m.path), c, groups_for(c, _positions(args[0].shape))))
        return next_fun(*args, **kwargs)

    def init(x):
        with nn.intercept_methods(spy):
            return fixed.init(jax.random.PRNGKey(0), x)

    jax.eval_shape(init, jax.ShapeDtypeStruct(x.shape, x.dtype))
    return list(dict.fromkeys(seen))
