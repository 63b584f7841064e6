"""Flax NNX LoRA fine-tuning: ``trainable=nnx.LoRAParam`` on a user's ``nnx.LoRALinear`` /
``nnx.LoRA`` model, ``init=`` from the base model's parameters, per-example clipping of the
factors equal to an independent vmap(grad) over them (in rank space), the frozen base bitwise
unchanged, and the release reloaded into the module."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dptune
from dptune.errors import TuningConfigError
from tests.trainers.test_lora import jaxpr_shapes  # the same nested-program walk
from trainers import dpsgd, finetune, ghost, models, nnx_model, step


class _Base(nnx.Module):
    """A Linear body on vectors (b, d_in) or sequences (b, T, d_in), a mean over positions, a
    3-class Linear head: the pretrained model."""

    def __init__(self, d_in: int, hidden: int, rngs: nnx.Rngs):
        self.body = nnx.Linear(d_in, hidden, rngs=rngs)
        self.head = nnx.Linear(hidden, 3, rngs=rngs)

    def __call__(self, x):
        h = jnp.tanh(self.body(x))
        return self.head(h if h.ndim == 2 else jnp.mean(h, axis=1))


class _Lora(_Base):
    """``_Base`` with a rank-r adapter on the body: ``nnx.LoRALinear`` (the same parameter paths
    as ``nnx.Linear``, plus ``body/lora/lora_a``, ``body/lora/lora_b``) or ``nnx.LoRA`` around
    an ``nnx.Linear`` (``body/base_module/...``, ``body/lora_a``, ``body/lora_b``)."""

    def __init__(self, d_in: int, hidden: int, rank: int, rngs: nnx.Rngs, kind: str = "linear"):
        super().__init__(d_in, hidden, rngs)
        if kind == "linear":
            self.body = nnx.LoRALinear(d_in, hidden, lora_rank=rank, rngs=rngs)
        else:
            base = nnx.Linear(d_in, hidden, rngs=rngs)
            self.body = nnx.LoRA(d_in, rank, hidden, base_module=base, rngs=rngs)


def _factors(params: dict, kind: str) -> tuple[dict, dict]:
    """(the LoRA factors {"a", "b"}, the frozen arrays {"w", "c", "w2", "c2"}) of ``params``."""
    body = params["body"]
    lora, base = (body["lora"], body) if kind == "linear" else (body, body["base_module"])
    head = params["head"]
    return (
        {"a": lora["lora_a"], "b": lora["lora_b"]},
        {"w": base["kernel"], "c": base["bias"], "w2": head["kernel"], "c2": head["bias"]},
    )


def _reference(params: dict, kind: str, x, y, mask, clip: float):
    """The clipped sum over the factors and the per-example norms, by vmap(grad) of the model
    written out in jnp (no dptune, no Flax): an independent number."""
    ab, fr = _factors(params, kind)

    def loss(f, xi, yi):
        h = jnp.tanh(xi @ fr["w"] + fr["c"] + (xi @ f["a"]) @ f["b"])
        h = h if h.ndim == 1 else jnp.mean(h, axis=0)
        logits = h @ fr["w2"] + fr["c2"]
        return -jax.nn.log_softmax(logits)[yi]

    g = jax.vmap(jax.grad(loss), in_axes=(None, 0, 0))(ab, x, y)
    norms = jnp.sqrt(sum(jnp.sum(v.reshape(v.shape[0], -1) ** 2, 1) for v in g.values()))
    c = mask * jnp.minimum(1.0, clip / norms)
    return {k: jnp.tensordot(c, v, axes=1) for k, v in g.items()}, norms


def _data(shape, n=60, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *shape)).astype(np.float32)
    y = (x.reshape(n, -1)[:, 0] > 0).astype(np.int32) + (x.reshape(n, -1)[:, 1] > 1)
    return dptune.Dataset.from_arrays(
        x, y.astype(np.int32), num_examples=n, validation_fraction=0.25, num_classes=3
    )


_BASE = dict(batch_size=16, epochs=2, noise_multiplier=1.0, clip_norm=0.5, learning_rate=0.5)


def _trainer(module, data, base=_BASE, **kw):
    return dptune.DpSgdTrainer(
        data, base, model=module, trainable=nnx.LoRAParam, epoch_progress=False, **kw
    )


def _equal_bits(a, b):
    fa, fb = finetune.flat_paths(a), finetune.flat_paths(b)
    assert sorted(fa) == sorted(fb)
    for k in fa:
        u, v = np.asarray(fa[k]), np.asarray(fb[k])
        assert u.dtype == v.dtype and u.shape == v.shape and u.tobytes() == v.tobytes(), k


def _clipped_sum(spec):
    """The clipped-sum function a training step of ``spec`` runs (path chosen as training
    chooses it), and that path's name."""
    impl = step.resolve_grad_impl(spec, "auto", spec.input_shape)
    fns = step.StepFunctions(spec, 3, "sgd", impl)
    return jax.jit(fns._clipped_sum_of(spec)), impl


