"""DP-SGD gradient: per-example gradients, L2 clipping, sum, Gaussian noise (Abadi et al. 2016,
Algorithm 1).

Two implementations of the clipped sum ``sum_i mask_i * g_i * min(1, C / ||g_i||)`` over a batch:

* :func:`clipped_sum_naive`: per-example gradients from ``vmap(grad)``; works for every model and is
  the reference the fast path is tested against.
* :func:`clipped_sum_bookkeeping`: for the :class:`trainers.models.MnistCNN` family. One
  forward pass and one backward pass to each layer's pre-activations; per-example weight gradients
  as batched einsums of im2col patches (space-to-depth + contiguous slices) with the pre-activation
  gradients for the convolutions, and the rank-1 identity ||a g^T||^2 = ||a||^2 ||g||^2 for the
  dense layers ("book-keeping" clipping, Bu et al. 2022, "Scalable and efficient training of large
  convolutional neural networks with differential privacy"). Why this shape, and what was measured
  on XLA CPU: ``../shared/notes/cpu-dpsgd-performance.md``.
* :func:`clipped_sum_bookkeeping_cifar`: the same idea for :class:`trainers.models.CifarCNN`, with
  augmentation multiplicity (K augmented copies per example, gradients averaged before clipping).

Shapes: images x (b, h, w, c) float32 (or (b, K, h, w, c) with K augmented copies per example),
labels y (b,) int32, mask (b,) float32 in {0, 1}; the clipped sum has the parameters' pytree
structure. Masked examples (padding of a Poisson batch) and examples whose gradient norm is not
finite contribute exactly zero (:func:`clip_factors`, :func:`keep_rows`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from trainers.models import conv_stride2_s2d, group_norm
from trainers.models import max_pool_2x2_stride1 as _pool
from trainers.models import max_pool_2x2_stride2 as models_pool2

Params = dict


def per_example_loss(logits: jax.Array, y: jax.Array) -> jax.Array:
    """Softmax cross-entropy per example, (b, classes), (b,) -> (b,) in nats."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def clip_factors(sq_norms: jax.Array, mask: jax.Array, clip_norm: jax.Array) -> jax.Array:
    """mask_i * min(1, C / ||g_i||), written as C / max(||g_i||, C) so that a zero gradient gives 1,
    not NaN; exactly 0 where mask_i = 0 or ||g_i||² is not finite (NaN or inf: such an example is
    dropped from the sum, :func:`keep_rows`). (b,) -> (b,)."""
    kept = (mask > 0) & jnp.isfinite(sq_norms)
    norms = jnp.sqrt(jnp.where(kept, sq_norms, 0.0))
    return jnp.where(kept, mask * (clip_norm / jnp.maximum(norms, clip_norm)), 0.0)


