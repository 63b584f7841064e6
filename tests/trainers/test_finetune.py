"""Fine-tuning (trainers.finetune, DpSgdTrainer(init=..., trainable=...)): every init format loads
bitwise, a mismatching init is refused before anything runs, frozen parameters come out bitwise
as they went in, only trainable parameters are clipped and noised, the clipped sum over the
trainable part moves by at most C when one example is removed, and the statement names the
public start."""

from __future__ import annotations

import dataclasses
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dptune
from dptune.errors import TuningConfigError
from dptune.learners.dpsgd import DpSgdTrainer
from selection.random_stopping import RandomStopping
from trainers import dpsgd, finetune, ghost, models
from trainers.data import make_synthetic

_DATA = make_synthetic(num_train=300, num_test=20, validation_size=60, image_shape=(6, 6, 1))
_BASE = dict(
    batch_size=40, epochs=2, learning_rate=0.5, noise_multiplier=1.0, score_noise_std=5.0,
    clip_norm=0.5,
)  # fmt: skip


class _Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x.reshape(x.shape[0], -1)
        x = jnp.tanh(nn.Dense(12, name="Dense_0")(x))
        x = jnp.tanh(nn.Dense(12, name="Dense_1")(x))
        return nn.Dense(10, name="Dense_2")(x)


def _pretrained(seed=7):
    p = _Mlp().init(jax.random.PRNGKey(seed), jnp.zeros((1, 6, 6, 1)))["params"]
    p = jax.tree_util.tree_map(np.array, p)  # writable copies
    p["Dense_0"]["bias"][0] = -0.0  # a signed zero must survive too
    return p


def _equal(a, b):
    fa, fb = finetune.flat_paths(a), finetune.flat_paths(b)
    assert list(fa) == list(fb) or sorted(fa) == sorted(fb)
    for k in fa:
        u, v = np.asarray(fa[k]), np.asarray(fb[k])
        assert u.dtype == v.dtype and u.shape == v.shape, k
        assert u.tobytes() == v.tobytes(), k


def _save_every_format(p, tmp_path):
    import orbax.checkpoint as ocp
    from flax import serialization

    npz = tmp_path / "p.npz"
    np.savez(npz, **finetune.flat_paths(p))
    msg = tmp_path / "p.msgpack"
    msg.write_bytes(serialization.msgpack_serialize(p))
    std = tmp_path / "std"
    with ocp.StandardCheckpointer() as c:
        c.save(std.absolute(), p)
        c.wait_until_finished()
    tree = tmp_path / "tree"
    with ocp.PyTreeCheckpointer() as c:
        c.save(tree.absolute(), p)
    rel = tmp_path / "run" / "release"
    rel.mkdir(parents=True)
    from dptune.release import _save_orbax

    _save_orbax(p, rel / "checkpoint")
    (rel / "result.json").write_text(json.dumps({"released": True}))
    return {"npz": npz, "msgpack": msg, "orbax": std, "orbax-pytree": tree, "release": rel.parent}


def test_each_init_format_loads_bitwise(tmp_path):
    p = _pretrained()
    for name, source in _save_every_format(p, tmp_path).items():
        tr = DpSgdTrainer(_DATA, _BASE, epoch_progress=False, model=_Mlp(), init=source)
        spec = tr.model
        got = models.init_params(spec, jax.random.PRNGKey(0))
        _equal(jax.tree_util.tree_map(np.asarray, got), p)
        assert tr.init_fingerprint == finetune.fingerprint(p), name
    # a pytree (and flax's {"params": ...} variables) as it is
    tr = DpSgdTrainer(_DATA, _BASE, epoch_progress=False, model=_Mlp(), init={"params": p})
    assert tr.init_fingerprint == finetune.fingerprint(p)


