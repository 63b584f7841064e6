"""A new user's fine-tuning mistakes and usual inputs: each mistake is refused in one line naming
the keyword (a ``dptune.Refused``) before anything runs, and the ways Flax users usually hold
their pretrained weights (flax's ``{"params": ...}`` in any format, ``nn.Partitioned`` boxes, an
``nnx.State`` or the NNX module itself) load as the same start."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx, serialization

import dptune
from dptune.learners.dpsgd import DpSgdTrainer
from tests.trainers.test_finetune import _BASE, _DATA, _equal, _Mlp, _pretrained
from trainers import finetune


def _refused(match: str, fn, *args, **kwargs) -> str:
    """``fn(*args, **kwargs)`` raises a ``dptune.Refused`` of one line matching ``match``."""
    with pytest.raises(dptune.Refused, match=match) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


def test_a_lora_model_without_init_trains_its_adapters_and_its_targets_are_checked():
    """The default ``trainable`` of a ``with_lora`` model is its adapters whether or not
    ``init=`` is given, and a target that adapts no layer is refused when the trainer is built,
    not when a candidate (already charged) meets it."""
    tr = DpSgdTrainer(_DATA, _BASE, epoch_progress=False,
                      model=dptune.with_lora(_Mlp(), rank=2, targets=["Dense_1"]))  # fmt: skip
    mask = tr.model.trainable
    assert mask is not None
    assert [p for p, m in finetune.flat_paths(mask).items() if m] == [
        "lora_Dense_1/a/kernel", "lora_Dense_1/b/kernel",
    ]  # fmt: skip
    # the same candidate seed (the same random start) at two learning rates: the base comes out
    # bitwise the same, the adapters do not
    a, b = (tr({"learning_rate": lr}, np.random.default_rng(0))[1]["params"] for lr in (0.5, 0.1))
    _equal({k: a[k] for k in ("Dense_0", "Dense_1", "Dense_2")},
           {k: b[k] for k in ("Dense_0", "Dense_1", "Dense_2")})  # fmt: skip
    assert a["lora_Dense_1"]["b"]["kernel"].tobytes() != b["lora_Dense_1"]["b"]["kernel"].tobytes()

    class WithNorm(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(10)(nn.LayerNorm()(x.reshape(x.shape[0], -1)))

    for module, target in ((_Mlp(), "Dense_9"), (WithNorm(), "LayerNorm_0")):
        _refused(
            rf"^model=with_lora\(\w+, targets=\['{target}'\]\): target '{target}' matches no "
            "Dense / DenseGeneral / Conv / Embed layer",
            DpSgdTrainer, _DATA, _BASE, model=dptune.with_lora(module, rank=2, targets=[target]),
        )  # fmt: skip


def test_with_lora_refusals_are_one_line_refusals():
    for rank in (0, -1, 1.5):
        _refused(rf"^rank={rank!r}: a LoRA rank is an integer >= 1",
                 dptune.with_lora, _Mlp(), rank=rank, targets=["Dense_0"])  # fmt: skip
    _refused(r"^targets=\[\]", dptune.with_lora, _Mlp(), rank=2, targets=[])

    class Small(nnx.Module):
        def __init__(self, rngs):
            self.l1 = nnx.Linear(4, 3, rngs=rngs)

    _refused(r"^with_lora is for flax.linen modules.*nnx.LoRALinear.*trainable=nnx.LoRAParam",
             dptune.with_lora, Small(nnx.Rngs(0)), rank=2, targets=["l1"])  # fmt: skip
    p = _pretrained()
    _refused(r"^with_lora takes an unbound flax.linen Module",
             dptune.with_lora, _Mlp().bind({"params": p}), rank=2, targets=["Dense_0"])  # fmt: skip


def test_a_mismatching_pytree_init_is_named_not_printed():
    p = _pretrained()
    p["Dense_1"]["kernel"] = p["Dense_1"]["kernel"][:, :5]
    _refused(r"^init=<dict>: parameter 'Dense_1/kernel': the init holds float32\[12, 5\]",
             DpSgdTrainer, _DATA, _BASE, model=_Mlp(), init=p)  # fmt: skip
    for bad in (3, [1, 2], "", None.__class__):
        _refused(r"^init=.*: initial parameters are a params pytree",
                 DpSgdTrainer, _DATA, _BASE, model=_Mlp(), init=bad)  # fmt: skip


@pytest.mark.parametrize("bad", [True, False, 1, 2.5])
def test_a_trainable_that_is_neither_patterns_nor_a_callable_is_refused(bad):
    _refused(rf"^trainable={bad!r}: .*regexes", DpSgdTrainer, _DATA, _BASE, model=_Mlp(),
             trainable=bad)  # fmt: skip


def test_a_trainable_callable_of_the_wrong_signature_is_refused():
    _refused(r"^trainable=<function .*\(path, leaf\) -> bool.*TypeError", DpSgdTrainer, _DATA,
             _BASE, model=_Mlp(), trainable=lambda path: "Dense_1" in path)  # fmt: skip


def test_flax_variables_load_in_every_format(tmp_path):
    """``{"params": ...}`` (what ``module.init`` returns) is read as its params from a pytree, a
    msgpack file and an npz of its flattened paths alike."""
    import flax

    p = _pretrained()
    variables = {"params": p}
    npz = tmp_path / "v.npz"
    np.savez(npz, **flax.traverse_util.flatten_dict(variables, sep="/"))
    msg = tmp_path / "v.msgpack"
    msg.write_bytes(serialization.to_bytes(variables))
    for source in (variables, npz, msg):
        tr = DpSgdTrainer(_DATA, _BASE, epoch_progress=False, model=_Mlp(), init=source)
        assert tr.init_fingerprint == finetune.fingerprint(p), source


class _Boxed(nn.Module):
    """A model whose kernels are partitioning boxes (``nn.with_partitioning`` /
    ``nn.with_logical_partitioning``), as sharded Flax models hold them."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = x.reshape(x.shape[0], -1)
        h = nn.Dense(8, kernel_init=nn.with_partitioning(init, (None, "model")))(x)
        return nn.Dense(10, kernel_init=nn.with_logical_partitioning(init, ("mlp", None)))(
            jnp.tanh(h)
        )


