"""The generic ghost / book-keeping clipped sum (trainers.ghost) against vmap(grad), as compiled:
per layer type, on randomly composed small modules, and the sensitivity bound; which modules it
accepts and which fall back."""

from __future__ import annotations

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainers import dpsgd, ghost, models, step

B = 5


def _loss(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def _inputs(shape, dtype, seed, b=B, vocab=7):
    rng = np.random.default_rng(seed)
    if np.issubdtype(np.dtype(dtype), np.integer):
        x = rng.integers(0, vocab, size=(b, *shape)).astype(dtype)
    else:
        x = rng.standard_normal((b, *shape)).astype(dtype)
    return x, rng.integers(0, 3, size=b).astype(np.int32)


def _rel_err(a, b):
    """Largest difference relative to the largest magnitude, per leaf; max over leaves."""
    errs = jax.tree_util.tree_map(
        lambda u, v: float(jnp.max(jnp.abs(u - v)) / jnp.maximum(jnp.max(jnp.abs(v)), 1e-30)), a, b
    )
    return max(jax.tree_util.tree_leaves(errs))


def _global_rel_err(a, b):
    """Largest difference relative to the largest magnitude of the whole sum: a leaf whose true
    value is ~0 (e.g. behind a 2-feature LayerNorm, ill-conditioned) is all rounding."""
    diff = max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(
        jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True))  # fmt: skip
    scale = max(float(jnp.max(jnp.abs(v))) for v in jax.tree_util.tree_leaves(b))
    return diff / max(scale, 1e-30)


def _both(module, x, y, seed=0):
    """The plan (structural checks only: the probe is tested below), the jitted ghost and
    vmap(grad) clipped sums (mask and clip traced), params."""
    params = module.init(jax.random.PRNGKey(seed), x[:1])["params"]
    plan = ghost.analyze(
        module, params, jax.ShapeDtypeStruct(x.shape, x.dtype), _loss,
        jax.ShapeDtypeStruct(y.shape, y.dtype), probe=False,
    )  # fmt: skip
    fast = jax.jit(lambda p, m, c: ghost.clipped_sum_ghost(module, _loss, p, x, y, m, c))
    ref = jax.jit(lambda p, m, c: dpsgd.clipped_sum_naive(module.apply, p, x, y, m, c, _loss))
    return plan, fast, ref, params


class _Head(nn.Module):
    """body, then mean over any positions, then a 3-class Dense head."""

    body: nn.Module

    @nn.compact
    def __call__(self, x):
        h = self.body(x)
        if h.ndim > 2:
            h = h.reshape(h.shape[0], -1, h.shape[-1]).mean(axis=1)
        return nn.Dense(3)(jnp.tanh(h))


class _NormAfterDense(nn.Module):
    norm: nn.Module

    @nn.compact
    def __call__(self, x):
        return self.norm(nn.Dense(8)(x))


LAYERS = {
    "dense_vector": (nn.Dense(6), (4,), np.float32),
    "dense_sequence": (nn.Dense(6), (5, 4), np.float32),
    "dense_general": (nn.DenseGeneral((2, 3)), (5, 4), np.float32),
    "conv_same_stride2": (nn.Conv(4, (3, 3), strides=2), (7, 7, 2), np.float32),
    "conv_space_to_depth": (nn.Conv(3, (4, 4), strides=2), (9, 9, 2), np.float32),
    "conv_valid_dilated": (
        nn.Conv(3, (2, 2), padding="VALID", kernel_dilation=2),
        (6, 6, 2),
        np.float32,
    ),  # fmt: skip
    "conv_1d_causal": (nn.Conv(4, (3,), padding="CAUSAL"), (8, 3), np.float32),
    "conv_circular": (nn.Conv(3, (3, 3), padding="CIRCULAR"), (5, 5, 2), np.float32),
    "conv_input_dilation": (
        nn.Conv(3, (2, 2), padding=((1, 0), (0, 1)), input_dilation=2),
        (4, 4, 2),
        np.float32,
    ),
    "conv_no_bias": (nn.Conv(3, (3, 3), use_bias=False), (5, 5, 1), np.float32),
    "wsconv": (models.WSConv(4, 3), (6, 6, 2), np.float32),
    "wsconv_1x1_stride2": (models.WSConv(3, 1, 2), (6, 6, 6), np.float32),
    "embed": (nn.Embed(7, 6), (5,), np.int32),
    "layernorm": (_NormAfterDense(nn.LayerNorm()), (5, 4), np.float32),
    "groupnorm": (_NormAfterDense(nn.GroupNorm(num_groups=2)), (5, 4), np.float32),
    "rmsnorm": (_NormAfterDense(nn.RMSNorm()), (4,), np.float32),
    "attention": (
        nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=4),
        (5, 4),
        np.float32,
    ),  # fmt: skip
}