def test_the_fingerprint_sees_every_bit():
    p = _pretrained()
    q = jax.tree_util.tree_map(np.copy, p)
    q["Dense_0"]["bias"][0] = 0.0  # -0.0 -> +0.0: equal values, other bits
    assert finetune.fingerprint(p) != finetune.fingerprint(q)
    assert finetune.fingerprint(p) == finetune.fingerprint(jax.tree_util.tree_map(np.copy, p))


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda p: p["Dense_1"].__setitem__("kernel", p["Dense_1"]["kernel"][:, :5]),
         "'Dense_1/kernel': the init holds float32[12, 5], the module expects float32[12, 12]"),
        (lambda p: p["Dense_2"].__setitem__("bias", p["Dense_2"]["bias"].astype(np.float16)),
         "'Dense_2/bias': the init holds float16[10]"),
        (lambda p: p.pop("Dense_2"), "'Dense_2/bias' of the module is missing"),
        (lambda p: p.__setitem__("extra", {"w": np.zeros(2, np.float32)}), "holds 'extra/w'"),
    ],
)  # fmt: skip
def test_a_mismatching_init_is_refused_in_one_line_before_anything_is_charged(
    change, words, tmp_path
):
    p = _pretrained()
    change(p)
    ledger = tmp_path / "ledger.sqlite"
    with pytest.raises(TuningConfigError) as e:
        tr = DpSgdTrainer(_DATA, _BASE, epoch_progress=False, model=_Mlp(), init=p)
        dptune.tune(tr, dict(learning_rate=0.5), RandomStopping.logarithmic(mean=2),
                    dptune.Budget(8.0, 1e-5), workdir=tmp_path / "w", ledger=ledger)  # fmt: skip
    msg = str(e.value)
    assert msg.startswith("init=") and words in msg and "\n" not in msg
    assert not ledger.exists() and not (tmp_path / "w").exists()


def test_bad_sources_and_trainable_choices_are_refused(tmp_path):
    for source, words in ((tmp_path / "none.npz", "no such file"), (tmp_path, "not an orbax")):
        with pytest.raises(TuningConfigError, match=words):
            DpSgdTrainer(_DATA, _BASE, model=_Mlp(), init=source)
    (tmp_path / "p.txt").write_text("x")
    with pytest.raises(TuningConfigError, match=r"\.msgpack file"):
        DpSgdTrainer(_DATA, _BASE, model=_Mlp(), init=tmp_path / "p.txt")
    with pytest.raises(TuningConfigError, match="matches no parameter"):
        DpSgdTrainer(_DATA, _BASE, model=_Mlp(), trainable=["nothing_here"])
    with pytest.raises(TuningConfigError, match="not a list of regexes"):
        DpSgdTrainer(_DATA, _BASE, model=_Mlp(), trainable=["("])
    with pytest.raises(TuningConfigError, match="'bookkeeping' trains every parameter"):
        DpSgdTrainer(_DATA, _BASE, model="cnn26k", trainable=["dense2"], grad_impl="bookkeeping")


@pytest.mark.parametrize("grad_impl", ["ghost", "vmap"])
@pytest.mark.parametrize("ema", [None, 0.9])
def test_frozen_parameters_come_out_bitwise_and_the_trainable_ones_move(grad_impl, ema):
    p = _pretrained()
    tr = DpSgdTrainer(
        _DATA, {**_BASE, "ema_decay": ema, "optimizer": "adam", "learning_rate": 0.01},
        epoch_progress=False, model=_Mlp(), init=p, trainable=["Dense_1"], grad_impl=grad_impl,
    )  # fmt: skip
    score, payload = tr({}, np.random.default_rng(0))
    assert np.isfinite(score)
    out = payload["params"]
    _equal({k: out[k] for k in ("Dense_0", "Dense_2")}, {k: p[k] for k in ("Dense_0", "Dense_2")})
    assert not np.array_equal(out["Dense_1"]["kernel"], p["Dense_1"]["kernel"])


def test_a_callable_chooses_the_trainable_part():
    p = _pretrained()
    tr = DpSgdTrainer(
        _DATA, _BASE, epoch_progress=False, model=_Mlp(), init=p,
        trainable=lambda path, leaf: path.endswith("bias"),
    )  # fmt: skip
    _, payload = tr({}, np.random.default_rng(1))
    for layer in ("Dense_0", "Dense_1", "Dense_2"):
        assert payload["params"][layer]["kernel"].tobytes() == p[layer]["kernel"].tobytes()
        assert payload["params"][layer]["bias"].tobytes() != p[layer]["bias"].tobytes()


