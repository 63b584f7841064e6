"""Models as Flax's own examples write them, at tiny sizes: what dptune must accept and how.

* Flax's ``examples/mnist`` CNN (NNX) passes its ``nnx.Rngs`` at call time,
  ``__call__(self, x, rngs)``, to ``nnx.Dropout(rate)`` layers built without rngs: dptune calls
  it with an ``nnx.Rngs`` of its own (from the chunk's secret dropout key while it trains, a
  fixed one at evaluation, where dropout is off), with per-example masks on both paths.
* ``fix_model``: one group on features without positions (a group of one value normalises to
  0), BatchNorms found under ``nnx.scan`` and behind ``rngs`` at call, the linen wrapper's
  ``train`` keyword; a GroupNorm of single-value groups is refused.
* Refusals in one ``dptune:`` line for what evaluates but cannot train (an ``nnx.Dropout`` with
  no rngs, another linen rng stream), several positional inputs, linen BatchNorm.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dptune
from tests.trainers.test_dropout import (  # the same batch, clipped sums and checks
    _flat,
    _sums,
    check_compiled_step_keys,
    check_ghost_and_vmap_agree,
    check_masks_follow_the_key,
    check_one_example_alone,
    check_removal_moves_at_most_c,
)
from trainers import dpsgd, ghost, models, nnx_model, step


class RngsAtCall(nnx.Module):
    """Flax's examples/mnist CNN's calling convention on 5 features and 3 classes: dropout
    layers without rngs, the ``nnx.Rngs`` passed to ``__call__`` and on to them."""

    def __init__(self, rngs: nnx.Rngs, rate: float = 0.5):
        self.a = nnx.Linear(5, 16, rngs=rngs)
        self.drop1 = nnx.Dropout(rate=rate)
        self.b = nnx.Linear(16, 16, rngs=rngs)
        self.drop2 = nnx.Dropout(rate=rate)
        self.c = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs):
        h = self.drop1(jnp.tanh(self.a(x)), rngs=rngs)
        return self.c(self.drop2(jnp.tanh(self.b(h)), rngs=rngs))


def _spec(rate: float = 0.5):
    return models.user_model(RngsAtCall(nnx.Rngs(0), rate), (5,), "float32")


def test_an_nnx_module_taking_rngs_at_call_is_accepted_stochastic_on_the_ghost_path():
    spec = _spec()
    assert spec.stochastic
    assert step.ghost_plan(spec).supported, step.ghost_plan(spec).reason


def test_rngs_at_call_dropout_is_on_per_key_in_training_and_off_at_evaluation():
    spec = _spec()
    params = models.init_params(spec, None)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 5)), jnp.float32)
    a, evaluated = check_masks_follow_the_key(spec, params, x)
    np.testing.assert_allclose(evaluated, _spec(0.0).apply({"params": params}, x), rtol=1e-6)
    assert not np.allclose(a, evaluated)


def test_rngs_at_call_one_example_alone_and_removal_moves_the_sum_by_at_most_c():
    spec = _spec()
    params = models.init_params(spec, None)
    check_one_example_alone(spec, params)
    for impl in ("ghost", "vmap"):
        check_removal_moves_at_most_c(spec, params, impl)


def test_rngs_at_call_ghost_and_vmap_draw_the_same_masks():
    spec = _spec()
    params = models.init_params(spec, None)
    g1, x, y, mask = check_ghost_and_vmap_agree(spec, params)
    g2, _, _ = _sums(spec, params, x, y, mask, jax.random.PRNGKey(6), "ghost")
    assert not np.allclose(_flat(g1), _flat(g2))  # another step's key, other masks


@pytest.mark.parametrize("impl", ["ghost", "vmap"])
def test_rngs_at_call_compiled_step_follows_the_candidate_key(impl):
    spec = _spec()
    check_compiled_step_keys(spec, models.init_params(spec, None), impl)


class TrainKeywordBN(nn.Module):
    """The usual linen pattern (Flax's imagenet ResNet, most tutorials): a ``train`` keyword that
    switches BatchNorm's running averages and dropout."""

    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.Dense(16)(x)
        h = nn.BatchNorm(use_running_average=not train)(h)
        h = nn.Dropout(0.5, deterministic=not train)(jnp.tanh(h))
        return nn.Dense(3)(h)


def test_fix_model_keeps_the_train_keyword_of_a_linen_module():
    """The wrapper ``fix_model`` returns is called with the inner module's ``train`` keyword:
    dropout trains per example and is off at evaluation (it was called with no keyword:
    refused, as ``train`` has no default)."""
    fixed, _ = dptune.fix_model(TrainKeywordBN())
    spec = models.user_model(fixed, (5,), "float32")
    assert spec.call_keyword == "train" and spec.stochastic
    assert step.ghost_plan(spec).supported, step.ghost_plan(spec).reason
    params = models.init_params(spec, jax.random.PRNGKey(0))
    assert set(params) == {"Dense_0", "BatchNorm_0", "Dense_1"}  # the inner module's paths
    x = jnp.asarray(np.random.default_rng(0).standard_normal((6, 5)), jnp.float32)
    check_masks_follow_the_key(spec, params, x)
    check_one_example_alone(spec, params)
    check_ghost_and_vmap_agree(spec, params)


class LinenBNMLP(nn.Module):
    """BatchNorm on features without positions (b, 32): Opacus's gcd(32, 32) = 32 groups would
    normalise each value on its own (the output is the bias, whatever the input)."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(jnp.tanh(nn.BatchNorm(use_running_average=True)(nn.Dense(32)(x))))


class NnxBNMLP(nnx.Module):
    """docs/your_model.md's NNX example: nnx.BatchNorm(32) after a Linear."""

    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(5, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.out = nnx.Linear(32, 3, rngs=rngs)

    def __call__(self, x):
        return self.out(nnx.tanh(self.norm(self.dense(x))))


def _outputs_move_with_the_input(spec) -> bool:
    params = models.init_params(spec, jax.random.PRNGKey(0))
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 5)), jnp.float32)
    out = np.asarray(spec.apply({"params": params}, x))
    return not np.allclose(out, out[:1])


