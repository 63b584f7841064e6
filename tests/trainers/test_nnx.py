"""Flax NNX models (trainers.nnx_model) and partitioned linen parameters on the ghost path: each
known NNX layer's clipped sum equals vmap(grad)'s, an NNX model and its linen twin (same weights)
give the same clipped sums, what is refused is refused with the layer named, and a
LogicallyPartitioned linen transformer block takes the ghost path."""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.trainers.test_ghost import (  # the same loss, inputs and comparison
    B,
    _assert_matches_vmap_grad,
    _inputs,
    _loss,
)
from tests.trainers.test_ghost import _global_rel_err as _rel_err
from trainers import dpsgd, ghost, models, nnx_model, step


class _Head(nnx.Module):
    """body, then the mean over any positions, then a 3-class Linear head."""

    def __init__(self, body, width: int, rngs: nnx.Rngs):
        self.body = body
        self.head = nnx.Linear(width, 3, rngs=rngs)

    def __call__(self, x):
        h = self.body(x)
        if h.ndim > 2:
            h = h.reshape(h.shape[0], -1, h.shape[-1]).mean(axis=1)
        return self.head(jnp.tanh(h))


class _NormAfter(nnx.Module):
    def __init__(self, norm, d_in: int, d: int, rngs: nnx.Rngs):
        self.dense = nnx.Linear(d_in, d, rngs=rngs)
        self.norm = norm

    def __call__(self, x):
        return self.norm(self.dense(x))


class _Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.attn = nnx.MultiHeadAttention(
            num_heads=2, in_features=4, qkv_features=4, decode=False, rngs=rngs
        )

    def __call__(self, x):
        return self.attn(x)


class _KeyValue(nnx.Module):
    """gemma's key-value projection: one einsum whose output puts the (key, value) axis before
    the batch axes, unpacked into two arrays."""

    def __init__(self, einsum_str: str, kernel_shape: tuple, bias_shape: tuple | None, rngs):
        self.kv = nnx.Einsum(einsum_str, kernel_shape, bias_shape, rngs=rngs)

    def __call__(self, x):
        k, v = self.kv(x)
        return jnp.tanh(k) * v


def _r():
    return nnx.Rngs(0)


#: name -> (a factory of (body, output width), one example's shape, dtype)
LAYERS = {
    "linear": (lambda: (nnx.Linear(4, 6, rngs=_r()), 6), (4,), np.float32),
    "linear_sequence": (lambda: (nnx.Linear(4, 6, rngs=_r()), 6), (5, 4), np.float32),
    "linear_general": (
        lambda: (nnx.LinearGeneral((2, 3), 5, axis=(-2, -1), rngs=_r()), 5),
        (4, 2, 3),
        np.float32,
    ),  # fmt: skip
    "conv": (lambda: (nnx.Conv(2, 3, (3, 3), rngs=_r()), 3), (5, 5, 2), np.float32),
    "conv_stride2_valid": (
        lambda: (nnx.Conv(1, 4, (4, 4), strides=2, padding="VALID", rngs=_r()), 4),
        (8, 8, 1),
        np.float32,
    ),  # fmt: skip
    "conv_1d_no_bias": (
        lambda: (nnx.Conv(3, 4, (3,), use_bias=False, rngs=_r()), 4),
        (8, 3),
        np.float32,
    ),  # fmt: skip
    "embed": (lambda: (nnx.Embed(7, 6, rngs=_r()), 6), (5,), np.int32),
    "layernorm": (
        lambda: (_NormAfter(nnx.LayerNorm(4, rngs=_r()), 3, 4, _r()), 4),
        (5, 3),
        np.float32,
    ),  # fmt: skip
    "rmsnorm": (
        lambda: (_NormAfter(nnx.RMSNorm(4, rngs=_r()), 3, 4, _r()), 4),
        (3,),
        np.float32,
    ),  # fmt: skip
    "groupnorm": (
        lambda: (_NormAfter(nnx.GroupNorm(4, num_groups=2, rngs=_r()), 3, 4, _r()), 4),
        (5, 3),
        np.float32,
    ),  # fmt: skip
    "attention": (lambda: (_Attention(_r()), 4), (5, 4), np.float32),
    "einsum": (
        lambda: (nnx.Einsum("btd,dnh->btnh", (4, 2, 3), (2, 3), rngs=_r()), 3),
        (5, 4),
        np.float32,
    ),  # fmt: skip
    # gemma's projections: the kernel's axes in another order than the dense map's
    "einsum_permuted": (
        lambda: (nnx.Einsum("btd,ndh->btnh", (2, 4, 3), (2, 3), rngs=_r()), 3),
        (5, 4),
        np.float32,
    ),  # fmt: skip
    # gemma's key-value projection: a dense map to (..., C, K, H), its output axes then moved
    "einsum_kv_vectors": (
        lambda: (_KeyValue("bd,ckdh->cbkh", (2, 2, 4, 3), None, _r()), 3),
        (4,),
        np.float32,
    ),  # fmt: skip
    "einsum_kv_sequence_bias": (
        lambda: (_KeyValue("BTD,CKDH->CBTKH", (2, 2, 4, 3), (2, 2, 3), _r()), 3),
        (5, 4),
        np.float32,
    ),  # fmt: skip
    "einsum_transposed_dense": (
        lambda: (nnx.Einsum("bd,hd->bh", (6, 4), rngs=_r()), 6),
        (4,),
        np.float32,
    ),  # fmt: skip
}


