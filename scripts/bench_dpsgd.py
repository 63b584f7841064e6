r"""DP-SGD step speed on this machine: dptune (JAX) vs its own non-private step, torch.func and
Opacus.

All rows train the 26,010-parameter tanh CNN (conv 16@8x8/2 SAME, maxpool 2x2/1, conv 32@4x4/2
VALID,
maxpool 2x2/1, dense 32, dense 10) on 28x28x1 inputs at batch 256 (C = 1, sigma = 1.1). Rows are
timed interleaved, round after round, in one process, and every ratio is the ratio of per-row
medians over the same rounds, so background load affects numerator and denominator alike.

Rows:
  jax_nonprivate       flax model, value_and_grad of the mean loss, optax SGD, fixed batch
  dptune_dp_fixed      dptune's compiled DP-SGD step, fixed batch of 256 (no padding)
  dptune_dp_poisson    dptune's DP-SGD step as trained: Poisson batch (expected 256) sampled on
                       the host, body chunk + tail chunks, noise, update; counted at 256 per step
  jax_dp_naive         vmap(grad) per-example gradients (the reference formulation), fixed batch
  dptune_kK_vmap       K candidates in one vmapped step (K x 256 examples per step)
  dptune_kK_seq        the same K candidates one after another
  torch_nonprivate     PyTorch, same model, SGD                      (needs the `bench` extra)
  torch_func_dp        PyTorch torch.func vmap(grad) DP-SGD          (needs the `bench` extra)
  opacus_dp            Opacus DP-SGD (GradSampleModule hooks)        (needs the `bench` extra)

    python scripts/bench_dpsgd.py            # full table (a few minutes)
    python scripts/bench_dpsgd.py --quick    # < 1 minute, fewer rows and rounds
    python scripts/bench_dpsgd.py --json     # ... and one JSON object as the last line
    python scripts/bench_dpsgd.py --cifar    # the CIFAR row set (CIFAR CNN, batch 256)
    python scripts/bench_dpsgd.py --user     # user models through the automatic path
    python scripts/bench_dpsgd.py --lm       # a 2-layer transformer LM (``lm_rows``)

Language-model row set (--lm; ``lm_rows``): a 2-layer pre-norm causal transformer LM (d 128, 4
heads, MLP 512, vocabulary 256, learned positions) on 64 token ids with next-token labels (b, 64),
one sequence one record (mean token cross-entropy), batch 64, one jitted step per row:
  lm_dp_ghost          dptune's DP-SGD step through the automatic path (ghost here; lm_dp_vmap
                       if the ghost path did not apply)
  lm_nonprivate        the same module's non-private step (optax SGD)
  lm_jaxprivacy        jax_privacy 2.0's clipped_grad on the same module, + noise + SGD

User-model row set (--user; ``user_rows``): models written as a user would, through the automatic
per-example clipping of a user's model (``trainers.ghost`` when it applies), batch 256 unless said:
  user_cnn_auto        cnn26k's architecture with plain nn.Conv / nn.max_pool / nn.Dense, dptune's
                       automatic path (the ghost / book-keeping path here)
  cnn26k_handtuned     the shipped cnn26k's hand-tuned book-keeping step
  user_cnn_vmap        the user CNN with vmap(grad) per-example gradients (the generic path)
  user_cnn_nnx_auto    the user CNN's Flax NNX twin (nnx.Conv / nnx.max_pool / nnx.Linear), the
                       automatic path (goal: >= 0.9x user_cnn_auto)
  user_cnn_jaxprivacy  jax_privacy 2.0's clipped_grad on the same module (needs jax_privacy)
  user_cnn_nonprivate  the user CNN's non-private step
  text_auto / text_nonprivate        the text example's one-block transformer on 24 token ids
  tabular_auto / tabular_nonprivate  the tabular example's MLP on 30 features, batch 64
  (all DP rows: clipped sum + noise + SGD update in one jitted step, fixed batch)

LoRA row set (--lora; ``lora_rows``): a 4-layer pre-norm transformer classifier (d 256, 4 heads,
MLP 1024, sequence 128, vocabulary 512; --lora-d / --lora-seq / --lora-batch to shrink it), rank-8
LoRA adapters (``dptune.with_lora``) on every attention projection and MLP layer, only the
adapters trained; batch --lora-batch (default 16):
  lora_dp              dptune's DP-SGD step (its automatic path: ghost norms in rank space over
                       the adapters, the frozen base with no norm terms), noise, SGD update
  lora_nonprivate      the same model's non-private LoRA step (grad w.r.t. the adapters only)
  lora_jaxprivacy      jax_privacy 2.0's clipped_grad over the adapters (base closed over),
                       noise, SGD update
  full_dp              dptune's DP-SGD step training every parameter (full fine-tuning)
  lora_forward         the adapted model's forward pass and loss alone, no gradient: a floor
                       under any training step of this model, private or not
  lora_backprop_floor  the base model's forward pass and a backward pass through every block
                       with no weight gradient (the gradient w.r.t. the first block's first
                       LayerNorm scale only): what any step that trains an adapter in the first
                       block must at least compute, private or not
  lora_candidate       a whole DP candidate of the LoRA model through trainers.loop (one epoch of
                       10 steps at the batch above: parameter init, the epoch on the device,
                       validation scoring), per expected training example (goal on a GPU: >= 0.9x
                       lora_dp's examples/s; measured here on the CPU)
  plus each row's compiled peak memory (XLA's buffer assignment), printed after the table

CIFAR row set (--cifar): the 550,570-parameter tanh CIFAR CNN on 32x32x3 inputs, batch 256:
  cifar_nonprivate     its non-private step (flax, optax SGD)
  cifar_dp_fast        dptune's DP-SGD step, book-keeping clipped sum
  cifar_dp_naive       the same step with vmap(grad) per-example gradients
  cifar_dp_fast_augmult4  dptune's DP step with augmentation multiplicity 4 (full runs only)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np

# JAX is imported lazily: the PyTorch rows run in worker processes of their own (one per torch
# thread count), so that neither library's thread pools share a process with the other's.

BATCH = 256
N_TRAIN = 60000
CLIP, SIGMA, LR = 1.0, 1.1, 0.1


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def jax_rows(quick: bool) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (run one step and return something to block on, examples per step)."""
    import jax
    import jax.numpy as jnp

    from trainers import models
    from trainers.runtime import tune_malloc
    from trainers.sampling import PoissonSampler
    from trainers.spec import Hyperparams
    from trainers.step import get_step_functions, make_optimizer

    tune_malloc()  # applies to every JAX row alike (dptune's trainer does this on first use)
    rng = np.random.default_rng(0)
    data_x = jax.device_put(rng.uniform(0, 1, (N_TRAIN, 28, 28, 1)).astype(np.float32))
    data_y = jax.device_put(rng.integers(0, 10, N_TRAIN).astype(np.int32))
    spec = models.get_model("cnn26k")
    params0 = models.init_params(spec, jax.random.PRNGKey(0))
    rows: dict[str, tuple[Callable[[], object], int]] = {}
    fixed_idx = np.sort(rng.choice(N_TRAIN, BATCH, replace=False)).astype(np.int32)
    ones = np.ones(BATCH, np.float32)
    key = jax.random.PRNGKey(1)
    b = jnp.float32(BATCH)
    clip, sigma = jnp.float32(CLIP), jnp.float32(SIGMA)

    # Non-private step: same model, same gather from device-resident data, same optimiser.
    np_step = _nonprivate_step(spec.module.apply, data_x, data_y, params0)
    rows["jax_nonprivate"] = (_stateful_row(*np_step, fixed_idx), BATCH)
    state: dict[str, tuple] = {}

    def dp_row(impl: str, name: str):
        fns = get_step_functions("cnn26k", 10, "sgd", impl)
        rows[name] = (_dp_row(fns, params0, (data_x, data_y), fixed_idx, key), BATCH)
        return fns

    fns = dp_row("bookkeeping", "dptune_dp_fixed")
    hp = Hyperparams(learning_rate=LR, clip_norm=CLIP, noise_multiplier=SIGMA)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params0)

    # Poisson: exactly the loop of trainers.loop (host sampling, chunks, accumulate, fused step).
    sampler = PoissonSampler(N_TRAIN, BATCH, np.random.default_rng(2))
    state["poisson"] = (params0, make_optimizer(hp).init(params0), 0)

    def run_poisson():
        p, o, i = state["poisson"]
        chunks = sampler.chunks(sampler.sample())
        g, lo = zeros, jnp.float32(0)
        for idx, mask in chunks[1:]:
            g, lo = fns.accumulate(p, g, lo, data_x, data_y, idx, mask, clip, key, i, 1)
        p, o, lo = fns.step(
            p, o, g, lo, data_x, data_y, *chunks[0], key, jnp.int32(i), clip, sigma, b
        )
        state["poisson"] = (p, o, i + 1)
        return lo

    rows["dptune_dp_poisson"] = (run_poisson, BATCH)
    if not quick:
        dp_row("naive", "jax_dp_naive")
    if _have_jax_privacy():
        jp_step, _, jp_state = jax_privacy_step(spec.module.apply, params0, data_x, data_y, BATCH)
        rows["jax_privacy_dp"] = (_stateful_row(jp_step, params0, jp_state, fixed_idx), BATCH)

    for k in (4,) if quick else (4, 8):
        keys = jnp.stack([jax.random.PRNGKey(10 + i) for i in range(k)])
        kparams = [models.init_params(spec, jax.random.PRNGKey(20 + i)) for i in range(k)]
        kopts = [make_optimizer(hp).init(p) for p in kparams]

        def stack(xs):
            return jax.tree_util.tree_map(lambda *a: jnp.stack(a), *xs)

        vname, sname = f"dptune_k{k}_vmap", f"dptune_k{k}_seq"
        state[vname] = (stack(kparams), stack(kopts), 0)
        kidx = np.stack([fixed_idx] * k)
        kones = np.ones((k, BATCH), np.float32)
        kzeros = stack([zeros] * k)
        kclip, ksigma = jnp.full((k,), CLIP), jnp.full((k,), SIGMA)

        def run_vmap(vname=vname, kidx=kidx, kones=kones, kzeros=kzeros, keys=keys,
                     kclip=kclip, ksigma=ksigma, k=k):  # fmt: skip
            p, o, i = state[vname]
            p, o, lo = fns.vstep(
                p, o, kzeros, jnp.zeros(k), data_x, data_y, kidx, kones, keys, jnp.int32(i),
                kclip, ksigma, b,
            )  # fmt: skip
            state[vname] = (p, o, i + 1)
            return lo

        state[sname] = (list(kparams), list(kopts), 0)

        def run_seq(sname=sname, keys=keys, k=k):
            ps, os_, i = state[sname]
            out = None
            for c in range(k):
                ps[c], os_[c], out = fns.step(
                    ps[c], os_[c], zeros, jnp.float32(0), data_x, data_y, fixed_idx, ones,
                    keys[c], jnp.int32(i), clip, sigma, b,
                )  # fmt: skip
            state[sname] = (ps, os_, i + 1)
            return out

        rows[vname] = (run_vmap, k * BATCH)
        rows[sname] = (run_seq, k * BATCH)
    return rows


