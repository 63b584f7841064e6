"""Tests of the selection methods: plans, the total order, select/done semantics, the run loop
(batches, map_fn, seeds), hidden private parts, and the random-stopping utility identity."""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import selection
from selection import (
    BestOfK,
    NonPrivateBest,
    Plan,
    RandomStopping,
    Thresholding,
    best_index,
)
from selection import privacy as sp


def normal_candidate(index: int, rng: np.random.Generator) -> tuple[float, dict]:
    return float(rng.normal()), {"index": index, "draw": float(rng.random())}


# ------------------------------------------------------------------------------------------------
# total order


def test_total_order_score_then_lower_index_nan_last():
    assert best_index([1.0, 3.0, 3.0, 2.0]) == 1  # tie -> lower index
    assert best_index([math.nan, -math.inf, math.nan]) == 1  # NaN ranks below -inf
    assert best_index([math.nan, math.nan]) == 0
    assert best_index([0.5]) == 0
    with pytest.raises(ValueError):
        best_index([])


# ------------------------------------------------------------------------------------------------
# random stopping


def test_random_stopping_plan_uses_the_count_sampler():
    method = RandomStopping.logarithmic(10)
    ks = [method.plan(np.random.default_rng(s)).num_trials for s in range(50)]
    expected = [int(method.count.sample(np.random.default_rng(s))) for s in range(50)]
    assert ks == expected and min(ks) >= 1
    capped = RandomStopping.geometric(50, max_trials=7)
    assert max(capped.plan(np.random.default_rng(s)).num_trials for s in range(200)) == 7


def test_random_stopping_select_and_done():
    method = RandomStopping.geometric(3)
    plan = Plan(num_trials=3, method="random_stopping")
    assert not method.done(plan, [0.1, 0.2])
    with pytest.raises(ValueError, match="all planned scores"):
        method.select(plan, [0.1, 0.2])
    assert method.done(plan, [0.1, 0.9, 0.2])
    assert method.select(plan, [0.1, 0.9, 0.2]) == 1
    assert method.select(plan, [0.1, 0.2, 0.3, 5.0]) == 2  # scores beyond K are ignored
    assert RandomStopping.poisson(2).select(Plan(0, "random_stopping"), []) is None  # K = 0


def test_poisson_k_zero_releases_nothing():
    method = RandomStopping.poisson(1.0)
    results = [method.run(normal_candidate, rng=s) for s in range(60)]
    empty = [r for r in results if not r.released]
    assert empty and all(r.private.num_trials == 0 and r.payload is None for r in empty)
    assert any(r.released for r in results)


def test_run_is_independent_of_batching_and_map_fn():
    method = RandomStopping.geometric(6)
    base = method.run(normal_candidate, rng=123)
    with ThreadPoolExecutor(3) as pool:
        batched = method.run(normal_candidate, rng=123, batch_size=4, map_fn=pool.map)
    assert batched == base
    assert batched.private.scores == base.private.scores
    assert base.score == max(base.private.scores)
    assert base.payload["index"] == base.index