def test_the_filter_trains_the_factors_and_init_takes_the_base_model_params():
    """``trainable=nnx.LoRAParam`` chooses the factors by their Variable type; ``init=`` takes
    the base model's parameters (same paths with nnx.LoRALinear), the factors start at the
    module's own values (B = 0), so the adapted model starts equal to the base."""
    data = _data((4,))
    base = _Base(4, 6, nnx.Rngs(7))
    pretrained = dptune.NnxModel(base).params()
    tr = _trainer(_Lora(4, 6, 2, nnx.Rngs(0)), data, init=pretrained)
    spec = tr.model
    assert [p for p, m in finetune.flat_paths(spec.trainable).items() if m] == [
        "body/lora/lora_a", "body/lora/lora_b",
    ]  # fmt: skip
    start = models.init_params(spec, jax.random.PRNGKey(0))
    body = {k: v for k, v in start["body"].items() if k != "lora"}
    _equal_bits({"body": body, "head": start["head"]}, pretrained)
    x = jnp.asarray(data.test_x)
    np.testing.assert_array_equal(spec.apply({"params": start}, x), base(x))
    assert tr.init_fingerprint == finetune.fingerprint(pretrained)


def test_a_model_with_lora_factors_trains_them_by_default(caplog):
    """Without ``trainable=``, an NNX model built with LoRA factors trains the factors alone, as a
    ``with_lora`` model does (it trained everything, the base included, on ``vmap(grad)``)."""
    with caplog.at_level(logging.INFO, logger="dptune"):
        tr = dptune.DpSgdTrainer(
            _data((4,)), _BASE, model=_Lora(4, 6, 2, nnx.Rngs(0)), epoch_progress=False
        )
    assert [p for p, m in finetune.flat_paths(tr.model.trainable).items() if m] == [
        "body/lora/lora_a", "body/lora/lora_b",
    ]  # fmt: skip
    assert "nnx.LoRAParam factors: they train" in caplog.text
    # a model without factors still trains everything
    assert (
        dptune.DpSgdTrainer(_data((4,)), _BASE, model=_Base(4, 6, nnx.Rngs(0))).model.trainable
        is None
    )


