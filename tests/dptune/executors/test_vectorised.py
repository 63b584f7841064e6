"""The vectorised path through the tuner (``VectorizedExecutor`` -> ``trainer.train_many``) with a
failing member in a group: a NaN member, a member that makes the whole group raise, and a real
DP-SGD member whose parameters overflow inside a ``vmap``-ed group.

The rule (DESIGN.md, dptune/executors/): a candidate's failure scores NaN and never aborts the
search nor changes the other candidates' results, which are those of the same candidates trained
one at a time with the same seeds.
"""

import math
import os

import numpy as np
import pytest

import dptune
from dptune import space
from dptune._state.journal import Journal
from dptune.accounting.events import DpSgdCandidate
from dptune.executors import SequentialExecutor, VectorizedExecutor
from dptune.tuner import FunctionTrainer
from selection import BestOfK

N = 10_000
POISON = 7.0  # the learning rate of the failing member
SPACE = dict(learning_rate=space.choice(0.1, 0.3, 1.0, POISON), noise_multiplier=1.5)


class ToyGroupTrainer(FunctionTrainer):
    """Score: -|log(lr / 0.3)| plus the candidate's own seeded noise; ``fail`` says what the
    POISON member does: ``"nan"`` (scores NaN inside the group) or ``"raise"`` (its presence makes
    ``train_many`` raise, like an XLA error, and it raises alone too)."""

    def __init__(self, fail: str):
        self.fail, self.groups, self.singles = fail, [], []
        # the score reads no data: covered by any declaration
        super().__init__(
            self._one, lambda hp: DpSgdCandidate(0.01, 200, 1.5), N, score_kind="covered"
        )

    def _score(self, hp, rng):
        return -abs(math.log(hp["learning_rate"] / 0.3)) + 0.01 * rng.standard_normal()

    def _one(self, hp, rng):
        self.singles.append(hp["learning_rate"])
        if hp["learning_rate"] == POISON:
            if self.fail == "raise":
                raise FloatingPointError("diverged")
            return float("nan"), {"lr": hp["learning_rate"]}
        return self._score(hp, rng), {"lr": hp["learning_rate"]}

    def train_many(self, hparams, rngs):
        self.groups.append([h["learning_rate"] for h in hparams])
        if self.fail == "raise" and any(h["learning_rate"] == POISON for h in hparams):
            raise RuntimeError("XLA: the group's computation failed")
        out = []
        for hp, rng in zip(hparams, rngs, strict=True):
            bad = hp["learning_rate"] == POISON
            out.append((float("nan") if bad else self._score(hp, rng), {"lr": hp["learning_rate"]}))
        return out


def _journal_scores(workdir):
    with Journal(workdir / "private") as j:
        return {
            r.index: (r.hparams["learning_rate"], math.nan if r.failed else r.score)
            for r in j.candidates()
            if r.status == "done"
        }


@pytest.mark.parametrize("fail", ["nan", "raise"])
def test_failing_member_of_a_group_changes_nothing_else(tmp_path, fail):
    seed, k = 3, 8
    runs = {}
    for name, executor in [("vec", VectorizedExecutor(4)), ("seq", SequentialExecutor())]:
        tr = ToyGroupTrainer(fail)
        rel = dptune.tune(
            tr, SPACE, BestOfK(k), (50.0, 1e-5), seed=seed, workdir=tmp_path / name,
            executor=executor, ledger=None,
        )  # fmt: skip
        runs[name] = (tr, rel, _journal_scores(tmp_path / name))
    tr, rel, scores = runs["vec"]
    lrs = [scores[i][0] for i in range(k)]
    # the draw puts the poison member into a group together with healthy members (seed 3)
    poisoned = [g for g in tr.groups if POISON in g]
    assert poisoned and all(len(g) == 4 and len(set(g) - {POISON}) >= 1 for g in poisoned)
    # journaled: NaN for the poison member only, every other score as trained one at a time
    seq_scores = runs["seq"][2]
    for i in range(k):
        if lrs[i] == POISON:
            assert math.isnan(scores[i][1])
        else:
            assert math.isfinite(scores[i][1])
            assert scores[i][1] == seq_scores[i][1]  # same seed, same computation: bit-equal
    if fail == "raise":
        # the group that raised was retried one candidate at a time (same seeds), the others not
        assert sorted(tr.singles) == sorted(x for g in poisoned for x in g)
    else:
        assert tr.singles == []
    # the release: the best finite candidate, the same as the sequential run's
    seq_rel = runs["seq"][1]
    assert rel.released and rel.hparams == seq_rel.hparams
    assert rel.hparams["learning_rate"] != POISON
    assert rel.validation_score == seq_rel.validation_score
    best = max((s for _, s in scores.values() if math.isfinite(s)))
    assert rel.validation_score == best