def test_noise_is_added_to_trainable_parameters_only():
    g = {"a": jnp.zeros((3, 2)), "b": jnp.zeros((4,)), "c": jnp.zeros(())}
    mask = {"a": True, "b": False, "c": True}
    out = dpsgd.add_noise(g, jax.random.PRNGKey(0), 2.0, 0.5, mask=mask)
    assert np.all(np.asarray(out["b"]) == 0) and out["b"] is g["b"]
    assert np.all(np.asarray(out["a"]) != 0) and float(out["c"]) != 0
    # the noise's std is sigma * C on the trainable leaves
    big = {"a": jnp.zeros((200_000,)), "b": jnp.zeros((3,))}
    noisy = dpsgd.add_noise(big, jax.random.PRNGKey(1), 2.0, 0.5, mask={"a": True, "b": False})
    assert abs(float(jnp.std(noisy["a"])) - 1.0) < 0.01


@pytest.mark.parametrize("impl", ["ghost", "vmap"])
def test_removing_one_example_moves_the_trainable_clipped_sum_by_at_most_c(impl):
    """Sensitivity of the clipped sum over the trainable part, for each example removed (masked
    out): ||sum(D) - sum(D - {i})|| <= C, and the frozen part of the sum is exactly zero."""
    module = _Mlp()
    params = _pretrained()
    mask = finetune.trainable_mask(params, ["Dense_1", "Dense_2"])
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((6, 6, 6, 1)) * 3, jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, 6), jnp.int32)
    clip = 0.3
    if impl == "ghost":
        loss = dpsgd.per_example_loss
        assert ghost.analyze(module, params, x, loss, y, trainable=mask).supported

        def fn(m):
            return ghost.clipped_sum_ghost(module, loss, params, x, y, m, clip, trainable=mask)
    else:
        clipped = finetune.masked_clipped_sum(dpsgd.clipped_sum_naive, module.apply, mask)

        def fn(m):
            return clipped(params, x, y, m, clip)

    fn = jax.jit(fn)
    full, _, norms = fn(jnp.ones(6))
    assert float(jnp.max(norms)) > clip  # clipping binds for some example
    assert not np.any(np.asarray(full["Dense_0"]["kernel"]))
    for i in range(6):
        m = jnp.ones(6).at[i].set(0.0)
        less, _, _ = fn(m)
        diff = jax.tree_util.tree_map(lambda a, b: a - b, full, less)
        dist = float(jnp.sqrt(sum(jnp.sum(d * d) for d in jax.tree_util.tree_leaves(diff))))
        assert dist <= clip * (1 + 1e-5)


def test_the_statement_names_the_public_start_and_its_fingerprint():
    p = _pretrained()
    tr = DpSgdTrainer(_DATA, _BASE, epoch_progress=False, model=_Mlp(), init=p)
    sp = dptune.Space(dict(learning_rate=dptune.space.log_uniform(0.1, 1.0), noise_multiplier=2.0))
    method, budget = RandomStopping.logarithmic(mean=2), dptune.Budget(20.0, 1e-5)
    _, st = dptune.plan_privacy(tr, sp, method, budget)
    assert "public-init" in st.assumptions
    assert any(finetune.fingerprint(p) in n for n in st.all_notes())
    plain = DpSgdTrainer(_DATA, _BASE, epoch_progress=False, model=_Mlp())
    _, st0 = dptune.plan_privacy(plain, sp, method, budget)
    assert "public-init" not in st0.assumptions
    # the same privacy either way: a public start is free
    assert st.total_epsilon == pytest.approx(st0.total_epsilon, rel=1e-12)
    assert not any("parameter arrays train" in n for n in st.all_notes())  # everything trains


def test_the_statement_says_which_part_trains():
    tr = DpSgdTrainer(
        _DATA, _BASE, epoch_progress=False, model=_Mlp(), init=_pretrained(), trainable=["Dense_1"]
    )
    notes = tr.privacy_notes()
    assert any(
        n.startswith("Only 2 of 6 parameter arrays train (Dense_1/bias, Dense_1/kernel)")
        and "released checkpoint holds all" in n
        for n in notes
    ), notes


