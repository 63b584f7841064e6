"""Vectorised vs sequential candidates is decided by a short measurement (``trainers.probe``) per
model and device, remembered in the process and in a cache file, and used by the training loop."""

import json

import numpy as np
import pytest

import trainers.loop
from trainers import probe
from trainers.data import make_synthetic
from trainers.spec import CandidateResult, Hyperparams

HP = Hyperparams(batch_size=16, epochs=1, optimizer="sgd")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty memo and a cache file in tmp_path; ``calls`` counts measurements."""
    monkeypatch.setattr(probe, "_memo", {})
    monkeypatch.setattr(probe, "_cache_file", tmp_path / "probe.json")
    return tmp_path / "probe.json"


def _fake_timing(monkeypatch, vmapped_s, sequential_s):
    calls = []

    def fake(*args):
        calls.append(args)
        return vmapped_s, sequential_s

    monkeypatch.setattr(probe, "_time_steps", fake)
    return calls


@pytest.mark.parametrize(
    "vmapped_s, sequential_s, expected",
    [(1.0, 2.0, True), (1.0, 1.05, False), (2.0, 1.0, False)],  # vmap must win by MARGIN
)
def test_the_faster_path_is_chosen(fresh, monkeypatch, vmapped_s, sequential_s, expected):
    _fake_timing(monkeypatch, vmapped_s, sequential_s)
    choice = probe.choose(HP, 10, (28, 28, 1))
    assert choice.vectorize is expected
    assert choice.k == probe.PROBE_K and choice.source == "probe"
    assert choice.speedup == pytest.approx(sequential_s / vmapped_s)


def test_measured_once_then_read_from_the_memo_and_the_file(fresh, monkeypatch):
    calls = _fake_timing(monkeypatch, 1.0, 3.0)
    first = probe.choose(HP, 10, (28, 28, 1))
    assert probe.choose(HP, 10, (28, 28, 1)) is first and len(calls) == 1
    # another process (an empty memo) reads the file instead of measuring
    monkeypatch.setattr(probe, "_memo", {})
    again = probe.choose(HP, 10, (28, 28, 1))
    assert len(calls) == 1 and again.source == "cache" and again.vectorize
    # another structure (optimiser) or a damaged file is measured again
    probe.choose(Hyperparams(batch_size=16, optimizer="adam"), 10, (28, 28, 1))
    assert len(calls) == 2
    assert len(json.loads(fresh.read_text())) == 2
    fresh.write_text("{not json")
    monkeypatch.setattr(probe, "_memo", {})
    assert probe.choose(HP, 10, (28, 28, 1)).source == "probe" and len(calls) == 3


def test_nothing_to_decide_without_two_identical_structures(fresh, monkeypatch):
    calls = _fake_timing(monkeypatch, 1.0, 3.0)
    other = Hyperparams(batch_size=32, epochs=1, optimizer="sgd")
    assert probe.choose_for([HP], 10, (28, 28, 1)) is None
    assert probe.choose_for([HP, other], 10, (28, 28, 1)) is None
    assert not calls
    # the learning rate is not structure: two candidates differing in it can share a step
    assert probe.choose_for([HP, other, Hyperparams(**{**HP.__dict__, "learning_rate": 0.1})],
                            10, (28, 28, 1)).vectorize  # fmt: skip


def test_the_loop_follows_the_probe(fresh, monkeypatch):
    data = make_synthetic(num_train=200, num_test=10, validation_size=50, seed=0)
    groups = []

    def spy(hps, *args, **kw):  # records the grouping; trains nothing
        groups.append(len(hps))
        return [CandidateResult(None, 0.5, [], False) for _ in hps]

    monkeypatch.setattr(trainers.loop, "_train_group", spy)
    keys = [np.array([0, i], np.uint32) for i in (1, 2, 3)]
    _fake_timing(monkeypatch, 2.0, 1.0)  # vmap slower: one after another
    trainers.loop.train_candidates([HP, HP, HP], data, keys)
    assert groups == [1, 1, 1]
    monkeypatch.setattr(probe, "_memo", {})
    fresh.unlink()
    _fake_timing(monkeypatch, 1.0, 2.0)  # vmap faster: one group
    trainers.loop.train_candidates([HP, HP, HP], data, keys)
    assert groups[3:] == [3]


@pytest.mark.slow  # compiles cnn26k's step twice (vmapped and single): 6-16 s on 2 cores
def test_a_real_probe_measures_both_paths(fresh):
    choice = probe.choose(HP, 10, (28, 28, 1))  # cnn26k, a 16-example chunk, on this device
    assert choice.vmapped_s > 0 and choice.sequential_s > 0
    assert choice.device.startswith("cpu")
    assert choice.vectorize == (choice.vmapped_s * probe.MARGIN < choice.sequential_s)
    assert json.loads(fresh.read_text())  # saved for the next run


def test_the_timing_harness_with_a_stand_in_step(fresh, monkeypatch):
    """The probe's layout of K candidates (``Group.stack`` / ``chunk``) and its interleaved timing,
    with a trivial compiled step in place of the model's (the real one: the slow twin above)."""
    import jax

    from trainers import models
    from trainers.step import Group, make_optimizer

    calls = {1: 0, probe.PROBE_K: 0}

    class StandIn:
        spec = models.get_model("cnn26k")
        optimizer = make_optimizer(HP)

        def group(self, k):
            def step(p, o, g, lo, x, y, idx, mask, key, i, clip, sigma, b):
                calls[k] += 1
                assert idx.shape == ((16,) if k == 1 else (k, 16)) and x.shape == (16, 28, 28, 1)
                return p, o, lo

            return Group(k, None, jax.jit(step))

    monkeypatch.setattr(probe, "get_step_functions", lambda *a: StandIn())
    choice = probe.choose(HP, 10, (28, 28, 1))
    assert calls == {1: 1, probe.PROBE_K: 1}  # traced once each: every call reuses the compile
    assert choice.vmapped_s > 0 and choice.sequential_s > 0
