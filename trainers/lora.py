"""LoRA adapters for an existing Flax (linen) module, without editing its source.

``with_lora(module, rank=r, targets=["Dense_0"])`` returns a module whose targeted layers (Dense,
DenseGeneral, Conv, Embed; by '/'-joined path, regexes searched like ``trainable=``) compute
``layer(x) + scale * B(A(x))`` (Hu et al. 2021, "LoRA"), with

* A: a layer of the target's own kind onto ``rank`` features (Dense / DenseGeneral on the same
  input axes, Conv with the same window, strides, padding and dilations, Embed of the same
  vocabulary), no bias, the target's default kernel initialiser;
* B: an ``nn.Dense`` (``nn.DenseGeneral`` for a DenseGeneral target) from ``rank`` to the
  target's features, no bias, initialised to zero, so the adapted model starts equal to the base.

How: the returned module shares its scope with the base module (``nn.share_scope``), so every base
parameter keeps its path and the base's parameters load into it unchanged (``init=``); while the
base runs, an ``nn.intercept_methods`` interceptor adds the adapter to each targeted layer's
``__call__`` output. The adapters live at the top level as ``lora_<path with '/' as '_'>/{a,b}``
(one per targeted layer, shared by its calls). Cloning the base with replaced submodules was the
alternative: it cannot reach layers created inside ``@nn.compact`` methods, which is how most
modules are written.

Per-example clipping: A and B are plain Dense / Conv / Embed layers, so the ghost path
(``trainers.ghost``) forms their per-example gradient norms in rank space: d_in x r and r x d_out
per example (or their T x T ghost Grams), never a per-example d_in x d_out matrix; the frozen base
layers get no norm terms at all.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax

#: Adapter modules' names start so; ``trainable`` defaults to the parameters under them.
PREFIX = "lora_"
#: The default ``trainable`` of an adapted module: its adapters.
TRAINABLE = (r"(^|/)lora_",)

_TARGET_KINDS = (nn.Dense, nn.DenseGeneral, nn.Conv, nn.Embed)


class _Adapter(nn.Module):
    """B(A(x)) for one targeted layer (an unbound copy of it in ``target``)."""

    target: nn.Module
    rank: int

    @nn.compact
    def __call__(self, x):
        t = self.target
        common = dict(use_bias=False, dtype=t.dtype, param_dtype=t.param_dtype)
        if type(t) is nn.Embed:
            a = nn.Embed(t.num_embeddings, self.rank, dtype=t.dtype, param_dtype=t.param_dtype,
                         name="a")(x)  # fmt: skip
            return nn.Dense(t.features, kernel_init=nn.initializers.zeros, name="b", **common)(a)
        if type(t) is nn.DenseGeneral:
            a = nn.DenseGeneral(self.rank, axis=t.axis, name="a", **common)(x)
            return nn.DenseGeneral(
                t.features, axis=-1, kernel_init=nn.initializers.zeros, name="b", **common
            )(a)
        if type(t) is nn.Conv:
            a = nn.Conv(
                self.rank, t.kernel_size, strides=t.strides, padding=t.padding,
                input_dilation=t.input_dilation, kernel_dilation=t.kernel_dilation, name="a",
                **common,
            )(x)  # fmt: skip
            return nn.Dense(t.features, kernel_init=nn.initializers.zeros, name="b", **common)(a)
        a = nn.Dense(self.rank, name="a", **common)(x)
        return nn.Dense(t.features, kernel_init=nn.initializers.zeros, name="b", **common)(a)


class LoRA(nn.Module):
    """``base`` with rank-``rank`` adapters on the layers matched by ``targets`` (see the module
    docstring); build it with :func:`with_lora`. ``scale`` multiplies the adapters' output (Hu
    et al.'s alpha / r)."""

    base: nn.Module
    rank: int
    targets: tuple[str, ...]
    scale: float = 1.0

    def setup(self):
        nn.share_scope(self, self.base)

    def targeted(self, path: Sequence[str]) -> bool:
        """Whether the layer at ``path`` (its module path) gets an adapter."""
        where = "/".join(path)
        if path and path[0].startswith(PREFIX):
            return False
        return any(re.search(t, where) for t in self.targets)

    @nn.compact
    def __call__(self, x, *args, **kwargs):
        """``base(x, *args, **kwargs)`` with the adapters added to the targeted layers' outputs."""
        adapters: dict[str, _Adapter] = {}

        def intercept(next_fun, args, kwargs, context):
            m = context.module
            if (
                context.method_name != "__call__"
                or type(m) not in _TARGET_KINDS
                or m.scope is None
                or not self.targeted(m.path)
            ):
                return next_fun(*args, **kwargs)
            y = next_fun(*args, **kwargs)
            key = "/".join(m.path)
            if key not in adapters:
                name = PREFIX + "_".join(m.path)
                if any(a.name == name for a in adapters.values()):
                    raise ValueError(f"two targeted layers map to the adapter name {name!r}")
                adapters[key] = _Adapter(m.clone(parent=None), self.rank, name=name, parent=self)
            return y + self.scale * adapters[key](args[0]).astype(y.dtype)

        with nn.intercept_methods(intercept):
            return self.base(x, *args, **kwargs)


