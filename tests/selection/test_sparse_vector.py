"""Generalized sparse vector (Liu & Talwar 2019, §4.1): its bound, an exact computation, an audit.

* The bound's ingredient, "logit(p) of an eps-DP candidate moves by at most 2 eps", checked by
  enumeration over every percentile pair an eps-DP mechanism allows.
* The exact distribution of the released index (numerical integration over the threshold noise),
  on neighbouring streams of worst-case logit shifts: its largest log-ratio stays under the
  AboveThreshold bound 4 eps / beta, and the production ``run`` reproduces that distribution.
* An empirical audit (the machinery of ``test_selection_audit``) of the full release (index and one
  sample of the selected candidate) stays under (4/beta + 1) eps, and catches a broken variant that
  redraws the threshold noise for every candidate (Lyu, Su & Li 2017's classic SVT error).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from selection import PercentileSparseVector, Plan, registry
from selection.privacy import PercentileSparseVectorPrivacy
from selection.sparse_vector import SparseVectorPlan, logit
from tests.selection.test_audit import BINARY_EDGES, audit

EPS = 1.0


def test_logit_sensitivity_is_two_eps_by_enumeration():
    """Every (p, p') with p <= e^eps p' and 1 - p <= e^eps (1 - p') (both directions) has
    |logit p - logit p'| <= 2 eps, and 2 eps is attained (at p' = 1/(1 + e^eps))."""
    grid = np.linspace(1e-6, 1 - 1e-6, 2001)
    p, q = np.meshgrid(grid, grid)
    e = math.exp(EPS)
    ok = (p <= e * q) & (q <= e * p) & (1 - p <= e * (1 - q)) & (1 - q <= e * (1 - p))
    shift = np.abs(np.log(p / (1 - p)) - np.log(q / (1 - q)))
    assert shift[ok].max() <= 2 * EPS + 1e-9
    assert shift[ok].max() >= 2 * EPS - 0.02
    lo = 1 / (1 + e)
    assert logit(1 - lo) - logit(lo) == pytest.approx(2 * EPS, rel=1e-12)


def _laplace_cdf(x, b):
    return np.where(
        x < 0, 0.5 * np.exp(np.minimum(x, 0) / b), 1 - 0.5 * np.exp(-np.maximum(x, 0) / b)
    )


def exact_index_distribution(g, target_logit, beta):
    """P[released index = k] for k < T and P[none], by integrating over rho ~ Lap(beta):
    P[k | rho] = prod_{j<k} F(t + rho - g_j) * (1 - F(t + rho - g_k)), F the Lap(2 beta) CDF."""
    g = np.asarray(g, dtype=float)

    def density(r):
        return math.exp(-abs(r) / beta) / (2 * beta)

    def cond(r):
        fail = _laplace_cdf(target_logit + r - g, 2 * beta)
        before = np.concatenate([[1.0], np.cumprod(fail)[:-1]])
        return np.concatenate([before * (1 - fail), [np.prod(fail)]])

    kinks = sorted({0.0, *(gi - target_logit for gi in g)})
    out = np.zeros(len(g) + 1)
    for k in range(len(g) + 1):
        out[k] = integrate.quad(
            lambda r, k=k: density(r) * cond(r)[k], -60 * beta, 60 * beta, points=kinks, limit=200
        )[0]
    return out


@pytest.mark.parametrize("beta", [1.0, 4.0])
def test_exact_index_distribution_stays_under_the_bound(beta):
    """Worst-case neighbouring streams (each logit shifted by 2 eps, in every sign pattern of a
    3-query stream): max |log P_D[k] / P_D'[k]| <= 4 eps / beta, and not vacuously far below."""
    bound = PercentileSparseVectorPrivacy(beta, 3).index_epsilon(EPS)
    base = np.array([-1.0, 0.0, 0.5])
    worst = 0.0
    for signs in np.ndindex(3, 3, 3):
        shift = 2 * EPS * (np.array(signs) - 1) / 1.0  # -2 eps, 0, +2 eps per query
        pd = exact_index_distribution(base, 0.2, beta)
        pd2 = exact_index_distribution(base + shift, 0.2, beta)
        assert pd.sum() == pytest.approx(1.0, abs=1e-7)
        worst = max(worst, float(np.max(np.abs(np.log(pd) - np.log(pd2)))))
    assert worst <= bound, (worst, bound)
    assert worst >= 0.25 * bound, (worst, bound)


def test_production_run_matches_the_exact_distribution():
    """Released-index frequencies of ``PercentileSparseVector.run`` (4000 runs, fixed seeds) agree
    with the integrated distribution (chi-square)."""
    g = np.array([-1.0, 0.3, 0.8, -0.2])
    p = 1 / (1 + np.exp(-g))
    method = PercentileSparseVector(0.55, 1.0, len(g))
    exact = exact_index_distribution(g, logit(0.55), 1.0)

    def candidate(index, rng):
        return float(p[index]), index

    counts = np.zeros(len(g) + 1)
    for seed in range(4000):
        sel = method.run(candidate, rng=seed)
        counts[sel.payload if sel.released else len(g)] += 1
    assert stats.chisquare(counts, exact * counts.sum()).pvalue > 1e-3


def test_plan_select_done_and_registry():
    method = registry.build(
        "sparse_vector", {"target_percentile": 0.5, "noise_scale": 2.0, "max_trials": 3}
    )
    assert isinstance(method, PercentileSparseVector)
    assert method.privacy.pure_dp(EPS) == pytest.approx(3.0)
    plan = SparseVectorPlan(3, "sparse_vector", threshold_noise=0.0, query_noise=(0.0, 0.0, 0.0))
    assert "noise" not in repr(plan).replace("<private noise>", "")
    assert not method.done(plan, [0.4])
    assert method.done(plan, [0.4, 0.6]) and method.select(plan, [0.4, 0.6]) == 1
    assert method.select(plan, [0.4, float("nan"), 0.2]) is None  # NaN never passes
    assert SparseVectorPlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(TypeError):
        method.select(Plan(3, "sparse_vector"), [0.9])
    with pytest.raises(ValueError):
        PercentileSparseVector(1.0, 1.0, 3)
    with pytest.raises(registry.SelectionConfigError):
        registry.build(
            "sparse_vector", {"target_percentile": 0.5, "noise_scale": 0.0, "max_trials": 3}
        )
    with pytest.raises(NotImplementedError):
        method.privacy.approx_dp(EPS, 1e-6)


# ------------------------------------------------------------------------------------------------
# empirical audit: randomised-response candidates at the worst-case logit shift (+eps on D, -eps
# on D'), so that each candidate is exactly eps-DP and every logit moves by 2 eps.

T_STREAM = 16
BETA = 1.0
TARGET = 1.0 / (1.0 + math.exp(-EPS))  # logit(target) = eps: on D each test is a coin flip
N = 600_000


def _percentiles(dataset: int) -> float:
    return 1 / (1 + math.exp(-EPS)) if dataset == 0 else 1 / (1 + math.exp(EPS))


def _simulate(fresh_threshold: bool):
    def simulate(dataset, rng):
        p = _percentiles(dataset)
        g = logit(p)
        shape = (N, T_STREAM)
        rho = rng.laplace(0, BETA, size=(N, T_STREAM) if fresh_threshold else (N, 1))
        nu = rng.laplace(0, 2 * BETA, size=shape)
        passes = g + nu >= logit(TARGET) + rho
        released = passes.any(axis=1)
        index = np.where(released, passes.argmax(axis=1), -1)
        if not fresh_threshold and dataset == 0:  # the engine's choice = production select
            method = PercentileSparseVector(TARGET, BETA, T_STREAM)
            for r in range(300):
                plan = SparseVectorPlan(T_STREAM, "sparse_vector", float(rho[r, 0]), tuple(nu[r]))
                got = method.select(plan, [p] * T_STREAM)
                assert (got if got is not None else -1) == index[r]
        sample = (rng.random(N) < p).astype(float)  # one eps-DP sample of the selected candidate
        x = np.minimum(np.maximum(index, 0) // 6, 2)  # index buckets 0-5, 6-11, 12-15
        return released, x, sample, None

    return simulate


def test_audit_stays_under_the_bound():
    bound = PercentileSparseVectorPrivacy(BETA, T_STREAM).pure_dp(EPS)
    lower, estimate = audit(_simulate(False), BINARY_EDGES, seed=31)
    assert lower <= bound, (lower, estimate, bound)
    assert estimate > 0.3 * EPS, estimate


def test_audit_catches_fresh_threshold_noise_per_candidate():
    """Redrawing rho for every candidate makes the tests independent: P[no pass in 16] differs by
    about (0.78/0.5)^16 = e^7.1 between D and D', above the claimed (4/beta + 1) eps = 5."""
    claimed = PercentileSparseVectorPrivacy(BETA, T_STREAM).pure_dp(EPS)
    lower, estimate = audit(_simulate(True), BINARY_EDGES, seed=32)
    assert lower > claimed, (lower, estimate, claimed)


def test_cli_states_the_total_for_laplace_candidates():
    """``dptune account --laplace_epsilon=0.5 --selection=sparse_vector`` states
    (4/beta + 1) eps, computed here by hand: (4/8 + 1) * 0.5 = 0.75, delta 0, pure route."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "dptune.cli.account",
            "--laplace_epsilon=0.5",
            "--selection=sparse_vector",
            "--noise_scale=8",
            "--max_trials=20",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    d = json.loads(out.stdout)
    assert d["total_epsilon"] == pytest.approx(0.75, rel=1e-9)
    assert d["delta"] == 0.0 and d["accountant"] == "pure"
    assert "Liu & Talwar 2019, §4.1" in d["theorem"]
    bad = subprocess.run(
        [sys.executable, "-m", "dptune.cli.account", "--laplace_epsilon=0.5", "--steps=3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0 and "--laplace_epsilon" in bad.stderr