#: Layers on sequences or images, also run with ghost norms forced (no per-example gradient).
GHOST_FORMS = ["dense_sequence", "dense_general", "conv_same_stride2", "conv_space_to_depth",
               "attention", "wsconv"]  # fmt: skip


def _assert_matches_vmap_grad(fast_fn, ref_fn, params, masked: int = -1):
    """With example ``masked`` masked and the clip at the median norm (about half the examples
    clipped): the ghost sum ``fast_fn(params, mask, clip)`` equals vmap(grad)'s ``ref_fn`` to
    f32 precision, and so do the loss sum and the per-example norms."""
    mask = np.ones(B, np.float32)
    mask[masked] = 0
    clip = jnp.float32(np.median(np.asarray(ref_fn(params, mask, 1.0)[2])))
    fast, fast_loss, fast_norms = fast_fn(params, mask, clip)
    ref, ref_loss, ref_norms = ref_fn(params, mask, clip)
    assert _rel_err(fast, ref) <= 2e-5
    np.testing.assert_allclose(float(fast_loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(fast_norms), np.asarray(ref_norms), rtol=2e-5)


@pytest.mark.parametrize("name", sorted(LAYERS) + [f"{n}:ghost_norms" for n in GHOST_FORMS])
def test_each_layer_type_matches_vmap_grad(name, monkeypatch):
    """Per layer type, with about half the examples clipped and one masked: the ghost sum equals
    vmap(grad)'s to f32 precision, and so do the loss sum and the per-example norms. ":ghost_norms":
    Gram-matrix norms and the book-keeping contraction instead of materialised gradients (for a
    reparametrised layer: per-example gradients formed one example at a time, then the
    book-keeping contraction)."""
    name, _, form = name.partition(":")
    if form:
        monkeypatch.setattr(ghost, "MATERIALISE_FLOATS", 0)
    body, shape, dtype = LAYERS[name]
    module = _Head(body)
    x, y = _inputs(shape, dtype, seed=1)
    plan, fast_fn, ref_fn, params = _both(module, x, y)
    assert plan.supported, plan.reason
    _assert_matches_vmap_grad(fast_fn, ref_fn, params)


@pytest.mark.parametrize("form,width,features", [("ghost", 32, 8), ("materialise", 3, 4)])
def test_shared_layer_and_both_ghost_and_materialised_forms(form, width, features):
    """A Dense called twice (its calls' positions concatenated), through ghost norms (a 32 x 8
    gradient, larger than a Gram matrix) and through materialised per-example gradients (3 x 4,
    smaller than a Gram matrix)."""

    class Shared(nn.Module):
        @nn.compact
        def __call__(self, x):
            d = nn.Dense(features, name="shared")
            return nn.Dense(3)(jnp.tanh(d(x)).mean(1) + jnp.tanh(d(2 * x)).mean(1))

    # two calls of T = 2 positions: 4 positions per example for the shared layer
    assert ghost.matmul_form(4, width, features, B, "dense") == form
    x, y = _inputs((2, width), np.float32, seed=2)
    plan, fast, ref, params = _both(Shared(), x, y)
    assert plan.supported and dict((p[0], n) for p, _, n in plan.layers)["shared"] == 2
    mask = np.ones(B, np.float32)
    assert _rel_err(fast(params, mask, 0.5)[0], ref(params, mask, 0.5)[0]) <= 2e-5


class UserCNN(nn.Module):
    """cnn26k's architecture as a user writes it: nn.Conv, nn.max_pool (its gradient through
    ``ghost.with_fast_pools``), nn.Dense; the benchmark's user model (scripts/bench_dpsgd.py)."""

    @nn.compact
    def __call__(self, x):
        x = nn.max_pool(jnp.tanh(nn.Conv(16, (8, 8), strides=2, padding="SAME")(x)), (2, 2),
                        strides=(1, 1))  # fmt: skip
        x = nn.max_pool(jnp.tanh(nn.Conv(32, (4, 4), strides=2, padding="VALID")(x)), (2, 2),
                        strides=(1, 1))  # fmt: skip
        return nn.Dense(10)(jnp.tanh(nn.Dense(32)(x.reshape(x.shape[0], -1))))


def _full_size_rel_err(spec, b: int, masked: int) -> float:
    """The compiled ghost step's chunk sum against vmap(grad)'s, on b uniform images of the
    spec's input shape, 10 classes, the last ``masked`` masked out, clipped at the median norm of
    the others (examples above and below the clip): ``_rel_err``."""
    fns = step.get_step_functions(spec, 10, "sgd", "ghost")
    params = models.init_params(spec, jax.random.PRNGKey(3))
    rng = np.random.default_rng(4)
    x = rng.uniform(0, 1, size=(b, *spec.input_shape)).astype(np.float32)
    y = rng.integers(0, 10, size=b).astype(np.int32)
    mask = np.ones(b, np.float32)
    mask[-masked:] = 0
    ref = jax.jit(lambda p, c: dpsgd.clipped_sum_naive(spec.apply, p, x, y, mask, c))
    clip = jnp.float32(np.median(np.asarray(ref(params, 1.0)[2])[:-masked]))
    fast, _ = fns.chunk_sum(params, x, y, np.arange(b, dtype=np.int32), mask, clip)
    return _rel_err(fast, ref(params, clip)[0])


def test_user_cnn_at_full_size_matches_vmap_grad_as_compiled():
    """The compiled step's chunk sum at the real shape (28x28x1, the shapes where an XLA CPU
    miscompilation of slice-based im2col + slice max-pools was once seen:
    cpu-dpsgd-performance note) equals vmap(grad)'s, with half the examples clipped."""
    spec = models.user_model(UserCNN(), (28, 28, 1), "float32")
    assert _full_size_rel_err(spec, b=16, masked=2) <= 1e-5


# --- layers on reparametrised parameters (weight standardisation), WRN-16-4 ---------------------


class _UserWSConv(nn.Module):
    """A user's own weight-standardised conv (VALID, with a bias), declared to the ghost path as
    an nn.Conv on the standardised kernel; the bias passes through unchanged."""

    features: int

    @staticmethod
    def transform(raw):
        k = raw["kernel"]
        k = (k - k.mean(axis=(0, 1, 2))) / jnp.sqrt(k.var(axis=(0, 1, 2)) + 1e-4)
        return {"kernel": k, "bias": raw["bias"]}

    @nn.compact
    def __call__(self, x):
        raw = {
            "kernel": self.param("kernel", nn.initializers.lecun_normal(),
                                 (2, 2, x.shape[-1], self.features)),
            "bias": self.param("bias", nn.initializers.normal(0.5), (self.features,)),
        }  # fmt: skip
        p = self.transform(raw)
        y = jax.lax.conv_general_dilated(x, p["kernel"], (1, 1), "VALID",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))  # fmt: skip
        return y + p["bias"]

    def as_known_layer(self):
        return ghost.Reparametrized(nn.Conv(self.features, (2, 2), padding="VALID"), self.transform)