def test_an_nnx_filter_is_refused_in_one_line_where_it_cannot_apply():
    import flax.linen as nn

    data = _data((4,))
    with pytest.raises(TuningConfigError, match=r"^trainable=PathContains\('nope'.*matches no"):
        dptune.DpSgdTrainer(data, _BASE, model=_Base(4, 6, nnx.Rngs(0)),
                            trainable=nnx.PathContains("nope"))  # fmt: skip
    with pytest.raises(TuningConfigError, match=r"^trainable=LoRAParam matches no parameter"):
        dptune.DpSgdTrainer(data, _BASE, model=_Base(4, 6, nnx.Rngs(0)), trainable=nnx.LoRAParam)
    with pytest.raises(
        TuningConfigError,
        match="^trainable=LoRAParam: an NNX filter chooses parameters of a Flax NNX",
    ):
        dptune.DpSgdTrainer(data, _BASE, model=nn.Dense(3), trainable=nnx.LoRAParam)
    with pytest.raises(TuningConfigError, match="'body/base_module/bias' of the module is missing"):
        # nnx.LoRA around a Linear nests the base's parameters: the base's own paths do not fit
        _trainer(_Lora(4, 6, 2, nnx.Rngs(0), kind="wrap"), data,
                 init=dptune.NnxModel(_Base(4, 6, nnx.Rngs(7))).params())  # fmt: skip


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(
    d_in=st.integers(2, 7),
    hidden=st.integers(2, 7),
    rank=st.integers(1, 3),
    seq=st.sampled_from([0, 1, 3]),
    kind=st.sampled_from(["linear", "wrap"]),
    seed=st.integers(0, 2**16),
)
def test_clipped_sums_over_the_factors_equal_vmap_grad(d_in, hidden, rank, seq, kind, seed):
    """2-D (seq=0) and 3-D inputs (b, T, d_in), nnx.LoRALinear and nnx.LoRA: the clipped sum a
    training step computes (on the path training chooses: ghost, the factors as two Dense
    kernels) equals vmap(grad) of the model written out in jnp, to f32; the frozen part of the
    sum is exactly zero."""
    shape = (d_in,) if seq == 0 else (seq, d_in)
    data = _data(shape, seed=seed % 7)
    spec = _trainer(_Lora(d_in, hidden, rank, nnx.Rngs(seed), kind=kind), data).model
    fn, impl = _clipped_sum(spec)
    assert impl == "ghost"
    leaves, tree = jax.tree_util.tree_flatten(models.init_params(spec, jax.random.PRNGKey(0)))
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    noisy = [
        v + 0.5 * jax.random.normal(k, v.shape, v.dtype) for v, k in zip(leaves, keys, strict=True)
    ]
    params = jax.tree_util.tree_unflatten(tree, noisy)  # B = 0 would make A's gradient zero
    b, clip = 5, 0.05
    x, y = jnp.asarray(data.train_x[:b]), jnp.asarray(data.train_y[:b])
    mask = jnp.asarray([1.0, 1.0, 0.0, 1.0, 1.0])
    got, _, norms = fn(params, x, y, mask, clip)
    want, want_norms = _reference(params, kind, x, y, mask, clip)
    np.testing.assert_allclose(norms, want_norms, rtol=2e-5, atol=1e-6)
    ab, frozen = _factors(got, kind)
    for k in ab:
        np.testing.assert_allclose(ab[k], want[k], rtol=2e-4, atol=1e-6, err_msg=k)
    for k, v in frozen.items():
        assert not np.any(np.asarray(v)), k


@pytest.mark.parametrize(
    "kind, trainable, impl",
    [
        ("linear", nnx.Any(nnx.LoRAParam, nnx.PathContains("head")), "ghost"),
        ("wrap", nnx.Any(nnx.LoRAParam, nnx.PathContains("head")), "ghost"),
        ("wrap", nnx.Param, "ghost"),  # the base Linear inside nnx.LoRA: a known layer
        ("wrap", nnx.PathContains("base_module"), "ghost"),  # frozen factors run as written
        ("linear", nnx.Param, "vmap"),  # nnx.LoRALinear's own kernel: read outside known layers
        ("linear", nnx.PathContains("lora_b"), "vmap"),  # one factor of a LoRA: partly trained
        ("custom", nnx.LoRAParam, "vmap"),  # a custom promote_dtype: no formula here
    ],
)
def test_factors_with_other_trained_parameters_equal_vmap_grad(kind, trainable, impl):
    """Factors trained with other layers, or frozen around a trained base: the path training
    chooses gives the clipped sums and norms of the vmap(grad) path; what has no formula falls
    back to vmap(grad) whole."""
    data = _data((3, 5), n=8)
    module = _Lora(5, 6, 2, nnx.Rngs(0), kind="linear" if kind == "custom" else kind)
    if kind == "custom":
        module.body.lora.promote_dtype = lambda args, dtype=None: args
    spec = dptune.DpSgdTrainer(data, _BASE, model=module, trainable=trainable).model
    fn, got_impl = _clipped_sum(spec)
    assert got_impl == impl
    exact = jax.jit(step.StepFunctions(spec, 3, "sgd", "vmap")._clipped_sum_of(spec))
    start = models.init_params(spec, jax.random.PRNGKey(0))
    params = jax.tree_util.tree_map(lambda v: v + 0.3, start)  # B != 0
    x, y, mask = jnp.asarray(data.train_x[:5]), jnp.asarray(data.train_y[:5]), jnp.ones(5)
    got, _, norms = fn(params, x, y, mask.at[2].set(0.0), 0.05)
    want, _, want_norms = exact(params, x, y, mask.at[2].set(0.0), 0.05)
    np.testing.assert_allclose(norms, want_norms, rtol=2e-5, atol=1e-6)
    got, want = finetune.flat_paths(got), finetune.flat_paths(want)
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        np.testing.assert_allclose(got[k], v, rtol=2e-4, atol=1e-6, err_msg=k)


