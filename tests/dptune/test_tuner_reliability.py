"""Paths through dptune.tune that a normal run does not take: nothing released (thresholding that
never hits, a Poisson count of 0), every candidate failed, and the widths of the secret seeds.

A toy trainer (no JAX) keeps these fast; the DP-SGD paths are in test_reliability_vectorised.py and
test_reliability_cli.py.
"""

import json
import logging
import math

import numpy as np
import pytest

import dptune
from dptune import space
from dptune._state.journal import Journal
from dptune.accounting.events import DpSgdCandidate
from dptune.tuner import FunctionTrainer
from selection import BestOfK, RandomStopping, Thresholding

N = 10_000
SPACE = dict(learning_rate=space.log_uniform(0.01, 10.0), noise_multiplier=1.5)


class Toy:
    """Score in (-inf, 0], peak at lr = 0.3; records every call and the rng it got."""

    def __init__(self, fail=False):
        self.calls, self.rngs, self.fail = [], [], fail

    def __call__(self, hp, rng):
        self.calls.append(dict(hp))
        self.rngs.append(rng)
        if self.fail == "raise":
            raise FloatingPointError("diverged")
        if self.fail == "nan":
            return float("nan"), {"lr": hp["learning_rate"]}
        return -abs(math.log(hp["learning_rate"] / 0.3)), {"lr": hp["learning_rate"]}


def trainer(toy):
    return FunctionTrainer(
        toy,
        lambda hp: DpSgdCandidate(0.01, 200, hp["noise_multiplier"]),
        N,
        score_kind="covered",
    )


def release_files(workdir):
    return sorted(p.name for p in (workdir / "release").iterdir())


def test_thresholding_that_never_hits_releases_nothing(tmp_path, capsys):
    toy = Toy()
    sel = Thresholding(threshold=1.0, stop_probability=0.2)  # every toy score is <= 0
    rel = dptune.tune(trainer(toy), SPACE, sel, (20.0, 1e-5), ledger=None, seed=4, workdir=tmp_path)
    assert not rel.released and rel.hparams is None and rel.validation_score is None
    # it tried every planned candidate (the coin flips' stopping time), then gave up
    assert len(toy.calls) == rel.private.num_trials >= 2
    assert json.loads((tmp_path / "release" / "result.json").read_text()) == {
        "released": False,
        "reason": "none_selected",
    }
    # the statement is released (it is what the user may publish) but no model, no curve
    assert release_files(tmp_path) == [
        "epsilon.png",
        "privacy.json",
        "privacy.txt",
        "report.md",
        "result.json",
    ]
    assert (
        "Liu & Talwar" in json.loads((tmp_path / "release" / "privacy.json").read_text())["theorem"]
    )
    assert str(rel).startswith("Nothing released")
    # a rerun reads the finished release back and trains nothing
    again = dptune.tune(
        trainer(toy), SPACE, sel, (20.0, 1e-5), ledger=None, seed=4, workdir=tmp_path
    )
    assert not again.released and len(toy.calls) == rel.private.num_trials
    assert "score" not in capsys.readouterr().out


def test_poisson_count_zero_trains_nothing_and_releases_nothing(tmp_path):
    """A Poisson number of candidates is 0 with probability exp(-mean): a legitimate outcome."""
    sel = RandomStopping.poisson(1.0)
    for seed in range(40):  # P(K = 0) = e^-1 per seed: some seed below 40 draws K = 0
        toy = Toy()
        rel = dptune.tune(trainer(toy), SPACE, sel, (20.0, 1e-5), ledger=None, seed=seed)
        if rel.private.num_trials == 0:
            break
    else:
        pytest.fail("no seed in 0..39 drew K = 0")
    assert toy.calls == [] and not rel.released
    work = tmp_path / "run"
    rel = dptune.tune(
        trainer(Toy()), SPACE, sel, (20.0, 1e-5), ledger=None, seed=seed, workdir=work
    )
    assert not rel.released
    assert json.loads((work / "release" / "result.json").read_text()) == {
        "released": False,
        "reason": "none_selected",
    }
    assert "payload.pkl" not in release_files(work) and "checkpoint" not in release_files(work)
    privacy = json.loads((work / "release" / "privacy.json").read_text())
    # The Poisson count's statement: PS Thm 6 or the (tighter, when it is) profile route for it.
    assert "Poisson" in privacy["theorem"] and privacy["total_epsilon"] <= 20.0


def test_failures_are_not_counted_on_the_console(tmp_path, caplog):
    """A failed candidate is journaled, not logged at INFO or above: a line per failure on the
    console (whose log may be shared) would count the candidates, K when all of them fail."""
    with caplog.at_level(logging.INFO, logger="dptune"):
        rel = dptune.tune(
            trainer(Toy(fail="raise")), SPACE, RandomStopping.logarithmic(4), (20.0, 1e-5),
            ledger=None, seed=9, workdir=tmp_path / "rs",
        )  # fmt: skip
    assert rel.private.num_trials >= 2 and rel.outcome == "no_candidate_succeeded"
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.text