class _WeightNormDense(nn.Module):
    """A user's weight-normalised Dense (Salimans & Kingma 2016): kernel g v / ‖v‖ per output
    feature (``wrong``: declares the kernel without the gain g, which the probe must catch)."""

    features: int
    wrong: bool = False

    @staticmethod
    def transform(raw):
        return {"kernel": raw["g"] * raw["v"] / jnp.linalg.norm(raw["v"], axis=0)}

    @nn.compact
    def __call__(self, x):
        v = self.param("v", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        g = self.param("g", nn.initializers.normal(1.0), (self.features,))
        return x @ self.transform({"v": v, "g": g})["kernel"]

    def as_known_layer(self):
        if self.wrong:
            return ghost.Reparametrized(
                nn.Dense(self.features, use_bias=False),
                lambda raw: {"kernel": raw["v"] / jnp.linalg.norm(raw["v"], axis=0)},
            )
        return ghost.Reparametrized(nn.Dense(self.features, use_bias=False), self.transform)


class _UserReparamNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(_UserWSConv(4)(x))
        x = jnp.tanh(models.WSConv(4, 3, 2)(nn.GroupNorm(num_groups=2)(x)))
        return _WeightNormDense(3)(jnp.tanh(_WeightNormDense(5)(x.mean(axis=(1, 2)))))


@pytest.mark.parametrize("budget", [0, 2**26])  # one example per block, or the whole batch
def test_user_reparametrised_layers_match_vmap_grad(budget, monkeypatch):
    """A user's module with its own weight-standardised conv (with a bias), dptune's WSConv and a
    weight-normalised Dense: the plan accepts it (the declared layers reproduce the module's
    output), and the clipped sum, per-example norms (of the raw parameters' gradients) and loss
    equal vmap(grad)'s, with examples above and below the clip and one masked."""
    monkeypatch.setattr(ghost, "MATERIALISE_FLOATS", budget)
    module = _UserReparamNet()
    x, y = _inputs((6, 6, 2), np.float32, seed=5)
    assert _plan(module, (6, 6, 2)).supported
    plan, fast_fn, ref_fn, params = _both(module, x, y, seed=1)
    assert [k for _, k, _ in plan.layers] == ["conv", "norm", "conv", "dense", "dense"]
    mask = np.ones(B, np.float32)
    mask[2] = 0
    norms = np.asarray(ref_fn(params, mask, 1e9)[2])
    clip = jnp.float32(np.median(norms))
    assert (norms > clip).any() and (norms < clip).any()
    fast, fast_loss, fast_norms = fast_fn(params, mask, clip)
    ref, ref_loss, ref_norms = ref_fn(params, mask, clip)
    assert _rel_err(fast, ref) <= 1e-5
    np.testing.assert_allclose(float(fast_loss), float(ref_loss), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(fast_norms), np.asarray(ref_norms), rtol=1e-5)


def test_a_wrong_reparametrisation_is_refused_with_the_layer_named():
    class Wrong(nn.Module):
        @nn.compact
        def __call__(self, x):
            return _WeightNormDense(3, wrong=True, name="wn")(x)

    plan = _plan(Wrong())
    assert not plan.supported and "wn" in plan.reason and "differs" in plan.reason

    class NotALayer(nn.Module):
        def as_known_layer(self):
            return nn.relu

        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(x)

    assert "must return a Reparametrized" in _plan(NotALayer()).reason


def _smooth_wrn(depth=10, width=1):
    """A small WideResNet (WSConv, GroupNorm, projections, strides 2) with ELU. Exact agreement
    with vmap(grad) is tested at this size: at full size on XLA CPU, WRN-16-4's batched float32
    backward (which gives the ghost path its output gradients, and the non-private step its
    gradient) was 1e-2 off a float64 reference at 5 or more examples, where vmap(grad) was not."""
    return models.WideResNet(depth, width, activation="elu")


def test_wrn16_4_takes_the_ghost_path_with_and_without_augmult():
    """The shipped WRN-16-4 (weight-standardised convs, group norms, a Dense head) is covered by
    the ghost path: the default implementation is "ghost" (it was vmap(grad)) for K = 0 and the
    config's augmentation multiplicities, and the plan (probe included) accepts every layer."""
    for augmult in (0, 8, 16):
        assert step.default_grad_impl("wrn16_4", (32, 32, 3), augmult) == "ghost"
        assert step.resolve_grad_impl("wrn16_4", None, (32, 32, 3), augmult) == "ghost"
    plan = step.ghost_plan(models.get_model("wrn16_4"))
    assert plan.supported, plan.reason
    kinds = [k for _, k, _ in plan.layers]
    assert kinds.count("conv") == 16 and kinds.count("norm") == 13  # every WSConv and GroupNorm
    assert kinds[-1] == "dense"  # the head


def test_a_refused_plan_for_wrn16_4_falls_back_to_vmap_unless_ghost_was_forced(monkeypatch):
    """WRN-16-4's default is the ghost path only while its plan's probes accept it: a refused plan
    (on an H100 the probes once compared TF32 products and refused a correct declaration) makes
    the default vmap(grad), for the step and the vectorisation probe alike; only a forced 'ghost'
    is an error."""
    monkeypatch.setattr(step, "ghost_plan", lambda spec: ghost.GhostPlan("a probe disagreed"))
    assert step.default_grad_impl("wrn16_4", (32, 32, 3), 0) == "naive"
    assert step.resolve_grad_impl("wrn16_4", None, (32, 32, 3)) == "vmap"
    assert step.resolve_grad_impl("wrn16_4", "auto", (32, 32, 3), 8) == "vmap"
    with pytest.raises(ValueError, match="a probe disagreed"):
        step.resolve_grad_impl("wrn16_4", "ghost", (32, 32, 3))


def test_the_plan_probes_compare_float32_products(monkeypatch):
    """The probes run under float32 matmul precision ('highest'), whatever the device's default
    (TF32 on GPUs), so that two computations of one function agree to float32 rounding."""
    seen = []
    real = ghost._probe_reparam

    def spy(*args):
        seen.append(jax.config.jax_default_matmul_precision)
        return real(*args)

    monkeypatch.setattr(ghost, "_probe_reparam", spy)
    spec = models.user_model(_smooth_wrn(), (8, 8, 3), "float32")
    params = jax.tree_util.tree_map(jnp.zeros_like, models.init_params(spec, jax.random.PRNGKey(0)))
    plan = ghost.analyze(
        spec.module, params, jax.ShapeDtypeStruct((3, 8, 8, 3), jnp.float32), _loss,
        jax.ShapeDtypeStruct((3,), jnp.int32),
    )  # fmt: skip
    assert plan.supported, plan.reason
    assert seen == ["highest"]


@pytest.mark.parametrize("augmult", [pytest.param(0, marks=pytest.mark.slow), 2])
def test_small_wide_resnet_step_matches_vmap_grad(augmult):
    """The compiled chunk sum of a small WideResNet (the WRN-16-4 blocks: WSConv, GroupNorm,
    projection shortcuts, strides 2) on the ghost path equals the vmap(grad) path's, with and
    without augmentation multiplicity (the same copies: the same key), clip above and below."""
    spec = models.user_model(_smooth_wrn(), (8, 8, 3), "float32")
    assert step.resolve_grad_impl(spec, None, (8, 8, 3), augmult) == "ghost"
    fast = step.get_step_functions(spec, 10, "sgd", "ghost", augmult)
    ref = step.get_step_functions(spec, 10, "sgd", "vmap", augmult)
    params = models.init_params(spec, jax.random.PRNGKey(6))
    rng = np.random.default_rng(7)
    b = 6
    data_x = rng.uniform(0, 1, size=(b, 8, 8, 3)).astype(np.float32)
    data_y = rng.integers(0, 10, size=b).astype(np.int32)
    idx, mask = np.arange(b, dtype=np.int32), np.ones(b, np.float32)
    mask[-1] = 0
    key = jax.random.PRNGKey(8)
    naive = jax.jit(lambda p: dpsgd.clipped_sum_naive(spec.apply, p, data_x, data_y, mask, 1.0))
    norms = np.asarray(naive(params)[2])  # jitted: op by op, this line alone took ~11 s
    median = float(np.median(norms[:-1]))
    for clip in (1e-3, median, 1e3):  # all clipped, about half, none
        args = (params, data_x, data_y, idx, mask, jnp.float32(clip), key, jnp.int32(1))
        got, loss = fast.chunk_sum(*args)
        want, want_loss = ref.chunk_sum(*args)
        assert _rel_err(got, want) <= 1e-5
        np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)


