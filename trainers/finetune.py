"""Fine-tuning: a pretrained (public) start and a trainable part of the parameters.

* **Initial parameters** (:func:`read_init`): a params pytree, an orbax checkpoint folder, a Flax
  msgpack file (``flax.serialization.to_bytes`` / ``msgpack_serialize``) or an ``.npz`` whose keys
  are '/'-joined parameter paths (``"Dense_0/kernel"``). :func:`match_init` checks them against
  the module's parameter shapes and dtypes (exactly; the first mismatching path in one line) and
  :func:`fingerprint` names them in the privacy statement: DP-SGD's guarantee holds for the
  training that starts from them only if they are public, i.e. independent of the private data.
* **A trainable part** (:func:`trainable_mask`): regex patterns searched in the '/'-joined paths,
  or a callable ``(path, leaf) -> bool`` (an NNX model's filter, e.g. ``nnx.LoRAParam``, becomes
  one through ``trainers.nnx_model.NnxModel.selects``); the result is a pytree of Python bools
  shaped like the parameters (static: it decides what a step computes, never a traced value).
  Only trainable leaves are clipped, noised and updated (``trainers.step``); frozen leaves are
  passed through the step as they came in, so they come out bitwise equal to the start.

Parameter paths: the keys of nested dicts (flax's params) joined by '/', sequence indices as
their decimal string.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def path_str(keypath: Sequence[Any]) -> str:
    """A jax key path as the '/'-joined parameter path (``("Dense_0", "kernel")`` ->
    ``"Dense_0/kernel"``)."""
    parts = []
    for k in keypath:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def flat_paths(tree: Any) -> dict[str, Any]:
    """{'/'-joined path: leaf} of a pytree, in the tree's flattening order."""
    return {path_str(k): v for k, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def fingerprint(params: Any) -> str:
    """``sha256:<hex>`` of the parameters' values: every leaf's path, dtype, shape and bytes (C
    order), in sorted path order. Equal for equal values whatever the container types."""
    h = hashlib.sha256()
    for path, leaf in sorted(flat_paths(params).items()):
        a = np.ascontiguousarray(np.asarray(leaf))
        h.update(f"{path}|{a.dtype.str}|{a.shape}\n".encode())
        h.update(a.tobytes())
    return "sha256:" + h.hexdigest()


def _unflatten(flat: Mapping[str, np.ndarray]) -> dict:
    out: dict = {}
    for path, v in flat.items():
        node = out
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = v
    return out


def read_init(source: Any) -> dict:
    """Initial parameters from ``source`` as a nested dict of NumPy arrays (values bitwise as
    stored).

    Args:
      source: a params pytree (nested dicts of arrays, e.g. ``module.init(...)["params"]``, or
        flax's ``{"params": ...}``), a Flax NNX module or its ``nnx.State`` (its ``nnx.Param``
        arrays), an orbax checkpoint folder (``orbax.checkpoint.StandardCheckpointer`` or
        ``PyTreeCheckpointer`` layout), a Flax msgpack file (``*.msgpack``), or an ``.npz`` of
        '/'-joined parameter paths. Partitioning boxes (``nn.Partitioned``) are left for
        :func:`match_init` to open.

    Raises:
      ValueError: a path that does not exist, or a source in none of these formats; the
        message says which formats are read and leaves naming the source to the caller.
    """
    from flax import nnx

    if isinstance(source, nnx.Module):
        source = nnx.state(source, nnx.Param)
    if isinstance(source, nnx.State):  # nnx.state(model) also holds RNG and other state
        source = nnx.to_pure_dict(source.filter(nnx.Param))
    if isinstance(source, Mapping):
        if "params" in source and len(source) == 1:
            source = source["params"]  # flax's variables dict
        return jax.tree_util.tree_map_with_path(_as_array, _as_dicts(source))
    if not isinstance(source, (str, Path)) or not str(source):
        raise ValueError(_FORMATS)
    path = Path(source).expanduser()
    if path.is_dir():
        import orbax.checkpoint as ocp  # heavy: only for an orbax start

        try:
            with ocp.PyTreeCheckpointer() as ckpt:
                tree = ckpt.restore(path.absolute())
        except Exception as e:
            raise ValueError(
                f"not an orbax checkpoint folder ({type(e).__name__}: {e!s:.200})"
            ) from None
        return read_init(tree)
    if not path.is_file():
        raise ValueError("no such file or folder")
    if path.suffix == ".npz":
        with np.load(path, allow_pickle=False) as z:
            return read_init(_unflatten({k: z[k] for k in z.files}))
    if path.suffix == ".msgpack":
        from flax import serialization

        tree = serialization.msgpack_restore(path.read_bytes())
        return read_init(tree)
    raise ValueError(_FORMATS)


_FORMATS = (
    "initial parameters are a params pytree (nested dicts of arrays), an orbax checkpoint "
    "folder, a .msgpack file (flax.serialization), an .npz of '/'-joined parameter paths or a "
    "dptune release"
)


def _as_array(keypath: Sequence[Any], leaf: Any) -> np.ndarray:
    """``leaf`` as a NumPy array; ValueError naming its path when NumPy cannot hold it (e.g. an
    NNX RNG key)."""
    try:
        return np.asarray(leaf)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"the value at {path_str(keypath)!r} is not an array of numbers ({type(e).__name__}: "
            f"{e!s:.80}); an NNX model's start is its nnx.Param state: nnx.state(model, nnx.Param)"
        ) from None