def test_partitioned_params_load_as_their_values_in_every_format(tmp_path):
    """``module.init(...)["params"]`` of a model with ``nn.Partitioned`` boxes, as a pytree, a
    msgpack file (``serialization.to_bytes``) or an orbax folder: the same start as the unboxed
    values, bitwise, and the model trains from it."""
    import orbax.checkpoint as ocp

    boxed = _Boxed().init(jax.random.PRNGKey(3), jnp.zeros((1, 6, 6, 1)))["params"]
    plain = jax.tree_util.tree_map(np.asarray, nn.meta.unbox(boxed))
    msg = tmp_path / "b.msgpack"
    msg.write_bytes(serialization.to_bytes(boxed))
    orb = tmp_path / "orbax"
    with ocp.StandardCheckpointer() as c:
        c.save(orb.absolute(), boxed)
        c.wait_until_finished()
    for source in (boxed, {"params": boxed}, msg, orb):
        tr = DpSgdTrainer(_DATA, _BASE, epoch_progress=False, model=_Boxed(), init=source,
                          trainable=["Dense_1"])  # fmt: skip
        assert tr.init_fingerprint == finetune.fingerprint(plain), source
    _, payload = tr({}, np.random.default_rng(0))
    _equal({"Dense_0": payload["params"]["Dense_0"]}, {"Dense_0": plain["Dense_0"]})


