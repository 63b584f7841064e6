"""The ``dptune`` command as a user sees it, through a real subprocess: each refusal exits with
code 2 and prints exactly one ``dptune: refused: ...`` line (no traceback), having trained and
charged nothing; and thresholding through the DP-SGD trainer and the CLI, killed with SIGKILL and
resumed, ends exactly as an uninterrupted run of the same seed.

(``test_tuner_cli.py`` tests the same refusals in-process, message by message; the locked-workdir
refusal is in ``test_reliability_lock.py``.)
"""

import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.journal_rows import journal_rows
from tests.paths import REPO

ROOT = REPO


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path}


def _cmd(workdir: Path, ledger: Path, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "dptune.cli.main", "--config=smoke", f"--workdir={workdir}",
        "--noprogress", f"--config.ledger.path={ledger}", *extra,
    ]  # fmt: skip


def _refused(r: subprocess.CompletedProcess) -> str:
    """The one refusal line; fails unless the process exited 2 with exactly one and no
    traceback."""
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("dptune: refused:")]
    assert len(lines) == 1, r.stderr[-2000:]
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    return lines[0]


def _smoke_fingerprint() -> str:
    """The ledger id of the shipped smoke data (what the command charges)."""
    from dptune.cli.build import _plain, load_data
    from dptune.configs import smoke
    from dptune.learners.dpsgd import DpSgdTrainer

    cfg = _plain(smoke.get_config())
    return DpSgdTrainer(load_data(cfg), cfg["train"], epoch_progress=False).fingerprint


REFUSALS = [
    # (flags, text the one line must contain): an override of a field the config lacks (absl
    # parsing), a delta the data size forbids, a budget no noise meets (calibration), a dataset
    # whose ledger budget is spent
    (["--config.train.no_such_field=1"], "names a field the config does not have"),
    (["--config.privacy.delta=1e-3"], "1/n"),
    (["--config.privacy.epsilon=0.01"], "no noise multiplier meets"),
    ([], "budget"),  # the ledger is pre-charged in the test
]