def _as_dicts(tree: Any) -> Any:
    """flax FrozenDicts (and other mappings) as plain nested dicts."""
    if isinstance(tree, Mapping):
        return {str(k): _as_dicts(v) for k, v in tree.items()}
    return tree


def match_init(
    init: Any, shapes: Any, fresh: Callable[[str], bool] | None = None
) -> dict[str, np.ndarray]:
    """The initial parameters as {'/'-joined path: array}, checked against the module's parameter
    shapes: every path of ``shapes`` (a pytree of arrays or ``ShapeDtypeStruct``) must be in
    ``init`` with exactly its shape and dtype, except paths for which ``fresh(path)`` is true
    (new parameters, e.g. LoRA adapters: initialised by the module when ``init`` lacks them),
    and ``init`` holds nothing else.

    Raises:
      ValueError: one line naming the first mismatching path (in the module's order) and what
        differs.
    """
    given = flat_paths(init)
    want = flat_paths(shapes)
    for path in want:  # a partitioning box (nn.Partitioned) holds its array under "value"
        if path not in given and f"{path}/value" in given:
            given[path] = given.pop(f"{path}/value")
    out: dict[str, np.ndarray] = {}
    for path, s in want.items():
        if path not in given:
            if fresh is not None and fresh(path):
                continue
            raise ValueError(f"parameter {path!r} of the module is missing from the init")
        v = np.asarray(given[path])
        if tuple(v.shape) != tuple(s.shape) or v.dtype != np.dtype(s.dtype):
            raise ValueError(
                f"parameter {path!r}: the init holds {v.dtype}{list(v.shape)}, the module "
                f"expects {np.dtype(s.dtype)}{list(s.shape)}"
            )
        out[path] = v
    extra = [p for p in given if p not in want]
    if extra:
        raise ValueError(f"the init holds {extra[0]!r}, which the module has no parameter for")
    return out


def overlay(params: Any, init: Mapping[str, Any]) -> Any:
    """``params`` with every leaf whose path is in ``init`` replaced by that value (as stored)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    return jax.tree_util.tree_unflatten(treedef, [init.get(path_str(k), v) for k, v in leaves])


# --- the trainable part -----------------------------------------------------------------------


def is_nnx_filter(trainable: Any) -> bool:
    """Whether ``trainable`` is a Flax NNX filter (a Variable type such as ``nnx.LoRAParam``, or
    a filter object such as ``nnx.PathContains("head")``), which chooses by the Variables of an
    NNX model (``trainers.nnx_model.NnxModel.selects``), not by paths alone."""
    from flax import nnx

    if isinstance(trainable, type):
        return issubclass(trainable, nnx.Variable)
    return type(trainable).__module__ == nnx.filterlib.__name__


def trainable_mask(params: Any, trainable: Any) -> Any:
    """A pytree of Python bools shaped like ``params``: which leaves train.

    Args:
      params: the parameters (arrays or ``ShapeDtypeStruct``).
      trainable: None (everything), a regex or a list of regexes searched (``re.search``) in
        each leaf's '/'-joined path (``["Dense_1"]``, ``[".*lora.*"]``), or a callable
        ``(path, leaf) -> bool``.

    Raises:
      ValueError: a pattern that is not a valid regex, a choice that trains nothing, or an NNX
        filter (for an NNX model it is read by ``NnxModel.selects`` first).
    """
    if trainable is None:
        return jax.tree_util.tree_map(lambda _: True, params)
    if is_nnx_filter(trainable):
        name = trainable.__name__ if isinstance(trainable, type) else repr(trainable)
        raise ValueError(
            f"trainable={name}: an NNX filter chooses parameters of a Flax NNX model; for this "
            "model give regexes searched in the '/'-joined parameter paths or a callable "
            "(path, leaf) -> bool"
        )
    if callable(trainable):
        test = trainable
    else:
        if isinstance(trainable, str) and _is_list_literal(trainable):
            raise ValueError(
                f"trainable={trainable!r} is one regex, not a list: join the patterns with '|' "
                "(e.g. 'Dense_1|Dense_2'); as written it is a character class that matches "
                "nearly every path"
            )
        try:
            pats = [trainable] if isinstance(trainable, str) else list(trainable)
            compiled = [re.compile(p) for p in pats]
        except (re.error, TypeError) as e:
            raise ValueError(
                f"trainable={trainable!r}: not a list of regexes ({e}); give regexes searched in "
                "the '/'-joined parameter paths (['Dense_1']) or a callable (path, leaf) -> bool"
            ) from None

        def test(path, _leaf):
            return any(c.search(path) for c in compiled)

    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    try:
        mask = [bool(test(path_str(k), v)) for k, v in leaves]
    except TypeError as e:  # e.g. a callable of one argument
        raise ValueError(
            f"trainable={trainable!r}: called as (path, leaf) -> bool, it raised TypeError: {e}"
        ) from None
    if not any(mask):
        paths = ", ".join(path_str(k) for k, _ in leaves[:4])
        comma = isinstance(trainable, str) and "," in trainable
        raise ValueError(
            f"trainable={trainable!r} matches no parameter (paths look like: {paths}, ...)"
            + ("; join patterns with '|' (e.g. 'Dense_1|Dense_2')" if comma else "")
        )
    return jax.tree_util.tree_unflatten(treedef, mask)


def _is_list_literal(text: str) -> bool:
    """Whether ``text`` is a Python list or tuple of strings written out (``"['a', 'b']"``)."""
    import ast

    try:
        value = ast.literal_eval(text.strip())
    except (ValueError, SyntaxError):
        return False
    return isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)


def all_trainable(mask: Any) -> bool:
    return mask is None or all(jax.tree_util.tree_leaves(mask))


def partition(params: Any, mask: Any) -> tuple[Any, Any]:
    """(trainable, frozen): two pytrees shaped like ``params`` with ``None`` in place of the
    other part's leaves (None is an empty subtree to JAX and optax)."""
    t = jax.tree_util.tree_map(lambda m, p: p if m else None, mask, params)
    f = jax.tree_util.tree_map(lambda m, p: None if m else p, mask, params)
    return t, f