class _Nnx(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.body = nnx.Linear(36, 6, rngs=rngs)
        self.head = nnx.Linear(6, 10, rngs=rngs)

    def __call__(self, x):
        return self.head(jnp.tanh(self.body(x.reshape(x.shape[0], -1))))


def test_an_nnx_state_or_module_is_an_init():
    """``init=nnx.state(base, nnx.Param)`` or ``init=base`` (an NNX module) is the same start
    as ``dptune.NnxModel(base).params()``."""
    base = _Nnx(nnx.Rngs(7))
    want = finetune.fingerprint(dptune.NnxModel(base).params())
    for source in (nnx.state(base, nnx.Param), base):
        tr = DpSgdTrainer(_DATA, _BASE, epoch_progress=False, model=_Nnx(nnx.Rngs(0)),
                          init=source, trainable=nnx.PathContains("head"))  # fmt: skip
        assert tr.init_fingerprint == want


def lora_nowhere(num_classes: int):
    """A ``config.model`` factory: cnn26k with adapters on a layer it does not have."""
    return dptune.shipped_with_lora("cnn26k", num_classes, rank=2, targets=["nope"])


@pytest.mark.parametrize("init", [[], ["--config.init="]], ids=["pretrained", "scratch"])
def test_a_lora_target_that_adapts_nothing_names_config_model_on_the_command_line(
    tmp_path, capsys, init
):
    from dptune.cli.main import cli

    capsys.readouterr()
    code = cli(
        ["dptune", "--config=finetune", f"--workdir={tmp_path / 'w'}", "--noprogress",
         f"--config.ledger.path={tmp_path / 'ledger.sqlite'}", "--dry_run",
         f"--config.model={__name__}:lora_nowhere", *init]
    )  # fmt: skip
    _, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("dptune: refused:")]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert lines[0].startswith("dptune: refused: config.model=with_lora(") and "'nope'" in lines[0]
    assert not (tmp_path / "ledger.sqlite").exists()


def test_load_release_into_another_model_is_refused_in_one_line(tmp_path):
    """``load_release(like=...)`` (``release.load_params``) with the shapes of a model the release
    was not trained with (orbax restored the stored shapes under ``like``'s structure without a
    word), another structure, or a linen Module (no parameters before ``init``) is one refusal."""
    from dptune.release import _save_orbax, load_params

    p = _pretrained()
    _save_orbax(p, tmp_path / "checkpoint")
    shapes = jax.eval_shape(_Mlp().init, jax.random.PRNGKey(0), jnp.zeros((1, 6, 6, 1)))["params"]
    _equal(jax.tree_util.tree_map(np.asarray, load_params(tmp_path, like=shapes)), p)
    wider = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((*a.shape[:-1], 7), a.dtype),
                                   shapes)  # fmt: skip
    _refused(r"^like=: the release's parameter 'Dense_0/bias' is float32\[12\], like= has "
             r"float32\[7\]", load_params, tmp_path, like=wider)  # fmt: skip
    other = {**shapes, "Dense_3": shapes["Dense_2"]}
    _refused(r"^like=: the release's parameters are not shaped like like=",
             load_params, tmp_path, like=other)  # fmt: skip
    _refused(r"^like=_Mlp\(\): a linen Module", load_params, tmp_path, like=_Mlp())


@pytest.mark.parametrize("written", ["['Dense_1', 'Dense_2']", '["Dense_1"]', "('Dense_1',)"])
def test_a_list_written_as_one_string_is_refused_not_read_as_a_character_class(written):
    """``--config.learner.trainable="['dense1','dense2']"`` is one string: as a regex, a character
    class that matches nearly every path, so it trained the whole model without a word."""
    _refused(r"^trainable=.*is one regex, not a list: join the patterns with '\|'",
             DpSgdTrainer, _DATA, _BASE, model=_Mlp(), trainable=written)  # fmt: skip


def test_patterns_joined_by_commas_are_refused_with_the_way_to_join_them():
    _refused(r"^trainable='Dense_1,Dense_2' matches no parameter.*join patterns with '\|'",
             DpSgdTrainer, _DATA, _BASE, model=_Mlp(), trainable="Dense_1,Dense_2")  # fmt: skip


def test_the_score_noise_warning_is_not_prefixed_twice_on_the_command_line(caplog):
    """The command's log handler writes ``dptune: <message>``: a message of its own starting
    ``dptune:`` read ``dptune: dptune: the validation score's noise ...``."""
    small = dptune.Dataset.from_arrays(_DATA.train_x[:100], _DATA.train_y[:100],
                                       num_examples=100, num_classes=10)  # fmt: skip
    with caplog.at_level("WARNING", logger="dptune"):
        DpSgdTrainer(small, _BASE, model=_Mlp())
    (record,) = [r for r in caplog.records if "score units" in r.getMessage()]
    assert record.getMessage().startswith("the validation score's noise is")


def test_lora_params_on_an_nnx_model_without_lora_layers_say_how_to_add_them():
    words = r"^trainable=LoRAParam matches no parameter .*nnx.LoRALinear\(\.\.\., lora_rank=r\)"
    _refused(words, DpSgdTrainer, _DATA, _BASE, model=_Nnx(nnx.Rngs(0)), trainable=nnx.LoRAParam)


