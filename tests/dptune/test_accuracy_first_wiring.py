"""Accuracy First wired into dptune: the `AccuracyFirst` selection method (registry entry
``accuracy_first``), its theorem `AccuracyFirstPrivacy`, the worst-case charge and the CLI.

* The transform's numbers equal Lemma 2.8's formula evaluated separately (eps_A + prefix eps), and
  its RDP form equals dp_accounting's own composition of T Laplace mechanisms plus eps_A.
* The plan's noise has the scales of IAT (Lap(2 Delta/eps_A), Lap(4 Delta/eps_A)): KS tests.
* The method releases the first candidate whose noisy score passes the noisy target.
* ``dptune account --selection=accuracy_first`` states the worst case, and a dry run of
  the ``dptune`` command calibrates DP-SGD for a total budget that charges the worst case.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from dp_accounting import dp_event
from dp_accounting.rdp import rdp_privacy_accountant
from scipy import stats

import dptune
from dptune import accounting
from selection import registry
from selection.accuracy_first import AccuracyFirst, AccuracyFirstPlan, accuracy_first
from selection.plan import Plan
from selection.privacy import AccuracyFirstPrivacy


def test_transform_equals_lemma_2_8_formula():
    tr = AccuracyFirstPrivacy(0.5, 8)
    for t in range(8):
        assert tr.ex_post(0.1, t) == pytest.approx(0.5 + (t + 1) * 0.1, rel=1e-12)
    assert tr.ex_post(0.1, None) == pytest.approx(0.5 + 8 * 0.1, rel=1e-12)
    assert tr.pure_dp(0.1) == tr.ex_post(0.1, None)  # the charge is the worst case
    nr = AccuracyFirstPrivacy(0.5, 4, "noise_reduction")
    assert nr.pure_dp(2.0) == pytest.approx(2.5, rel=1e-12)  # eps_A + eps_T
    assert nr.ex_post(0.25, 0) == pytest.approx(0.75, rel=1e-12)  # eps_A + eps_t
    with pytest.raises(NotImplementedError, match="pure"):
        nr.rdp([2.0], [0.1])
    with pytest.raises(ValueError, match="iat_epsilon"):
        AccuracyFirstPrivacy(0.0, 4)
    with pytest.raises(ValueError, match="max_trials"):
        AccuracyFirstPrivacy(0.5, 0)


def test_library_result_uses_the_transform():
    r = accuracy_first(
        0.0, 1.0, [0.25, 0.5, 1.0], float, lambda h: -abs(h), -100.0, 1.0, 1.0, rng=3
    )
    assert r.released and r.index == 0  # a target everyone meets: the first level passes
    assert r.ex_post_epsilon == pytest.approx(1.25, rel=1e-12)
    assert r.charged_epsilon == pytest.approx(2.0, rel=1e-12)


def test_rdp_form_equals_dp_accounting_composition():
    orders = [1.5, 2.0, 4.0, 16.0, 64.0]
    lap = dp_event.LaplaceDpEvent(1.0 / 0.3)  # a 0.3-DP Laplace mechanism
    one = rdp_privacy_accountant.RdpAccountant(orders)
    one.compose(lap)
    composed = rdp_privacy_accountant.RdpAccountant(orders)
    composed.compose(dp_event.SelfComposedDpEvent(lap, 6))
    got = AccuracyFirstPrivacy(0.7, 6).rdp(orders, one._rdp)
    np.testing.assert_allclose(got, np.asarray(composed._rdp) + 0.7, rtol=1e-9)


def test_plan_noise_has_iat_scales():
    m = AccuracyFirst(threshold=0.8, score_sensitivity=0.01, iat_epsilon=0.5, max_trials=3)
    plans = [m.plan(np.random.default_rng(s)) for s in range(1500)]
    w = np.array([p.threshold_noise for p in plans])
    nu = np.array([p.query_noise for p in plans]).ravel()
    assert stats.kstest(w, stats.laplace(scale=2 * 0.01 / 0.5).cdf).pvalue > 1e-3
    assert stats.kstest(nu, stats.laplace(scale=4 * 0.01 / 0.5).cdf).pvalue > 1e-3
    # a half-scale (broken) test would be rejected by the same KS test
    assert stats.kstest(nu, stats.laplace(scale=2 * 0.01 / 0.5).cdf).pvalue < 1e-6
    assert "noise" in repr(plans[0]) and str(plans[0].threshold_noise) not in repr(plans[0])
    again = AccuracyFirstPlan.from_dict(json.loads(json.dumps(plans[0].to_dict())))
    assert again == plans[0]


def test_method_releases_first_pass_and_states_ex_post():
    m = registry.build(
        "accuracy_first",
        {"threshold": 0.5, "score_sensitivity": 0.01, "iat_epsilon": 1.0, "max_trials": 4},
    )
    assert isinstance(m, AccuracyFirst)
    plan = AccuracyFirstPlan(4, "accuracy_first", threshold_noise=0.1, query_noise=(0, 0, 0, 0.2))
    assert not m.done(plan, [0.2, 0.55])  # 0.55 < 0.5 + 0.1
    assert m.done(plan, [0.2, 0.55, float("nan"), 0.45])  # T reached
    assert m.select(plan, [0.2, 0.55, float("nan"), 0.45]) == 3  # 0.45 + 0.2 >= 0.6
    assert m.select(plan, [0.7]) == 0
    assert m.ex_post_epsilon(0.2, 3) == pytest.approx(1.0 + 4 * 0.2, rel=1e-12)
    with pytest.raises(TypeError, match="AccuracyFirstPlan"):
        m.select(Plan(4, "accuracy_first"), [0.9])
    scores = [0.1, 0.2, 0.95, 0.99]
    sel = m.run(lambda i, rng: (scores[i], f"model {i}"), rng=0)
    assert sel.released and sel.payload == f"model {sel.index}"
    with pytest.raises(registry.SelectionConfigError, match="score_sensitivity"):
        registry.build("accuracy_first", {"threshold": 0.5, "iat_epsilon": 1.0, "max_trials": 4})


def test_cli_states_the_worst_case_total():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dptune.cli.account",
            "--laplace_epsilon=0.1",
            "--selection=accuracy_first",
            "--iat_epsilon=0.5",
            "--max_trials=8",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    d = json.loads(out.stdout)
    # worst case eps_A + T eps = 1.3 (pure); the RDP route may state a slightly smaller eps at
    # delta > 0, never more
    assert 1.2 < d["total_epsilon"] <= 1.3 + 1e-9
    assert "worst case" in d["theorem"] and d["method"] == "accuracy_first/independent"
    # the same through the library
    st = accounting.total_privacy(
        accounting.EventCandidate(dp_event.LaplaceDpEvent(10.0)),
        AccuracyFirstPrivacy(0.5, 8),
        1e-5,
    )
    assert st.total_epsilon == pytest.approx(d["total_epsilon"], rel=1e-9)
    assert math.isfinite(st.total_epsilon)


def test_dptune_dry_run_calibrates_to_the_worst_case(tmp_path, monkeypatch):
    """``dptune --config=smoke --config.selection.method=accuracy_first ... --dry_run``: the noise
    is calibrated so that the WORST case (eps_A + T x one run, in RDP) meets the total budget."""
    from dptune.cli import build as cli
    from dptune.configs import smoke
    from dptune.data import MNIST_10K_DIR
    from selection.privacy import AccuracyFirstPrivacy as AFP
    from trainers.data import load_dataset

    data = load_dataset(
        "mnist", str(MNIST_10K_DIR), validation_size=1000, source="idx", num_examples=8000
    )
    monkeypatch.setattr(cli, "load_data", lambda cfg: data)
    cfg = cli._plain(smoke.get_config())
    cfg["selection"].update(
        method="accuracy_first",
        threshold=0.9,
        score_sensitivity=1e-3,
        iat_epsilon=0.5,
        max_trials=4,
    )
    cfg["ledger"]["path"] = str(tmp_path / "ledger.sqlite")
    st = cli.run_config(cfg, tmp_path / "run", dry_run=True, progress=False).statement
    assert 3.9 < st.total_epsilon <= 4.0 and st.method == "accuracy_first/independent"
    # recomputed independently: the calibrated candidate through the same theorem
    cand = st.to_dict()["candidates"][0]
    again = accounting.total_privacy(
        accounting.DpSgdCandidate(
            cand["sampling_rate"], cand["steps"], cand["noise_multiplier"], cand["score_noise_std"]
        ),
        AFP(0.5, 4),
        st.delta,
        "rdp",
    )
    assert again.total_epsilon == pytest.approx(st.total_epsilon, rel=1e-6)
    # 4 runs by composition + 0.5 can only be looser than the RDP route used
    assert st.total_epsilon <= 4 * st.single_run_epsilon + 0.5


def test_tune_with_pure_candidates_states_ex_post_next_to_worst_case():
    """``dptune.tune`` with pure-DP classical candidates: the release states the realised ex-post
    loss eps_A + (t + 1) eps (Lemma 2.8) next to the worst case eps_A + T eps that meets the
    budget (and is what a ledger is charged); the ex-post value is one of the T possible ones."""
    from dptune import space
    from dptune.learners import classical

    rng = np.random.default_rng(0)
    x = rng.normal(size=(600, 5))
    y = np.where(x[:, 0] > 0, 1.0, -1.0)
    trainer = classical.logistic_trainer(
        (x[:400], y[:400]), (x[400:], y[400:]), 400, 200, score_noise_multiplier=2.0
    )
    seen = set()
    for seed in range(4):
        method = AccuracyFirst(threshold=0.8, score_sensitivity=1 / 200, iat_epsilon=0.5,
                               max_trials=4)  # fmt: skip
        release = dptune.tune(
            trainer,
            {"regularization": space.log_uniform(1e-2, 1.0), "noise_multiplier": "auto"},
            method,
            (2.5, 1e-5),
            seed=seed,
            progress=False,
            ledger=None,  # four runs on one toy dataset: no budget to protect
        )
        p = release.privacy
        eps = p["single_run_epsilon"]
        assert p["total_epsilon"] == pytest.approx(0.5 + 4 * eps, rel=1e-9)
        assert p["total_epsilon"] <= 2.5 * (1 + 1e-6)
        possible = [0.5 + k * eps for k in range(1, 5)]
        k = int(np.argmin([abs(p["ex_post_epsilon"] - v) for v in possible]))
        assert p["ex_post_epsilon"] == pytest.approx(possible[k], rel=1e-12)
        assert "Realised ex-post privacy loss" in release.privacy_text
        seen.add(k if release.released else -1)
    assert len(seen) >= 2  # the realised loss does vary with where the search stopped