def _both(module, x, y):
    spec = models.user_model(module, x.shape[1:], x.dtype, loss=_loss)
    params = models.init_params(spec, jax.random.PRNGKey(0))
    plan = ghost.analyze(
        spec.module, params, jax.ShapeDtypeStruct(x.shape, x.dtype), _loss,
        jax.ShapeDtypeStruct(y.shape, y.dtype),
    )  # fmt: skip
    fast = jax.jit(lambda p, m, c: ghost.clipped_sum_ghost(spec.module, _loss, p, x, y, m, c))
    ref = jax.jit(lambda p, m, c: dpsgd.clipped_sum_naive(spec.apply, p, x, y, m, c, _loss))
    return plan, fast, ref, params


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_each_nnx_layer_matches_vmap_grad(name):
    """Per known NNX layer, with about half the examples clipped and one masked: the ghost sum
    equals vmap(grad)'s to f32 precision, and so do the loss sum and the per-example norms."""
    make, shape, dtype = LAYERS[name]
    body, width = make()
    module = _Head(body, width, nnx.Rngs(1))
    x, y = _inputs(shape, dtype, seed=1)
    plan, fast_fn, ref_fn, params = _both(module, x, y)
    assert plan.supported, plan.reason
    assert all(kind != "?" for _, kind, _ in plan.layers) and len(plan.layers) >= 2
    _assert_matches_vmap_grad(fast_fn, ref_fn, params)


class _NnxNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(7, 4, rngs=rngs)
        self.conv = nnx.Conv(4, 6, (3,), rngs=rngs)
        self.norm = nnx.GroupNorm(6, num_groups=3, rngs=rngs)
        self.dense = nnx.Linear(6, 5, rngs=rngs)
        self.ln = nnx.LayerNorm(5, rngs=rngs)
        self.out = nnx.Linear(5, 3, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.norm(self.conv(self.embed(x))))
        h = jnp.tanh(self.ln(self.dense(h.mean(axis=1))))
        return self.out(h)


class _LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.Embed(7, 4, name="embed")(x)
        h = nn.Conv(6, (3,), name="conv")(h)
        h = jnp.tanh(nn.GroupNorm(num_groups=3, epsilon=1e-6, name="norm")(h))
        h = nn.Dense(5, name="dense")(h.mean(axis=1))
        h = jnp.tanh(nn.LayerNorm(epsilon=1e-6, name="ln")(h))
        return nn.Dense(3, name="out")(h)


def test_nnx_and_linen_twins_give_the_same_clipped_sums():
    """The same architecture written in NNX and in linen, the NNX weights copied into the linen
    one: the same outputs and, on the ghost path of each, the same clipped sums and norms."""
    x, y = _inputs((6,), np.int32, seed=3)
    mask = np.ones(B, np.float32)
    spec = models.user_model(_NnxNet(nnx.Rngs(0)), (6,), np.int32)
    params = models.init_params(spec, jax.random.PRNGKey(0))
    linen = _LinenNet()
    np.testing.assert_allclose(
        np.asarray(spec.apply({"params": params}, x)),
        np.asarray(linen.apply({"params": params}, x)), rtol=1e-5, atol=1e-6,
    )  # fmt: skip
    assert step.ghost_plan(spec).supported
    loss = dpsgd.per_example_loss
    a = jax.jit(lambda p: ghost.clipped_sum_ghost(spec.module, loss, p, x, y, mask, 0.3))(params)
    b = jax.jit(lambda p: ghost.clipped_sum_ghost(linen, loss, p, x, y, mask, 0.3))(params)
    assert _rel_err(a[0], b[0]) <= 1e-5
    np.testing.assert_allclose(np.asarray(a[2]), np.asarray(b[2]), rtol=1e-5)
    assert step.resolve_grad_impl(spec, "auto", (6,)) == "ghost"


