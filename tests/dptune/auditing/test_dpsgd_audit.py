"""``dptune audit`` of dptune's own DP-SGD on the shipped MNIST-10k (one candidate at the tuning's
noise, 2 epochs, fixed seeds): the correct run's bound stays below its stated epsilon for every
canary kind, and each negative control's bound exceeds it. The command line end to end.

Slow (a DP-SGD run each, ~20-40 s on 2 CPU cores); the fast twins are the user-function audit of
``test_audit.py`` (correct and without noise), the conversion tests of ``test_bound.py`` and the
gradient-canary tests of ``tests/trainers/test_audit.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import dptune
from dptune import space as sp
from dptune.learners.dpsgd import DpSgdTrainer, load_dataset
from selection import RandomStopping
from tests.paths import REPO, mnist_10k

pytestmark = pytest.mark.slow

BUDGET = (1.0, 1e-5)


@pytest.fixture(scope="module")
def trainer():
    data = load_dataset(
        "mnist", data_dir=str(mnist_10k()), source="idx", validation_size=1000, num_examples=8000
    )
    base = dict(epochs=2, batch_size=256, optimizer="sgd", score_noise_std=5.0)
    return DpSgdTrainer(data, base, epoch_progress=False)


def _audit(trainer, **kw):
    space = dict(learning_rate=sp.log_uniform(1.0, 4.0), clip_norm=1.0, noise_multiplier="auto")
    kw.setdefault("canaries", 256)
    return dptune.audit(
        trainer, space, RandomStopping.logarithmic(2.5), BUDGET, what="training", seed=0,
        progress=False, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("kind, m", [("gradient", 256), ("input", 256), ("score", 20)])
def test_correct_run_stays_below_its_epsilon(trainer, kind, m):
    result = _audit(trainer, kind=kind, canaries=m)
    assert result.released and 0 < result.stated_epsilon <= BUDGET[0]
    assert result.epsilon_lower_bound <= result.stated_epsilon, result
    assert result.ceiling > result.stated_epsilon  # the audit could have shown a violation


@pytest.mark.parametrize("control", ["no_noise", "no_clipping", "noise_reused", "exact_score"])
def test_negative_controls_exceed_the_stated_epsilon(trainer, control):
    result = _audit(trainer, break_=control, canaries=20 if control == "exact_score" else 256)
    assert result.exceeds, result
    assert result.epsilon_lower_bound > result.stated_epsilon


def test_command_line(tmp_path):
    """``dptune audit`` on the smoke config: one line on stdout, audit.json, a marked release."""
    work = tmp_path / "audit"
    cmd = [
        sys.executable, "-m", "dptune.cli.audit", "--config=smoke", f"--workdir={work}",
        "--what=training", "--canaries=256", "--break=no_noise", "--seed=1", "--noprogress",
        "--config.train.epochs=1", "--config.privacy.epsilon=1.0",
        f"--config.ledger.path={tmp_path / 'ledger.sqlite'}",
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "EXCEEDS" in proc.stdout
    saved = json.loads((work / "audit.json").read_text())
    assert saved["break"] == "no_noise" and saved["exceeds_stated_epsilon"]
    assert "NEGATIVE CONTROL" in (work / "release" / "privacy.txt").read_text()
