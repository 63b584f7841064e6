"""The documented non-neural example (examples/selection_laplace.py) runs and releases only the
selected candidate."""

from __future__ import annotations

import importlib.util

import pytest

from tests.paths import REPO

EXAMPLE = REPO / "examples" / "selection_laplace.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("selection_laplace", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_releases_one_histogram_at_twice_the_candidate_epsilon(example, capsys):
    out = example.main(["--n", "4000", "--epsilon", "0.5", "--mean", "6", "--seed", "3"])
    printed = capsys.readouterr().out
    assert out["released"] and 2 <= out["bins"] <= 128
    assert out["total_epsilon"] == pytest.approx(1.0)  # PS Cor. 3, eta = 0: 2 eps
    assert "Papernot & Steinke 2022" in out["theorem"]
    assert f"{out['bins']} bins" in printed
    # Nothing private is printed: neither the number of candidates nor the other scores.
    private = out["selection"].private
    for score in private.scores:
        if score != out["score"]:
            assert f"{score:.4f}" not in printed
    assert "candidates tried" not in printed
    # The same seed reproduces the release (debugging only).
    again = example.main(["--n", "4000", "--epsilon", "0.5", "--mean", "6", "--seed", "3"])
    assert again["bins"] == out["bins"] and again["score"] == out["score"]


def test_example_candidate_is_a_plain_callable(example):
    import numpy as np

    data = example.synthetic_data(2000, np.random.default_rng(0))
    candidate = example.make_candidate(data[:1000], data[1000:], 1.0, 1000)
    score, payload = candidate(0, np.random.default_rng(1))
    assert np.isfinite(score) and payload["density"].shape == (payload["bins"],)
    assert payload["density"].mean() == pytest.approx(1.0)  # a density on [0, 1)