class _Tied(nnx.Module):
    """A tied embedding: ``embed`` looks the tokens up and its ``attend`` makes the logits from
    the same table, at every position (``positions``) or from their mean; or ``attend`` alone
    on a Linear's output (``lookup=False``)."""

    def __init__(self, rngs, positions: bool = True, lookup: bool = True, embed=nnx.Embed):
        self.embed = embed(7, 4, rngs=rngs)
        self.positions, self.lookup = positions, lookup
        self.proj = None if lookup else nnx.Linear(1, 4, rngs=rngs)

    def __call__(self, x):
        h = self.embed(x) if self.lookup else jnp.tanh(self.proj(x[..., None].astype(jnp.float32)))
        if not self.positions:
            return self.embed.attend(h.mean(axis=1))
        return self.embed.attend(jnp.tanh(h)).mean(axis=1)


class _TiedLinen(nn.Module):
    @nn.compact
    def __call__(self, x):
        e = nn.Embed(7, 4)
        return e.attend(jnp.tanh(e(x))).mean(axis=1)


class _ScaledEmbed(nnx.Embed):
    """gemma's embedder: a subclass scaling the lookup (not a known layer)."""

    def __call__(self, x):
        return super().__call__(x) * 2.0


TIED = {  # name -> (module, tokens per example): T^2 against d v = 28 picks the attend form
    "mean_query": (lambda: _Tied(_r(), positions=False), 5),  # one query: rank-1
    "ghost_form": (lambda: _Tied(_r()), 5),
    "materialised_form": (lambda: _Tied(_r()), 6),
    "attend_only": (lambda: _Tied(_r(), lookup=False), 5),
    "linen": (lambda: _TiedLinen(), 5),
}


@pytest.mark.parametrize("name", sorted(TIED))
def test_a_tied_embedding_matches_vmap_grad(name):
    """A table read by its lookup and by ``attend`` (the tied output projection): the norms hold
    both terms and their cross term, and the clipped sum, loss sum and norms equal vmap(grad)'s
    (repeated token ids within an example included)."""
    make, t = TIED[name]
    module = make()
    x, y = _inputs((t,), np.int32, seed=4)
    assert any(len(set(row)) < t for row in x)  # a token repeated within an example
    if isinstance(module, nn.Module):
        from tests.trainers.test_ghost import _both as linen_both

        plan, fast_fn, ref_fn, params = linen_both(module, x, y)
    else:
        plan, fast_fn, ref_fn, params = _both(module, x, y)
    assert plan.supported, plan.reason
    _assert_matches_vmap_grad(fast_fn, ref_fn, params)


class _PerHead(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Einsum("bnd,ndh->bnh", (2, 3, 3), rngs=rngs)

    def __call__(self, x):
        return self.proj(x).reshape(x.shape[0], -1)


def test_what_the_nnx_ghost_path_refuses_falls_back_with_the_layer_named():
    """A parameter read outside a known layer's call (in a subclass of nnx.Embed, named as
    such) and an Einsum whose kernel is per head (not a dense map) fall back to vmap(grad), with
    the reason naming them."""
    spec = models.user_model(_Tied(nnx.Rngs(0), embed=_ScaledEmbed), (3,), np.int32)
    plan = step.ghost_plan(spec)
    assert not plan.supported and "outside" in plan.reason
    assert "embed (a _ScaledEmbed: a subclass of nnx.Embed" in plan.reason
    spec = models.user_model(_PerHead(nnx.Rngs(0)), (2, 3), np.float32)
    plan = step.ghost_plan(spec)
    assert not plan.supported and "proj" in plan.reason and "bnd,ndh->bnh" in plan.reason
    with pytest.raises(ValueError, match="does not apply"):
        step.resolve_grad_impl(spec, "ghost", (2, 3))


class _TwoPermuted(nnx.Module):
    """Three gemma-like projections on the ghost (Gram) form (T^2 < d_in d_out): two read x
    (their Gram is shared), the third reads another input of x's shape (its Gram must not be)."""

    def __init__(self, rngs):
        self.q = nnx.Einsum("btd,ndh->btnh", (2, 4, 4), rngs=rngs)
        self.k = nnx.Einsum("btd,ndh->btnh", (2, 4, 4), rngs=rngs)
        self.v = nnx.Einsum("btd,ndh->btnh", (2, 4, 4), rngs=rngs)
        self.head = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.q(x) * self.k(x)).sum(axis=2)  # (b, t, 4): x's shape
        return self.head(jnp.mean(self.v(h), axis=1).reshape(x.shape[0], 8))


