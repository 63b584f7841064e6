"""What a subsampled run's release says it holds: the final run's model and its noisy score,
whatever the tuning phase's selection would publish; and a trainer whose score its privacy does
not cover is refused before anything runs (the final run releases its score)."""

from __future__ import annotations

import dataclasses
import json

import pytest
from dp_accounting import dp_event

import dptune
from dptune._state.ledger import Ledger
from dptune.accounting.events import EventCandidate
from dptune.release import read_release
from dptune.tuner import TuningConfigError
from selection import RandomStopping
from selection.stability_validation import StabilityValidation
from tests.dptune.test_subsampled import SPACE, SubsetToy


@dataclasses.dataclass
class LaplaceToy(SubsetToy):
    """Pure-DP candidates (a Laplace mechanism of scale noise_multiplier), as Chaudhuri &
    Vinterbo's stability validation needs; a score its privacy covers unless told otherwise."""

    def privacy(self, hp):
        return EventCandidate(dp_event.LaplaceDpEvent(hp["noise_multiplier"]))

    def subset(self, fraction, key):
        self.keys.append(key)
        out = LaplaceToy(round(fraction * self.n), self.calls, self.keys, key)
        out.score_kind = self.score_kind
        return out


def _run(toy, tmp_path, **kw):
    # Stability validation publishes the selected index and model, never a score.
    return dptune.tune_subsampled(
        toy, SPACE, StabilityValidation.from_beta(3, 0.2, 0.01), (3.0, 1e-5), fraction=0.3,
        tuning_epsilon=1.0, seed=2, progress=False, workdir=tmp_path / "run", **kw,
    )  # fmt: skip


def test_the_statement_names_the_final_runs_score_that_the_release_holds(tmp_path):
    rel = _run(LaplaceToy(), tmp_path)
    assert rel.released
    result = json.loads((tmp_path / "run/release/result.json").read_text())
    privacy = json.loads((tmp_path / "run/release/privacy.json").read_text())
    # The release holds the final run's score (covered by its privacy) and says so.
    assert "validation_score" in result and "score" in privacy["published"]
    assert "not its score" not in rel.privacy_text
    assert read_release(tmp_path / "run/release").validation_score == result["validation_score"]


def test_a_score_its_privacy_does_not_cover_is_refused_before_anything_runs(tmp_path):
    toy = LaplaceToy()
    toy.score_kind = "exact"  # stability validation takes exact scores; the final run cannot
    with pytest.raises(TuningConfigError, match="score_kind='exact'.*strategy 'full'"):
        _run(toy, tmp_path, ledger=tmp_path / "ledger")
    assert toy.calls == [] and not (tmp_path / "run" / "private").exists()
    assert Ledger(tmp_path / "ledger").spend("toy-data") is None


@dataclasses.dataclass
class SizedToy(SubsetToy):
    """A subset whose public size is the subset's expected size (as ``DpSgdTrainer.subset``)."""

    def subset(self, fraction, key):
        out = super().subset(fraction, key)
        out.num_examples = out.n
        return out


def test_a_delta_too_large_for_the_full_data_is_refused_before_anything_runs(tmp_path):
    # 1/N = 1e-4 on all the data; the subset's share 0.1 delta / f = 2.5e-4 is below its 1/(f N).
    toy = SizedToy()
    with pytest.raises(TuningConfigError, match=r"delta=0.0005 must be below 1/n = 0.0001"):
        dptune.tune_subsampled(
            toy, SPACE, RandomStopping.logarithmic(3),
            (2.0, 5e-4), fraction=0.2, tuning_epsilon=0.3, seed=1, progress=False,
            workdir=tmp_path / "run", ledger=tmp_path / "ledger",
        )  # fmt: skip
    assert toy.calls == [] and Ledger(tmp_path / "ledger").spend("toy-data") is None
