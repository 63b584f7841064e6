"""Exploratory: the clipped gradient sum of one DP-SGD step of Flax's own ``examples/gemma``
Transformer (NNX, as it comes), ghost path against ``vmap(grad)``, interleaved in one process.

Flax's gemma embedder (an ``nnx.Embed`` subclass whose table is also the tied output layer) and
its own RMSNorm class are not known layers, so the whole model clips by ``vmap(grad)``; with them
held (``NnxModel(module, trainable=...)``, what trains is every other ``nnx.Param``: the
attention einsums and the MLP), the ghost path applies. Both paths here train that same set.
Each round times one call of each path (compiled beforehand), alternating which goes first;
medians over ``--rounds``.

Usage (the example's files from a flax checkout; jaxtyping is stubbed when absent)::

    git --git-dir=FLAX/.git archive HEAD examples/gemma | tar -x -C /tmp/flax
    python scripts/bench_gemma_ghost.py --gemma /tmp/flax/examples/gemma [--rounds 5]

Prints one line per size (parameters trained, milliseconds per step for each path, the ratio).
"""

from __future__ import annotations

import argparse
import sys
import time
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from trainers.nnx_model import NnxModel  # noqa: E402
from trainers.userloop import clipped_grad_sum  # noqa: E402

#: name -> (layers, width, hidden, heads, kv heads, head dim, vocabulary, tokens, batch)
SIZES = {
    "toy": (1, 32, 64, 2, 1, 16, 256, 32, 16),
    "small": (2, 128, 256, 4, 1, 32, 2048, 64, 16),
    "flax-tiny-body": (4, 256, 512, 4, 1, 128, 4096, 64, 16),  # configs/tiny.py, less vocabulary
}
HELD = ("embedder", "final_norm", "pre_attention_norm", "post_attention_norm", "pre_ffw_norm",
        "post_ffw_norm")  # fmt: skip


def load_gemma(folder: str):
    if "jaxtyping" not in sys.modules:
        try:
            import jaxtyping  # noqa: F401
        except ImportError:
            sys.modules["jaxtyping"] = types.SimpleNamespace(Array=jax.Array)
    sys.path.insert(0, folder)
    import transformer  # the example's own module names
    import transformer_cfg

    return transformer, transformer_cfg


def build(transformer, cfg_lib, size):
    layers, width, hidden, heads, kv, head_dim, vocab, _, _ = size
    cfg = cfg_lib.TransformerConfig(
        num_layers=layers, num_embed=vocab, embed_dim=width, hidden_dim=hidden, num_heads=heads,
        head_dim=head_dim, num_kv_heads=kv, final_logit_softcap=None, use_post_attn_norm=False,
        use_post_ffw_norm=False, attention_types=(cfg_lib.AttentionType.GLOBAL,) * layers,
    )  # fmt: skip

    class Gemma(nnx.Module):
        """Tokens in; positions and the causal mask made inside; logits (b, T, vocab)."""

        def __init__(self, rngs):
            self.model = transformer.Transformer(cfg, rngs=rngs)

        def __call__(self, tokens):
            mask = jnp.ones(tokens.shape, bool)
            positions = transformer.build_positions_from_mask(mask)
            causal = transformer.make_causal_attn_mask(mask)
            return self.model(tokens, positions, None, causal)[0]

    return Gemma(nnx.Rngs(0))


def sequence_loss(logits, labels):
    return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels), axis=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gemma", required=True, help="Flax's examples/gemma folder")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sizes", default=",".join(SIZES))
    args = parser.parse_args()
    transformer, cfg_lib = load_gemma(args.gemma)
    held = nnx.Any(*(nnx.PathContains(n) for n in HELD))
    for name in args.sizes.split(","):
        size = SIZES[name]
        tokens, batch = size[7], size[8]
        model = NnxModel(
            build(transformer, cfg_lib, size), trainable=nnx.All(nnx.Param, nnx.Not(held))
        )
        params = model.params()
        rng = np.random.default_rng(0)
        seq = rng.integers(0, size[6], (batch, tokens + 1)).astype(np.int32)
        x, y = jnp.asarray(seq[:, :-1]), jnp.asarray(seq[:, 1:])
        mask = jnp.ones((batch,), jnp.float32)
        fns = {}
        for impl in ("ghost", "vmap"):
            fn = clipped_grad_sum(model, sequence_loss, grad_impl=impl)
            assert fn.impl(x, y) == impl, (impl, fn.impl(x, y))
            jax.block_until_ready(fn(params, x, y, mask, 1.0))  # compile
            fns[impl] = fn
        times = {impl: [] for impl in fns}
        for r in range(args.rounds):
            for impl in ("ghost", "vmap") if r % 2 == 0 else ("vmap", "ghost"):
                t = time.perf_counter()
                jax.block_until_ready(fns[impl](params, x, y, mask, 1.0))
                times[impl].append(time.perf_counter() - t)
        med = {impl: 1e3 * float(np.median(v)) for impl, v in times.items()}
        n = sum(v.size for v in jax.tree_util.tree_leaves(params))
        print(
            f"{name}: {n} parameters trained, batch {batch} x {tokens} tokens: ghost "
            f"{med['ghost']:.1f} ms, vmap {med['vmap']:.1f} ms per step (median of "
            f"{args.rounds}), vmap/ghost {med['vmap'] / med['ghost']:.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