@pytest.mark.slow  # compiles WRN-16-4 for both paths (~1 min)
def test_wrn16_4_at_full_size_matches_vmap_grad_as_compiled():
    """WRN-16-4 at its real size (32x32x3, 2.7M parameters) through the shipped model's step:
    the ghost chunk sum equals vmap(grad)'s, examples above and below the clip (ELU for the
    ReLU: see ``_smooth_wrn``)."""
    import dataclasses

    spec = dataclasses.replace(models.get_model("wrn16_4"), module=_smooth_wrn(16, 4))
    assert _full_size_rel_err(spec, b=8, masked=1) <= 1e-5


# --- randomly composed modules -------------------------------------------------------------------


class _Composed(nn.Module):
    """A stack described by ``spec``: (kind, width) pairs over a (T, d) float sequence, or over
    (h, w, c) images for convs; then the head."""

    spec: tuple
    image: bool

    @nn.compact
    def __call__(self, x):
        for kind, width in self.spec:
            if kind == "dense":
                x = jnp.tanh(nn.Dense(width)(x))
            elif kind == "conv":
                x = jnp.tanh(nn.Conv(width, (2, 2), padding="SAME" if width % 2 else "VALID")(x))
            elif kind == "layernorm":
                x = nn.LayerNorm()(x)
            elif kind == "groupnorm":
                x = nn.GroupNorm(num_groups=1)(x)
            elif kind == "residual":
                x = x + nn.Dense(x.shape[-1])(x)
        x = x.reshape(x.shape[0], -1, x.shape[-1]).mean(axis=1)
        return nn.Dense(3)(x)


