"""The documented user-trainer example runs end to end and states a total within its budget."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.paths import REPO

EXAMPLE = REPO / "examples" / "tune_custom_jax.py"


def test_tune_custom_jax_example_releases_within_budget(tmp_path):
    out = subprocess.run(
        [sys.executable, str(EXAMPLE)], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-2000:]
    m = re.search(r"The whole tuning run satisfies \(([0-9.]+), 1e-05\)-DP", out.stdout)
    assert m, out.stdout[-2000:]
    assert float(m.group(1)) <= 2.0  # the example's total budget
    assert "Released:" in out.stdout or "nothing released" in out.stdout.lower()