def test_fix_model_on_features_without_positions_gives_one_group_linen():
    x = jnp.ones((2, 5))
    for fixed, _ in (dptune.fix_model(LinenBNMLP(), x), dptune.fix_model(LinenBNMLP())):
        spec = models.user_model(fixed, (5,), "float32")
        assert _outputs_move_with_the_input(spec)
    assert [(r.path, r.channels, r.groups) for r in dptune.fix_model(LinenBNMLP(), x)[1]] == [
        ("BatchNorm_0", 32, 1)
    ]


def test_fix_model_on_features_without_positions_gives_one_group_nnx():
    fixed, replaced = dptune.fix_model(NnxBNMLP(nnx.Rngs(0)), jnp.ones((2, 5)))
    assert [(r.path, r.channels, r.groups) for r in replaced] == [("norm", 32, 1)]
    assert fixed.norm.num_groups == 1
    assert _outputs_move_with_the_input(models.user_model(fixed, (5,), "float32"))


def test_a_group_norm_of_single_values_is_refused_with_the_layer_named():
    """Without an example batch, fix_model cannot see that an NNX BatchNorm reads features
    without positions; the model check then refuses the dead GroupNorm it made (and any such
    user GroupNorm): one line naming the layer and the fix."""
    fixed, _ = dptune.fix_model(NnxBNMLP(nnx.Rngs(0)))
    with pytest.raises(ValueError) as e:
        models.user_model(fixed, (5,), "float32")
    msg = str(e.value)
    assert msg.startswith("dptune: ") and "\n" not in msg
    assert "'norm'" in msg and "fix_model(model, x)" in msg

    class Dead(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(nn.GroupNorm(num_groups=8, name="gn")(nn.Dense(8)(x)))

    with pytest.raises(ValueError, match=r"^dptune: .*'gn'.*GroupNorm"):
        models.user_model(Dead(), (5,), "float32")
    # on images, the same groups hold many values: accepted
    from tests.trainers.test_nnx import _NnxResNet

    images, _ = dptune.fix_model(_NnxResNet(nnx.Rngs(0)))
    models.user_model(images, (6, 6, 3), "float32")


def test_a_linen_batchnorm_is_refused_in_one_dptune_line_pointing_at_fix_model():
    with pytest.raises(ValueError) as e:
        models.user_model(TrainKeywordBN(), (5,), "float32")
    msg = str(e.value)
    assert msg.startswith("dptune: model=TrainKeywordBN: layer 'BatchNorm_0'") and "\n" not in msg
    assert "dptune.fix_model(model, x)" in msg
    assert str(dptune.fix_model(LinenBNMLP(), jnp.ones((2, 5)))[1][0]).endswith("(1 group)")


class ScannedBlocks(nnx.Module):
    """Flax's nnx_toy_examples/06_scan_over_layers: blocks with BatchNorm made by nnx.vmap and
    applied by nnx.scan (here with a head)."""

    def __init__(self, rngs: nnx.Rngs):
        @nnx.split_rngs(splits=2)
        @nnx.vmap(axis_size=2)
        def block(rngs):
            return nnx.Sequential(nnx.Linear(4, 4, rngs=rngs), nnx.BatchNorm(4, rngs=rngs))

        self.layers = block(rngs)
        self.head = nnx.Linear(4, 3, rngs=rngs)

    def __call__(self, x):
        @nnx.scan
        def step(x, layer):
            return jnp.tanh(layer(x)), None

        return self.head(step(x, self.layers)[0])


class ConvRngsAtCall(nnx.Module):
    """Flax's examples/mnist CNN's shape: BatchNorm on feature maps, rngs passed at call."""

    def __init__(self, rngs: nnx.Rngs):
        self.conv = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
        self.bn = nnx.BatchNorm(8, rngs=rngs)
        self.drop = nnx.Dropout(0.1)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs):
        h = self.drop(nnx.relu(self.bn(self.conv(x))), rngs=rngs)
        return self.out(h.mean(axis=(1, 2)))