@pytest.mark.parametrize(
    "dtype, param_dtype, x_dtype",
    [(None, "float32", "bfloat16"), ("bfloat16", "float32", "float32"),
     (None, "bfloat16", "float32")],
)  # fmt: skip
def test_the_recorded_lora_computes_what_flax_computes(dtype, param_dtype, x_dtype):
    """Recorded as two Dense kernels (at the factors' own paths), an nnx.LoRA around a Linear
    gives flax's own output bitwise, in flax's promoted dtype."""
    module = nnx.LoRA(5, 2, 4, base_module=nnx.Linear(5, 4, rngs=nnx.Rngs(1)), dtype=dtype,
                      param_dtype=param_dtype, b_initializer=nnx.initializers.normal(1.0),
                      rngs=nnx.Rngs(0))  # fmt: skip
    m = nnx_model.NnxModel(module, nnx.LoRAParam)
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 5)), x_dtype)
    out, rec = ghost._record(m, m.params(), x)
    assert [c.path for c in rec.calls] == [("lora_a",), ("lora_b",)]
    want = module(x)
    assert out.dtype == want.dtype and np.asarray(out).tobytes() == np.asarray(want).tobytes()


def test_removing_one_example_moves_the_clipped_sum_by_at_most_c():
    data = _data((3, 5))
    spec = _trainer(_Lora(5, 6, 2, nnx.Rngs(1)), data).model
    fn, _ = _clipped_sum(spec)
    params = models.init_params(spec, jax.random.PRNGKey(0))
    params["body"]["lora"]["lora_b"] = jnp.ones_like(params["body"]["lora"]["lora_b"])
    x, y, clip = jnp.asarray(data.train_x[:6]) * 3, jnp.asarray(data.train_y[:6]), 0.02
    full, _, norms = fn(params, x, y, jnp.ones(6), clip)
    assert float(jnp.min(norms)) > clip  # clipping binds for every example
    for i in range(6):
        less, _, _ = fn(params, x, y, jnp.ones(6).at[i].set(0.0), clip)
        d = jax.tree_util.tree_map(lambda a, b: a - b, full, less)
        dist = float(jnp.sqrt(sum(jnp.sum(v * v) for v in jax.tree_util.tree_leaves(d))))
        assert clip * 0.99 <= dist <= clip * (1 + 1e-5)


def test_no_per_example_d_in_by_d_out_matrix_is_formed():
    """The traced clipped sum over the factors of a (b, T, 37) -> 41 nnx.LoRALinear (the ghost
    path) holds no array with both 37 and 41 among three or more axes: the per-example norms
    are formed in rank space. The same check sees the matrix of a trainable base kernel."""
    d_in, d_out, b, t = 37, 41, 4, 5
    data = _data((t, d_in), n=8)
    x, y = jnp.asarray(data.train_x[:b]), jnp.asarray(data.train_y[:b])

    def big(trainable):
        spec = dptune.DpSgdTrainer(data, _BASE, model=_Lora(d_in, d_out, 3, nnx.Rngs(0)),
                                   trainable=trainable).model  # fmt: skip
        fn, impl = _clipped_sum(spec)
        assert impl == "ghost" or trainable is not nnx.LoRAParam
        params = models.init_params(spec, jax.random.PRNGKey(0))
        jx = jax.make_jaxpr(fn)(params, x, y, jnp.ones(b), 1.0)
        return [s for s in jaxpr_shapes(jx.jaxpr) if d_in in s and d_out in s and len(s) > 2]

    assert not big(nnx.LoRAParam)
    assert big(nnx.PathContains("body"))