@pytest.mark.slow  # ~15 s of DP-SGD; fast twin: test_failing_member_of_a_group_changes_nothing_else
def test_dpsgd_vmapped_group_with_an_overflowing_member(tmp_path, monkeypatch):
    """DP-SGD through the tuner with the group really ``vmap``-ed (forced; on CPU the trainer
    would train a group's members one after another): a member whose noise overflows float32
    (clip_norm 1e30 with learning rate 1e30: update ~ 1e60 -> inf -> NaN) scores NaN, the run
    goes on, and a healthy member's score equals its one-at-a-time training with the same seed."""
    import trainers.loop
    from trainers.data import make_synthetic

    real = trainers.loop.train_candidates
    vmapped: list[int] = []

    def forced(hps, data, keys, **kw):
        vmapped.append(len(hps))
        return real(hps, data, keys, **{**kw, "vectorize": True})

    monkeypatch.setattr(trainers.loop, "train_candidates", forced)
    data = make_synthetic(num_train=400, num_test=50, validation_size=100, seed=0)
    sp = dict(
        learning_rate=space.choice(0.5, 1e30), clip_norm=space.choice(1.0, 1e30),
        noise_multiplier=2.0,
    )  # fmt: skip
    tr = dptune.DpSgdTrainer(
        data, dict(batch_size=64, epochs=1, optimizer="sgd"), epoch_progress=False,
        test_curve=False,
    )  # fmt: skip
    rel = dptune.tune(
        tr, sp, BestOfK(3), (50.0, 1e-5), seed=5, workdir=tmp_path, accountant="rdp",
        executor=VectorizedExecutor(3), progress=False, ledger=None,
    )  # fmt: skip
    assert vmapped == [3]  # one vmapped group of three
    with Journal(tmp_path / "private") as j:
        rows = [(r.seed, r.hparams, r.failed, r.score) for r in j.candidates()]
    overflow = [hp["learning_rate"] == 1e30 and hp["clip_norm"] == 1e30 for _, hp, _, _ in rows]
    assert any(overflow) and not all(overflow)  # seed 5 draws a mixed group
    assert [failed for _, _, failed, _ in rows] == overflow  # exactly the overflowing ones failed
    assert all(math.isfinite(score) for _, _, failed, score in rows if not failed)
    # the release: a healthy candidate with its finite score
    assert rel.released and rel.hparams != rows[overflow.index(True)][1]
    assert np.isfinite(rel.validation_score)
    if os.environ.get("DPTUNE_SLOW_TESTS"):  # a second compile (the single step): ~2x the time
        # a healthy member alone (not vmapped: one candidate) with its seed: the same score up
        # to float rounding between the vmapped and the single step, which may move a few of
        # the 100 validation predictions (score = noisy accuracy: 1/100 per example)
        seed, hp, _, score = rows[overflow.index(False)]
        alone, _ = tr(hp, np.random.default_rng(seed))
        assert vmapped == [3] and alone == pytest.approx(score, abs=0.03)