def test_permuted_einsums_on_equal_shaped_inputs_match_vmap_grad():
    x, y = _inputs((3, 4), np.float32, seed=3)
    plan, fast_fn, ref_fn, params = _both(_TwoPermuted(nnx.Rngs(2)), x, y)
    assert plan.supported, plan.reason
    _assert_matches_vmap_grad(fast_fn, ref_fn, params)


def test_einsum_as_dense_rules():
    """(features, axis, kernel permutation, output permutation), or why not."""
    dense = nnx_model.einsum_as_dense
    assert dense("btd,dnh->btnh", (4, 2, 3), (2, 3)) == ((2, 3), (-1,), None, None)
    assert dense("btnh,nhd->btd", (2, 3, 4), None) == ((4,), (-2, -1), None, None)
    assert dense("bd,hd->bh", (3, 4), None) == ((3,), (-1,), (1, 0), None)
    assert dense("BTD,NDH->BTNH", (2, 4, 3), None) == ((2, 3), (-1,), (1, 0, 2), None)
    # gemma's key-value projection: the dense map to BSCKH, its output moved to CBSKH
    assert dense("BSD,CKDH->CBSKH", (2, 1, 4, 3), None) == (
        (2, 1, 3), (-1,), (2, 0, 1, 3), (2, 0, 1, 3, 4),
    )  # fmt: skip
    assert dense("bd,dh->hb", (3, 4), (4,)) == ((4,), (-1,), None, (1, 0))
    refused = {
        "bnd,ndh->bnh": "not a dense map",  # a per-head kernel: parameters per batch entry
        "cbd,cdh->cbh": "not a dense map",
        "btd,dh->bh": "not a dense map",  # a sum over positions
        "bbd,dh->bh": "not a dense map",  # a diagonal
        "...d,dh->...h": "no ellipsis",
    }
    for einsum_str, why in refused.items():
        assert why in dense(einsum_str, (), None), einsum_str
    assert "bias of shape (1, 4)" in dense("bd,dh->bh", (3, 4), (1, 4))


class _MovedOutput(nn.Module):
    """A Dense on (b, 3, 4) -> (b, 3, 3) that declares its output's last two axes swapped
    (``wrong``) or not: the probe must catch the wrong declaration (same shape, other values)."""

    wrong: bool

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (4, 3))
        return x @ kernel

    def as_known_layer(self):
        dense = nn.Dense(3, use_bias=False, parent=None)
        moved = (0, 2, 1) if self.wrong else None
        return ghost.Reparametrized(dense, lambda raw: raw, (0, 1), moved)


@pytest.mark.parametrize("wrong", [False, True])
def test_a_declared_output_permutation_is_checked_by_the_probe(wrong):
    module = _MovedOutput(wrong)
    x, y = _inputs((3, 4), np.float32, seed=0)
    params = module.init(jax.random.PRNGKey(0), x[:1])["params"]
    plan = ghost.analyze(
        module, params, jax.ShapeDtypeStruct(x.shape, x.dtype),
        lambda out, y: _loss(out.mean(axis=1), y), jax.ShapeDtypeStruct(y.shape, y.dtype),
    )  # fmt: skip
    assert plan.supported is not wrong, plan.reason
    assert not wrong or "differs from the module's own output" in plan.reason


class _BN(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 4, rngs=rngs)
        self.bn = nnx.BatchNorm(4, rngs=rngs)

    def __call__(self, x):
        return self.bn(self.lin(x))


def test_batch_statistics_are_refused_with_the_layer_named_and_fix_model_pointed_at():
    with pytest.raises(ValueError) as e:
        models.user_model(_BN(nnx.Rngs(0)), (3,), np.float32)
    msg = str(e.value)
    assert msg.startswith("dptune:") and "'bn'" in msg and "BatchNorm" in msg
    assert "fix_model" in msg and "\n" not in msg
    with pytest.raises(ValueError, match="'bn'"):  # trained or not, batch statistics mix
        nnx_model.NnxModel(_BN(nnx.Rngs(0)), trainable=nnx.Variable)