def combine(trainable: Any, frozen: Any, mask: Any) -> Any:
    """The inverse of :func:`partition`."""
    leaves, treedef = jax.tree_util.tree_flatten(mask)
    t = iter(jax.tree_util.tree_leaves(trainable))
    f = iter(jax.tree_util.tree_leaves(frozen))
    return jax.tree_util.tree_unflatten(treedef, [next(t) if m else next(f) for m in leaves])


def keep_frozen(new: Any, old: Any, mask: Any) -> Any:
    """``new`` at trainable leaves and ``old`` (the very same arrays) at frozen ones: a static
    selection, so frozen leaves stay bitwise as they came in."""
    return jax.tree_util.tree_map(lambda m, n, o: n if m else o, mask, new, old)


def zeros_at_frozen(grads: Any, params: Any, mask: Any) -> Any:
    """A gradient of the trainable part (``None`` at frozen leaves) completed with zeros."""
    t = iter(jax.tree_util.tree_leaves(grads))
    leaves, treedef = jax.tree_util.tree_flatten(params)
    return jax.tree_util.tree_unflatten(
        treedef,
        [
            next(t) if m else jnp.zeros_like(p)
            for m, p in zip(jax.tree_util.tree_leaves(mask), leaves, strict=True)
        ],
    )


def masked_clipped_sum(naive: Callable, apply_fn: Callable, mask: Any) -> Callable:
    """A ``vmap(grad)`` clipped sum over the trainable leaves only: per-example gradients with
    respect to the trainable subtree, the frozen one closed over (no per-example gradient of a
    frozen leaf is formed).

    Args:
      naive: ``naive(apply_fn, params, x, y, mask, clip_norm) -> (sum, loss sum, norms)``, e.g.
        ``functools.partial(trainers.dpsgd.clipped_sum_naive, loss=..., copies=...)``.
      apply_fn: the model's ``apply(variables, x)`` (or ``apply_slots(variables, x, slots)``).
      mask: the trainable mask (:func:`trainable_mask`).

    Returns:
      ``clipped(params, x, y, batch_mask, clip_norm)``, the same return value as ``naive`` with
      the sum zero at frozen leaves.
    """

    def clipped(params, x, y, batch_mask, clip_norm):
        t, f = partition(params, mask)

        def apply_t(variables, *args):  # (x) or (x, slots): trainers.train_mode
            return apply_fn({"params": combine(variables["params"], f, mask)}, *args)

        g, loss_sum, norms = naive(apply_t, t, x, y, batch_mask, clip_norm)
        return zeros_at_frozen(g, params, mask), loss_sum, norms

    return clipped


def fill_from(tree: Any, params: Any) -> Any:
    """``tree`` (e.g. a parameter average kept by ``optax.masked`` for the trainable leaves, with
    ``optax.MaskedNode`` at frozen ones) completed with ``params``' leaves where it has none."""
    import optax

    return jax.tree_util.tree_map(
        lambda p, t: p if isinstance(t, optax.MaskedNode) or t is None else t,
        params, tree, is_leaf=lambda t: t is None or isinstance(t, optax.MaskedNode),
    )  # fmt: skip
