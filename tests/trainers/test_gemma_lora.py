"""Private LoRA fine-tuning of Flax's examples/gemma (the tiny transcription of
``tests/trainers/test_flax_examples.py``) as an NNX user adds LoRA: module surgery on the
pretrained instance, without editing the model's code.

Flax's gemma MLP (``modules.FeedForward``) is three bias-free ``nnx.Linear``; attention is
``nnx.Einsum``. The surgery is Flax's own recipe (the NNX optimization cookbook's LoRA section):
``nnx.recursive_map`` wrapping every ``nnx.Linear`` (here exactly the MLP's) in
``nnx.LoRA(..., base_module=layer)``; or the surgery guide's ``nnx.LoRALinear`` assigned in place
of a Linear, the base's state loaded through ``init=``. Checked: the factors alone train by
default, on the ghost path; the per-example norms and clipped sum equal an independent
``vmap(grad)`` through Flax (no dptune code) to f32; a short private tuning run keeps the frozen
base bitwise and releases a model that ``dptune.load_release`` gives back into the module.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, traverse_util

import dptune
from tests.trainers.test_flax_examples import Gemma
from tests.trainers.test_nnx_lora import tune_on_the_ghost_path
from trainers import finetune, models, step

VOCAB, TOKENS, RANK = 8, 5, 2
_BASE = dict(batch_size=16, epochs=2, noise_multiplier=1.0, clip_norm=0.5, learning_rate=0.5)


def _pretrained() -> Gemma:
    """The tiny gemma (2 query heads, 1 key head: its q and kv einsums) standing in for
    pretrained weights."""
    return Gemma(2, 1, nnx.Rngs(0))


def add_lora(model: nnx.Module, rank: int, rngs: nnx.Rngs) -> nnx.Module:
    """Flax's cookbook surgery: every ``nnx.Linear`` wrapped in a rank-``rank`` ``nnx.LoRA``
    whose base is the layer itself (its weights, shared, not copied); B starts at zero."""

    def wrap(path, node):
        if isinstance(node, nnx.Linear):
            return nnx.LoRA(node.in_features, rank, node.out_features, base_module=node,
                            rngs=rngs)  # fmt: skip
        return node

    return nnx.recursive_map(wrap, model)


def _data(n: int = 64, seed: int = 0) -> dptune.Dataset:
    """Token sequences (n, 5) in [0, 8); the label is the first token (gemma predicts it from
    the last position's logits: a copy task attention can learn)."""
    rng = np.random.default_rng(seed)
    x = rng.integers(0, VOCAB, (n, TOKENS)).astype(np.int32)
    return dptune.Dataset.from_arrays(
        x, x[:, 0].copy(), num_examples=n, validation_fraction=0.25, num_classes=VOCAB
    )


def _flat_bits(tree) -> dict[str, tuple]:
    return {
        k: (np.asarray(v).dtype, np.asarray(v).shape, np.asarray(v).tobytes())
        for k, v in finetune.flat_paths(tree).items()
    }


_FACTORS = [
    f"layers/0/mlp/{p}/{f}" for p in ("down_proj", "gate_proj", "up_proj")
    for f in ("lora_a", "lora_b")
]  # fmt: skip


@pytest.mark.parametrize("surgery", ["wrap", "assign"])
def test_lora_surgery_on_gemma_trains_the_factors_alone_on_the_ghost_path(surgery, caplog):
    """``wrap``: ``nnx.recursive_map`` puts ``nnx.LoRA`` around the MLP's Linears of the
    pretrained instance (its own values are the start). ``assign``: the surgery guide's
    ``nnx.LoRALinear`` assigned in place of each Linear of a fresh model, the pretrained
    parameters passed as ``init=`` (same paths as ``nnx.Linear``). Either way, without
    ``trainable=`` the six factor arrays train, the clipping path is ghost (the frozen embedder
    and RMSNorms are gemma's own classes, run as written), and the adapted model starts equal
    to the base, bit for bit."""
    base = _pretrained()
    x = jnp.asarray(_data().train_x[:8])
    want = np.asarray(base(x))
    pretrained = dptune.NnxModel(base).params()
    if surgery == "wrap":
        model, kw = add_lora(base, RANK, nnx.Rngs(1)), {}
        factors = _FACTORS
    else:
        model, kw = Gemma(2, 1, nnx.Rngs(5)), {"init": pretrained}
        rngs = nnx.Rngs(1)
        for mlp in (layer.mlp for layer in model.layers):
            for name in ("gate_proj", "up_proj", "down_proj"):
                old = getattr(mlp, name)
                setattr(mlp, name, nnx.LoRALinear(old.in_features, old.out_features,
                                                  lora_rank=RANK, use_bias=False,
                                                  rngs=rngs))  # fmt: skip
        factors = [p.replace("/lora_", "/lora/lora_") for p in _FACTORS]
    with caplog.at_level(logging.INFO):
        tr = dptune.DpSgdTrainer(_data(), _BASE, model=model, epoch_progress=False, **kw)
    assert any("LoRAParam" in r.getMessage() for r in caplog.records)  # the default, said
    trains = finetune.flat_paths(tr.model.trainable)
    assert sorted(p for p, m in trains.items() if m) == factors
    path = tr.clipping_path()
    assert path == {"path": "ghost", "why": "every parametrised layer is a known layer (6 layers)"}
    start = models.init_params(tr.model, jax.random.PRNGKey(0))
    frozen = {k: v for k, v in _flat_bits(start).items() if k not in factors}
    base_paths = {k.replace("/base_module", ""): v for k, v in frozen.items()}
    assert base_paths == _flat_bits(pretrained)
    np.testing.assert_array_equal(tr.model.apply({"params": start}, x), want)


def _reference(model: nnx.Module, x, y, mask, clip: float):
    """Per-example norms of the factors' gradients and their clipped sum, by ``jax.vmap`` of
    ``jax.grad`` through Flax alone (``nnx.split`` / ``nnx.merge``, optax's cross-entropy on the
    last position's logits): an independent number."""
    graphdef, factors, rest = nnx.split(model, nnx.LoRAParam, ...)

    def loss(f, xi, yi):
        logits = nnx.merge(graphdef, f, rest)(xi[None])
        return optax.softmax_cross_entropy_with_integer_labels(logits, yi[None])[0]

    g = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(factors, x, y)
    g = finetune.flat_paths(nnx.to_pure_dict(g))
    norms = jnp.sqrt(sum(jnp.sum(v.reshape(v.shape[0], -1) ** 2, 1) for v in g.values()))
    c = mask * jnp.minimum(1.0, clip / norms)
    return {k: jnp.tensordot(c, v, axes=1) for k, v in g.items()}, norms


def test_gemma_lora_clipped_norms_and_sum_equal_an_independent_vmap_grad():
    """The clipped sum a training step computes (the ghost path, each factor a Dense kernel in
    rank space) against vmap(grad) through Flax: the per-example norms to 2e-5, the sums of
    the factors to 2e-4, every frozen array's sum exactly zero. The factors are drawn away
    from the start (B = 0 would make A's gradient zero)."""
    model = add_lora(_pretrained(), RANK, nnx.Rngs(1))
    state = nnx.state(model, nnx.LoRAParam)
    leaves, tree = jax.tree_util.tree_flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(3), len(leaves))
    noisy = [
        0.5 * jax.random.normal(k, v.shape, v.dtype) for v, k in zip(leaves, keys, strict=True)
    ]
    nnx.update(model, jax.tree_util.tree_unflatten(tree, noisy))
    data = _data()
    spec = dptune.DpSgdTrainer(data, _BASE, model=model).model
    impl = step.resolve_grad_impl(spec, "auto", spec.input_shape)
    assert impl == "ghost"
    fn = jax.jit(step.StepFunctions(spec, 3, "sgd", impl)._clipped_sum_of(spec))
    params = models.init_params(spec, jax.random.PRNGKey(0))  # the module's own values
    b, clip = 6, 0.05
    x, y = jnp.asarray(data.train_x[:b]), jnp.asarray(data.train_y[:b])
    mask = jnp.ones(b).at[2].set(0.0)
    got, _, norms = fn(params, x, y, mask, clip)
    want, want_norms = _reference(model, x, y, mask, clip)
    assert float(jnp.min(want_norms)) > clip  # clipping binds: the sum tests the factors
    np.testing.assert_allclose(norms, want_norms, rtol=2e-5, atol=1e-7)
    got = finetune.flat_paths(got)
    assert sorted(want) == _FACTORS
    for k, v in got.items():
        if k in want:
            np.testing.assert_allclose(v, want[k], rtol=2e-4, atol=1e-7, err_msg=k)
        else:
            assert not np.any(np.asarray(v)), k