def user_rows(quick: bool) -> dict[str, tuple[Callable[[], object], int]]:
    """The user-model row set (see the module docstring): name -> (one step, examples per step)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from trainers import dpsgd, models, step
    from trainers.runtime import tune_malloc

    tune_malloc()
    rows: dict[str, tuple[Callable[[], object], int]] = {}
    rng = np.random.default_rng(0)
    key = jax.random.PRNGKey(1)

    class TinyTransformer(nn.Module):  # examples/user_text_classifier.py
        @nn.compact
        def __call__(self, ids):
            h = nn.Embed(64, 32)(ids)
            h = h + nn.MultiHeadDotProductAttention(num_heads=2)(nn.LayerNorm()(h))
            h = h + nn.Dense(32)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(h))))
            return nn.Dense(2)(jnp.mean(nn.LayerNorm()(h), axis=1))

    class TabularMLP(nn.Module):  # examples/user_tabular.py
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.tanh(nn.Dense(16)(nn.LayerNorm()(x))))

    def task(name, module, x, y, classes, batch):
        """DP rows through StepFunctions (as trainers.loop runs them) for `impls`, plus the
        module's non-private step; returns (spec, data, params0, fixed batch)."""
        spec = models.user_model(module, x.shape[1:], x.dtype, num_classes=classes)
        data_x, data_y = jax.device_put(x), jax.device_put(y)
        params0 = models.init_params(spec, jax.random.PRNGKey(0))
        idx = np.sort(rng.choice(len(x), batch, replace=False)).astype(np.int32)
        np_step = _nonprivate_step(spec.apply, data_x, data_y, params0)
        return spec, (data_x, data_y), params0, idx, (_stateful_row(*np_step, idx), batch)

    def dp_row(row, model, impl, data, params0, idx, batch):
        fns = step.get_step_functions(model, 10, "sgd", impl)
        rows[row] = (_dp_row(fns, params0, data, idx, key), batch)

    images = rng.uniform(0, 1, (N_TRAIN // 4, 28, 28, 1)).astype(np.float32)
    labels = rng.integers(0, 10, len(images)).astype(np.int32)
    spec, data, params0, idx, nonpriv = task(
        "user_cnn", _user_cnn_spec().module, images, labels, 10, BATCH
    )
    auto = step.resolve_grad_impl(spec, "auto", spec.input_shape)
    dp_row("user_cnn_auto", spec, auto, data, params0, idx, BATCH)
    shipped = models.init_params(models.get_model("cnn26k"), jax.random.PRNGKey(0))
    dp_row("cnn26k_handtuned", "cnn26k", "bookkeeping", data, shipped, idx, BATCH)
    dp_row("user_cnn_vmap", spec, "vmap", data, params0, idx, BATCH)
    nnx_spec = _user_cnn_nnx_spec()
    dp_row("user_cnn_nnx_auto", nnx_spec, step.resolve_grad_impl(nnx_spec, "auto", (28, 28, 1)),
           data, models.init_params(nnx_spec, jax.random.PRNGKey(0)), idx, BATCH)  # fmt: skip
    if _have_jax_privacy():

        def example_loss(p, x, y, spec=spec):  # one example, its batch axis kept
            return dpsgd.per_example_loss(spec.apply({"params": p}, x), y).sum()

        jp_row = _clipped_grad_row(example_loss, data, idx, params0, key, BATCH)
        rows["user_cnn_jaxprivacy"] = (jp_row, BATCH)
    rows["user_cnn_nonprivate"] = nonpriv
    if quick:
        return rows
    tokens = rng.integers(0, 64, (6000, 24)).astype(np.int32)
    spec, data, params0, idx, nonpriv = task(
        "text", TinyTransformer(), tokens, rng.integers(0, 2, 6000).astype(np.int32), 2, BATCH
    )
    dp_row("text_auto", spec, step.resolve_grad_impl(spec, "auto", spec.input_shape), data,
           params0, idx, BATCH)  # fmt: skip
    rows["text_nonprivate"] = nonpriv
    table = rng.standard_normal((500, 30)).astype(np.float32)
    spec, data, params0, idx, nonpriv = task(
        "tabular", TabularMLP(), table, rng.integers(0, 2, 500).astype(np.int32), 2, 64
    )
    dp_row("tabular_auto", spec, step.resolve_grad_impl(spec, "auto", spec.input_shape), data,
           params0, idx, 64)  # fmt: skip
    rows["tabular_nonprivate"] = nonpriv
    return rows


def lm_rows(quick: bool) -> dict[str, tuple[Callable[[], object], int]]:
    """The language-model row set (--lm; see the module docstring): a 2-layer pre-norm causal
    transformer LM (width 128, 4 heads, MLP 512, vocabulary 256) on sequences of 64 token ids,
    next-token labels (b, 64), the loss of a sequence the mean token cross-entropy; batch 64
    (16 with --quick). name -> (one step, sequences per step)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    from trainers import models, step
    from trainers.runtime import tune_malloc
    from trainers.spec import Hyperparams
    from trainers.step import make_optimizer

    tune_malloc()
    vocab, length, width, batch = 256, 64, 128, 16 if quick else 64

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h):
            mask = nn.make_causal_mask(jnp.ones(h.shape[:2]))
            h = h + nn.MultiHeadDotProductAttention(4)(nn.LayerNorm()(h), mask=mask)
            return h + nn.Dense(width)(nn.gelu(nn.Dense(4 * width)(nn.LayerNorm()(h))))

    class LM(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
            h = nn.Embed(vocab, width)(tokens) + nn.Embed(length, width)(positions)
            h = Block()(Block()(h))
            return nn.Dense(vocab)(nn.LayerNorm()(h))

    def seq_loss(logits, y):
        return jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, y), axis=-1)

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, (2048, length + 1)).astype(np.int32)
    x, y = tokens[:, :-1], tokens[:, 1:]
    spec = models.user_model(
        LM(), (length,), "int32", loss=seq_loss, label_shape=(length,), check_metric=False
    )
    data = (jax.device_put(x), jax.device_put(y))
    params0 = models.init_params(spec, jax.random.PRNGKey(0))
    idx = np.sort(rng.choice(len(x), batch, replace=False)).astype(np.int32)
    key = jax.random.PRNGKey(1)
    clip, sigma = jnp.float32(CLIP), jnp.float32(SIGMA)
    rows: dict[str, tuple[Callable[[], object], int]] = {}
    state: dict[str, object] = {}

    impl = step.resolve_grad_impl(spec, "auto", spec.input_shape)
    fns = step.get_step_functions(spec, 0, "sgd", impl)
    hp = Hyperparams(learning_rate=LR, clip_norm=CLIP, noise_multiplier=SIGMA)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params0)
    ones = np.ones(batch, np.float32)
    state["auto"] = (params0, make_optimizer(hp).init(params0), 0)

    def run_auto():
        p, o, i = state["auto"]
        p, o, loss = fns.step(
            p, o, zeros, jnp.float32(0), *data, idx, ones, key, jnp.int32(i), clip, sigma,
            jnp.float32(batch),
        )  # fmt: skip
        state["auto"] = (p, o, i + 1)
        return loss

    rows[f"lm_dp_{impl}"] = (run_auto, batch)
    np_step = _nonprivate_step(spec.apply, *data, params0, loss=seq_loss)
    rows["lm_nonprivate"] = (_stateful_row(*np_step, idx), batch)
    if not _have_jax_privacy():
        return rows

    def example_loss(p, x, y):  # one example, its batch axis kept
        return seq_loss(spec.apply({"params": p}, x), y).sum()

    rows["lm_jaxprivacy"] = (_clipped_grad_row(example_loss, data, idx, params0, key, batch), batch)
    return rows


def lora_rows(quick: bool, d: int, seq: int, batch: int) -> tuple[dict, dict]:
    """The LoRA row set (see the module docstring): (name -> (one step, examples per step),
    name -> compiled peak MiB)."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import optax

    from trainers import dpsgd, finetune, lora, models, step
    from trainers.runtime import tune_malloc

    tune_malloc()
    vocab, layers, rank = 512, 2 if quick else 4, 8
    rng = np.random.default_rng(0)
    key = jax.random.PRNGKey(1)
    clip, sigma = jnp.float32(CLIP), jnp.float32(SIGMA)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h):
            h = h + nn.MultiHeadDotProductAttention(num_heads=4, name="attn")(nn.LayerNorm()(h))
            mlp = nn.Dense(d, name="mlp_out")(nn.gelu(nn.Dense(4 * d, name="mlp_in")(
                nn.LayerNorm()(h))))  # fmt: skip
            return h + mlp

    class Transformer(nn.Module):
        @nn.compact
        def __call__(self, ids):
            pos = jnp.broadcast_to(jnp.arange(seq), ids.shape)  # a row per example
            h = nn.Embed(vocab, d)(ids) + nn.Embed(seq, d, name="pos")(pos)
            for _ in range(layers):
                h = Block()(h)
            return nn.Dense(2)(jnp.mean(nn.LayerNorm()(h), axis=1))

    adapted = lora.with_lora(Transformer(), rank, [r"attn/(query|key|value|out)", "mlp_"])
    tokens = rng.integers(0, vocab, (4 * batch, seq)).astype(np.int32)
    labels = rng.integers(0, 2, len(tokens)).astype(np.int32)
    data = (jax.device_put(tokens), jax.device_put(labels))
    idx = np.arange(batch, dtype=np.int32)
    ones = np.ones(batch, np.float32)
    spec = models.user_model(adapted, (seq,), "int32", num_classes=2)
    params0 = models.init_params(spec, jax.random.PRNGKey(0))
    mask = finetune.trainable_mask(params0, lora.TRAINABLE)
    lora_spec = models.ModelSpec(
        "lora8", adapted, (seq,), None, "int32", shipped=False, trainable=mask
    )
    full_spec = models.user_model(Transformer(), (seq,), "int32", num_classes=2)
    full0 = models.init_params(full_spec, jax.random.PRNGKey(0))
    rows: dict = {}
    memory: dict = {}

    def dp_row(name, sp, p0):
        impl = step.resolve_grad_impl(sp, "auto", sp.input_shape)
        fns = step.get_step_functions(sp, 2, "sgd", impl)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, p0)
        state = [p0, fns.init_opt(p0, {"learning_rate": np.float32(LR)}), 0]
        args = lambda: (state[0], state[1], zeros, jnp.float32(0), *data, idx, ones, key,  # noqa: E731
                        jnp.int32(state[2]), clip, sigma, jnp.float32(batch))  # fmt: skip
        memory[name] = _memory_mib(fns.step, *args(), resident=tokens.nbytes + labels.nbytes)

        def run():
            state[0], state[1], loss = fns.step(*args())
            state[2] += 1
            return loss

        rows[name] = (run, batch)
        return impl

    impl = dp_row("lora_dp", lora_spec, params0)
    t0, f0 = finetune.partition(params0, mask)
    print(f"lora_dp takes the {impl} path; {models.param_count(t0)} adapter parameters of "
          f"{models.param_count(params0)}")  # fmt: skip
    opt = optax.sgd(LR)

    def loss_t(t, f, x, y):
        return dpsgd.per_example_loss(
            adapted.apply({"params": finetune.combine(t, f, mask)}, x), y
        ).sum()

    @jax.jit
    def nonprivate(t, o, f):
        g = jax.grad(loss_t)(t, f, data[0][idx], data[1][idx])
        g = jax.tree_util.tree_map(lambda v: v / batch, g)
        u, o = opt.update(g, o, t)
        return optax.apply_updates(t, u), o

    st = [t0, opt.init(t0)]
    memory["lora_nonprivate"] = _memory_mib(nonprivate, t0, st[1], f0)

    def run_np():
        st[0], st[1] = nonprivate(st[0], st[1], f0)
        return st[0]

    rows["lora_nonprivate"] = (run_np, batch)
    forward = jax.jit(lambda t, f: loss_t(t, f, data[0][idx], data[1][idx]))
    rows["lora_forward"] = (lambda: forward(t0, f0), batch)

    def loss_first_norm(scale, p):
        block = {**p["Block_0"], "LayerNorm_0": scale}
        out = Transformer().apply({"params": {**p, "Block_0": block}}, data[0][idx])
        return dpsgd.per_example_loss(out, data[1][idx]).sum()

    backprop = jax.jit(jax.grad(loss_first_norm))
    first_norm = full0["Block_0"]["LayerNorm_0"]
    rows["lora_backprop_floor"] = (lambda: backprop(first_norm, full0), batch)

    from trainers.data import Dataset
    from trainers.loop import train_candidate
    from trainers.spec import Hyperparams

    n_train = 10 * batch  # one epoch of 10 steps; a quarter more records for validation
    ids = rng.integers(0, vocab, (n_train * 5 // 4, seq)).astype(np.int32)
    cand_data = Dataset.from_arrays(ids, rng.integers(0, 2, len(ids)).astype(np.int32),
                                    num_examples=len(ids), validation_fraction=0.2,
                                    num_classes=2)  # fmt: skip
    hp = Hyperparams(model=lora_spec, batch_size=batch, epochs=1, learning_rate=LR,
                     clip_norm=CLIP, noise_multiplier=SIGMA, optimizer="sgd")  # fmt: skip
    rows["lora_candidate"] = (lambda: train_candidate(hp, cand_data, key).params, n_train)
    if _have_jax_privacy():
        from jax_privacy import clipped_grad

        grad_fn = clipped_grad(
            lambda t, f, x, y: loss_t(t, f, x, y), l2_clip_norm=CLIP, batch_argnums=(2, 3)
        )

        @jax.jit
        def jp_step(t, o, f, i):
            g = grad_fn(t, f, data[0][idx], data[1][idx])
            g = dpsgd.add_noise(g, jax.random.fold_in(key, i), sigma, clip)
            g = jax.tree_util.tree_map(lambda v: v / batch, g)
            u, o = opt.update(g, o, t)
            return optax.apply_updates(t, u), o

        sj = [t0, opt.init(t0), 0]
        memory["lora_jaxprivacy"] = _memory_mib(jp_step, t0, sj[1], f0, jnp.int32(0))

        def run_jp():
            sj[0], sj[1] = jp_step(sj[0], sj[1], f0, jnp.int32(sj[2]))
            sj[2] += 1
            return sj[0]

        rows["lora_jaxprivacy"] = (run_jp, batch)
    dp_row("full_dp", full_spec, full0)
    return rows, memory


def jax_privacy_step(apply_fn, params0, data_x, data_y, batch: int):
    """jax_privacy 2.0's documented DP-SGD pipeline for a flax ``apply_fn`` (its Flax and JAX
    examples): ``jax_privacy.clipped_grad`` (per-example clipping to CLIP, summed), its
    ``noise_addition.gaussian_privatizer`` (std SIGMA x the clipped sum's add/remove sensitivity)
    chained with optax (division by the expected batch size, SGD). Returns ``(step, state)``:
    ``step(params, opt_state, idx) -> (params, opt_state, loss sum)``, jitted."""
    import dp_accounting
    import jax
    import jax_privacy
    import optax
    from jax_privacy import noise_addition

    from trainers import dpsgd

    def loss(params, x, y):  # one example (jax_privacy keeps a batch axis of 1)
        return dpsgd.per_example_loss(apply_fn({"params": params}, x), y).sum()

    grad_fn = jax_privacy.clipped_grad(
        loss, l2_clip_norm=CLIP, batch_argnums=(1, 2), return_values=True
    )
    sensitivity = grad_fn.sensitivity(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    tx = optax.chain(
        noise_addition.gaussian_privatizer(stddev=SIGMA * sensitivity, prng_key=3),
        optax.scale(1.0 / batch),
        optax.sgd(LR),
    )

    @jax.jit
    def step(params, opt_state, idx):
        grads, aux = grad_fn(params, data_x[idx], data_y[idx])
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, aux.values.sum()

    return step, grad_fn, tx.init(params0)


def _have_jax_privacy() -> bool:
    try:
        import jax_privacy  # noqa: F401  (optional: the `bench` extra)
    except ImportError:
        return False
    return True


def _stateful_row(step, params0, opt_state0, idx):
    """A row calling ``step(params, opt_state, idx)`` on its own running state."""
    state = [params0, opt_state0]

    def run():
        state[0], state[1], loss = step(state[0], state[1], idx)
        return loss

    return run


def _nonprivate_step(apply_fn, data_x, data_y, params0, loss=None):
    """``(step, params0, opt_state0)``: the non-private step on device-resident data, jitted,
    ``step(params, opt_state, idx) -> (params, opt_state, mean loss)`` (value_and_grad of the mean
    of ``loss(logits, y)``, default the per-example cross-entropy; optax SGD), and its start."""
    import jax
    import optax

    from trainers import dpsgd

    loss = loss or dpsgd.per_example_loss
    opt = optax.sgd(LR)

    @jax.jit
    def step(params, opt_state, idx):
        def mean_loss(p):
            return loss(apply_fn({"params": p}, data_x[idx]), data_y[idx]).mean()

        value, grads = jax.value_and_grad(mean_loss)(params)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    return step, params0, opt.init(params0)


def _dp_row(fns, params0, data, idx, key):
    """A row of dptune's compiled DP-SGD step (``fns.step``: clipped sum, noise, SGD update) on
    the fixed batch ``idx`` of ``data = (x, y)``, on its own running state."""
    import jax
    import jax.numpy as jnp

    from trainers.spec import Hyperparams
    from trainers.step import make_optimizer

    hp = Hyperparams(learning_rate=LR, clip_norm=CLIP, noise_multiplier=SIGMA)
    zeros = jax.tree_util.tree_map(jnp.zeros_like, params0)
    ones = np.ones(len(idx), np.float32)
    clip, sigma, b = jnp.float32(CLIP), jnp.float32(SIGMA), jnp.float32(len(idx))
    state = [params0, make_optimizer(hp).init(params0), 0]

    def run():
        p, o, i = state
        state[0], state[1], loss = fns.step(
            p, o, zeros, jnp.float32(0), *data, idx, ones, key, jnp.int32(i), clip, sigma, b
        )
        state[2] = i + 1
        return loss

    return run


def _clipped_grad_row(example_loss, data, idx, params0, key, batch: int):
    """A row of jax_privacy 2.0's ``clipped_grad`` (per-example clipping to CLIP, summed) with
    dptune's noise (``dpsgd.add_noise``, the key folded with the step) and an SGD update on
    the clipped sum over ``batch``, on the fixed batch ``idx`` of ``data = (x, y)``;
    ``example_loss(params, x, y)`` is one example's loss, its batch axis kept."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax_privacy import clipped_grad

    from trainers import dpsgd

    grad_fn = clipped_grad(example_loss, l2_clip_norm=CLIP, batch_argnums=(1, 2))
    opt = optax.sgd(LR)
    clip, sigma = jnp.float32(CLIP), jnp.float32(SIGMA)

    @jax.jit
    def step(params, opt_state, i, idx):
        g = grad_fn(params, data[0][idx], data[1][idx])
        g = dpsgd.add_noise(g, jax.random.fold_in(key, i), sigma, clip)  # as dptune's step
        g = jax.tree_util.tree_map(lambda v: v / batch, g)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    state = [params0, opt.init(params0), 0]

    def run():
        p, o, i = state
        state[0], state[1] = step(p, o, jnp.int32(i), idx)
        state[2] = i + 1
        return state[0]

    return run


def _warm(rows) -> None:
    """Compiles and warms up every JAX row (two calls each)."""
    for fn, _ in rows.values():
        if fn is not None:
            for _ in range(2):
                _block(fn())


def _time_row(fn, steps: int, warmup: int) -> float:
    """Seconds per step of ``fn`` over ``steps`` calls after ``warmup`` calls, blocking on the
    last result."""
    for _ in range(warmup):
        _block(fn())
    start = time.perf_counter()
    for _ in range(steps):
        out = fn()
    _block(out)
    return (time.perf_counter() - start) / steps


CIFAR_N = 10000  # device-resident CIFAR-shaped training set for the gathers (size does not matter)


def cifar_rows(quick: bool) -> dict[str, tuple[Callable[[], object], int]]:
    """The CIFAR row set: the 550,570-parameter tanh CIFAR CNN on 32x32x3 inputs at batch 256, as
    name -> (run one step, examples per step). Rows: its non-private step, dptune's DP step
    (book-keeping), the vmap(grad) DP step, and (full runs) dptune's DP step with augmentation
    multiplicity 4 (counted per example, i.e. 256 per step, 1,024 images)."""
    import jax

    from trainers import models
    from trainers.runtime import tune_malloc
    from trainers.step import get_step_functions

    tune_malloc()
    rng = np.random.default_rng(0)
    data_x = jax.device_put(rng.uniform(0, 1, (CIFAR_N, 32, 32, 3)).astype(np.float32))
    data_y = jax.device_put(rng.integers(0, 10, CIFAR_N).astype(np.int32))
    spec = models.get_model("cifar_cnn")
    params0 = models.init_params(spec, jax.random.PRNGKey(0))
    idx = np.sort(rng.choice(CIFAR_N, BATCH, replace=False)).astype(np.int32)
    key = jax.random.PRNGKey(1)
    rows: dict[str, tuple[Callable[[], object], int]] = {}
    np_step = _nonprivate_step(spec.module.apply, data_x, data_y, params0)
    rows["cifar_nonprivate"] = (_stateful_row(*np_step, idx), BATCH)

    def dp_row(impl: str, name: str, augmult: int = 0):
        fns = get_step_functions("cifar_cnn", 10, "sgd", impl, augmult)
        rows[name] = (_dp_row(fns, params0, (data_x, data_y), idx, key), BATCH)

    dp_row("bookkeeping", "cifar_dp_fast")
    dp_row("naive", "cifar_dp_naive")
    if _have_jax_privacy():
        jp_step, _, jp_state = jax_privacy_step(spec.module.apply, params0, data_x, data_y, BATCH)
        rows["cifar_jax_privacy"] = (_stateful_row(jp_step, params0, jp_state, idx), BATCH)
    if not quick:
        dp_row("bookkeeping", "cifar_dp_fast_augmult4", 4)
    return rows


def torch_rows() -> dict[str, tuple[Callable[[], object], int]]:
    """The same model and steps in PyTorch (torch.func and Opacus); {} if torch/opacus are
    absent."""
    try:
        import torch
        from torch import nn
    except ImportError:
        return {}

    torch.manual_seed(0)
    # The GPU when torch sees one (the accelerator suite on a GPU machine), else the CPU.
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def make_net():
        return nn.Sequential(
            nn.Conv2d(
                1, 16, 8, stride=2, padding=3
            ),  # = SAME for 28x28 input, 8x8 kernel, stride 2
            nn.Tanh(),
            nn.MaxPool2d(2, 1),
            nn.Conv2d(16, 32, 4, stride=2),
            nn.Tanh(),
            nn.MaxPool2d(2, 1),
            nn.Flatten(),
            nn.Linear(32 * 4 * 4, 32),
            nn.Tanh(),
            nn.Linear(32, 10),
        ).to(device)

    x = torch.rand(BATCH, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (BATCH,), device=device)
    loss_fn = nn.CrossEntropyLoss()
    rows: dict[str, tuple[Callable[[], object], int]] = {}

    def optimiser_row(net, opt):
        """One step of ``opt`` on ``net``'s mean loss over the fixed batch."""

        def run():
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(net(x), y)
            loss.backward()
            opt.step()
            return loss

        return run

    net = make_net()
    assert sum(p.numel() for p in net.parameters()) == 26010
    rows["torch_nonprivate"] = (optimiser_row(net, torch.optim.SGD(net.parameters(), lr=LR)), BATCH)

    from torch.func import functional_call, grad, vmap

    fnet = make_net()
    fparams = {k: v.detach() for k, v in fnet.named_parameters()}

    def single_loss(p, xi, yi):
        out = functional_call(fnet, p, (xi.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yi.unsqueeze(0))

    per_example = vmap(grad(single_loss), in_dims=(None, 0, 0))

    def run_func():
        g = per_example(fparams, x, y)
        norms = torch.sqrt(sum(v.reshape(BATCH, -1).pow(2).sum(1) for v in g.values()))
        factor = (CLIP / torch.clamp(norms, min=CLIP)).detach()
        for k, v in g.items():
            summed = torch.einsum("b,b...->...", factor, v)
            noisy = summed + SIGMA * CLIP * torch.randn_like(summed)
            fparams[k] = fparams[k] - LR * noisy / BATCH
        return norms

    rows["torch_func_dp"] = (run_func, BATCH)

    try:
        from opacus import GradSampleModule
        from opacus.optimizers import DPOptimizer
    except ImportError:
        return rows
    onet = GradSampleModule(make_net())
    oopt = DPOptimizer(
        torch.optim.SGD(onet.parameters(), lr=LR),
        noise_multiplier=SIGMA,
        max_grad_norm=CLIP,
        expected_batch_size=BATCH,
    )

    rows["opacus_dp"] = (optimiser_row(onet, oopt), BATCH)
    return rows


def _block(out):
    if "jax" in sys.modules:
        import jax

        if isinstance(out, (jax.Array, list, tuple, dict)):
            jax.block_until_ready(out)


def torch_worker(threads: int) -> None:
    """Serves the PyTorch rows over stdin/stdout: 'names' -> JSON {name: examples per step};
    '<name> <steps> <warmup>' -> seconds per step, after ``warmup`` untimed calls (the row waited
    while the others ran: its caches and thread pool are cold again)."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    torch.set_num_interop_threads(1)
    rows = torch_rows()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn, _ in rows.values():
        for _ in range(3):
            fn()
    for line in sys.stdin:
        cmd = line.split()
        if cmd[0] == "names":
            print(json.dumps({k: v[1] for k, v in rows.items()}), flush=True)
        else:
            fn = rows[cmd[0]][0]
            for _ in range(int(cmd[2]) if len(cmd) > 2 else 0):
                fn()
            sync()
            start = time.perf_counter()
            for _ in range(int(cmd[1])):
                fn()
            sync()  # a GPU runs asynchronously: the steps are done when the device says so
            print((time.perf_counter() - start) / int(cmd[1]), flush=True)


class TorchRows:
    """The PyTorch rows, run in a worker process (no JAX there), timed on request."""

    def __init__(self, threads: int):
        self.suffix = f"_t{threads}"
        # Idle OpenMP threads sleep instead of spinning: on a shared machine spinning threads
        # fight the other process for the cores (the rows collapsed 5-10x under load).
        env = {"OMP_WAIT_POLICY": "PASSIVE", **os.environ}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, f"--torch-worker={threads}"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            env=env,
        )  # fmt: skip
        self.proc.stdin.write("names\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        self.names = {k + self.suffix: v for k, v in (json.loads(line) if line else {}).items()}

    def time(self, name: str, steps: int, warmup: int = 1) -> float:
        self.proc.stdin.write(f"{name.removesuffix(self.suffix)} {steps} {warmup}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# --- the accelerator suite (--suite=accelerator) --------------------------------------------------

ACCEL_MODELS = ("cnn26k", "cifar_cnn", "wrn16_4", "user_cnn")
ACCEL_KS = (2, 4, 8)
MiB = 2.0**20


def _user_cnn_spec():
    """A user-written model: cnn26k's architecture in plain flax (nn.Conv, nn.max_pool), none of
    the shipped model's hand-tuned layers; its "dp" row takes the path a user's model gets
    automatically (``trainers.step.resolve_grad_impl``: the ghost path of ``trainers.ghost``),
    its "naive" row vmap(grad)."""
    import flax.linen as nn
    import jax.numpy as jnp

    from trainers import models

    class UserCnn(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = jnp.tanh(nn.Conv(16, (8, 8), strides=2, padding="SAME")(x))
            x = nn.max_pool(x, (2, 2), strides=(1, 1))
            x = jnp.tanh(nn.Conv(32, (4, 4), strides=2, padding="VALID")(x))
            x = nn.max_pool(x, (2, 2), strides=(1, 1))
            x = jnp.tanh(nn.Dense(32)(x.reshape((x.shape[0], -1))))
            return nn.Dense(10)(x)

    return models.user_model(UserCnn(), (28, 28, 1), name="user_cnn")


def _user_cnn_nnx_spec():
    """:func:`_user_cnn_spec`'s model written in Flax NNX (the same layers and shapes)."""
    import jax.numpy as jnp
    from flax import nnx

    from trainers import models

    class UserCnnNnx(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            self.conv1 = nnx.Conv(1, 16, (8, 8), strides=2, padding="SAME", rngs=rngs)
            self.conv2 = nnx.Conv(16, 32, (4, 4), strides=2, padding="VALID", rngs=rngs)
            self.dense1 = nnx.Linear(4 * 4 * 32, 32, rngs=rngs)
            self.dense2 = nnx.Linear(32, 10, rngs=rngs)

        def __call__(self, x):
            x = nnx.max_pool(jnp.tanh(self.conv1(x)), (2, 2), strides=(1, 1))
            x = nnx.max_pool(jnp.tanh(self.conv2(x)), (2, 2), strides=(1, 1))
            x = jnp.tanh(self.dense1(x.reshape((x.shape[0], -1))))
            return self.dense2(x)

    return models.user_model(UserCnnNnx(nnx.Rngs(0)), (28, 28, 1), name="user_cnn_nnx")


def _memory_mib(jitted, *args, resident: int = 0) -> float:
    """Peak memory of one call of ``jitted`` from XLA's buffer assignment (arguments +
    temporaries + outputs - aliased), MiB, less ``resident`` bytes (the device-resident training
    set a step takes as an argument; the other rows close over it, and XLA then does not count
    it); NaN where the backend does not report it."""
    try:
        m = jitted.lower(*args).compile().memory_analysis()
    except Exception:  # noqa: BLE001 - a report, never a reason to stop the table
        return float("nan")
    if m is None:
        return float("nan")
    total = m.argument_size_in_bytes + m.temp_size_in_bytes + m.output_size_in_bytes
    return (total - m.alias_size_in_bytes - resident) / MiB


def accelerator_rows(models_: tuple[str, ...], batch: int, ks: tuple[int, ...], n_train: int):
    """For each model: dptune's DP step, its non-private step, the naive vmap(grad) DP step,
    jax_privacy 2.0's pipeline, and K candidates vmapped vs one after another, on the default
    device. Returns ``(rows, memory, checks)``: name -> (run one step, examples per step), name ->
    compiled peak MiB, model -> max relative difference of jax_privacy's clipped sum from
    dptune's (same parameters and batch)."""
    import jax
    import jax.numpy as jnp
    import optax

    from trainers import dpsgd, models
    from trainers.runtime import tune_malloc
    from trainers.spec import Hyperparams
    from trainers.step import get_step_functions, make_optimizer, resolve_grad_impl

    tune_malloc()
    rows: dict[str, tuple[Callable[[], object], int]] = {}
    memory: dict[str, float] = {}
    checks: dict[str, float] = {}
    rng = np.random.default_rng(0)
    hp = Hyperparams(learning_rate=LR, clip_norm=CLIP, noise_multiplier=SIGMA)

    def add_model(name: str) -> None:  # one call per model: its closures bind its values
        spec = _user_cnn_spec() if name == "user_cnn" else models.get_model(name)
        shape = spec.input_shape
        data_x = jax.device_put(rng.uniform(0, 1, (n_train, *shape)).astype(np.float32))
        data_y = jax.device_put(rng.integers(0, 10, n_train).astype(np.int32))
        # One compiled initialisation (flax's eager one compiles every op on its own).
        init = jax.jit(lambda key: models.init_params(spec, key))
        params0 = init(jax.random.PRNGKey(0))
        # Every per-step argument of every row is already on the device, for dptune's rows and
        # the peers' alike: the table times the compiled steps. A host array or a fresh scalar
        # per call is a host-to-device copy each, which on the lent H100 cost ~0.25 ms apiece,
        # more than the whole step of a small model (docs/performance.md).
        idx = jax.device_put(np.sort(rng.choice(n_train, batch, replace=False)).astype(np.int32))
        ones = jax.device_put(np.ones(batch, np.float32))
        key, b = jax.random.PRNGKey(1), jnp.float32(batch)
        clip, sigma = jnp.float32(CLIP), jnp.float32(SIGMA)
        f0, i0 = jnp.float32(0), jnp.int32(0)
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params0)
        apply_fn = spec.module.apply
        resident = data_x.nbytes + data_y.nbytes

        nonprivate, _, np_state = _nonprivate_step(apply_fn, data_x, data_y, params0)
        rows[f"{name}/nonprivate"] = (_stateful_row(nonprivate, params0, np_state, idx), batch)
        memory[f"{name}/nonprivate"] = _memory_mib(nonprivate, params0, np_state, idx)

        def generic_step(clipped_sum):
            """dptune's DP step around a clipped-sum function (the user model's path)."""
            dp_opt = make_optimizer(hp)

            @jax.jit
            def step(params, opt_state, idx):
                gsum, loss, _ = clipped_sum(params, data_x[idx], data_y[idx], ones, clip)
                noisy = dpsgd.add_noise(gsum, key, sigma, clip)
                grads = jax.tree_util.tree_map(lambda g: g / b, noisy)
                updates, opt_state = dp_opt.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state, loss

            return step, dp_opt.init(params0)

        model = spec if name == "user_cnn" else name
        impls = {"dp": resolve_grad_impl(model, None, shape), "naive": "naive"}
        fns_by_impl = {}
        for row, impl in impls.items():
            if name == "user_cnn" and row == "naive":
                fns_by_impl[impl] = None
                step, st = generic_step(
                    lambda p, x, y, m, c: dpsgd.clipped_sum_naive(apply_fn, p, x, y, m, c)
                )
                rows[f"{name}/{row}"] = (_stateful_row(step, params0, st, idx), batch)
                memory[f"{name}/{row}"] = _memory_mib(step, params0, st, idx)
                continue
            fns = fns_by_impl[impl] = get_step_functions(model, 10, "sgd", impl)
            args = (zeros, f0, data_x, data_y, idx, ones, key, i0, clip, sigma, b)

            def fused(params, opt_state, idx, fns=fns):
                return fns.step(params, opt_state, zeros, f0, data_x, data_y, idx, ones, key, i0,
                                clip, sigma, b)  # fmt: skip

            st = make_optimizer(hp).init(params0)
            rows[f"{name}/{row}"] = (_stateful_row(fused, params0, st, idx), batch)
            memory[f"{name}/{row}"] = _memory_mib(fns.step, params0, st, *args, resident=resident)
        if _have_jax_privacy():
            jp_step, jp_grad, jp_state = jax_privacy_step(apply_fn, params0, data_x, data_y, batch)
            rows[f"{name}/jax_privacy"] = (_stateful_row(jp_step, params0, jp_state, idx), batch)
            memory[f"{name}/jax_privacy"] = _memory_mib(jp_step, params0, jp_state, idx)
            # Same clipped sum as dptune's (the DP row's clipping) on the same batch.
            if fns_by_impl.get(impls["dp"]) is not None:
                ours = fns_by_impl[impls["dp"]].chunk_sum(params0, data_x, data_y, idx, ones, clip)
            else:
                naive = jax.jit(
                    lambda p, x, y: dpsgd.clipped_sum_naive(apply_fn, p, x, y, ones, clip)
                )
                ours = naive(params0, data_x[idx], data_y[idx])
            theirs = jax.jit(jp_grad)(params0, data_x[idx], data_y[idx])[0]
            diff = jax.tree_util.tree_map(
                lambda a, t: float(jnp.max(jnp.abs(a - t)) / (jnp.max(jnp.abs(t)) + 1e-30)),
                ours[0], theirs,
            )  # fmt: skip
            checks[name] = max(jax.tree_util.tree_leaves(diff))
        fns = fns_by_impl.get(impls["dp"])
        if fns is None:
            return
        for k in ks:
            kparams = [init(jax.random.PRNGKey(20 + i)) for i in range(k)]
            kopts = [make_optimizer(hp).init(p) for p in kparams]
            group = fns.group(k)
            kstate = [group.stack(kparams), group.stack(kopts)]
            kargs = dict(
                gsum=group.stack([zeros] * k), loss=group.stack([jnp.float32(0)] * k),
                keys=group.stack([jax.random.PRNGKey(10 + i) for i in range(k)]),
                clip=group.stack([clip] * k), sigma=group.stack([sigma] * k),
                chunk=jax.device_put(group.chunk([[(np.asarray(idx), np.asarray(ones))]] * k, 0)),
            )  # fmt: skip

            def run_vmap(group=group, kstate=kstate, kargs=kargs):
                a = kargs
                kstate[0], kstate[1], loss = group.step(
                    kstate[0], kstate[1], a["gsum"], a["loss"], data_x, data_y, *a["chunk"],
                    a["keys"], i0, a["clip"], a["sigma"], b,
                )  # fmt: skip
                return loss

            seq_state = [list(kparams), list(kopts)]

            def run_seq(seq_state=seq_state, k=k):
                out = None
                for c in range(k):
                    seq_state[0][c], seq_state[1][c], out = fns.step(
                        seq_state[0][c], seq_state[1][c], zeros, f0, data_x, data_y, idx, ones,
                        key, i0, clip, sigma, b,
                    )  # fmt: skip
                return out

            rows[f"{name}/k{k}_vmap"] = (run_vmap, k * batch)
            rows[f"{name}/k{k}_seq"] = (run_seq, k * batch)
            memory[f"{name}/k{k}_vmap"] = _memory_mib(
                group.step, kstate[0], kstate[1], kargs["gsum"], kargs["loss"], data_x, data_y,
                *kargs["chunk"], kargs["keys"], i0, kargs["clip"], kargs["sigma"], b,
                resident=resident,
            )  # fmt: skip
            memory[f"{name}/k{k}_seq"] = memory[f"{name}/dp"]

    for name in models_:
        add_model(name)
    return rows, memory, checks


def accelerator_main(args) -> None:
    """--suite=accelerator: one interleaved run over every model's rows on the default device."""
    import jax

    from dptune.learners.dpsgd import use_compilation_cache

    # dptune's default (or $DPTUNE_COMPILATION_CACHE / JAX's own setting): the memory analysis
    # compiles each step a second time, which the cache turns into a read.
    use_compilation_cache()

    tiny = args.tiny
    models_ = tuple(args.models.split(",")) if args.models else ACCEL_MODELS
    ks = tuple(int(k) for k in args.ks.split(",")) if args.ks else ((2,) if tiny else ACCEL_KS)
    batch = args.batch or (8 if tiny else BATCH)
    n_train = 64 if tiny else 4096
    rounds = args.rounds or (1 if tiny else 5)
    steps = args.steps or (1 if tiny else 5)
    t0 = time.perf_counter()
    rows, memory, checks = accelerator_rows(models_, batch, ks, n_train)
    workers = []
    if not (args.no_torch or tiny) and "cnn26k" in models_:
        workers = [TorchRows(0)]  # torch's default threads, on its GPU when torch sees one
    _warm(rows)
    owner = {}
    for w in workers:
        for tname, per_step in w.names.items():
            rows[f"cnn26k/{tname}"] = (None, per_step)
            owner[f"cnn26k/{tname}"] = w
    setup_s = time.perf_counter() - t0
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, (fn, _) in rows.items():
            if fn is None:
                tname = name.split("/", 1)[1]
                times[name].append(owner[name].time(tname, steps, args.warmup))
                continue
            times[name].append(_time_row(fn, steps, args.warmup))
    for w in workers:
        w.close()
    med = {name: statistics.median(ts) for name, ts in times.items()}
    eps = {name: rows[name][1] / med[name] for name in rows}
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    print(f"device: {dev.platform} {dev.device_kind}; host {_cpu_name()}, {os.cpu_count()} cores; "
          f"jax {jax.__version__}; batch {batch}; {rounds} rounds x {steps} steps; "
          f"setup+compile {setup_s:.0f} s")  # fmt: skip
    if "peak_bytes_in_use" in stats:
        print(f"peak device memory of the whole run: {stats['peak_bytes_in_use'] / MiB:.0f} MiB")
    print(f"{'row':26s} {'ms/step':>9s} {'examples/s':>11s} {'peak MiB':>9s}")
    for name in rows:
        mem = memory.get(name, float("nan"))
        print(f"{name:26s} {1e3 * med[name]:9.2f} {eps[name]:11.0f} {mem:9.1f}")
    ratios = {}
    for m in models_:
        pairs = {"dp / nonprivate": ("dp", "nonprivate", None),
                 "dp / naive vmap(grad)": ("dp", "naive", None),
                 "dp / jax_privacy": ("dp", "jax_privacy", 1.5)}  # fmt: skip
        for k in ks:
            pairs[f"k{k} vmapped / sequential"] = (f"k{k}_vmap", f"k{k}_seq", None)
        for w in workers if m == "cnn26k" else ():
            pairs[f"dp / torch_func_dp{w.suffix}"] = ("dp", f"torch_func_dp{w.suffix}", None)
            pairs[f"dp / opacus_dp{w.suffix}"] = ("dp", f"opacus_dp{w.suffix}", None)
        for label, (a, b_, target) in pairs.items():
            a, b_ = f"{m}/{a}", f"{m}/{b_}"
            if a in eps and b_ in eps:
                ratios[f"{m}: {label}"] = {"ratio": eps[a] / eps[b_], "target": target}
    print(f"{'ratio (examples/s)':44s} {'value':>6s}  target")
    for label, r in ratios.items():
        flag = "" if r["target"] is None else ("  ok" if r["ratio"] >= r["target"] else "  MISSED")
        tgt = "" if r["target"] is None else f">= {r['target']:.1f}"
        print(f"{label:44s} {r['ratio']:6.2f}  {tgt}{flag}")
    for m, d in checks.items():
        print(f"{m}: jax_privacy's clipped sum vs dptune's: max relative difference {d:.1e}")
    if args.json:
        print(json.dumps({
            "suite": "accelerator", "device": f"{dev.platform} {dev.device_kind}",
            "jax": jax.__version__, "batch": batch, "rounds": rounds, "steps": steps,
            "rows": [{"name": n, "examples_per_s": eps[n], "ms_per_step": 1e3 * med[n],
                      "peak_mib": memory.get(n)} for n in rows],
            "ratios": {k: v["ratio"] for k, v in ratios.items()},
            "clipped_sum_agreement": checks,
            "peak_device_mib": stats.get("peak_bytes_in_use", 0) / MiB or None,
        }))  # fmt: skip


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rows and rounds (< 1 min)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row per round")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch rows")
    parser.add_argument(
        "--warmup", type=int, default=1,
        help="untimed calls of a row before its timed steps in every round (caches, thread pools)",
    )  # fmt: skip
    parser.add_argument(
        "--cifar", action="store_true",
        help="the CIFAR row set instead (CIFAR CNN: fast DP, naive DP, non-private; no PyTorch)",
    )  # fmt: skip
    parser.add_argument(
        "--user", action="store_true",
        help="the user-model row set instead (automatic clipping path vs hand-tuned, vmap(grad), "
        "jax_privacy and non-private; no PyTorch)",
    )  # fmt: skip
    parser.add_argument(
        "--lm", action="store_true",
        help="the language-model row set instead (2-layer transformer LM, d 128, sequence 64: "
        "dptune's DP step vs its non-private step and jax_privacy's clipped_grad; no PyTorch)",
    )  # fmt: skip
    parser.add_argument(
        "--torch-threads", default="1,2",
        help="comma-separated torch.set_num_threads values, one worker each (0: torch default)",
    )  # fmt: skip
    parser.add_argument(
        "--suite", choices=("cpu", "accelerator", "user"), default="cpu",
        help="cpu: the default table (cnn26k or --cifar); accelerator: every model (cnn26k, CIFAR "
        "CNN, WRN-16-4, a user-written CNN) with jax_privacy, memory and K=2,4,8 candidates on "
        "the default device; user: the same as --user",
    )  # fmt: skip
    parser.add_argument("--tiny", action="store_true", help="accelerator suite: tiny sizes (tests)")
    parser.add_argument("--models", default=None, help="accelerator suite: comma-separated models")
    parser.add_argument("--ks", default=None, help="accelerator suite: candidates K, e.g. 2,4,8")
    parser.add_argument("--batch", type=int, default=None, help="accelerator suite: batch size")
    parser.add_argument(
        "--lora", action="store_true",
        help="the LoRA row set instead (rank-8 adapters on a 4-layer transformer: DP vs its own "
        "non-private LoRA step vs jax_privacy; full fine-tuning; peak memory)",
    )  # fmt: skip
    parser.add_argument("--lora-d", type=int, default=256, help="LoRA set: model width")
    parser.add_argument("--lora-seq", type=int, default=128, help="LoRA set: sequence length")
    parser.add_argument("--lora-batch", type=int, default=16, help="LoRA set: batch size")
    parser.add_argument("--torch-worker", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick and args.torch_threads == "1,2":
        args.torch_threads = "0"  # torch's default thread count only
    if args.torch_worker is not None:
        return torch_worker(args.torch_worker)
    if args.suite == "accelerator":
        return accelerator_main(args)
    args.user = args.user or args.suite == "user"
    rounds = args.rounds or (3 if args.quick else 7)
    steps = args.steps or (4 if args.quick else 10)

    t0 = time.perf_counter()
    no_torch = args.no_torch or args.cifar or args.user or args.lm or args.lora
    workers = [] if no_torch else [TorchRows(int(t)) for t in args.torch_threads.split(",")]
    memory: dict[str, float] = {}
    if args.lora:
        rows, memory = lora_rows(args.quick, args.lora_d, args.lora_seq, args.lora_batch)
    elif args.lm:
        rows = lm_rows(args.quick)
    elif args.user:
        rows = user_rows(args.quick)
    else:
        rows = cifar_rows(args.quick) if args.cifar else jax_rows(args.quick)
    _warm(rows)
    owner = {}
    for w in workers:
        rows.update({name: (None, batch) for name, batch in w.names.items()})
        owner.update({name: w for name in w.names})
    setup_s = time.perf_counter() - t0
    import jax

    times: dict[str, list[float]] = {name: [] for name in rows}
    load_before = os.getloadavg()
    for _ in range(rounds):
        for name, (fn, _) in rows.items():
            if fn is None:  # a PyTorch row, timed in its worker while this process waits
                times[name].append(owner[name].time(name, steps, args.warmup))
                continue
            times[name].append(_time_row(fn, steps, args.warmup))
    load_after = os.getloadavg()
    for w in workers:
        w.close()

    med = {name: statistics.median(ts) for name, ts in times.items()}
    eps = {name: rows[name][1] / med[name] for name in rows}
    ratio_defs = {
        "dp_fixed / jax_nonprivate": ("dptune_dp_fixed", "jax_nonprivate", 0.8),
        "dp_poisson / dp_fixed": ("dptune_dp_poisson", "dptune_dp_fixed", 0.9),
        "dp_fixed / jax_dp_naive": ("dptune_dp_fixed", "jax_dp_naive", None),
        "k4 vmap / seq": ("dptune_k4_vmap", "dptune_k4_seq", None),
        "k8 vmap / seq": ("dptune_k8_vmap", "dptune_k8_seq", None),
        "dp_fixed / jax_privacy_dp": ("dptune_dp_fixed", "jax_privacy_dp", 1.5),
        "cifar dp_fast / cifar dp_naive": ("cifar_dp_fast", "cifar_dp_naive", 1.5),
        "cifar dp_fast / cifar jax_privacy": ("cifar_dp_fast", "cifar_jax_privacy", 1.5),
        "cifar dp_fast / cifar nonprivate": ("cifar_dp_fast", "cifar_nonprivate", 0.6),
        "cifar dp_fast augmult 4 / dp_fast": ("cifar_dp_fast_augmult4", "cifar_dp_fast", None),
        "user_cnn auto / cnn26k hand-tuned": ("user_cnn_auto", "cnn26k_handtuned", 0.8),
        "user_cnn auto / user_cnn vmap(grad)": ("user_cnn_auto", "user_cnn_vmap", 1.5),
        "user_cnn auto / jax_privacy clipped_grad": ("user_cnn_auto", "user_cnn_jaxprivacy", 1.5),
        "user_cnn auto / user_cnn nonprivate": ("user_cnn_auto", "user_cnn_nonprivate", None),
        "user_cnn NNX twin / user_cnn (linen) auto": ("user_cnn_nnx_auto", "user_cnn_auto", 0.9),
        "text auto / text nonprivate": ("text_auto", "text_nonprivate", None),
        "tabular auto / tabular nonprivate": ("tabular_auto", "tabular_nonprivate", None),
        "lm dp (ghost) / lm nonprivate": ("lm_dp_ghost", "lm_nonprivate", 0.7),
        "lm dp (ghost) / lm jax_privacy clipped_grad": ("lm_dp_ghost", "lm_jaxprivacy", 1.5),
        "lm dp (vmap) / lm nonprivate": ("lm_dp_vmap", "lm_nonprivate", 0.7),
        "lm dp (vmap) / lm jax_privacy clipped_grad": ("lm_dp_vmap", "lm_jaxprivacy", 1.5),
        "lora dp / lora nonprivate": ("lora_dp", "lora_nonprivate", 0.8),
        "lora dp / jax_privacy clipped_grad": ("lora_dp", "lora_jaxprivacy", 2.0),
        "lora dp / full fine-tuning dp": ("lora_dp", "full_dp", None),
        "lora dp / forward pass alone": ("lora_dp", "lora_forward", None),
        "lora jax_privacy / forward pass alone": ("lora_jaxprivacy", "lora_forward", None),
        "lora jax_privacy / backprop floor": ("lora_jaxprivacy", "lora_backprop_floor", None),
        "lora dp / backprop floor": ("lora_dp", "lora_backprop_floor", None),
        "lora whole candidate / lora dp step": ("lora_candidate", "lora_dp", 0.9),
    }
    for w in workers:  # one set of PyTorch ratios per thread count
        t = w.suffix
        ratio_defs[f"dp_fixed / torch_func_dp{t}"] = ("dptune_dp_fixed", f"torch_func_dp{t}", 1.0)
        ratio_defs[f"dp_fixed / opacus_dp{t}"] = ("dptune_dp_fixed", f"opacus_dp{t}", 1.2)
        ratio_defs[f"jax_nonprivate / torch_nonprivate{t}"] = (
            "jax_nonprivate", f"torch_nonprivate{t}", None,
        )  # fmt: skip
    ratios = {}
    for label, (a, b, target) in ratio_defs.items():
        if a in eps and b in eps:
            ratios[label] = {"ratio": eps[a] / eps[b], "target": target}

    print(f"machine: {_cpu_name()}, {os.cpu_count()} cores; jax {jax.__version__}")
    print(f"load average before/after: {load_before[0]:.2f} / {load_after[0]:.2f}; "
          f"{rounds} rounds x {steps} steps; setup+compile {setup_s:.0f} s")  # fmt: skip
    print(f"{'row':22s} {'ms/step':>9s} {'examples/s':>11s}   spread (min-max ms)")
    for name in rows:
        ts = times[name]
        print(f"{name:22s} {1e3 * med[name]:9.1f} {eps[name]:11.0f}   "
              f"{1e3 * min(ts):.1f}-{1e3 * max(ts):.1f}")  # fmt: skip
    print(f"{'ratio (examples/s)':40s} {'value':>6s}  target")
    for label, r in ratios.items():
        tgt = "" if r["target"] is None else f">= {r['target']:.1f}"
        flag = "" if r["target"] is None else ("  ok" if r["ratio"] >= r["target"] else "  MISSED")
        print(f"{label:40s} {r['ratio']:6.2f}  {tgt}{flag}")
    for name, mib in memory.items():
        print(f"peak memory {name:20s} {mib:9.1f} MiB (compiled step, XLA buffer assignment)")
    if args.json:
        print(json.dumps({
            "machine": _cpu_name(), "cores": os.cpu_count(), "jax": jax.__version__,
            "load_average": [load_before[0], load_after[0]], "rounds": rounds, "steps": steps,
            "rows": [{"name": n, "examples_per_s": eps[n], "ms_per_step": 1e3 * med[n]}
                     for n in rows],
            "ratios": {k: v["ratio"] for k, v in ratios.items()},
            "peak_memory_mib": memory,
        }))  # fmt: skip


if __name__ == "__main__":
    main()