@pytest.mark.parametrize("how", ["raise", "nan"])
def test_every_candidate_failed(tmp_path, how):
    """Random stopping whose K candidates all fail: the search finishes (failures never abort it),
    the selection picks a failure (the lowest index among equal failure scores), so no model is
    released and the release says no candidate succeeded; every failure's reason is journaled.
    Thresholding releases nothing (a failure never passes its threshold)."""
    toy = Toy(fail=how)
    rel = dptune.tune(
        trainer(toy), SPACE, RandomStopping.logarithmic(4), (20.0, 1e-5), ledger=None, seed=9,
        workdir=tmp_path / "rs",
    )  # fmt: skip
    k = rel.private.num_trials
    assert k >= 2 and len(toy.calls) == k
    assert all(math.isnan(s) for s in rel.private.scores)
    assert not rel.released and rel.hparams is None and rel.outcome == "no_candidate_succeeded"
    result = json.loads((tmp_path / "rs" / "release" / "result.json").read_text())
    assert result == {"released": False, "reason": "no_candidate_succeeded"}
    assert "no candidate succeeded" in (tmp_path / "rs" / "release" / "report.md").read_text()
    assert "checkpoint" not in release_files(tmp_path / "rs")
    with Journal(tmp_path / "rs" / "private") as j:
        assert all(r.failed and r.status == "done" for r in j.candidates())
        failures = j.failures()
    assert sorted(failures) == list(range(k))
    if how == "raise":
        assert {f.type for f in failures.values()} == {"FloatingPointError"}
        assert all(
            "diverged" in f.message and "Traceback" in f.traceback for f in failures.values()
        )
    else:
        assert {f.type for f in failures.values()} == {"NonFiniteScore"}
    toy = Toy(fail=how)
    sel = Thresholding(threshold=-100.0, stop_probability=0.3)  # any finite toy score would hit
    rel = dptune.tune(
        trainer(toy), SPACE, sel, (20.0, 1e-5), ledger=None, seed=7, workdir=tmp_path / "th"
    )
    assert not rel.released and len(toy.calls) == rel.private.num_trials
    assert json.loads((tmp_path / "th" / "release" / "result.json").read_text()) == {
        "released": False,
        "reason": "none_selected",
    }


# --- widths of the secret randomness --------------------------------------------------------------


def test_candidate_seeds_are_128_bit_and_reach_the_trainer_whole(tmp_path):
    toy = Toy()
    sel = BestOfK(12)  # a fixed number of candidates
    rel = dptune.tune(
        trainer(toy), SPACE, sel, (50.0, 1e-5), ledger=None, seed=11, workdir=tmp_path
    )
    with Journal(tmp_path / "private") as j:
        seeds = [r.seed for r in j.candidates()]
    k = rel.private.num_trials
    assert k == 12 and len(set(seeds)) == k
    assert all(0 <= s < 2**128 for s in seeds)
    # 128 random bits: every seed's top 32 bits are nonzero with probability 1 - k * 2^-32 (a
    # 32- or 64-bit seed would fail this), and the bits are balanced
    assert all(s >= 2**96 for s in seeds)
    bits = np.array([[(s >> b) & 1 for b in range(128)] for s in seeds])
    assert 0.35 < bits.mean() < 0.65
    # the trainer's numpy Generator is seeded with the whole 128-bit seed
    assert [r.bit_generator.seed_seq.entropy for r in toy.rngs] == seeds


def test_dpsgd_noise_keys_are_64_bit_functions_of_the_whole_seed(monkeypatch):
    """DpSgdTrainer turns the candidate's 128-bit seed into a 64-bit threefry key (both words
    random) for trainers.loop; seeds differing only in their top bits give different keys."""
    import trainers.loop
    from trainers.data import make_synthetic
    from trainers.spec import CandidateResult

    keys = []

    def capture(hps, data, ks, **kw):
        keys.extend(np.asarray(k) for k in ks)
        return [CandidateResult({}, 0.5, [], False) for _ in hps]

    monkeypatch.setattr(trainers.loop, "train_candidates", capture)
    tr = dptune.DpSgdTrainer(make_synthetic(600, 10, 100), epoch_progress=False, test_curve=False)
    tr.test_curve = False
    base = 0x1234_5678_9ABC_DEF0_0FED_CBA9_8765_4321
    seeds = [base + (i << 100) for i in range(16)]  # same low 100 bits
    for s in seeds:
        tr.train_many([dict(batch_size=64, epochs=1)], [np.random.default_rng(s)])
    assert all(k.dtype == np.uint32 and k.shape == (2,) for k in keys)
    assert len({k.tobytes() for k in keys}) == len(seeds)
    words = np.stack(keys).astype(np.uint64)
    assert words[:, 0].max() >= 2**31 and words[:, 1].max() >= 2**31  # both words carry bits
    assert len(set(words[:, 0])) == len(seeds) and len(set(words[:, 1])) == len(seeds)