def test_fix_model_with_x_sees_batchnorms_under_scan_and_under_rngs_at_call():
    fixed, replaced = dptune.fix_model(ScannedBlocks(nnx.Rngs(0)), np.ones((2, 4), np.float32))
    assert [(r.path, r.groups) for r in replaced] == [("layers/layers/1", 1)]
    spec = models.user_model(fixed, (4,), "float32")
    params = models.init_params(spec, None)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, 4)), jnp.float32)
    out = np.asarray(spec.apply({"params": params}, x))
    assert not np.allclose(out, out[:1])
    plan = step.ghost_plan(spec)  # vmap(grad), and the log says why in words
    assert not plan.supported and "inside a lifted transform (nnx.scan" in plan.reason
    _, replaced = dptune.fix_model(
        ConvRngsAtCall(nnx.Rngs(0)), jax.ShapeDtypeStruct((2, 6, 6, 1), jnp.float32)
    )
    assert [(r.path, r.groups) for r in replaced] == [("bn", 8)]  # feature maps: gcd(32, 8)


def test_an_nnx_dropout_with_no_rngs_is_refused_before_anything_trains():
    """``nnx.Dropout(rate)`` with neither its own rngs nor an ``rngs`` argument of ``__call__``
    evaluates (dropout off) but cannot train: refused in one line, not a run whose every
    candidate fails."""

    class NoRngs(nnx.Module):
        def __init__(self, rngs):
            self.a = nnx.Linear(5, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.5)
            self.b = nnx.Linear(8, 3, rngs=rngs)

        def __call__(self, x):
            return self.b(self.drop(self.a(x)))

    with pytest.raises(ValueError) as e:
        models.user_model(NoRngs(nnx.Rngs(0)), (5,), "float32")
    msg = str(e.value)
    assert msg.startswith("dptune: model=NoRngs failed in training mode") and "\n" not in msg
    assert "training mode" in msg and "nnx.Dropout(rate, rngs=rngs)" in msg


def test_a_model_of_several_positional_inputs_is_refused_with_the_dict_convention():
    """Flax's sst2 classifier is called as model(token_ids, lengths): one line that says how
    dptune calls a model and how to pass several inputs."""

    class TwoInputs(nn.Module):
        @nn.compact
        def __call__(self, token_ids, lengths):
            return nn.Dense(2)(nn.Embed(7, 4)(token_ids).sum(1) / lengths[:, None])

    with pytest.raises(ValueError) as e:
        models.user_model(TwoInputs(), (5,), "int32")
    msg = str(e.value)
    assert msg.startswith("dptune: model=TwoInputs ") and "\n" not in msg
    assert "'lengths'" in msg and "one positional argument" in msg and "dict" in msg


