"""The examples run end to end (short runs: DPTUNE_EXAMPLES_QUICK=1) and state a total within
their budgets; the user-model examples load their release back."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.paths import REPO

EXAMPLES = REPO / "examples"


def _run(name: str, tmp_path) -> str:
    env = dict(os.environ, DPTUNE_EXAMPLES_QUICK="1")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name)], cwd=tmp_path, capture_output=True, text=True,
        timeout=600, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _total_epsilon(stdout: str) -> float:
    m = re.search(r"The whole tuning run satisfies \(([0-9.]+), 1e-05\)-DP", stdout)
    assert m, stdout[-2000:]
    return float(m.group(1))


def test_tune_custom_jax_example_releases_within_budget(tmp_path):
    out = _run("tune_custom_jax.py", tmp_path)
    assert _total_epsilon(out) <= 2.0  # the example's total budget
    assert "Released:" in out or "nothing released" in out.lower()


def _slow(name: str, budget: float, loaded: str):
    return pytest.param(name, budget, loaded, marks=pytest.mark.slow)


@pytest.mark.parametrize(
    "name, budget, loaded",
    [
        ("user_mlp_mnist.py", 3.0, "predictions"),
        # slow (a transformer compiled cold: ~20 s); its fast twins: the attention layer of
        # tests/trainers/test_ghost.py and the token-input model of tests/trainers/test_user_data.py
        _slow("user_text_classifier.py", 4.0, "test accuracy of the loaded parameters"),
        ("user_tabular.py", 5.0, "P(benign)"),
        # float labels, own loss and metric (scikit-learn's bundled diabetes data)
        ("user_regression_diabetes.py", 5.0, "predicted progression"),
        # slow (a transformer with dropout compiled cold: ~30 s of CPU); its fast twin is the
        # sequence-label test of tests/dptune/learners/test_any_labels.py
        _slow("user_next_token_lm.py", 8.0, "token accuracy of the loaded parameters"),
        ("user_nnx_mnist.py", 3.0, "test accuracy of the loaded model"),
    ],
)
def test_user_model_examples_tune_and_load_their_release(name, budget, loaded, tmp_path):
    out = _run(name, tmp_path)
    assert _total_epsilon(out) <= budget
    assert "Released:" in out and loaded in out  # released, and load_release read it back
