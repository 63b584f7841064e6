"""LoRA adapters (trainers.lora) on existing linen modules: the adapted model starts equal to the
base, the base's parameters keep their paths, and the ghost path's per-example norms and clipped
sums over the adapters equal vmap(grad) over them, without a per-example d_in x d_out matrix."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainers import dpsgd, finetune, ghost, lora


class _Net(nn.Module):
    """Dense layers on vectors (b, d) or sequences (b, T, d); a Conv or an Embed in front."""

    hidden: int
    out: int = 3
    front: str = "dense"

    @nn.compact
    def __call__(self, x):
        if self.front == "embed":
            x = nn.Embed(11, self.hidden, name="emb")(x)
        elif self.front == "conv":
            x = jnp.tanh(nn.Conv(self.hidden, (3, 3), strides=2, name="conv")(x))
            x = x.reshape(x.shape[0], -1, self.hidden)
        x = jnp.tanh(nn.Dense(self.hidden, name="up")(x))
        x = nn.Dense(self.out, name="head")(x)
        return x if x.ndim == 2 else jnp.mean(x, axis=1)


def _perturbed(params, seed):
    """Random values everywhere (B = 0 would make A's gradient zero and hide errors)."""
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    return jax.tree_util.tree_unflatten(
        tree,
        [
            v + 0.5 * jax.random.normal(k, v.shape, v.dtype)
            for v, k in zip(leaves, keys, strict=True)
        ],
    )


def _both(model, params, x, y, clip=0.05):
    mask = finetune.trainable_mask(params, lora.TRAINABLE)
    assert ghost.analyze(model, params, x, dpsgd.per_example_loss, y, trainable=mask).supported
    b = x.shape[0]
    m = jnp.ones((b,), jnp.float32)
    fast = jax.jit(
        lambda p, x, y: ghost.clipped_sum_ghost(
            model, dpsgd.per_example_loss, p, x, y, m, clip, trainable=mask
        )
    )
    naive = jax.jit(finetune.masked_clipped_sum(dpsgd.clipped_sum_naive, model.apply, mask))
    return fast(params, x, y), naive(params, x, y, m, clip), mask


def _assert_both_agree(model, params, x, y):
    """The ghost path's norms and clipped sum equal vmap(grad)'s (``_both``)."""
    (g1, _, n1), (g2, _, n2), _ = _both(model, params, x, y)
    np.testing.assert_allclose(n1, n2, rtol=2e-5, atol=1e-6)
    for u, v in zip(jax.tree_util.tree_leaves(g1), jax.tree_util.tree_leaves(g2), strict=True):
        np.testing.assert_allclose(u, v, rtol=2e-4, atol=1e-6)


def jaxpr_shapes(jx):
    """Every value's shape in a jaxpr, nested programs (jit, custom_vjp, ...) included."""
    for eqn in jx.eqns:
        for v in eqn.outvars:
            yield tuple(getattr(v.aval, "shape", ()))
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from jaxpr_shapes(inner)


def test_the_adapted_model_starts_equal_to_the_base_and_keeps_its_paths():
    base = _Net(8)
    model = lora.with_lora(base, rank=2, targets=["up", "head"], scale=2.0)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 5)), jnp.float32)
    pb = base.init(jax.random.PRNGKey(0), x)["params"]
    p = model.init(jax.random.PRNGKey(1), x)["params"]
    assert set(p) == {"up", "head", "lora_up", "lora_head"}
    assert p["lora_up"]["a"]["kernel"].shape == (5, 2) and p["lora_up"]["b"]["kernel"].shape == (
        2,
        8,
    )
    assert not np.any(np.asarray(p["lora_head"]["b"]["kernel"]))  # B = 0
    start = finetune.overlay(p, finetune.match_init(pb, p, lora.is_adapter))
    np.testing.assert_array_equal(model.apply({"params": start}, x), base.apply({"params": pb}, x))
    assert lora.targeted_layers(model, x) == ["up", "head"]
    with pytest.raises(ValueError, match="'nope' matches no Dense"):
        lora.targeted_layers(lora.with_lora(base, 2, ["nope"]), x)
    with pytest.raises(ValueError, match="rank"):
        lora.with_lora(base, 0, ["up"])


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    d_in=st.integers(2, 9),
    hidden=st.integers(2, 9),
    rank=st.integers(1, 4),
    seq=st.sampled_from([0, 1, 3]),
    seed=st.integers(0, 2**16),
)
def test_lora_fast_norms_equal_vmap_grad_over_the_adapters(d_in, hidden, rank, seq, seed):
    """2-D (seq=0) and 3-D inputs (b, T, d_in): the ghost path's norms and clipped sum over the
    adapters equal vmap(grad) with respect to the adapters (f32), the frozen part is zero."""
    b = 4
    rng = np.random.default_rng(seed)
    shape = (b, d_in) if seq == 0 else (b, seq, d_in)
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, b), jnp.int32)
    model = lora.with_lora(_Net(hidden), rank=rank, targets=["up", "head"], scale=0.7)
    params = _perturbed(model.init(jax.random.PRNGKey(seed), x)["params"], seed)
    (g1, l1, n1), (g2, l2, n2), mask = _both(model, params, x, y)
    np.testing.assert_allclose(n1, n2, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(l1, l2, rtol=1e-5)
    for (path, u), v, m in zip(
        finetune.flat_paths(g1).items(),
        jax.tree_util.tree_leaves(g2),
        jax.tree_util.tree_leaves(mask),
        strict=True,
    ):
        np.testing.assert_allclose(u, v, rtol=2e-4, atol=1e-6, err_msg=path)
        if not m:
            assert not np.any(np.asarray(u)), path


@pytest.mark.parametrize("front", ["conv", "embed"])
def test_lora_on_conv_and_embed_layers_matches_vmap_grad(front):
    b = 3
    rng = np.random.default_rng(1)
    if front == "conv":
        x = jnp.asarray(rng.standard_normal((b, 6, 6, 2)), jnp.float32)
    else:
        x = jnp.asarray(rng.integers(0, 11, (b, 5)), jnp.int32)
    y = jnp.asarray([0, 1, 2], jnp.int32)
    model = lora.with_lora(_Net(4, front=front), rank=2, targets=[front, "head"])
    params = _perturbed(model.init(jax.random.PRNGKey(0), x)["params"], 3)
    _assert_both_agree(model, params, x, y)


def test_no_per_example_d_in_by_d_out_matrix_on_the_fast_path():
    """The traced ghost step over the adapters of a (b, T, 37) -> 41 layer holds no array with
    both 37 and 41 among its axes besides the frozen kernel itself."""
    d_in, d_out, b, t = 37, 41, 4, 5

    class Wide(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.mean(nn.Dense(d_out, name="w")(x), axis=1)

    model = lora.with_lora(Wide(), rank=3, targets=["w"])
    x = jnp.ones((b, t, d_in), jnp.float32)
    y = jnp.zeros((b,), jnp.int32)
    params = model.init(jax.random.PRNGKey(0), x)["params"]
    mask = finetune.trainable_mask(params, lora.TRAINABLE)
    jaxpr = jax.make_jaxpr(
        lambda p: ghost.clipped_sum_ghost(
            model, dpsgd.per_example_loss, p, x, y, jnp.ones((b,)), 1.0, trainable=mask
        )
    )(params)

    big = [s for s in jaxpr_shapes(jaxpr.jaxpr) if d_in in s and d_out in s and len(s) > 2]
    assert not big, big
    # the same check sees the matrix vmap(grad) over the base layer would form
    full = finetune.trainable_mask(params, None)
    naive = jax.make_jaxpr(
        lambda p: finetune.masked_clipped_sum(dpsgd.clipped_sum_naive, model.apply, full)(
            p, x, y, jnp.ones((b,)), 1.0
        )
    )(params)
    assert any(d_in in s and d_out in s and len(s) > 2 for s in jaxpr_shapes(naive.jaxpr))


def test_a_trainable_adapted_layer_is_not_taken_by_the_ghost_path():
    from trainers import models, step

    model = lora.with_lora(_Net(4), rank=2, targets=["up"])
    spec = models.user_model(model, (5,), "float32", num_classes=3)
    shapes = jax.eval_shape(lambda: models.init_params(spec, jax.random.PRNGKey(0)))
    import dataclasses

    both = dataclasses.replace(spec, trainable=finetune.trainable_mask(shapes, ["lora_", "^up/"]))
    plan = step.ghost_plan(both)
    assert not plan.supported and "LoRA-adapted layer up is trainable" in plan.reason
    only = dataclasses.replace(spec, trainable=finetune.trainable_mask(shapes, lora.TRAINABLE))
    assert step.ghost_plan(only).supported


def test_lora_on_attention_and_mlp_of_a_transformer_block_matches_vmap_grad():
    """DenseGeneral targets (query / key / value with (heads, head_dim) features, out over two
    input axes) and Dense ones on token sequences, found by regex inside a nested block."""

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h):
            h = h + nn.MultiHeadDotProductAttention(num_heads=2, name="attn")(nn.LayerNorm()(h))
            return h + nn.Dense(8, name="mlp_out")(nn.gelu(nn.Dense(16, name="mlp_in")(h)))

    class Text(nn.Module):
        @nn.compact
        def __call__(self, ids):
            return nn.Dense(3)(jnp.mean(Block()(nn.Embed(13, 8)(ids)), axis=1))

    model = lora.with_lora(Text(), rank=2, targets=[r"attn/(query|key|value|out)", "mlp_"])
    x = jnp.asarray(np.random.default_rng(0).integers(0, 13, (3, 5)), jnp.int32)
    y = jnp.asarray([0, 1, 2], jnp.int32)
    assert len(lora.targeted_layers(model, x)) == 6
    params = _perturbed(model.init(jax.random.PRNGKey(0), x)["params"], 4)
    _assert_both_agree(model, params, x, y)


def test_a_frozen_parameter_of_the_top_level_module_leaves_the_adapters_on_the_ghost_path():
    """A learned position table read outside any known layer, frozen: only the trainable
    parameters need a known layer."""

    class Pos(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = x + self.param("pos", nn.initializers.normal(1.0), x.shape[1:])
            return jnp.mean(nn.Dense(3, name="head")(jnp.tanh(nn.Dense(6, name="up")(x))), 1)

    model = lora.with_lora(Pos(), rank=2, targets=["up"])
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 4, 5)), jnp.float32)
    y = jnp.asarray([0, 1, 2], jnp.int32)
    params = _perturbed(model.init(jax.random.PRNGKey(0), x)["params"], 5)
    (g1, _, n1), (g2, _, n2), _ = _both(model, params, x, y)
    np.testing.assert_allclose(n1, n2, rtol=2e-5, atol=1e-6)
    # the top-level module's own "pos" trainable with its frozen head: partly trainable
    mask = finetune.trainable_mask(params, ["^pos$", "lora_"])
    plan = ghost.analyze(model, params, x, dpsgd.per_example_loss, y, trainable=mask)
    assert not plan.supported and "parameter ['pos'] is used outside" in plan.reason