_MODULES = dict(
    image=st.booleans(),
    spec=st.lists(
        st.tuples(
            st.sampled_from(["dense", "conv", "layernorm", "groupnorm", "residual"]),
            st.integers(2, 5),
        ),
        min_size=1,
        max_size=3,
    ),
    clip=st.sampled_from([1e-3, 0.3, 100.0]),
    seed=st.integers(0, 2**16),
)


def _check_random_module(image, spec, clip, seed):
    spec = tuple((k, w) for k, w in spec if image or k != "conv")
    shape = (4, 4, 2) if image else (3, 4)
    module = _Composed(spec, image)
    x, y = _inputs(shape, np.float32, seed=seed)
    mask = np.ones(B, np.float32)
    plan, fast, ref, params = _both(module, x, y, seed)
    assert plan.supported, plan.reason
    full = fast(params, mask, clip)[0]
    assert _global_rel_err(full, ref(params, mask, clip)[0]) <= 2e-5
    removed = mask.copy()
    removed[seed % B] = 0
    moved = jax.tree_util.tree_map(lambda a, b: a - b, full, fast(params, removed, clip)[0])
    norm = float(jnp.sqrt(sum(jnp.sum(v**2) for v in jax.tree_util.tree_leaves(moved))))
    assert norm <= clip * (1 + 1e-5)


