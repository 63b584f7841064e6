"""Subsampled tuning (strategy ``subsampled``) of a fine-tuning run: the subset's trainer keeps the
public start, the trainable part and the LoRA model, both phases' frozen parameters come out
bitwise as the start, and the one statement names the public start and both phases' public
sizes."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax
import numpy as np

import dptune
from dptune.accounting.events import DpSgdCandidate
from dptune.learners.dpsgd import DpSgdTrainer
from dptune.subsampled import plan_subsampled
from selection.random_stopping import RandomStopping
from tests.trainers.test_finetune import _BASE, _DATA, _equal, _Mlp, _pretrained
from trainers import finetune, models

KEY = b"k" * 32
METHOD = RandomStopping.logarithmic(2)


def test_the_subset_trainer_keeps_the_start_the_trainable_part_and_the_statement():
    p = _pretrained()
    tr = DpSgdTrainer(
        _DATA, _BASE, epoch_progress=False, model=_Mlp(), init=p, trainable=["Dense_1"]
    )
    sub = tr.subset(0.5, KEY)
    assert sub.init_fingerprint == tr.init_fingerprint == finetune.fingerprint(p)
    _equal(jax.tree_util.tree_map(np.asarray, dict(sub.model.init)), finetune.flat_paths(p))
    assert finetune.flat_paths(sub.model.trainable) == finetune.flat_paths(tr.model.trainable)
    # a subset candidate starts from the public start and trains Dense_1 only
    _, payload = sub({"learning_rate": 0.5}, np.random.default_rng(0))
    out = payload["params"]
    _equal({k: out[k] for k in ("Dense_0", "Dense_2")}, {k: p[k] for k in ("Dense_0", "Dense_2")})
    assert out["Dense_1"]["kernel"].tobytes() != p["Dense_1"]["kernel"].tobytes()
    sp = dict(learning_rate=dptune.space.log_uniform(0.1, 1.0), noise_multiplier="auto")
    plan = plan_subsampled(
        tr, sp, METHOD, (8.0, 1e-5), fraction=0.5, tuning_epsilon=3.0, subset_trainer=sub
    )
    st = plan.statement
    assert "public-init" in st.assumptions
    assert any(finetune.fingerprint(p) in n for n in st.all_notes())
    # both phases' sampling rates are stated with their own public sizes
    n, n_sub = tr.num_examples, sub.num_examples
    assert n_sub == round(0.5 * n) != n
    checked = "\n".join(st.checked)
    assert f"q = batch_size / {n} (the public size)" in checked
    assert "(on the subset of rate 0.5): DP-SGD" in checked
    assert f"q = batch_size / {n_sub} (the public size)" in checked


def test_lora_fine_tuning_subsampled_end_to_end(tmp_path):
    """The LoRA model and its rank (a privacy-irrelevant field) through both phases: the tuning
    phase's and the final release's base parameters are the start, bitwise."""
    p = _pretrained()
    model = dptune.with_lora(_Mlp(), rank=2, targets=["Dense_1", "Dense_2"])
    tr = DpSgdTrainer(_DATA, {**_BASE, "epochs": 1}, epoch_progress=False, model=model, init=p)
    sp = dict(
        lora_rank=dptune.space.choice(1, 3), learning_rate=dptune.space.log_uniform(0.1, 1.0),
        noise_multiplier="auto",
    )  # fmt: skip
    rel = dptune.tune_subsampled(
        tr, sp, METHOD, (30.0, 1e-5), fraction=0.5, tuning_epsilon=10.0, seed=3,
        workdir=tmp_path / "w", progress=False,
    )  # fmt: skip
    assert rel.released and "public-init" in rel.privacy["assumptions"]
    assert finetune.fingerprint(p) in rel.privacy_text
    rank = rel.hparams["lora_rank"]
    for folder in (tmp_path / "w", tmp_path / "w" / "private" / "tuning"):
        got = dptune.load_release(folder).payload["params"]
        _equal({k: got[k] for k in p}, p)  # the base, bitwise
        assert got["lora_Dense_1"]["a"]["kernel"].shape == (12, rank)
        assert np.any(np.asarray(got["lora_Dense_1"]["b"]["kernel"]) != 0)  # adapters trained


@dataclass
class _DroppingStart:
    """A user trainer on a public start whose subset hook forgets to say so."""

    n: int = 10_000
    init_fingerprint: str | None = "sha256:start"
    num_examples: int = 10_000
    calibrated_field: str = "noise_multiplier"
    score_kind: str = "covered"
    calls: list = field(default_factory=list)

    def privacy(self, hp):
        return DpSgdCandidate(0.01, 200, hp["noise_multiplier"], None)

    def __call__(self, hp, rng):
        return 0.0, None

    def subset(self, fraction, key):
        return _DroppingStart(round(fraction * self.n), None, round(fraction * self.n))


def test_the_final_runs_public_start_is_assumed_whatever_the_subset_says():
    sp = dict(learning_rate=dptune.space.log_uniform(0.1, 1.0), noise_multiplier="auto")
    plan = plan_subsampled(_DroppingStart(), sp, METHOD, (4.0, 1e-5), fraction=0.2,
                           tuning_epsilon=1.0)  # fmt: skip
    assert "public-init" in plan.statement.assumptions


def test_the_shipped_finetune_model_keeps_its_start_on_the_subset():
    """The shipped `finetune` config's model (cnn26k, 5 classes) on the public start, last layer
    trainable: the subset's model spec is the full trainer's (no rebuild, no fresh init)."""
    from dptune.configs import finetune as F
    from trainers.data import make_synthetic

    data = make_synthetic(num_train=200, num_test=10, validation_size=40, num_classes=5)
    tr = DpSgdTrainer(data, dict(_BASE, model="cnn26k"), epoch_progress=False,
                      init=str(F.PRETRAINED), trainable=["dense2"])  # fmt: skip
    sub = tr.subset(0.3, KEY)
    assert isinstance(sub.model, models.ModelSpec) and sub.model is tr.model
    assert sub.init_fingerprint == finetune.fingerprint(finetune.read_init(F.PRETRAINED))
