"""PrivacyStatement: every input, notes for seeded and non-private runs, text and JSON."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from dptune import accounting
from dptune.accounting.statement import NOT_PRIVATE_NOTE, SEEDED_NOTE
from selection import privacy as sp

CAND = accounting.DpSgdCandidate(0.01, 300, 1.2, score_noise_std=30.0)
TR = sp.RandomStoppingPrivacy.from_mean(10.0, 0.5)


@pytest.fixture(scope="module")
def statement():
    return accounting.total_privacy(CAND, TR, 1e-5, "rdp")


def test_statement_holds_every_input(statement):
    d = statement.to_dict()
    for key in (
        "total_epsilon",
        "delta",
        "single_run_epsilon",
        "overhead",
        "method",
        "theorem",
        "accountant",
        "route",
        "selection",
        "candidates",
        "seeded",
        "private",
    ):
        assert key in d
    assert d["candidates"] == [CAND.params()]
    assert d["selection"] == TR.params()
    assert d["method"] == "random_stopping/truncated_negative_binomial"
    assert "Papernot & Steinke 2022, Thm 2" in d["theorem"]
    assert d["overhead"] == pytest.approx(d["total_epsilon"] / d["single_run_epsilon"])
    assert json.loads(statement.to_json()) == d
    with pytest.raises(dataclasses.FrozenInstanceError):
        statement.total_epsilon = 0.0


def test_text_states_the_numbers_and_the_release_rule(statement):
    text = statement.to_text()
    assert f"{statement.total_epsilon:.4g}" in text
    assert f"{statement.single_run_epsilon:.4g}" in text
    assert "Only the selected candidate" in text
    assert "std 30" in text and "parallel composition" in text
    assert SEEDED_NOTE not in text and NOT_PRIVATE_NOTE not in text


def test_the_selections_floats_are_printed_to_six_digits(statement):
    # the logarithmic count of mean 3 (fashion_mnist's) printed mean=3.0000000000000004
    st = dataclasses.replace(statement, selection={**statement.selection, "mean": 3 + 4e-16})
    assert "mean=3," in st.to_text() or "mean=3)" in st.to_text()
    assert st.to_dict()["selection"]["mean"] == 3 + 4e-16


def test_seeded_runs_say_the_seed_must_stay_secret():
    st = accounting.total_privacy(CAND, TR, 1e-5, "rdp", seeded=True)
    assert st.seeded
    assert "seed stays secret" in st.to_text()
    assert SEEDED_NOTE in st.to_dict()["notes"]


def test_debug_runs_are_flagged_not_private():
    st = accounting.total_privacy(CAND, sp.NotPrivate(), 1e-5)
    assert not st.private and math.isinf(st.total_epsilon)
    assert st.to_text().startswith(NOT_PRIVATE_NOTE)
    d = json.loads(st.to_json())
    assert d["total_epsilon"] == "inf" and d["private"] is False
    # a private statement turned into a debug view (dataclasses.replace) is flagged too
    flagged = dataclasses.replace(accounting.total_privacy(CAND, TR, 1e-5, "rdp"), private=False)
    assert NOT_PRIVATE_NOTE in flagged.to_dict()["notes"]


def test_text_lists_a_few_settings_of_a_large_grid():
    grid = [accounting.DpSgdCandidate(0.01, 100 + i, 2.0) for i in range(20)]
    st = accounting.total_privacy(grid, TR, 1e-5, "rdp")
    text = st.to_text()
    assert text.count("DP-SGD:") == 8 and "12 more settings" in text
    assert len(st.to_dict()["candidates"]) == 20


def test_an_event_candidate_is_described_by_its_event_not_its_json():
    """A user DpEvent was listed as dp_accounting's named-tuple JSON ("type":
    "_LaplaceDpEventNamedTupleWrapper", "module_name": ...) after its label."""
    from dp_accounting import dp_event

    ev = dp_event.SelfComposedDpEvent(dp_event.GaussianDpEvent(2.0), 3)
    cand = accounting.EventCandidate(ev, (dp_event.LaplaceDpEvent(10.0),), label="my mechanism")
    text = accounting.total_privacy(cand, sp.SingleRunPrivacy(), 1e-5).to_text()
    line = next(ln for ln in text.splitlines() if "my mechanism" in ln)
    assert line == (
        "  my mechanism: SelfComposedDpEvent(event=GaussianDpEvent(noise_multiplier=2), "
        "count=3); in parallel LaplaceDpEvent(noise_multiplier=10)."
    ), line


def test_no_overhead_ratio_is_stated_when_one_candidate_costs_epsilon_0():
    """One candidate of epsilon 0 (a no-op, or a delta so large that no epsilon is left) made
    the text say "overhead xinfinite"; there is no ratio to state."""
    from dp_accounting import dp_event

    for cand, delta in ((dp_event.NoOpDpEvent(), 1e-5), (dp_event.LaplaceDpEvent(1.0), 0.9)):
        st = accounting.total_privacy(cand, TR, delta)
        assert st.single_run_epsilon == 0 and st.overhead is None
        assert "overhead" not in st.to_text() and "infinite" not in st.to_text()
        assert st.to_dict()["overhead"] is None