def test_default_randomness_comes_from_os_entropy(monkeypatch):
    calls = []
    original = np.random.default_rng

    def spy(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(selection.method.np.random, "default_rng", spy)
    RandomStopping.geometric(2).run(normal_candidate)
    assert calls and calls[0] == ()  # no seed: fresh OS entropy
    calls.clear()
    RandomStopping.geometric(2).run(normal_candidate, rng=5)
    assert calls[0] == (5,)


def test_capped_random_stopping_needs_geometric_counts():
    with pytest.raises(ValueError, match="geometric"):
        RandomStopping(selection.logarithmic(10), max_trials=20)
    with pytest.raises(ValueError, match="max_trials"):
        RandomStopping.geometric(10, max_trials=0)
    with pytest.raises(TypeError, match="count"):
        RandomStopping(10)
    capped = RandomStopping.geometric(10, max_trials=30)
    assert isinstance(capped.privacy, sp.HardCappedRandomStoppingPrivacy)
    assert capped.expected_trials == pytest.approx((1 - 0.9**30) / 0.1, rel=1e-12)


@pytest.mark.parametrize(
    "method,transform",
    [
        (RandomStopping.geometric(10), sp.RandomStoppingPrivacy),
        (RandomStopping.logarithmic(10), sp.RandomStoppingPrivacy),
        (RandomStopping.truncated_negative_binomial(10, -0.5), sp.RandomStoppingPrivacy),
        (RandomStopping.poisson(10), sp.PoissonStoppingPrivacy),
        (Thresholding(0.5, 0.1), sp.ThresholdingPrivacy),
        (BestOfK(4), sp.BestOfKPrivacy),
        (NonPrivateBest(), sp.NotPrivate),
    ],
)
def test_each_method_names_its_theorem(method, transform):
    assert isinstance(method.privacy, transform)
    assert method.privacy.is_private == (not isinstance(method, NonPrivateBest))
    json.dumps(method.privacy.describe(), allow_nan=False)


def test_random_stopping_privacy_multiples():
    assert RandomStopping.geometric(10).privacy.pure_dp(1.0) == 3.0  # LT Thm 3.2
    assert RandomStopping.logarithmic(10).privacy.pure_dp(1.0) == 2.0  # PS Cor. 3, eta = 0
    assert RandomStopping.logarithmic(10).privacy.mean == pytest.approx(10.0, rel=1e-12)


# ------------------------------------------------------------------------------------------------
# thresholding


def test_thresholding_plan_is_the_geometric_stopping_time():
    method = Thresholding(0.0, 0.2)
    plans = [method.plan(np.random.default_rng(s)).num_trials for s in range(40)]
    assert plans == [int(np.random.default_rng(s).geometric(0.2)) for s in range(40)]
    capped = Thresholding(0.0, 0.2, max_trials=3)
    assert max(capped.plan(np.random.default_rng(s)).num_trials for s in range(100)) == 3


def test_thresholding_select_uses_the_prefix_only():
    method = Thresholding(1.0, 0.5)
    plan = Plan(num_trials=4, method="thresholding")
    assert not method.done(plan, [0.1, math.nan])
    with pytest.raises(ValueError, match="not done"):
        method.select(plan, [0.1])
    assert method.done(plan, [0.1, 1.0])
    assert method.select(plan, [0.1, 1.0, 9.0]) == 1  # first hit, later (speculative) ignored
    assert method.select(plan, [0.1, 0.2, 0.3, 0.4]) is None  # coins stopped it
    assert method.select(plan, [0.1, 0.2, 0.3, 0.4, 5.0]) is None  # hit after the stop ignored
    assert method.select(plan, [math.nan, math.nan, math.nan, math.nan]) is None


def test_speculative_batches_keep_sequential_semantics():
    method = Thresholding(1.0, 0.1)
    for seed in range(30):
        sequential = method.run(normal_candidate, rng=seed)
        with ThreadPoolExecutor(4) as pool:
            spec = method.run(normal_candidate, rng=seed, batch_size=8, map_fn=pool.map)
        assert spec == sequential
        assert spec.private.num_evaluated >= sequential.private.num_evaluated
        if sequential.released:
            assert sequential.score >= 1.0
            assert all(s < 1.0 for s in sequential.private.scores[: sequential.index])


def test_thresholding_rejects_a_cap_the_theorem_does_not_cover():
    with pytest.raises(ValueError, match="max_trials"):
        Thresholding(0.5, 0.1, max_trials=3)
    with pytest.raises(ValueError, match="threshold"):
        Thresholding(math.nan, 0.1)
    assert Thresholding(0.5, 0.1, max_trials=50).privacy.pure_dp(1.0) == pytest.approx(
        2.0 + 2 * math.exp(-5.0)
    )


# ------------------------------------------------------------------------------------------------
# baselines, plans, what is hidden


def test_baselines():
    assert BestOfK(3).run(normal_candidate, rng=0).private.num_evaluated == 3
    assert BestOfK(3).privacy.pure_dp(0.5) == 1.5
    assert NonPrivateBest().k == 10 and NonPrivateBest.is_private is False
    assert math.isinf(NonPrivateBest(4).privacy.pure_dp(0.5))
    with pytest.raises(ValueError, match="k must be"):
        BestOfK(0)


def test_plan_round_trip_and_method_check():
    plan = RandomStopping.geometric(5).plan(7)
    again = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan
    with pytest.raises(ValueError, match="drawn by"):
        Thresholding(0.0, 0.5).done(plan, [])
    with pytest.raises(ValueError, match="num_trials"):
        Plan.from_dict({"method": "x"})
    with pytest.raises(ValueError, match="unknown"):
        Plan.from_dict({"num_trials": 1, "extra": 2})
    with pytest.raises(ValueError):
        Plan(num_trials=-1)


def test_private_parts_are_hidden_from_repr_and_str():
    result = RandomStopping.geometric(8).run(normal_candidate, rng=3)
    plan = RandomStopping.geometric(8).plan(3)
    text = repr(result) + str(result) + repr(plan) + repr(result.private) + str(result.private)
    assert "private" in repr(result.private)
    assert f"num_trials={plan.num_trials}" not in text
    for s in result.private.scores:
        if s != result.score:
            assert repr(s) not in text
    assert "index=" not in repr(result)  # the position reveals K >= index + 1


def test_bad_inputs_to_run():
    with pytest.raises(ValueError, match="batch_size"):
        BestOfK(2).run(normal_candidate, rng=0, batch_size=0)
    with pytest.raises(TypeError, match="score, payload"):
        BestOfK(2).run(lambda i, rng: 1.0, rng=0)
    with pytest.raises(TypeError, match="rng"):
        BestOfK(2).run(normal_candidate, rng="seed")


# ------------------------------------------------------------------------------------------------
# utility (Liu & Talwar 2019, Sec. 3.2; closed form derived in the notes)


@pytest.mark.parametrize("gamma,p", [(0.1, 0.1), (0.05, 0.02), (0.2, 0.3), (0.5, 0.05)])
def test_random_stopping_utility_closed_form(gamma, p):
    """P[released score < (1-p)-quantile of one candidate] = gamma(1-p)/(gamma + p - gamma p)
    for geometric K: scores U(0, 1), so the quantile is 1 - p; K from the production sampler."""
    n = 200_000
    rng = np.random.default_rng(2024)
    method = RandomStopping.geometric(1 / gamma)
    k = np.asarray(method.count.sample(rng, n))
    run_of = np.repeat(np.arange(n), k)
    scores = rng.random(run_of.size)
    best = np.full(n, -np.inf)
    np.maximum.at(best, run_of, scores)
    miss = float(np.mean(best < 1 - p))
    closed = gamma * (1 - p) / (gamma + p - gamma * p)
    assert abs(miss - closed) < 5 * math.sqrt(closed * (1 - closed) / n)
    assert closed <= gamma / p + 1e-15  # Liu & Talwar Thm 3.3's form of the bound


def test_utility_through_the_run_loop():
    """Same identity through ``RandomStopping.run`` (3000 runs; gamma = p = 0.1, P = 0.4737)."""
    method = RandomStopping.geometric(10)

    def uniform(index, rng):
        return float(rng.random()), None

    miss = np.mean([method.run(uniform, rng=s).score < 0.9 for s in range(3000)])
    closed = 0.1 * 0.9 / (0.1 + 0.1 - 0.01)
    assert abs(miss - closed) < 5 * math.sqrt(closed * (1 - closed) / 3000)


def test_a_failed_candidate_is_never_released_as_a_success():
    """Every candidate failing (NaN scores) releases nothing through ``run`` (it released
    ``score=nan`` with the failed payload as a success)."""
    sel = RandomStopping.logarithmic(3).run(lambda i, rng: (math.nan, "failed"), rng=0)
    assert not sel.released and sel.payload is None and sel.score is None


@pytest.mark.parametrize("gamma", [0.0, 1.5, -0.1])
def test_thresholding_names_its_stop_probability_keyword(gamma):
    """The privacy class words its check in the theorem's gamma; the method's caller passed
    ``stop_probability=`` (the command's ``--config.selection.stop_probability``)."""
    with pytest.raises(ValueError, match=r"^stop_probability must be in \(0, 1\]"):
        Thresholding(0.5, gamma)
    from selection.registry import options_as

    text = options_as("--config.selection.", "stop_probability must be in (0, 1]")
    assert text.startswith("--config.selection.stop_probability must")