def test_lora_fine_tuning_end_to_end_and_the_release_restores_the_model(tmp_path):
    """Base parameters in, adapters fresh (the adapted model starts equal to the base), only
    the adapters train, the rank is a privacy-irrelevant field of the space, and load_release
    gives back the full parameters the model runs with."""
    p = _pretrained()
    model = dptune.with_lora(_Mlp(), rank=2, targets=["Dense_1", "Dense_2"])
    tr = DpSgdTrainer(_DATA, _BASE, epoch_progress=False, model=model, init=p)
    assert tr.model.trainable is not None
    start = models.init_params(tr.model, jax.random.PRNGKey(3))
    x = jnp.asarray(_DATA.test_x[:5])
    np.testing.assert_array_equal(model.apply({"params": start}, x), _Mlp().apply({"params": p}, x))
    sp = dptune.Space(dict(lora_rank=dptune.space.choice(1, 3), noise_multiplier=2.0))
    assert "lora_rank" not in sp.privacy_relevant
    res = dptune.tune(
        tr, sp, RandomStopping.logarithmic(mean=2), dptune.Budget(30.0, 1e-5),
        workdir=tmp_path / "w", ledger=tmp_path / "l.sqlite", seed=3,
    )  # fmt: skip
    assert res.released
    rank = res.hparams["lora_rank"]
    got = dptune.load_release(tmp_path / "w").payload["params"]
    _equal({k: got[k] for k in p}, p)  # the base, bitwise
    assert got["lora_Dense_1"]["a"]["kernel"].shape == (12, rank)
    adapted = dptune.with_lora(_Mlp(), rank=rank, targets=["Dense_1", "Dense_2"])
    assert np.all(np.isfinite(adapted.apply({"params": got}, x)))
    # a release folder is an init format too: the next run starts from this one's output
    again = DpSgdTrainer(_DATA, _BASE, epoch_progress=False, model=adapted, init=tmp_path / "w")
    _equal(jax.tree_util.tree_map(np.asarray, dict(again.model.init)), finetune.flat_paths(got))


def test_a_shipped_model_with_a_trainable_part_leaves_the_hand_tuned_path():
    spec = models.get_model("cnn26k", 10)
    shapes = jax.eval_shape(lambda: models.init_params(spec, jax.random.PRNGKey(0)))
    mask = finetune.trainable_mask(shapes, ["dense2"])
    from trainers import step

    part = dataclasses.replace(spec, trainable=mask, shipped=False)
    # conv1 (not a known layer) is frozen: the ghost path covers the trainable head
    assert step.resolve_grad_impl(part, "auto", (28, 28, 1)) == "ghost"
    with pytest.raises(ValueError, match="bookkeeping"):
        step.StepFunctions(part, 10, "sgd", "bookkeeping")


def test_two_candidates_vectorised_keep_their_frozen_part_bitwise():
    """K = 2 candidates in one vmapped step (the accelerator layout) with a trainable part and a
    parameter average: the frozen leaves of both come out as the start."""
    from trainers import loop
    from trainers.spec import Hyperparams

    p = _pretrained()
    tr = DpSgdTrainer(_DATA, _BASE, model=_Mlp(), init=p, trainable=["Dense_2"])
    hps = [
        Hyperparams(**{**_BASE, "model": tr.model, "epochs": 1, "ema_decay": 0.5,
                       "learning_rate": lr})
        for lr in (0.1, 0.3)
    ]  # fmt: skip
    keys = [np.array([1, 2], np.uint32), np.array([3, 4], np.uint32)]
    results = loop.train_candidates(hps, _DATA, keys, vectorize=True)
    for r in results:
        assert not r.failed, r.error
        _equal({k: r.params[k] for k in ("Dense_0", "Dense_1")},
               {k: p[k] for k in ("Dense_0", "Dense_1")})  # fmt: skip
        assert r.params["Dense_2"]["kernel"].tobytes() != p["Dense_2"]["kernel"].tobytes()