def test_private_lora_tuning_of_gemma_keeps_the_base_bitwise_and_reloads(tmp_path, caplog):
    """Two candidates tuned privately (``BestOfK(2)``, learning rate searched) on the logged
    ghost path: the release holds the frozen base bitwise as it was pretrained and trained
    factors; ``load_release(workdir, like=model)`` gives it back as the module's state, and the
    updated module predicts what the released parameters do."""
    from selection import BestOfK

    base = _pretrained()
    pretrained = _flat_bits(dptune.NnxModel(base).params())
    model = add_lora(base, RANK, nnx.Rngs(1))
    data = _data()
    tr = dptune.DpSgdTrainer(data, _BASE, model=model, epoch_progress=False)
    tune_on_the_ghost_path(
        tr, {"learning_rate": dptune.space.log_uniform(0.1, 1.0)}, BestOfK(2), tmp_path / "run",
        caplog,
    )  # fmt: skip
    loaded = dptune.load_release(tmp_path / "run", like=model)
    released = nnx.to_pure_dict(loaded.params)
    bits = _flat_bits(released)
    assert {k.replace("/base_module", ""): v for k, v in bits.items() if k not in _FACTORS} == (
        pretrained
    )
    flat = finetune.flat_paths(released)
    assert all(np.any(np.asarray(flat[k])) for k in _FACTORS if k.endswith("lora_b"))
    nnx.update(model, loaded.params)
    x = jnp.asarray(data.train_x[:8])
    # dptune's parameter dicts key list entries by strings ('0'), nnx's pure dicts by ints
    plain = traverse_util.unflatten_dict(
        {tuple(k.split("/")): np.asarray(v) for k, v in flat.items()}
    )
    np.testing.assert_array_equal(model(x), tr.model.apply({"params": plain}, x))