def test_clipped_grad_sum_takes_an_nnx_module():
    """The own-loop piece: an nnx.Module, its params as NnxModel(module).params(); the ghost
    path, equal to vmap(grad)."""
    import dptune

    module = _NnxNet(nnx.Rngs(0))
    params = dptune.NnxModel(module).params()
    x, y = _inputs((6,), np.int32, seed=5)
    mask = np.ones(B, np.float32)
    fast = dptune.clipped_grad_sum(module)
    ref = dptune.clipped_grad_sum(module, grad_impl="vmap")
    assert fast.impl(x) == "ghost" and ref.impl(x) == "vmap"
    assert _rel_err(fast(params, x, y, mask, 0.3)[0], ref(params, x, y, mask, 0.3)[0]) <= 2e-5


class _Mlp(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(4, 8, rngs=rngs)
        self.b = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def test_a_trainable_filter_chooses_what_trains():
    """Only the filtered state is trained and clipped; the rest is held at its values."""
    module = _Mlp(nnx.Rngs(0))
    wrapped = nnx_model.NnxModel(module, trainable=nnx.PathContains("b"))
    spec = models.user_model(wrapped, (4,), np.float32)
    params = models.init_params(spec, jax.random.PRNGKey(0))
    assert set(params) == {"b"}
    x, y = _inputs((4,), np.float32, seed=0)
    mask = np.ones(B, np.float32)
    plan = step.ghost_plan(spec)
    assert plan.supported, plan.reason
    fast = ghost.clipped_sum_ghost(spec.module, dpsgd.per_example_loss, params, x, y, mask, 0.1)
    ref = dpsgd.clipped_sum_naive(spec.apply, params, x, y, mask, 0.1)
    assert _rel_err(fast[0], ref[0]) <= 2e-5
    np.testing.assert_allclose(
        np.asarray(spec.apply({"params": params}, x)), np.asarray(module(x)), rtol=1e-6
    )


# --- partitioning metadata ---------------------------------------------------------------------


def _part(init, names):
    return nn.with_logical_partitioning(init, names)


class _Block(nn.Module):
    """A transformer block in the style of Flax's lm1b / wmt examples: every parameter boxed by
    ``nn.with_logical_partitioning`` (attention, MLP, LayerNorms)."""

    @nn.compact
    def __call__(self, x):
        dense = nn.initializers.xavier_uniform()
        h = nn.LayerNorm(
            scale_init=_part(nn.initializers.ones, ("embed",)),
            bias_init=_part(nn.initializers.zeros, ("embed",)),
        )(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=2, qkv_features=4,
            kernel_init=_part(dense, ("embed", "heads", "kv")),
            bias_init=_part(nn.initializers.zeros, ("heads", "kv")),
            out_kernel_init=_part(dense, ("heads", "kv", "embed")),
            out_bias_init=_part(nn.initializers.zeros, ("embed",)),
        )(h)  # fmt: skip
        x = x + h
        h = nn.LayerNorm(
            scale_init=_part(nn.initializers.ones, ("embed",)),
            bias_init=_part(nn.initializers.zeros, ("embed",)),
        )(x)
        h = nn.Dense(8, kernel_init=_part(dense, ("embed", "mlp")))(h)
        h = nn.Dense(4, kernel_init=_part(dense, ("mlp", "embed")))(nn.relu(h))
        x = x + h
        return nn.Dense(3, kernel_init=_part(dense, ("embed", "vocab")))(x.mean(axis=1))


def test_a_logically_partitioned_transformer_block_takes_the_ghost_path():
    """Boxed parameters: the plan accepts the block (it failed on the boxes before), the ghost
    sum equals vmap(grad)'s, on boxed parameters (as a user's own loop passes them: the sum
    comes back boxed alike) and on the unboxed ones dptune trains."""
    module = _Block()
    x, y = _inputs((5, 4), np.float32, seed=2)
    mask = np.ones(B, np.float32)
    mask[0] = 0
    boxed = module.init(jax.random.PRNGKey(0), x[:1])["params"]
    assert any(
        isinstance(v, nn.LogicallyPartitioned)
        for v in jax.tree_util.tree_leaves(boxed, is_leaf=nn.meta.is_axis_metadata)
    )
    spec = models.user_model(module, (5, 4), np.float32)
    assert step.ghost_plan(spec).supported, step.ghost_plan(spec).reason
    plain = models.init_params(spec, jax.random.PRNGKey(0))
    assert not any(isinstance(v, nn.meta.AxisMetadata) for v in jax.tree_util.tree_leaves(
        plain, is_leaf=nn.meta.is_axis_metadata))  # fmt: skip
    loss = dpsgd.per_example_loss
    ref = jax.jit(lambda p: dpsgd.clipped_sum_naive(module.apply, p, x, y, mask, 0.05))(plain)
    fast = jax.jit(lambda p: ghost.clipped_sum_ghost(module, loss, p, x, y, mask, 0.05))(plain)
    assert _rel_err(fast[0], ref[0]) <= 2e-5
    np.testing.assert_allclose(np.asarray(fast[2]), np.asarray(ref[2]), rtol=2e-5)
    fast_boxed = ghost.clipped_sum_ghost(module, loss, boxed, x, y, mask, 0.05)[0]
    assert jax.tree_util.tree_structure(fast_boxed) == jax.tree_util.tree_structure(boxed)
    assert _rel_err(nn.meta.unbox(fast_boxed), ref[0]) <= 2e-5


# --- fix_model -----------------------------------------------------------------------------------


class _LinenBlock(nn.Module):
    norm: Any

    @nn.compact
    def __call__(self, x):
        y = self.norm()(nn.Conv(8, (3, 3), use_bias=False)(x))
        return nn.relu(x + y)


class _LinenResNet(nn.Module):
    """Flax's ResNet pattern: BatchNorm built inside ``__call__`` (a partial passed down)."""

    train: bool = True

    @nn.compact
    def __call__(self, x):
        norm = functools.partial(nn.BatchNorm, use_running_average=not self.train, momentum=0.9)
        x = nn.relu(norm(name="bn_init")(nn.Conv(8, (3, 3), use_bias=False, name="conv_init")(x)))
        x = _LinenBlock(norm)(x)
        return nn.Dense(3)(jnp.mean(x, axis=(1, 2)))


class _NnxResNet(nnx.Module):
    def __init__(self, rngs):
        self.conv = nnx.Conv(3, 12, (3, 3), use_bias=False, rngs=rngs)
        self.bn = nnx.BatchNorm(12, rngs=rngs)
        self.blocks = nnx.List([nnx.Conv(12, 12, (3, 3), rngs=rngs), nnx.BatchNorm(12, rngs=rngs)])
        self.head = nnx.Linear(12, 3, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.bn(self.conv(x)))
        x = nnx.relu(x + self.blocks[1](self.blocks[0](x)))
        return self.head(jnp.mean(x, axis=(1, 2)))


def _trains(model, shape):
    """A tiny DpSgdTrainer run on random images: finite score, the ghost path."""
    from dptune.learners.dpsgd import Dataset, DpSgdTrainer

    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, *shape)).astype(np.float32)
    y = rng.integers(0, 3, size=64).astype(np.int32)
    data = Dataset.from_arrays(x, y, num_examples=64, validation_fraction=0.25, num_classes=3)
    trainer = DpSgdTrainer(
        data, model=model, base=dict(batch_size=16, epochs=1, noise_multiplier=1.0),
        epoch_progress=False,
    )  # fmt: skip
    assert trainer.clipping_path()["path"] == "ghost", trainer.clipping_path()
    ((score, _),) = trainer.train_many([{"learning_rate": 0.1}], [np.random.default_rng(1)])
    assert np.isfinite(score)


