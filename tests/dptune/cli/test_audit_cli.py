"""``dptune audit`` refuses, in one line with exit code 2 and before anything private runs, a
folder that holds a tuning run (an audit's canaries must never reach a real release)."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.paths import REPO


def test_refuses_a_tuning_runs_folder_in_one_line(tmp_path):
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "journal.sqlite").write_bytes(b"")
    cmd = [
        sys.executable, "-m", "dptune.cli.audit", "--config=smoke", f"--workdir={tmp_path}",
        "--noprogress", f"--config.ledger.path={tmp_path / 'ledger.sqlite'}",
    ]  # fmt: skip
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("dptune: refused")]
    assert len(lines) == 1 and "holds a tuning run" in lines[0]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "ledger.sqlite").exists()  # nothing charged
    assert not (tmp_path / "audit.json").exists()