def keep_rows(c: jax.Array, v: jax.Array) -> jax.Array:
    """``v`` (b * r, ...) (r rows per example, e.g. positions or augmented copies) with the rows
    of every example whose clip factor ``c`` (b,) is 0 replaced by exact zeros.

    A select, not a product: ``0 * NaN`` is NaN, so one example with a non-finite gradient (or a
    padding slot that points at such a record) would otherwise make the whole clipped sum NaN.
    Every clipped sum applies it to the per-example factors it contracts with ``c``, so a dropped
    example (mask 0, or a gradient norm that is not finite) contributes exactly 0."""
    b = c.shape[0]
    kept = jnp.repeat(c > 0, v.shape[0] // b) if v.shape[0] != b else c > 0
    return jnp.where(kept.reshape(-1, *[1] * (v.ndim - 1)), v, jnp.zeros((), v.dtype))


def kept_loss_sum(losses: jax.Array, mask: jax.Array, sq_norms: jax.Array) -> jax.Array:
    """Sum of ``mask_i * loss_i`` (b,) over the examples in the clipped sum: mask_i > 0, a finite
    squared gradient norm ``sq_norms`` (b,) and a finite loss (the reported training loss of the
    records that were trained on, never NaN because of one record)."""
    kept = (mask > 0) & jnp.isfinite(sq_norms) & jnp.isfinite(losses)
    return jnp.sum(jnp.where(kept, mask * losses, 0.0))


def count_dropped(sq_norms: jax.Array, mask: jax.Array) -> jax.Array:
    """Number of examples with mask_i > 0 whose squared gradient norm ``sq_norms`` (b,) (or the
    norm itself) is not finite, () int32: the records left out of a clipped sum. PRIVATE (it
    counts people's records): for the curator's view only, never released."""
    return jnp.sum((mask > 0) & ~jnp.isfinite(sq_norms)).astype(jnp.int32)


def example_losses(
    apply_fn: Callable,
    params: Params,
    x: jax.Array,
    y: jax.Array,
    loss: Callable | None = None,
    copies: bool | None = None,
    slots: jax.Array | None = None,
) -> jax.Array:
    """Loss of each example, (b,): ``loss(outputs, labels)`` (default :func:`per_example_loss`) of
    x (b, ...) of any shape and dtype; outputs may be any pytree, labels y any (b, ...) array;
    with ``copies`` (augmentation multiplicity), x is (b, K, ...) and an example's loss is the
    mean over its K augmented copies. ``copies=None``: only 5-D image batches (b, K, h, w, c)
    carry copies, the shipped image models' convention. With ``slots`` (b,) int32 (the examples'
    positions in their chunk), the model is called ``apply_fn(variables, x, slots)`` (copy j of
    example i at slot ``slots_i K + j``): ``trainers.train_mode.TrainingCall.apply_slots``."""
    loss = loss or per_example_loss
    if copies is None:
        copies = x.ndim == 5
    variables = {"params": params}
    if not copies:
        out = apply_fn(variables, x) if slots is None else apply_fn(variables, x, slots)
        return loss(out, y)
    b, k = x.shape[:2]
    xf = x.reshape(b * k, *x.shape[2:])
    if slots is None:
        out = apply_fn(variables, xf)
    else:
        out = apply_fn(variables, xf, (slots[:, None] * k + jnp.arange(k)).reshape(-1))
    return jnp.mean(loss(out, jnp.repeat(y, k, axis=0)).reshape(b, k), axis=1)


def per_example_grads_naive(
    apply_fn: Callable, params: Params, x: jax.Array, y: jax.Array, loss: Callable | None = None,
    copies: bool | None = None, per_slot: bool = False,
) -> Params:  # fmt: skip
    """Per-example gradients of :func:`example_losses`, each leaf with a leading batch axis, via
    ``vmap(grad)``. With ``copies`` (x of shape (b, K, ...)) the gradient of example i is the mean
    of the gradients of its K augmented copies (augmentation multiplicity, De et al. 2022, §3.1).
    With ``per_slot``, example i's forward pass is ``apply_fn(variables, x_i, slot i)`` (its
    per-example randomness, ``trainers.train_mode``)."""

    def single(p, xi, yi, si):
        slots = si[None] if per_slot else None
        return example_losses(apply_fn, p, xi[None], yi[None], loss, copies, slots)[0]

    slots = jnp.arange(x.shape[0], dtype=jnp.int32)
    return jax.vmap(jax.grad(single), in_axes=(None, 0, 0, 0))(params, x, y, slots)


def clipped_sum_naive(
    apply_fn: Callable,
    params: Params,
    x: jax.Array,
    y: jax.Array,
    mask: jax.Array,
    clip_norm,
    loss: Callable | None = None,
    copies: bool | None = None,
    per_slot: bool = False,
) -> tuple[Params, jax.Array, jax.Array]:
    """Clipped gradient sum from ``vmap(grad)`` per-example gradients: correct for every model
    whose examples do not interact (each example's gradient is computed on that example alone).

    ``apply_fn(variables, x)``: a flax ``Module.apply`` (or the same signature); with
    ``per_slot``, ``apply_fn(variables, x, slots)`` (per-example randomness keyed by each
    example's position in the batch, ``trainers.train_mode``). ``copies``:
    whether x carries augmented copies (b, K, ...); None: only 5-D image batches (b, K, h, w, c)
    do, the convention of the shipped image models.

    Returns (clipped sum pytree, sum of masked per-example losses, per-example gradient norms (b,)).
    """
    grads = per_example_grads_naive(apply_fn, params, x, y, loss, copies, per_slot)
    sq = sum(
        jnp.sum(g.reshape(g.shape[0], -1) ** 2, axis=1) for g in jax.tree_util.tree_leaves(grads)
    )
    c = clip_factors(sq, mask, clip_norm)
    summed = jax.tree_util.tree_map(lambda g: jnp.tensordot(c, keep_rows(c, g), axes=1), grads)
    slots = jnp.arange(x.shape[0], dtype=jnp.int32) if per_slot else None
    loss_sum = kept_loss_sum(example_losses(apply_fn, params, x, y, loss, copies, slots), mask, sq)
    return summed, loss_sum, jnp.sqrt(sq)


# --- book-keeping clipping for MnistCNN -----------------------------------------------------------


def _conv(x, kernel, stride, padding):
    # Same call as flax.linen.Conv (NHWC input, HWIO kernel).
    return jax.lax.conv_general_dilated(
        x, kernel, (stride, stride), padding, dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def im2col_s2d(x: jax.Array, k: int, s: int, pad_lo: int, out_hw: int) -> jax.Array:
    """im2col patches of a k x k, stride-s convolution, built from space-to-depth plus (k/s)^2
    contiguous slices.

    Args:
      x: (b, h, w, c) input; the convolution reads rows/cols [-pad_lo, -pad_lo + (out_hw-1)*s + k)
        of it.
      k, s: kernel size and stride, with k % s == 0.
      pad_lo: zero padding before row/col 0 (SAME padding; 0 for VALID).
      out_hw: output height = width.

    Returns:
      (b, out_hw**2, k*k*c) patches whose last axis is ordered (a, b', r, c', channel) with kernel
      row 2a... i.e. kernel row = s*a + r and kernel col = s*b' + c'; :func:`kernel_to_s2d` puts a
      kernel in the same order.
    """
    b, h, w, c = x.shape
    extent = (out_hw - 1) * s + k
    pad_hi = extent - pad_lo - h
    if pad_lo or pad_hi > 0:
        x = jnp.pad(x, ((0, 0), (pad_lo, max(pad_hi, 0)), (pad_lo, max(pad_hi, 0)), (0, 0)))
    x = x[:, :extent, :extent, :]
    e = extent // s
    xs = x.reshape(b, e, s, e, s, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, e, e, s * s * c)
    m = k // s
    slices = [xs[:, a : a + out_hw, bb : bb + out_hw, :] for a in range(m) for bb in range(m)]
    return jnp.stack(slices, axis=3).reshape(b, out_hw * out_hw, k * k * c)


def im2col_kmajor_28x28x1(x: jax.Array) -> jax.Array:
    """Patches of the 8x8, stride-2, SAME convolution on (b, 28, 28, 1) images,
    kernel-position-major:
    (b, 64, 196), axis 1 ordered (a, b', r, c') like :func:`im2col_s2d` (kernel row 2a + r, col 2b'
    + c').

    Built from 4 space-to-depth planes and 16 contiguous (14 x 14) windows; this layout measured ~2x
    faster on XLA CPU than the position-major one.
    """
    b = x.shape[0]
    xp = jnp.pad(x[..., 0], ((0, 0), (3, 3), (3, 3)))  # (b, 34, 34)
    planes = xp.reshape(b, 17, 2, 17, 2).transpose(0, 2, 4, 1, 3).reshape(b, 4, 17, 17)
    windows = [planes[:, :, a : a + 14, c : c + 14] for a in range(4) for c in range(4)]
    return jnp.stack(windows, axis=1).reshape(b, 64, 196)


def kernel_to_s2d(kernel: jax.Array, s: int) -> jax.Array:
    """(k, k, c, o) HWIO kernel -> (k*k*c, o) in the patch order of :func:`im2col_s2d`."""
    k, _, c, o = kernel.shape
    m = k // s
    return kernel.reshape(m, s, m, s, c, o).transpose(0, 2, 1, 3, 4, 5).reshape(k * k * c, o)


def kernel_from_s2d(flat: jax.Array, k: int, s: int, c: int) -> jax.Array:
    """Inverse of :func:`kernel_to_s2d`: (k*k*c, o) -> (k, k, c, o)."""
    o = flat.shape[-1]
    m = k // s
    return flat.reshape(m, m, s, s, c, o).transpose(0, 2, 1, 3, 4, 5).reshape(k, k, c, o)


def clipped_sum_bookkeeping(
    params: Params, x: jax.Array, y: jax.Array, mask: jax.Array, clip_norm
) -> tuple[Params, jax.Array, jax.Array]:
    """Clipped gradient sum for :class:`trainers.models.MnistCNN` (28x28x1 input), book-keeping
    style.

    Same contract and return value as :func:`clipped_sum_naive`.
    """
    p = params
    b = x.shape[0]
    k1 = p["conv1"]["kernel"]  # (8, 8, 1, c1)
    k2 = p["conv2"]["kernel"]  # (4, 4, c1, c2)
    c1, c2 = k1.shape[-1], k2.shape[-1]

    def forward(zs):
        # zs: zero "taps" added to each pre-activation; the gradient w.r.t. them is dLoss/dz per
        # example.
        z1 = conv_stride2_s2d(x, k1, 3, 14) + p["conv1"]["bias"] + zs[0]  # (b, 14, 14, c1)
        h1 = _pool(jnp.tanh(z1))  # (b, 13, 13, c1)
        z2 = _conv(h1, k2, 2, "VALID") + p["conv2"]["bias"] + zs[1]  # (b, 5, 5, c2)
        h2 = _pool(jnp.tanh(z2)).reshape(b, -1)  # (b, 16*c2)
        z3 = h2 @ p["dense1"]["kernel"] + p["dense1"]["bias"] + zs[2]
        h3 = jnp.tanh(z3)
        z4 = h3 @ p["dense2"]["kernel"] + p["dense2"]["bias"] + zs[3]
        losses = per_example_loss(z4, y)
        return jnp.sum(losses), (losses, h1, h2, h3)

    d = p["dense1"]["kernel"].shape[1]
    nc = p["dense2"]["kernel"].shape[1]
    zeros = (
        jnp.zeros((b, 14, 14, c1), x.dtype),
        jnp.zeros((b, 5, 5, c2), x.dtype),
        jnp.zeros((b, d), x.dtype),
        jnp.zeros((b, nc), x.dtype),
    )
    gz, (losses, h1, h2, h3) = jax.grad(forward, has_aux=True)(zeros)
    g1 = gz[0].reshape(b, 196, c1)
    g2 = gz[1].reshape(b, 25, c2)
    g3, g4 = gz[2], gz[3]

    # Per-example conv weight gradients (b, out, k): gradient as the first einsum operand was ~2x
    # faster on XLA CPU.
    patches1 = im2col_kmajor_28x28x1(x)  # (b, 64, 196)
    patches2 = im2col_s2d(h1, 4, 2, 0, 5)  # (b, 25, 16*c1)
    w1 = jnp.einsum("bkp,bpo->bko", patches1, g1)
    w2 = jnp.einsum("bpo,bpk->bok", g2, patches2)
    bias1 = jnp.sum(g1, axis=1)
    bias2 = jnp.sum(g2, axis=1)

    def sq(a):
        return jnp.sum(a.reshape(b, -1) ** 2, axis=1)

    g3sq, g4sq = sq(g3), sq(g4)
    sq_norms = (
        sq(w1) + sq(bias1) + sq(w2) + sq(bias2) + g3sq * (sq(h2) + 1.0) + g4sq * (sq(h3) + 1.0)
    )
    c = clip_factors(sq_norms, mask, clip_norm)
    w1, bias1, w2, bias2, g3, g4 = (keep_rows(c, v) for v in (w1, bias1, w2, bias2, g3, g4))
    h2, h3 = keep_rows(c, h2 * c[:, None]), keep_rows(c, h3 * c[:, None])
    summed = {
        "conv1": {
            "kernel": kernel_from_s2d(jnp.einsum("b,bko->ko", c, w1), 8, 2, 1),
            "bias": c @ bias1,
        },
        "conv2": {
            "kernel": kernel_from_s2d(jnp.einsum("b,bok->ko", c, w2), 4, 2, c1),
            "bias": c @ bias2,
        },
        "dense1": {"kernel": jnp.einsum("bi,bo->io", h2, g3), "bias": c @ g3},
        "dense2": {"kernel": jnp.einsum("bi,bo->io", h3, g4), "bias": c @ g4},
    }
    return summed, kept_loss_sum(losses, mask, sq_norms), jnp.sqrt(sq_norms)


# --- book-keeping clipping for CifarCNN (with augmentation multiplicity) --------------------------


def im2col_3x3_same(x: jax.Array) -> jax.Array:
    """im2col patches of a 3x3, stride-1, SAME convolution: (n, h, w, c) -> (n, h*w, 9*c), last
    axis ordered (kernel row, kernel col, channel) like an HWIO kernel reshaped to (9*c, o)."""
    n, h, w, c = x.shape
    xp = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    cols = [xp[:, i : i + h, j : j + w, :] for i in range(3) for j in range(3)]
    return jnp.concatenate(cols, axis=-1).reshape(n, h * w, 9 * c)


#: CifarCNN's conv layers and their output sizes (height = width; 32x32x3 input).
_CIFAR_CONVS = tuple(f"conv{i}" for i in range(1, 7))
_CIFAR_HW = (32, 32, 16, 16, 8, 8)


def _cifar_backward(
    p: Params, xf: jax.Array, y: jax.Array, b: int, k: int
) -> tuple[list[jax.Array], jax.Array, list[jax.Array]]:
    """One forward and one backward pass of CifarCNN over the b*K images ``xf``: the gradients of
    the summed per-example losses (each the mean over its K copies) with respect to each layer's
    pre-activation (8 arrays, (b*K, ...)), the per-example losses (b,), and each layer's input."""
    n = b * k

    def forward(zs):
        h = xf
        inputs = []
        for i, name in enumerate(_CIFAR_CONVS):
            inputs.append(h)
            z = _conv(h, p[name]["kernel"], 1, "SAME") + p[name]["bias"] + zs[i]
            h = jnp.tanh(z)
            if i % 2 == 1:
                h = models_pool2(h)
        h = h.reshape(n, -1)
        inputs.append(h)
        z = h @ p["dense1"]["kernel"] + p["dense1"]["bias"] + zs[6]
        h = jnp.tanh(z)
        inputs.append(h)
        z = h @ p["dense2"]["kernel"] + p["dense2"]["bias"] + zs[7]
        losses = jnp.mean(per_example_loss(z, jnp.repeat(y, k)).reshape(b, k), axis=1)
        return jnp.sum(losses), (losses, inputs)

    zeros = [jnp.zeros((n, s, s, p[name]["kernel"].shape[-1]), xf.dtype) for name, s in
             zip(_CIFAR_CONVS, _CIFAR_HW, strict=True)]  # fmt: skip
    zeros += [jnp.zeros((n, p["dense1"]["kernel"].shape[1]), xf.dtype)]
    zeros += [jnp.zeros((n, p["dense2"]["kernel"].shape[1]), xf.dtype)]
    gz, (losses, inputs) = jax.grad(forward, has_aux=True)(zeros)
    return gz, losses, inputs


def clipped_sum_bookkeeping_cifar(
    params: Params, x: jax.Array, y: jax.Array, mask: jax.Array, clip_norm
) -> tuple[Params, jax.Array, jax.Array]:
    """Clipped gradient sum for :class:`trainers.models.CifarCNN` (32x32x3 input), book-keeping
    style (Bu et al. 2022), with or without augmentation multiplicity.

    x: (b, 32, 32, 3), or (b, K, 32, 32, 3) for K augmented copies per example. An example's
    gradient is the gradient of the mean loss over its K copies, i.e. the mean of the copies'
    gradients (De et al. 2022, §3.1), and that mean is what gets clipped. One forward and one
    backward pass over all b*K images give each layer's input a and pre-activation gradient g; then

    * conv layers: per-example weight gradient = sum over the K*P (copy, position) pairs of
      patch x gradient, one einsum per layer with the K copies folded into the position axis;
    * dense layers: per-example gradient sum_k a_k g_k^T, whose squared norm is
      sum_{k,k'} (a_k . a_k')(g_k . g_k') (a K x K Gram, the rank-1 identity when K = 1), and the
      clipped sum is a contraction of (c a) with g over (example, copy).

    Same contract and return value as :func:`clipped_sum_naive`.
    """
    p = params
    x5 = x[:, None] if x.ndim == 4 else x
    b, k = x5.shape[:2]
    xf = x5.reshape(b * k, *x5.shape[2:])
    conv_names, hw = _CIFAR_CONVS, _CIFAR_HW
    gz, losses, inputs = _cifar_backward(p, xf, y, b, k)

    def sq(a):
        return jnp.sum(a.reshape(b, -1) ** 2, axis=1)

    sq_norms = jnp.zeros((b,), xf.dtype)
    per_ex = {}
    for i, name in enumerate(conv_names):
        g = gz[i].reshape(b, k * hw[i] * hw[i], -1)  # (b, K*P, o)
        patches = im2col_3x3_same(inputs[i]).reshape(b, k * hw[i] * hw[i], -1)  # (b, K*P, 9c)
        w = jnp.einsum("bpo,bpk->bok", g, patches)  # gradient first: faster on XLA CPU
        bias = jnp.sum(g, axis=1)
        per_ex[name] = (w, bias)
        sq_norms = sq_norms + sq(w) + sq(bias)
    dense = {}
    for name, a, g in (("dense1", inputs[6], gz[6]), ("dense2", inputs[7], gz[7])):
        a = a.reshape(b, k, -1)
        g = g.reshape(b, k, -1)
        a1 = jnp.concatenate([a, jnp.ones((b, k, 1), a.dtype)], axis=-1)  # bias as input 1
        gram_a = jnp.einsum("bki,bji->bkj", a1, a1)
        gram_g = jnp.einsum("bko,bjo->bkj", g, g)
        sq_norms = sq_norms + jnp.sum(gram_a * gram_g, axis=(1, 2))
        dense[name] = (a, g)
    c = clip_factors(sq_norms, mask, clip_norm)
    summed = {}
    for name in conv_names:
        w, bias = (keep_rows(c, v) for v in per_ex[name])
        kshape = p[name]["kernel"].shape
        summed[name] = {
            "kernel": jnp.einsum("b,bok->ko", c, w).reshape(kshape),
            "bias": c @ bias,
        }
    for name, (a, g) in dense.items():
        ca, g = keep_rows(c, a * c[:, None, None]), keep_rows(c, g)
        summed[name] = {
            "kernel": jnp.einsum("bki,bko->io", ca, g),
            "bias": jnp.einsum("b,bko->o", c, g),
        }
    return summed, kept_loss_sum(losses, mask, sq_norms), jnp.sqrt(sq_norms)


# --- augmentation multiplicity --------------------------------------------------------------------


def augment_copies(key: jax.Array, x: jax.Array, copies: int, pad: int = 4) -> jax.Array:
    """K randomly augmented copies of each image: (b, h, w, c) -> (b, K, h, w, c).

    Each copy is a random h x w crop of the image reflect-padded by ``pad`` pixels, flipped
    left-right with probability 1/2: the CIFAR-10 augmentations of De et al. 2022 (§3.1,
    "augmentation multiplicity"). Offsets and flips are drawn independently per copy from ``key``;
    they depend on nothing private, and each example's K copies still feed one clipped gradient.
    """
    b, h, w, c = x.shape
    kc, kf = jax.random.split(key)
    offsets = jax.random.randint(kc, (b, copies, 2), 0, 2 * pad + 1)
    flips = jax.random.bernoulli(kf, 0.5, (b, copies))
    xp = jnp.pad(x, ((0, 0), (pad, pad), (pad, pad), (0, 0)), mode="reflect")

    def one(img, off, flip):
        crop = jax.lax.dynamic_slice(img, (off[0], off[1], 0), (h, w, c))
        return jnp.where(flip, crop[:, ::-1], crop)

    per_image = jax.vmap(one, in_axes=(None, 0, 0))  # over copies
    return jax.vmap(per_image)(xp, offsets, flips)  # over examples


def add_noise(
    grad_sum: Params, key: jax.Array, noise_multiplier, clip_norm, mask: Params | None = None
) -> Params:
    """grad_sum + N(0, (noise_multiplier * clip_norm)^2 I), independently per coordinate (Abadi et
    al. 2016, Alg. 1).

    The sensitivity of the clipped sum to adding or removing one example is clip_norm, so this is
    the Gaussian mechanism with noise multiplier ``noise_multiplier`` that the accountant assumes.
    ``mask``: a pytree of Python bools shaped like ``grad_sum`` (``trainers.finetune``): only the
    True leaves (the trainable parameters, the only ones released as trained) get noise; the
    others are returned as they are.
    """
    leaves, treedef = jax.tree_util.tree_flatten(grad_sum)
    keys = jax.random.split(key, len(leaves))
    std = noise_multiplier * clip_norm
    noised = [True] * len(leaves) if mask is None else jax.tree_util.tree_leaves(mask)
    noisy = [
        g + std * jax.random.normal(k, g.shape, g.dtype) if m else g
        for g, k, m in zip(leaves, keys, noised, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, noisy)


# --- exact per-example clipping for ScatterLinear ----------------------------------------------


def clipped_sum_scatter_linear(
    params: Params, x: jax.Array, y: jax.Array, mask: jax.Array, clip_norm, groups: int = 27
) -> tuple[Params, jax.Array, jax.Array]:
    """Clipped gradient sum for :class:`trainers.models.ScatterLinear` in closed form.

    The model is logits = z W + b with z the group-normalised features (no parameters before W).
    The per-example gradient of the cross-entropy is (z_i g_i^T, g_i) with g_i = softmax_i -
    onehot(y_i), so ||grad_i||^2 = (||z_i||^2 + 1) ||g_i||^2 and the clipped sum is
    (Z^T (c * G), sum_i c_i g_i): no per-example gradient is ever materialised. Same contract and
    return value as :func:`clipped_sum_naive` (which a test compares it with, jitted).
    """
    w, bias = params["dense"]["kernel"], params["dense"]["bias"]
    z = group_norm(x, groups).reshape(x.shape[0], -1)  # (b, d)
    logits = z @ w + bias
    losses = per_example_loss(logits, y)
    g = jax.nn.softmax(logits) - jax.nn.one_hot(y, logits.shape[-1], dtype=logits.dtype)  # (b, k)
    sq = (jnp.sum(z * z, axis=1) + 1.0) * jnp.sum(g * g, axis=1)
    c = clip_factors(sq, mask, clip_norm)
    cg, z = keep_rows(c, c[:, None] * g), keep_rows(c, z)
    summed = {"dense": {"kernel": z.T @ cg, "bias": jnp.sum(cg, axis=0)}}
    return summed, kept_loss_sum(losses, mask, sq), jnp.sqrt(sq)