def test_fix_model_on_a_linen_resnet_with_batchnorm_built_in_call(caplog):
    """Every BatchNorm (built inside __call__, also in a child block) becomes a GroupNorm of
    gcd(32, 8) = 8 groups at the same path; no batch_stats remain; listed and logged; it takes
    the ghost path and trains."""
    from trainers.fix_model import fix_model

    x = jnp.ones((1, 6, 6, 3))
    before = _LinenResNet().init(jax.random.PRNGKey(0), x)
    assert "batch_stats" in before
    with caplog.at_level("INFO", logger="dptune"):
        fixed, replaced = fix_model(_LinenResNet(), x)
    assert [(r.path, r.channels, r.groups) for r in replaced] == [
        ("bn_init", 8, 8), ("_LinenBlock_0/BatchNorm_0", 8, 8)
    ]  # fmt: skip
    assert "bn_init" in caplog.text and "GroupNorm" in caplog.text
    after = fixed.init(jax.random.PRNGKey(0), x)
    assert set(after) == {"params"}
    shapes = jax.tree_util.tree_map(jnp.shape, after["params"])
    assert shapes == jax.tree_util.tree_map(jnp.shape, before["params"])
    xs, y = _inputs((6, 6, 3), np.float32, seed=6)
    mask = np.ones(B, np.float32)
    loss = dpsgd.per_example_loss
    p = after["params"]
    fast = jax.jit(lambda p: ghost.clipped_sum_ghost(fixed, loss, p, xs, y, mask, 0.1))(p)
    ref = jax.jit(lambda p: dpsgd.clipped_sum_naive(fixed.apply, p, xs, y, mask, 0.1))(p)
    assert _rel_err(fast[0], ref[0]) <= 2e-5
    _trains(fixed, (6, 6, 3))