class _NnxDrop(_Nnx):
    def __init__(self, rngs: nnx.Rngs):
        super().__init__(rngs)
        self.drop = nnx.Dropout(0.2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.drop(jnp.tanh(self.body(x.reshape(x.shape[0], -1)))))


def test_an_nnx_models_whole_state_is_read_for_its_params_and_rng_keys_are_refused():
    """``nnx.state(base)`` holds the dropout's RNG state besides the parameters: its
    ``nnx.Param`` part is the start; the same as a plain dict, the keys are one refusal (they
    raised NumPy's TypeError)."""
    base = _NnxDrop(nnx.Rngs(7))
    want = finetune.fingerprint(dptune.NnxModel(base).params())
    tr = DpSgdTrainer(_DATA, _BASE, epoch_progress=False, model=_NnxDrop(nnx.Rngs(0)),
                      init=nnx.state(base), trainable=nnx.PathContains("head"))  # fmt: skip
    assert tr.init_fingerprint == want
    _refused(r"^init=<dict>: the value at 'drop/rngs/.*' is not an array of numbers",
             DpSgdTrainer, _DATA, _BASE, model=_NnxDrop(nnx.Rngs(0)),
             init=nnx.to_pure_dict(nnx.state(base)))  # fmt: skip


class _Drop(nn.Module):
    """An MLP with dropout switched by a call keyword (``train`` or ``deterministic``)."""

    @nn.compact
    def __call__(self, x, off: bool):
        h = nn.Dropout(0.5, deterministic=off)(jnp.tanh(nn.Dense(12)(x.reshape(x.shape[0], -1))))
        return nn.Dense(10)(h)


class _DropTrain(_Drop):
    def __call__(self, x, train: bool = False):
        return super().__call__(x, not train)


class _DropDet(_Drop):
    def __call__(self, x, *, deterministic: bool = True):
        return super().__call__(x, deterministic)


@pytest.mark.parametrize(
    "module, keyword", [(_DropTrain(), "train"), (_DropDet(), "deterministic")]
)
def test_with_lora_keeps_the_models_dropout_keyword(module, keyword):
    """A ``with_lora`` model takes its base's ``train`` / ``deterministic`` keyword and passes it
    on, so the adapted model trains with dropout and evaluates without (it took no keyword, so
    dptune trained it without dropout)."""
    from trainers import models

    adapted = dptune.with_lora(module, rank=2, targets=["Dense_1"])
    tr = DpSgdTrainer(_DATA, _BASE, epoch_progress=False, model=adapted)
    assert tr.model.call_keyword == keyword
    x = jnp.asarray(_DATA.test_x[:4])
    p = models.init_params(tr.model, jax.random.PRNGKey(0))
    base = {k: v for k, v in p.items() if not k.startswith("lora_")}
    on, off = (
        {keyword: v} for v in {"train": (True, False), "deterministic": (False, True)}[keyword]
    )
    rngs = {"dropout": jax.random.PRNGKey(1)}
    for kw in (off, {**on, "rngs": rngs}):  # B = 0: the adapted model computes the base's outputs
        want = module.apply({"params": base}, x, **kw)
        np.testing.assert_array_equal(adapted.apply({"params": p}, x, **kw), want)
    dropped = adapted.apply({"params": p}, x, rngs=rngs, **on)
    assert not np.array_equal(dropped, adapted.apply({"params": p}, x, **off))


def test_an_init_with_adapters_of_another_rank_is_refused_before_anything_is_charged(tmp_path):
    """``init=`` holding rank-2 adapters (e.g. a LoRA release) with ``lora_rank`` drawn at 4:
    every candidate at rank 4 failed after the run was charged; now the plan refuses it."""
    from selection.random_stopping import RandomStopping
    from trainers import models

    adapted = dptune.with_lora(_Mlp(), rank=2, targets=["Dense_1"])
    tr = DpSgdTrainer(_DATA, _BASE, epoch_progress=False, model=adapted)
    start = jax.tree_util.tree_map(np.asarray, models.init_params(tr.model, jax.random.PRNGKey(0)))
    tr = DpSgdTrainer(_DATA, _BASE, epoch_progress=False, model=adapted, init=start)
    ledger = tmp_path / "ledger.sqlite"
    space = {"learning_rate": dptune.space.log_uniform(0.3, 1.0),
             "lora_rank": dptune.space.choice(2, 4)}  # fmt: skip
    _refused(r"^lora_rank=4: init= holds adapters of another rank: parameter "
             r"'lora_Dense_1/a/kernel': the init holds float32\[12, 2\], the module expects "
             r"float32\[12, 4\]", dptune.tune, tr, space, RandomStopping.logarithmic(mean=2),
             dptune.Budget(30.0, 1e-5), workdir=tmp_path / "w", ledger=ledger)  # fmt: skip
    assert not ledger.exists()