def test_a_frozen_nnx_layer_is_not_recorded_on_the_ghost_path():
    """With a trainable part of an NNX model of known layers, a frozen layer runs as written:
    its gradient does not enter the norms (which equal vmap(grad) over the trainable part)."""
    module = _Base(4, 6, nnx.Rngs(3))
    m = nnx_model.NnxModel(module)
    params = m.params()
    mask = finetune.trainable_mask(params, ["^head/"])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((6, 4)) * 3, jnp.float32)
    y = jnp.asarray(rng.integers(0, 3, 6), jnp.int32)
    loss = dpsgd.per_example_loss
    plan = ghost.analyze(m, params, x, loss, y, trainable=mask)
    assert plan.supported and [p for p, _, _ in plan.layers] == [("head",)]
    g, _, n = ghost.clipped_sum_ghost(m, loss, params, x, y, jnp.ones(6), 0.1, trainable=mask)
    v, _, nv = finetune.masked_clipped_sum(dpsgd.clipped_sum_naive, m.apply, mask)(
        params, x, y, jnp.ones(6), 0.1
    )
    np.testing.assert_allclose(n, nv, rtol=2e-5)
    np.testing.assert_allclose(g["head"]["kernel"], v["head"]["kernel"], rtol=2e-4, atol=1e-6)
    assert not np.any(np.asarray(g["body"]["kernel"]))
    # the same part chosen by an NNX filter: a training step takes the ghost path
    spec = dptune.DpSgdTrainer(_data((4,)), _BASE, model=module,
                               trainable=nnx.PathContains("head")).model  # fmt: skip
    assert step.resolve_grad_impl(spec, "auto", spec.input_shape) == "ghost"


def tune_on_the_ghost_path(tr, space, selection, workdir, caplog) -> None:
    """``dptune.tune`` at a loose budget; asserts it released and logged the ghost path."""
    with caplog.at_level(logging.INFO):
        res = dptune.tune(
            tr, space, selection, budget=(50.0, 1e-5), workdir=workdir, progress=False,
            dataset_budget=(100.0, 1e-4),
        )  # fmt: skip
    assert res.released
    said = [r.getMessage() for r in caplog.records if "per-example clipping" in r.getMessage()]
    assert said and "per-example clipping: ghost" in said[0], said


def test_tuning_keeps_the_base_bitwise_and_the_release_reloads_into_the_module(tmp_path, caplog):
    """End to end (Adam, a parameter average): the base model's parameters in, the factors
    trained privately on the logged ghost path, the frozen base bitwise as it came in, the
    release loaded into the NNX module (nnx.update) predicting as the released parameters do."""
    from selection import BestOfK

    data = _data((3, 4), n=80)
    pretrained = dptune.NnxModel(_Base(4, 6, nnx.Rngs(7))).params()
    module = _Lora(4, 6, 2, nnx.Rngs(0))
    adam = {**_BASE, "optimizer": "adam", "ema_decay": 0.9}  # optimiser state and an average
    tr = _trainer(module, data, adam, init=pretrained)
    tune_on_the_ghost_path(
        tr, {"learning_rate": dptune.space.log_uniform(0.01, 0.1)}, BestOfK(1), tmp_path / "run",
        caplog,
    )  # fmt: skip
    loaded = dptune.load_release(tmp_path / "run", like=module)
    released = nnx.to_pure_dict(loaded.params)
    _equal_bits({k: v for k, v in released["body"].items() if k != "lora"}, pretrained["body"])
    _equal_bits(released["head"], pretrained["head"])
    assert np.any(np.asarray(released["body"]["lora"]["lora_b"]))  # the factors trained
    nnx.update(module, loaded.params)
    x = jnp.asarray(data.test_x)
    plain = {k: jax.tree_util.tree_map(np.asarray, v) for k, v in released.items()}
    want = tr.model.apply({"params": plain}, x)
    np.testing.assert_array_equal(module(x), want)
    # the release is an init too (factors included): the next run starts from this one's output
    again = _trainer(_Lora(4, 6, 2, nnx.Rngs(5)), data, init=tmp_path / "run")
    _equal_bits(models.init_params(again.model, jax.random.PRNGKey(0)), plain)