@settings(max_examples=3, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(**_MODULES)
def test_random_modules_match_vmap_grad_and_bound_the_sensitivity(image, spec, clip, seed):
    """Property: for small random architectures, the ghost sum equals vmap(grad)'s to f32
    precision, and removing one example (masking it) moves the clipped sum by at most C. (Three
    fixed draws here; the slow twin draws 30.)"""
    _check_random_module(image, spec, clip, seed)


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(**_MODULES)
def test_random_modules_match_vmap_grad_many(image, spec, clip, seed):
    _check_random_module(image, spec, clip, seed)


# --- what takes the ghost path and what falls back -----------------------------------------------


def _plan(module, shape=(4,), dtype=np.float32):
    x, y = _inputs(shape, dtype, seed=0, b=3)
    params = module.init(jax.random.PRNGKey(0), x[:1])["params"]
    return ghost.analyze(
        module, params, jax.ShapeDtypeStruct(x.shape, x.dtype), _loss,
        jax.ShapeDtypeStruct(y.shape, y.dtype),
    )  # fmt: skip


def test_parameters_outside_known_layers_fall_back_with_the_parameter_named():
    class Custom(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("gain", nn.initializers.ones, (x.shape[-1],))
            return nn.Dense(3)(x * w)

    class Tied(nn.Module):  # weight tying through Embed.attend
        @nn.compact
        def __call__(self, x):
            e = nn.Embed(7, 4)
            return e.attend(e(x).mean(1))

    plan = _plan(Custom())
    assert not plan.supported and "'gain'" in plan.reason
    assert _plan(Tied(), (3,), np.int32).supported  # attend: a known call of the table


def test_models_that_mix_examples_fall_back_and_batch_layouts_are_per_example():
    class Reversed(nn.Module):  # the Dense sees the batch in reverse order
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(x[::-1])[::-1]

    class Mixing(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(x - x.mean(axis=0))

    assert "mixes examples" in _plan(Mixing()).reason
    # The ghost path runs each example as a batch of its own: a layout along the batch axis
    # cannot put another example's rows in its block, and the sum is vmap(grad)'s.
    assert _plan(Reversed()).supported
    x, y = _inputs((4,), np.float32, seed=1)
    _, fast, ref, params = _both(Reversed(), x, y)
    assert _rel_err(fast(params, np.ones(B, np.float32), 0.5)[0],
                    ref(params, np.ones(B, np.float32), 0.5)[0]) <= 1e-5  # fmt: skip


def test_auto_falls_back_once_with_a_log_and_forced_ghost_is_refused(caplog):
    class Custom(nn.Module):
        @nn.compact
        def __call__(self, x):
            return x @ self.param("w", nn.initializers.lecun_normal(), (4, 3))

    spec = models.user_model(Custom(), (4,), "float32")
    with caplog.at_level(logging.WARNING):
        assert step.resolve_grad_impl(spec, "auto", (4,)) == "vmap"
        assert step.resolve_grad_impl(spec, None, (4,)) == "vmap"
    assert sum("vmap(grad)" in r.message for r in caplog.records) == 1  # said once
    with pytest.raises(ValueError, match="grad_impl='ghost' does not apply.*'w'"):
        step.resolve_grad_impl(spec, "ghost", (4,))
    assert step.resolve_grad_impl(spec, "naive", (4,)) == "vmap"  # the old spelling


def test_batchnorm_and_other_state_are_refused_with_the_layer_named():
    class WithBN(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = nn.Dense(4)(x)
            return nn.Dense(3)(nn.BatchNorm(use_running_average=False, name="bn")(x))

    with pytest.raises(ValueError, match="layer 'bn'.*batch_stats.*GroupNorm or nn.LayerNorm"):
        models.user_model(WithBN(), (4,), "float32")

    class MixesWithoutState(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(3)(x / jnp.linalg.norm(x, axis=0))

    with pytest.raises(ValueError, match="mixes examples"):
        models.user_model(MixesWithoutState(), (4,), "float32")

    with pytest.raises(ValueError, match="one value per example"):
        models.user_model(nn.Dense(3), (4,), "float32", loss=lambda o, y: jnp.mean(o))


class _Attentions(nn.Module):
    """Self-attention (query, key and value read one input), then cross-attention whose key and
    value read a second input of the same shape as the query's."""

    @nn.compact
    def __call__(self, x):
        h = x + nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(x)
        h = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8)(h, jnp.tanh(x))
        return nn.Dense(3)(jnp.tanh(h).mean(axis=1))


def test_projections_of_one_input_share_its_gram_and_match_vmap_grad():
    """Dense layers on T = 3 positions with 8 x 8 kernels take ghost norms; the projections that
    read one traced input (self-attention's query, key and value; cross-attention's key and value)
    share that input's Gram matrix, the cross-attention's query (another input of the same shape)
    does not: the clipped sum, loss and norms equal vmap(grad)'s."""
    module = _Attentions()
    x, y = _inputs((3, 8), np.float32, seed=4)
    assert ghost.matmul_form(3, 8, 8, B, "dense") == "ghost"
    plan, fast_fn, ref_fn, params = _both(module, x, y)
    assert plan.supported, plan.reason
    _, rec = ghost._record(module, params, jnp.asarray(x))
    sources = {"/".join(c.path): c.source for c in rec.calls}
    self_attn, cross = "MultiHeadDotProductAttention_0/", "MultiHeadDotProductAttention_1/"
    q = sources[self_attn + "query"]
    assert sources[self_attn + "key"] == sources[self_attn + "value"] == q
    kv = sources[cross + "key"]
    assert sources[cross + "value"] == kv and sources[cross + "query"] not in (q, kv)
    _assert_matches_vmap_grad(fast_fn, ref_fn, params, masked=0)