@pytest.mark.parametrize("wrapped", [False, True], ids=["module", "NnxModel"])
def test_an_nnx_models_own_start_is_named_and_assumed_public(wrapped):
    """An NNX module starts every candidate from its own values (a base the user may have loaded
    pretrained): the statement names them by their fingerprint, the held (frozen) base of
    ``NnxModel(module, trainable=...)`` included, and assumes them public, as for ``init=``."""
    from selection import BestOfK
    from tests.trainers.test_nnx_lora import _data, _Lora

    module = _Lora(4, 6, 2, nnx.Rngs(1))
    kw = (
        dict(model=dptune.NnxModel(module, trainable=nnx.LoRAParam))
        if wrapped
        else dict(model=module, trainable=nnx.LoRAParam)
    )
    tr = DpSgdTrainer(_data((4,)), _BASE, epoch_progress=False, **kw)
    want = finetune.fingerprint(nnx.to_pure_dict(nnx.state(module, nnx.Param)))
    assert tr.init_fingerprint == want
    space = {"learning_rate": dptune.space.log_uniform(0.1, 1.0), "noise_multiplier": "auto"}
    _, st = dptune.plan_privacy(tr, space, BestOfK(2), (4.0, 1e-5))
    assert "public-init" in st.assumptions and any(want in n for n in st.all_notes())
    other = _Lora(4, 6, 2, nnx.Rngs(2))  # other values, other fingerprint
    kw["model"] = dptune.NnxModel(other, trainable=nnx.LoRAParam) if wrapped else other
    assert DpSgdTrainer(_data((4,)), _BASE, **kw).init_fingerprint != want


def test_init_of_a_base_held_by_a_wrapped_nnx_model_says_how_to_load_it():
    from tests.trainers.test_nnx_lora import _Base, _data, _Lora

    wrapped = dptune.NnxModel(_Lora(4, 6, 2, nnx.Rngs(0)), trainable=nnx.LoRAParam)
    _refused(r"^init=<dict>: 'body/bias' is held by dptune.NnxModel\(module, trainable=\.\.\.\) "
             r"at the module's value.*DpSgdTrainer\(\.\.\., model=module, trainable=filter",
             DpSgdTrainer, _data((4,)), _BASE, model=wrapped,
             init=dptune.NnxModel(_Base(4, 6, nnx.Rngs(7))).params())  # fmt: skip


class _BatchNormed(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x):
        x = nn.BatchNorm(use_running_average=False)(x.reshape(x.shape[0], -1))
        return nn.Dense(self.num_classes)(x)


def batchnorm_model(num_classes: int):
    """A ``config.model`` factory whose model dptune refuses (batch statistics)."""
    return _BatchNormed(num_classes)


def test_a_refused_model_names_config_model_on_the_command_line(tmp_path, capsys):
    """The learner's refusal of the model read ``config.learner.model _BatchNormed: ...``
    (no such field); it names ``config.model`` (``config.model=_BatchNormed: ...``)."""
    from dptune.cli.main import cli

    capsys.readouterr()
    code = cli(
        ["dptune", "--config=finetune", f"--workdir={tmp_path / 'w'}", "--noprogress",
         f"--config.ledger.path={tmp_path / 'ledger.sqlite'}", "--dry_run", "--config.init=",
         f"--config.model={__name__}:batchnorm_model"]
    )  # fmt: skip
    _, err = capsys.readouterr()
    lines = [ln for ln in err.splitlines() if ln.startswith("dptune: refused:")]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert lines[0].startswith("dptune: refused: config.model=_BatchNormed: layer 'BatchNorm_0'")