def test_a_linen_module_drawing_another_rng_stream_in_training_is_refused_naming_it():
    """Flax's seq2seq decoder draws from make_rng('lstm') while it trains: dptune supplies the
    'dropout' stream only, which the one-line refusal says before anything is charged."""

    class Noisy(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            h = nn.Dense(4)(x)
            if train:
                h = h + jax.random.normal(self.make_rng("lstm"), h.shape)
            return nn.Dense(3)(h)

    with pytest.raises(ValueError) as e:
        models.user_model(Noisy(), (5,), "float32")
    msg = str(e.value)
    assert msg.startswith("dptune: model=Noisy failed in training mode") and "\n" not in msg
    assert "make_rng('dropout') instead of 'lstm'" in msg


# --- Flax's examples/gemma (NNX), its layers as it writes them at tiny sizes --------------------


class ScaledEmbed(nnx.Embed):
    """gemma's embedder: an ``nnx.Embed`` subclass scaling the lookup by sqrt(features); its
    ``attend`` (inherited) computes the tied output logits."""

    def __call__(self, x, out_sharding=None):
        x = super().__call__(x, out_sharding)
        return x * jnp.sqrt(x.shape[-1])


class GemmaRMSNorm(nnx.Module):
    """gemma's own RMSNorm (layers.RMSNorm): ``x̂ (1 + scale)``, scale initialised to zeros."""

    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.scale = nnx.Param(nnx.initializers.zeros_init()(rngs.params(), dim))

    def __call__(self, x):
        normed = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
        return normed * (1.0 + self.scale[...])


class GemmaAttention(nnx.Module):
    """gemma's Attention (modules.Attention): one ``'BTD,SNDH->SBTNH'`` einsum for queries, keys
    and values when every query head has its own key head, else ``'BTD,NDH->BTNH'`` queries and
    ``'BTD,CKDH->CBTKH'`` keys and values, grouped-query attention over the key heads and the
    ``'BTNH,NHD->BTD'`` output einsum (RoPE, which reads no parameter, left out)."""

    def __init__(self, heads: int, kv_heads: int, features: int, head_dim: int, rngs):
        self.heads, self.kv_heads = heads, kv_heads
        self.attn_vec_einsum = nnx.Einsum("BTNH,NHD->BTD", (heads, head_dim, features), rngs=rngs)
        if heads == kv_heads:
            self.qkv_einsum = nnx.Einsum(
                "BTD,SNDH->SBTNH", (3, heads, features, head_dim), rngs=rngs
            )
        else:
            self.q_einsum = nnx.Einsum("BTD,NDH->BTNH", (heads, features, head_dim), rngs=rngs)
            self.kv_einsum = nnx.Einsum(
                "BTD,CKDH->CBTKH", (2, kv_heads, features, head_dim), rngs=rngs
            )

    def __call__(self, x, attn_mask):
        if self.heads == self.kv_heads:
            q, k, v = self.qkv_einsum(x)
        else:
            q = self.q_einsum(x)
            k, v = self.kv_einsum(x)
        q = q * q.shape[-1] ** -0.5
        b, t, _, h = q.shape
        q = q.reshape(b, t, self.kv_heads, self.heads // self.kv_heads, h)
        logits = jnp.einsum("BTKGH,BSKH->BTKGS", q, k).reshape(b, t, self.heads, -1)
        logits = jnp.where(attn_mask[:, :, None, :], logits, -2.3819763e38)
        probs = jax.nn.softmax(logits, axis=-1).reshape(b, t, self.kv_heads, -1, t)
        encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, v).reshape(b, t, self.heads, h)
        return self.attn_vec_einsum(encoded)


class GemmaFeedForward(nnx.Module):
    """gemma's FeedForward (modules.FeedForward): the gated MLP of three bias-free
    ``nnx.Linear``, each called with the ``out_sharding`` keyword (None in its default sharding
    config), its dropout (rate 0 by default) left out."""

    def __init__(self, features: int, hidden_dim: int, *, rngs: nnx.Rngs):
        linear = functools.partial(nnx.Linear, use_bias=False, rngs=rngs)
        self.gate_proj, self.up_proj = linear(features, hidden_dim), linear(features, hidden_dim)
        self.down_proj = linear(hidden_dim, features)

    def __call__(self, x):
        gate_value = nnx.gelu(self.gate_proj(x, out_sharding=None))
        return self.down_proj(gate_value * self.up_proj(x, out_sharding=None), out_sharding=None)


class GemmaBlock(nnx.Module):
    """gemma's Block: pre- and post-norms around attention and the MLP, residuals."""

    def __init__(self, width: int, hidden: int, heads: int, kv_heads: int, rngs):
        self.pre_attention_norm = GemmaRMSNorm(width, rngs=rngs)
        self.attn = GemmaAttention(heads, kv_heads, width, 4, rngs)
        self.post_attention_norm = GemmaRMSNorm(width, rngs=rngs)
        self.pre_ffw_norm = GemmaRMSNorm(width, rngs=rngs)
        self.mlp = GemmaFeedForward(width, hidden, rngs=rngs)
        self.post_ffw_norm = GemmaRMSNorm(width, rngs=rngs)

    def __call__(self, x, attn_mask):
        x = x + self.post_attention_norm(self.attn(self.pre_attention_norm(x), attn_mask))
        return x + self.post_ffw_norm(self.mlp(self.pre_ffw_norm(x)))


class Gemma(nnx.Module):
    """gemma's Transformer behind the wrapper docs/your_model.md describes (tokens in; the causal
    mask made inside): ScaledEmbed, blocks, the final RMSNorm, logits by the embedder's
    ``attend``. The last position's logits: (b, vocab)."""

    def __init__(self, heads: int, kv_heads: int, rngs, vocab: int = 8, width: int = 8):
        self.embedder = ScaledEmbed(vocab, width, rngs=rngs)
        self.layers = nnx.List([GemmaBlock(width, 16, heads, kv_heads, rngs)])
        self.final_norm = GemmaRMSNorm(width, rngs=rngs)

    def __call__(self, tokens):
        t = tokens.shape[1]
        attn_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (tokens.shape[0], t, t))
        x = self.embedder(tokens)
        for layer in self.layers:
            x = layer(x, attn_mask)
        return self.embedder.attend(self.final_norm(x))[:, -1]


