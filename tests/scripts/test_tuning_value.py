"""scripts/tuning_value.py's summary: medians and percentiles per cell, a run that released
nothing counted as a guess, the reference arm read from the dptune runs only."""

import importlib.util
import sys

import pytest

from tests.paths import REPO


@pytest.fixture(scope="module")
def tv():
    spec = importlib.util.spec_from_file_location("tuning_value", REPO / "scripts/tuning_value.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["tuning_value"] = mod  # its dataclasses look their module up while defined
    spec.loader.exec_module(mod)
    return mod


def test_cells_hold_medians_percentiles_and_empty_releases_as_chance(tv):
    rows = [
        {"task": "t", "arm": "dptune", "epsilon": 1.0, "test_accuracy": a, "reference": r}
        for a, r in ((0.5, 0.6), (0.7, 0.8), (None, 0.9))
    ] + [{"task": "t", "arm": "opacus", "epsilon": 1.0, "test_accuracy": 0.4, "reference": None}]
    cells = tv.summarise(rows, {"t": 0.25})
    d = cells[("t", "dptune", 1.0)]
    assert d["n"] == 3 and d["empty"] == 1 and d["median"] == 0.5  # [0.25, 0.5, 0.7]
    assert d["p10"] == pytest.approx(0.25 + 0.2 * 0.25) and d["p90"] == pytest.approx(0.66)
    assert cells[("t", "reference", 1.0)]["median"] == 0.8  # from the dptune runs only
    assert cells[("t", "opacus", 1.0)]["n"] == 1
    table = tv.markdown_table(cells, ["t"], [1.0])
    assert "50.0 [30.0, 66.0] (n=3, 1 released nothing)" in table
    assert tv.LABELS["jax_privacy"] not in table  # an arm that never ran has no column
    cells = tv.summarise([*rows, {**rows[-1], "task": "u"}], {"t": 0.25, "u": 0.25})
    assert "| u | 1 | not run | 40.0" in tv.markdown_table(cells, ["t", "u"], [1.0])


def test_a_release_scored_by_its_own_metric_reads_its_value(tv):
    assert tv._score({"test_accuracy": 0.9}) == 0.9
    assert tv._score({"test_accuracy": None, "test_metric": {"name": "m", "value": 0.3}}) == 0.3
    assert tv._score({"epoch": 1}) is None
