"""release/report.md: one page that restates the release (result, privacy, plots) and nothing
about the other candidates."""

import math
import re

import dptune
from dptune import space
from dptune.accounting.events import DpSgdCandidate
from dptune.release import Release, write_release
from dptune.report import single_candidate_odds
from dptune.tuner import FunctionTrainer
from selection import RandomStopping


def _toy(hp, rng):
    score = -abs(math.log(hp["learning_rate"] / 0.3)) + 0.01 * rng.normal()
    return score, {"history": [{"epoch": 1, "test_accuracy": 0.5}]}


def test_report_restates_the_release_and_links_existing_plots(tmp_path):
    trainer = FunctionTrainer(
        _toy, lambda hp: DpSgdCandidate(0.01, 500, hp["noise_multiplier"]), num_examples=10_000,
        fingerprint="toy", score_kind="covered",
    )  # fmt: skip
    sp = dict(learning_rate=space.log_uniform(0.01, 10.0), noise_multiplier="auto")
    rel = dptune.tune(trainer, sp, RandomStopping.logarithmic(6), (2.0, 1e-5), seed=9,
                      workdir=tmp_path / "run")  # fmt: skip
    assert rel.private.num_trials >= 3  # several candidates, so "others" below is not empty
    text = (tmp_path / "run" / "release" / "report.md").read_text()
    assert f"{rel.privacy['total_epsilon']:.4g}" in text and "1e-05" in text
    assert rel.privacy["theorem"] in text
    assert f"{rel.hparams['learning_rate']:.4g}" in text
    # Every linked file exists in the folder.
    for link in re.findall(r"\]\(([^)]+)\)", text):
        assert (tmp_path / "run" / "release" / link).exists(), link
    assert "(epsilon.png)" in text
    best = max(range(rel.private.num_trials), key=lambda i: rel.private.scores[i])
    for i, s in enumerate(rel.private.scores):
        if i != best:
            assert f"{s:.4g}" not in text and f"{100 * s:.2f}" not in text
    assert "num_trials" not in text
    # The count's odds of a single candidate (public), and the loader the README teaches.
    p1 = single_candidate_odds(rel.privacy["selection"])[1]
    assert f"exactly one with probability {100 * p1:.0f} %" in text
    assert "dptune.load_release(" in text and "load_params" not in text


def test_single_candidate_odds_match_the_counts_own_sampling():
    """P[K = 1] (and P[K = 0]) from the statement's selection parameters, against independent
    numbers: the closed forms (logarithmic: (1 - gamma) / log(1 / gamma); geometric: gamma;
    Poisson: m e^-m) and the frequency of K = 1 in the count's own sampler (another code path:
    rejection sampling), 200,000 draws, fixed seed."""
    import numpy as np

    from selection import counts

    log3 = counts.logarithmic(3.0)
    g = log3.gamma
    odds = single_candidate_odds(RandomStopping.logarithmic(3.0).privacy.params())
    assert odds[0] == 0.0 and math.isclose(odds[1], (1 - g) / math.log(1 / g), rel_tol=1e-12)
    draws = log3.sample(np.random.default_rng(0), 200_000)
    assert abs(np.mean(draws == 1) - odds[1]) < 5 * math.sqrt(odds[1] * (1 - odds[1]) / 200_000)
    p0, p1 = single_candidate_odds(RandomStopping.geometric(4.0).privacy.params())
    assert p0 == 0.0 and math.isclose(p1, 0.25)
    p0, p1 = single_candidate_odds(RandomStopping.poisson(2.0).privacy.params())
    assert math.isclose(p0, math.exp(-2)) and math.isclose(p1, 2 * math.exp(-2))
    assert single_candidate_odds({"gamma": 0.1, "max_trials": 5}) == (0.0, 0.1)
    assert single_candidate_odds({"gamma": 0.1, "max_trials": 5, "eps0": 0.0}) is None  # thresh.
    assert single_candidate_odds({}) is None


def test_report_of_an_empty_release(tmp_path):
    rel = Release(False, None, None, None, {"total_epsilon": 1.0, "delta": 1e-5}, "statement")
    folder = write_release(rel, tmp_path / "release")
    text = (folder / "report.md").read_text()
    assert "Nothing" in text and "(1, 1e-05)" in text
    assert "training_curve.png" not in text  # not linked when absent


def test_headline_rounds_epsilon_up_never_down():
    from dptune.release import headline

    assert "(4, 1e-05)" in headline({"total_epsilon": 3.99871, "delta": 1e-5})
    assert "(3.01, 1e-05)" in headline({"total_epsilon": 3.0001, "delta": 1e-5})  # not 3
    assert "(2, 1e-05)" in headline({"total_epsilon": 2.0, "delta": 1e-5})
    assert "NOT" in headline({"total_epsilon": 1.0, "delta": 1e-5, "private": False})
    assert "no finite guarantee" in headline({"total_epsilon": float("inf"), "delta": 1e-5})


def test_report_names_the_trainer_and_never_prints_nan(tmp_path):
    from dptune.release import Release
    from dptune.report import report_markdown

    privacy = {"total_epsilon": 2.5, "delta": 1e-5, "single_run_epsilon": 2.0, "method": "m"}
    rel = Release(True, {"lr": 0.1}, float("nan"), None, privacy, "text", trainer_name="DP-Fisher")
    md = report_markdown(rel, set())
    assert "trained by DP-Fisher" in md and "DP-SGD" not in md
    assert not re.search(r"\bnan\b", md, re.I) and "n/a" in md
    assert md.splitlines()[2].startswith("Everything released by this run")


def test_plots_draw_without_pyplot_and_leave_the_callers_backend(tmp_path, monkeypatch):
    """The release's plots go through matplotlib's Figure API: a notebook user's pyplot backend
    and open figures are not touched (pyplot is never imported: None in sys.modules makes any
    import of it fail; matplotlib.use is never called), and the PNGs are written all the same."""
    import sys

    import matplotlib

    from dptune import plots

    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)

    def switch(*args, **kwargs):
        raise AssertionError("the plots switched matplotlib's backend")

    monkeypatch.setattr(matplotlib, "use", switch)
    rows = [{"epoch": 1, "epsilon_one_run": 0.5}, {"epoch": 2, "epsilon_one_run": 0.8}]
    curve = plots.training_curve(rows, tmp_path / "curve.png", total_epsilon=1.2)
    bars = plots.epsilon_breakdown(
        {"total_epsilon": 1.2, "single_run_epsilon": 0.8, "delta": 1e-5}, tmp_path / "eps.png"
    )
    for path in (curve, bars):
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