#: gemma's parameters that only its own code reads: the embedder (a subclass, tied) and norms
GEMMA_OWN_CODE = nnx.Any(*(nnx.PathContains(n) for n in (
    "embedder", "final_norm", "pre_attention_norm", "post_attention_norm", "pre_ffw_norm",
    "post_ffw_norm")))  # fmt: skip


def test_gemma_as_it_comes_takes_vmap_and_the_reason_names_its_own_layers():
    """The plan names the embedder (an nnx.Embed subclass) and gemma's own RMSNorm class: what
    keeps it on vmap(grad) now that its einsums are dense maps."""
    spec = models.user_model(Gemma(2, 1, nnx.Rngs(0)), (5,), "int32")
    reason = step.ghost_plan(spec).reason
    assert "embedder (a ScaledEmbed: a subclass of nnx.Embed" in reason, reason
    assert "final_norm (a tests.trainers.test_flax_examples.GemmaRMSNorm)" in reason, reason


@pytest.mark.parametrize(
    "kv_heads", [1, pytest.param(2, marks=pytest.mark.slow)]
)  # 1: 'BTD,CKDH->CBTKH' keys and values; 2: 'BTD,SNDH->SBTNH' queries, keys and values
def test_gemma_attention_and_mlp_take_the_ghost_path_and_match_vmap_grad(kv_heads):
    """With the embedder and the norms held (an NNX filter: what trains is every other Param),
    gemma's einsums and MLP take the ghost path: the clipped sum, loss sum and per-example norms
    equal vmap(grad)'s (the plan's probes are left to tests/trainers/test_nnx.py: seconds)."""
    from tests.trainers.test_nnx import _assert_matches_vmap_grad, _inputs, _loss

    trainable = nnx.All(nnx.Param, nnx.Not(GEMMA_OWN_CODE))
    module = nnx_model.NnxModel(Gemma(2, kv_heads, nnx.Rngs(0)), trainable=trainable)
    params = module.params()
    assert sorted(params["layers"]["0"]) == ["attn", "mlp"]
    x, y = _inputs((5,), np.int32, seed=1)
    shape = jax.ShapeDtypeStruct
    plan = ghost.analyze(module, params, shape(x.shape, x.dtype), _loss,
                         shape(y.shape, y.dtype), probe=False)  # fmt: skip
    assert plan.supported, plan.reason
    assert len(plan.layers) == (6 if kv_heads == 1 else 5)  # 3 (2) einsums and 3 Linears
    fast = jax.jit(lambda p, m, c: ghost.clipped_sum_ghost(module, _loss, p, x, y, m, c))
    ref = jax.jit(lambda p, m, c: dpsgd.clipped_sum_naive(module.apply, p, x, y, m, c, _loss))
    _assert_matches_vmap_grad(fast, ref, params)