@pytest.mark.parametrize("flags, message", REFUSALS, ids=["field", "delta", "epsilon", "ledger"])
def test_refusals_exit_2_with_one_line(tmp_path, flags, message):
    work, ledger = tmp_path / "run", tmp_path / "ledger.sqlite"
    if not flags:
        from dptune._state.ledger import Ledger

        with Ledger(ledger) as led:  # another run already spent 998 of the smoke budget (1000)
            led.charge(
                _smoke_fingerprint(), "earlier-run", 998.0, 1e-5, budget_epsilon=1000.0,
                budget_delta=1e-3,
            )  # fmt: skip
    r = subprocess.run(
        _cmd(work, ledger, "--seed=1", *flags), cwd=ROOT, env=_env(), capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    line = _refused(r)
    assert message in line, line
    # nothing private ran and nothing was written: the ledger is checked (read-only) before the
    # journal is created, so even the ledger's refusal leaves no journal
    assert not (work / "release").exists()
    assert not (work / "private").exists()
    if not flags:
        from dptune._state.ledger import Ledger

        with Ledger(ledger) as led:  # and the refused run was not charged
            assert led.spend(_smoke_fingerprint()).spent_epsilon == pytest.approx(998.0)


# --- thresholding through the DP-SGD trainer and the CLI, killed and resumed ----------------------

# One epoch per candidate; seed 9 plans K = 2 candidates for gamma = 0.25 (checked below), whose
# scores (about 0.76 and 0.71) both miss the threshold 0.85: nothing is released after both ran.
THRESHOLDING = [
    "--seed=9",
    "--config.train.epochs=1",
    "--config.selection.method=thresholding",
    "--config.selection.threshold=0.85",
    "--config.selection.stop_probability=0.25",
]


def _rows(workdir: Path) -> list[tuple]:
    return journal_rows(workdir, "idx, status, score, failed, attempts, seed")


@pytest.mark.slow  # three tiny CLI runs (~1.5 min of CPU); the in-process resume of thresholding
# is tested fast in test_thresholding_resume_in_process below
def test_thresholding_cli_killed_and_resumed_equals_uninterrupted(tmp_path):
    ledger = tmp_path / "ledger.sqlite"
    ref = subprocess.run(
        _cmd(tmp_path / "ref", ledger, *THRESHOLDING), cwd=ROOT, env=_env(), capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-2000:]
    ref_rows = _rows(tmp_path / "ref")
    assert len(ref_rows) == 2 and all(r[1] == "done" for r in ref_rows)

    work = tmp_path / "run"
    proc = subprocess.Popen(
        _cmd(work, ledger, *THRESHOLDING), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.time() + 600
    while time.time() < deadline:  # kill -9 once candidate 0 is done and candidate 1 trains
        rows = _rows(work)
        if any(r[1] == "done" for r in rows) and any(r[1] == "running" for r in rows):
            break
        assert proc.poll() is None, "the run ended before it could be killed"
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (work / "release").exists()
    done_before = [r[0] for r in _rows(work) if r[1] == "done"]
    assert done_before == [0]

    again = subprocess.run(
        _cmd(work, ledger, *THRESHOLDING), cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    rows = _rows(work)
    # same plan and seeds, candidate 0 not retrained, the same scores bit for bit
    assert [(r[0], r[5]) for r in rows] == [(r[0], r[5]) for r in ref_rows]
    assert rows[0][4] == 1
    assert [r[2] for r in rows] == [r[2] for r in ref_rows]
    assert all(r[2] < 0.85 for r in rows)  # both missed: nothing released, as the reference
    for name in ("result.json", "privacy.json"):
        assert json.loads((work / "release" / name).read_text()) == json.loads(
            (tmp_path / "ref" / "release" / name).read_text()
        )
    assert json.loads((work / "release" / "result.json").read_text()) == {
        "released": False,
        "reason": "none_selected",  # no candidate reached the threshold: a private outcome
    }
    assert not (work / "release" / "checkpoint").exists()
    assert "Nothing released" in again.stdout
    with sqlite3.connect(ledger) as db:  # two runs, each charged once (the killed one too)
        assert db.execute("SELECT COUNT(*) FROM charges").fetchone()[0] == 2


def test_thresholding_resume_in_process(tmp_path):
    """The same promise without subprocesses: a thresholding run interrupted inside a candidate
    (an exception the failure guard does not catch, like a kill) resumes to the uninterrupted
    run's release, without retraining what was done."""
    import dptune
    from dptune import space
    from dptune.accounting.events import DpSgdCandidate
    from dptune.tuner import FunctionTrainer
    from selection import Thresholding

    class Killed(BaseException):
        pass

    calls: list[float] = []
    kill_at = [None]

    def train(hp, rng):
        if len(calls) == kill_at[0]:
            raise Killed
        calls.append(hp["learning_rate"])
        score = -abs(math.log(hp["learning_rate"] / 0.3)) + 0.05 * rng.standard_normal()
        return score, {"params": {"w": rng.standard_normal(3)}}

    def run(workdir):
        tr = FunctionTrainer(
            train, lambda hp: DpSgdCandidate(0.01, 200, 1.5), 10_000, score_kind="covered"
        )
        sp = dict(learning_rate=space.log_uniform(0.01, 10.0), noise_multiplier=1.5)
        sel = Thresholding(threshold=-0.3, stop_probability=0.1)
        return dptune.tune(tr, sp, sel, (30.0, 1e-5), seed=1, workdir=workdir, ledger=None)

    ref = run(tmp_path / "ref")
    k_ref = len(calls)
    assert ref.released and k_ref == 5  # seed 1: the fifth candidate is the first hit
    calls.clear()
    kill_at[0] = 2  # interrupted while the third candidate trains
    with pytest.raises(Killed):
        run(tmp_path / "run")
    assert len(calls) == 2 and not (tmp_path / "run" / "release").exists()
    kill_at[0] = None
    rel = run(tmp_path / "run")
    assert len(calls) == k_ref  # the two finished candidates were not trained again
    assert rel.hparams == ref.hparams and rel.validation_score == ref.validation_score
    for name in ("result.json", "privacy.json"):
        assert (tmp_path / "run" / "release" / name).read_text() == (
            tmp_path / "ref" / "release" / name
        ).read_text()