def test_fix_model_on_an_nnx_resnet():
    """Attributes and list entries replaced on a copy (gcd(32, 12) = 4 groups), the original
    untouched; the fixed model is accepted and takes the ghost path."""
    from trainers.fix_model import fix_model

    original = _NnxResNet(nnx.Rngs(0))
    fixed, replaced = fix_model(original)
    assert sorted((r.path, r.channels, r.groups) for r in replaced) == [
        ("blocks/1", 12, 4), ("bn", 12, 4)
    ]  # fmt: skip
    assert isinstance(original.bn, nnx.BatchNorm) and isinstance(fixed.bn, nnx.GroupNorm)
    assert not any(isinstance(n, nnx.BatchNorm) for _, n in nnx.iter_graph(fixed))
    assert fixed.bn.num_groups == 4
    _trains(fixed, (6, 6, 3))


def test_load_params_gives_back_what_apply_and_nnx_update_take(tmp_path):
    """A released checkpoint restored into boxed linen parameters (the boxes kept, no
    ``{'value': ...}`` leaves: apply takes them) and into an NNX module (an nnx.State with the
    module's metadata, which nnx.update takes)."""
    from dptune import release

    module = _Block()
    x = np.ones((2, 5, 4), np.float32)
    spec = models.user_model(module, (5, 4), np.float32)
    trained = jax.tree_util.tree_map(lambda v: v + 1.0, models.init_params(spec, jax.random.key(0)))
    (tmp_path / "lin").mkdir()
    release._save_orbax(trained, tmp_path / "lin" / "checkpoint")
    like = jax.eval_shape(module.init, jax.random.key(0), x)["params"]
    got = release.load_params(tmp_path / "lin", like=like)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(like)
    np.testing.assert_allclose(
        np.asarray(module.apply({"params": got}, x)),
        np.asarray(module.apply({"params": trained}, x)), rtol=1e-6,
    )  # fmt: skip

    net = _NnxNet(nnx.Rngs(0))
    nspec = models.user_model(net, (6,), np.int32)
    trained = jax.tree_util.tree_map(lambda v: v * 2.0, models.init_params(nspec, None))
    (tmp_path / "nnx").mkdir()
    release._save_orbax(trained, tmp_path / "nnx" / "checkpoint")
    state = release.load_params(tmp_path / "nnx", like=net)
    assert isinstance(state, nnx.State)
    nnx.update(net, state)
    ids = np.arange(12, dtype=np.int32).reshape(2, 6) % 7
    np.testing.assert_allclose(
        np.asarray(net(ids)), np.asarray(nspec.apply({"params": trained}, ids)), rtol=1e-6
    )
    plain = release.load_params(tmp_path / "nnx")  # no like: the dict, which nnx.update takes
    nnx.update(net, plain)


def test_the_clipping_path_is_said_with_the_layer_that_kept_the_model_off_the_fast_path():
    from dptune.learners.dpsgd import Dataset, DpSgdTrainer

    rng = np.random.default_rng(0)
    x = rng.integers(0, 7, size=(40, 3)).astype(np.int32)
    y = rng.integers(0, 3, size=40).astype(np.int32)
    data = Dataset.from_arrays(x, y, num_examples=40, validation_fraction=0.25, num_classes=3)
    tied = _Tied(nnx.Rngs(0), embed=_ScaledEmbed)
    slow = DpSgdTrainer(data, model=tied, base=dict(batch_size=8, epochs=1))
    path = slow.clipping_path()
    assert path["path"] == "vmap" and "embed" in path["why"]
    fast = DpSgdTrainer(data, model=_NnxNet(nnx.Rngs(0)), base=dict(batch_size=8, epochs=1))
    assert fast.clipping_path()["path"] == "ghost"


class _Sharded(nnx.Module):
    """NNX sharding metadata on a kernel; optionally a dropout layer between known layers."""

    def __init__(self, rngs, dropout: bool = False):
        init = nnx.initializers.lecun_normal()
        if not dropout:  # (made under a mesh, where an nnx.Rngs' keys would be sharded too)
            init = nnx.with_partitioning(init, (None, "model"))
        self.a = nnx.Linear(4, 8, kernel_init=init, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs) if dropout else None
        self.b = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.a(x))
        return self.b(h if self.drop is None else self.drop(h))


