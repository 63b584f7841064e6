"""The release folder is complete or absent (dptune/release.py): a process killed with SIGKILL
while it writes the release leaves no ``release/`` (only the ``release.tmp/`` a rerun discards),
and the rerun writes the same release an uninterrupted run writes; a write that fails over an
existing release leaves the old one whole.

A toy trainer whose payload holds a parameter tree keeps this fast; the checkpoint write (orbax)
is slowed down in the killed process so that the kill lands inside it.
"""

import json
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from tests.paths import REPO

ROOT = REPO

# The run, importable by the killed subprocess and by this test: the same trainer, space,
# selection and seed, hence the same release.
_RUN = """
import math
import numpy as np
import dptune
from dptune import space
from dptune.accounting.events import DpSgdCandidate
from dptune.tuner import FunctionTrainer
from selection import RandomStopping

def train(hp, rng):
    w = rng.standard_normal((4, 3)).astype(np.float32)
    return -abs(math.log(hp["learning_rate"] / 0.3)), {"params": {"dense": {"kernel": w}}}

def run(workdir):
    tr = FunctionTrainer(
        train, lambda hp: DpSgdCandidate(0.01, 200, 1.5), 10_000, score_kind="covered"
    )
    sp = dict(learning_rate=space.log_uniform(0.01, 10.0), noise_multiplier=1.5)
    return dptune.tune(tr, sp, RandomStopping.logarithmic(3), (20.0, 1e-5), seed=5,
                       workdir=workdir, progress=False, ledger=None)
"""

# Killed while the checkpoint is half written: the orbax save writes a partial file, says so,
# and sleeps until the SIGKILL.
_KILLED = (
    _RUN
    + """
import sys, time
from pathlib import Path
import dptune.release as r

def slow_save(params, path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "partial").write_text("half a checkpoint")
    print("writing", flush=True)
    time.sleep(600)

r._save_orbax = slow_save
run(Path(sys.argv[1]))
"""
)


def _env():
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def _load_run():
    ns: dict = {}
    exec(compile(_RUN, "release_run", "exec"), ns)
    return ns["run"]


def test_kill_during_release_writing_leaves_no_release_and_a_rerun_completes_it(tmp_path):
    run = _load_run()
    ref = run(tmp_path / "ref")
    assert ref.released
    work = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED, str(work)], stdout=subprocess.PIPE, text=True,
        env=_env(), cwd=ROOT,
    )  # fmt: skip
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # complete or absent: nothing at release/, the half-written folder only under release.tmp/
    assert not (work / "release").exists()
    assert (work / "release.tmp" / "checkpoint" / "partial").exists()
    # the rerun (no more private computation: every candidate is journaled as done) writes it
    rel = run(work)
    assert rel.released and rel.hparams == ref.hparams
    assert not (work / "release.tmp").exists() and not (work / "release.old").exists()
    for name in ("result.json", "privacy.json", "privacy.txt"):
        assert (work / "release" / name).read_text() == (
            tmp_path / "ref" / "release" / name
        ).read_text()
    assert not (work / "release" / "checkpoint" / "partial").exists()
    from dptune.release import load_params

    np.testing.assert_array_equal(
        load_params(work / "release")["dense"]["kernel"],
        load_params(tmp_path / "ref" / "release")["dense"]["kernel"],
    )


def test_failed_rewrite_keeps_the_old_release_whole(tmp_path, monkeypatch):
    """Writing over an existing release (a rerun after a kill between the rename and the journal's
    ``released_at``) that fails midway leaves the previous release in place, untouched."""
    import dptune.release as r

    run = _load_run()
    rel = run(tmp_path / "run")
    folder = tmp_path / "run" / "release"
    before = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    def broken(params, path):
        path.mkdir(parents=True)
        (path / "partial").write_text("half")
        raise OSError("disk full")

    monkeypatch.setattr(r, "_save_orbax", broken)
    with pytest.raises(OSError, match="disk full"):
        r.write_release(rel, folder)
    after = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert after == before
    assert json.loads((folder / "result.json").read_text())["released"] is True