# dptune finds a model's dropout switch in its class's __call__ signature
# (``trainers.train_mode.call_keyword``): an adapted model whose base has one shows it too, and
# passes it on only when given (the base's default otherwise).
class _LoRATrain(LoRA):
    def __call__(self, x, *args, train: Any = None, **kwargs):
        return super().__call__(x, *args, **kwargs, **({} if train is None else {"train": train}))


class _LoRADeterministic(LoRA):
    def __call__(self, x, *args, deterministic: Any = None, **kwargs):
        given = {} if deterministic is None else {"deterministic": deterministic}
        return super().__call__(x, *args, **kwargs, **given)


_WITH_KEYWORD = {"train": _LoRATrain, "deterministic": _LoRADeterministic}


def with_lora(
    module: nn.Module, rank: int, targets: Sequence[str] | str, scale: float = 1.0
) -> LoRA:
    """``module`` with rank-``rank`` LoRA adapters on the Dense / DenseGeneral / Conv / Embed
    layers whose '/'-joined module path matches one of ``targets`` (layer names such as
    ``"Dense_0"`` or regexes, searched). The adapted module's parameters are the base's (same
    paths) plus ``lora_*/a`` and ``lora_*/b``; B starts at zero, so the adapted model starts equal
    to the base.

    Raises:
      ValueError: rank < 1, no targets, or a target that is not a regex (one that matches no
        layer is refused when the model meets its input: :func:`targeted_layers`).
    """
    if isinstance(rank, bool) or int(rank) != rank or rank < 1:
        raise ValueError(f"rank={rank!r}: a LoRA rank is an integer >= 1")
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    if not targets:
        raise ValueError("targets=[]: name the layers to adapt, e.g. ['Dense_0']")
    for t in targets:
        try:
            re.compile(t)
        except re.error as e:
            raise ValueError(f"targets: {t!r} is not a regex ({e})") from None
    if not isinstance(module, nn.Module) or module.scope is not None:
        from flax import nnx

        if isinstance(module, nnx.Module):
            raise ValueError(
                "with_lora is for flax.linen modules: an NNX model brings its own adapters "
                "(nnx.LoRALinear or nnx.LoRA layers) and trains them with "
                "DpSgdTrainer(..., trainable=nnx.LoRAParam) (docs/finetune.md)"
            )
        what = "a bound module" if isinstance(module, nn.Module) else type(module).__name__
        raise ValueError(f"with_lora takes an unbound flax.linen Module (e.g. MLP()), not {what}")
    from trainers.train_mode import call_keyword

    cls = _WITH_KEYWORD.get(call_keyword(module), LoRA)
    return cls(module, int(rank), targets, float(scale))


def targeted_layers(model: LoRA, x: Any) -> list[str]:
    """'/'-joined module paths of the layers of ``model.base`` that get an adapter, on an example
    input ``x`` (an array or ``ShapeDtypeStruct`` with a batch axis; traced abstractly).

    Raises:
      ValueError: a target pattern that matches no Dense / DenseGeneral / Conv / Embed layer.
    """
    seen: list[str] = []

    def spy(next_fun, args, kwargs, context):
        m = context.module
        if context.method_name == "__call__" and type(m) in _TARGET_KINDS and m.scope is not None:
            path = "/".join(m.path)
            if path not in seen:
                seen.append(path)
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(spy):
        jax.eval_shape(model.base.init, jax.random.PRNGKey(0), x)
    for t in model.targets:
        if not any(re.search(t, p) for p in seen):
            raise ValueError(
                f"target {t!r} matches no Dense / DenseGeneral / Conv / Embed layer of "
                f"{type(model.base).__name__} (its layers: {', '.join(seen) or 'none'})"
            )
    return [p for p in seen if model.targeted(p.split("/"))]


def is_adapter(path: str) -> bool:
    """Whether a '/'-joined parameter path is an adapter's (fresh when a base's ``init`` is
    loaded)."""
    return path.split("/", 1)[0].startswith(PREFIX)