def test_nnx_sharding_metadata_is_unboxed_for_clipping_and_kept_in_the_state():
    """Plain arrays are clipped (the ghost path, equal to vmap(grad)); the state handed back
    carries the kernel's sharding names."""
    with jax.set_mesh(jax.make_mesh((1,), ("model",))):
        module = _Sharded(nnx.Rngs(0))
    spec = models.user_model(module, (4,), np.float32)
    plan = step.ghost_plan(spec)
    assert plan.supported, plan.reason
    params = models.init_params(spec, None)
    assert all(isinstance(v, jax.Array) for v in jax.tree_util.tree_leaves(params))
    x, y = _inputs((4,), np.float32, seed=4)
    mask = np.ones(B, np.float32)
    loss = dpsgd.per_example_loss
    fast = jax.jit(lambda p: ghost.clipped_sum_ghost(spec.module, loss, p, x, y, mask, 0.2))
    ref = jax.jit(lambda p: dpsgd.clipped_sum_naive(spec.apply, p, x, y, mask, 0.2))
    assert _rel_err(fast(params)[0], ref(params)[0]) <= 2e-5
    state = spec.module.state(params)
    assert state["a"]["kernel"].get_metadata()["out_sharding"] == (None, "model")


def test_an_nnx_dropout_layer_with_its_rngs_runs():
    """A dropout layer holding its nnx.Rngs (state updated on each call) runs inside the traced
    copies and keeps the ghost path (its per-example, per-step masks:
    tests/trainers/test_nnx_dropout.py)."""
    spec = models.user_model(_Sharded(nnx.Rngs(0), dropout=True), (4,), np.float32)
    assert step.ghost_plan(spec).supported, step.ghost_plan(spec).reason
    params = models.init_params(spec, None)
    x, y = _inputs((4,), np.float32, seed=4)
    mask = np.ones(B, np.float32)
    loss = dpsgd.per_example_loss
    fast = jax.jit(lambda p: ghost.clipped_sum_ghost(spec.module, loss, p, x, y, mask, 0.2))
    assert np.isfinite(float(fast(params)[1]))


def test_a_tuning_run_of_an_nnx_model_says_its_clipping_path_and_reloads(tmp_path, caplog):
    """End to end: an NNX model tuned; the clipping path logged once at INFO and kept in the
    curator's view (dptune inspect); the release loaded back into the module."""
    import dptune
    from dptune.cli import inspect as inspect_cmd
    from selection import BestOfK

    rng = np.random.default_rng(0)
    x = rng.standard_normal((80, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1).astype(np.int32)
    data = dptune.Dataset.from_arrays(x, y, num_examples=80, validation_fraction=0.25,
                                      num_classes=3)  # fmt: skip
    module = _Mlp(nnx.Rngs(0))
    trainer = dptune.DpSgdTrainer(
        data, model=module, base=dict(batch_size=16, epochs=1), epoch_progress=False
    )
    with caplog.at_level("INFO", logger="dptune"):
        dptune.tune(
            trainer, {"learning_rate": dptune.space.log_uniform(0.3, 1.0), "noise_multiplier": 1.0},
            BestOfK(1),
            budget=(50.0, 1e-5), workdir=tmp_path / "run", progress=False,
            dataset_budget=(100.0, 1e-4),
        )  # fmt: skip
    said = [r.message for r in caplog.records if "per-example clipping" in r.message]
    assert said == [
        "per-example clipping: ghost (every parametrised layer is a known layer (2 layers))"
    ]
    run = inspect_cmd.read_run(tmp_path / "run")
    assert run["clipping"]["path"] == "ghost"
    assert "per-example clipping: ghost" in inspect_cmd.render(run)
    loaded = dptune.load_release(tmp_path / "run", like=module)
    assert loaded.released
    nnx.update(module, loaded.params)
    assert module(x[:2]).shape == (2, 3)


class _SetupBN(nn.Module):
    def setup(self):
        self.dense = nn.Dense(6)
        self.bn = nn.BatchNorm(use_running_average=False)
        self.out = nn.Dense(3)

    def __call__(self, x):
        return self.out(nn.tanh(self.bn(self.dense(x))))


def test_fix_model_on_a_linen_module_with_batchnorm_in_setup():
    from trainers.fix_model import fix_model

    x = jnp.ones((2, 4))
    fixed, replaced = fix_model(_SetupBN(), x)
    assert [(r.path, r.groups) for r in replaced] == [("bn", 1)]  # features without positions
    variables = fixed.init(jax.random.PRNGKey(0), x)
    assert set(variables) == {"params"} and set(variables["params"]["bn"]) == {"scale", "bias"}
    spec = models.user_model(fixed, (4,), np.float32)
    assert step.ghost_plan(spec).supported
