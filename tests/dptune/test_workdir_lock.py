"""One run per workdir (_state/workdir_lock.py): a second *process* on a live run's workdir is
refused before it reads or writes anything, and a holder killed with SIGKILL leaves no stale lock.

The holder is a real second interpreter (flock is per open file, so a check inside one process
would prove little about two processes); a toy trainer keeps the tuner paths fast.
"""

import math
import os
import signal
import subprocess
import sys
import time

import pytest

import dptune
from dptune import space
from dptune._state.workdir_lock import LOCK_FILE, WorkdirLockedError, workdir_lock
from dptune.accounting.events import DpSgdCandidate
from dptune.tuner import FunctionTrainer
from selection import BestOfK
from tests.paths import REPO

ROOT = REPO

# A second process that takes the workdir's lock, says so on stdout, and holds it until killed.
_HOLDER = """
import sys, time
from dptune._state.workdir_lock import workdir_lock
with workdir_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


@pytest.fixture
def holder(tmp_path):
    """A live process holding ``tmp_path / 'run'``'s lock; yields (workdir, process)."""
    work = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(work)], stdout=subprocess.PIPE, text=True, env=_env()
    )
    assert proc.stdout.readline().strip() == "locked"
    yield work, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _trainer(calls):
    def train(hp, rng):
        calls.append(hp)
        return -abs(math.log(hp["learning_rate"] / 0.3)), {"lr": hp["learning_rate"]}

    return FunctionTrainer(
        train, lambda hp: DpSgdCandidate(0.01, 200, 1.5), 10_000, "toy", score_kind="covered"
    )


SPACE = dict(learning_rate=space.log_uniform(0.01, 10.0), noise_multiplier=1.5)


def test_second_process_is_refused_while_the_first_lives(holder):
    work, proc = holder
    with pytest.raises(WorkdirLockedError) as err:
        with workdir_lock(work):
            pass
    msg = str(err.value)
    assert f"pid {proc.pid}" in msg and "in use by another dptune run" in msg
    # tune() on that workdir is refused before any private computation or any file of the run
    calls: list = []
    with pytest.raises(WorkdirLockedError):
        dptune.tune(_trainer(calls), SPACE, BestOfK(3), (20.0, 1e-5), seed=1, workdir=work)
    assert calls == [] and sorted(p.name for p in work.iterdir()) == [LOCK_FILE]


def test_sigkilled_holder_leaves_no_stale_lock(holder):
    work, proc = holder
    with pytest.raises(WorkdirLockedError):
        with workdir_lock(work):
            pass
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # the kernel dropped the dead process's flock: the workdir is usable at once, no cleanup
    calls: list = []
    rel = dptune.tune(_trainer(calls), SPACE, BestOfK(3), (20.0, 1e-5), seed=1, workdir=work)
    assert rel.released and len(calls) == 3
    assert (work / LOCK_FILE).exists()  # never deleted (see workdir_lock's docstring)
    # and after tune() returned, the lock is free again (held for the run only)
    with workdir_lock(work):
        pass


def test_lock_is_held_for_the_whole_run(tmp_path):
    """While a candidate trains, another process cannot take the lock."""
    work = tmp_path / "run"
    probe = (
        f"from dptune._state.workdir_lock import workdir_lock as w\nwith w({str(work)!r}): pass\n"
    )
    outcomes: list[int] = []

    def train(hp, rng):
        r = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, env=_env(), timeout=120
        )
        outcomes.append(r.returncode)
        assert "WorkdirLockedError" in r.stderr, r.stderr
        return 0.0, {}

    tr = FunctionTrainer(
        train, lambda hp: DpSgdCandidate(0.01, 200, 1.5), 10_000, score_kind="covered"
    )
    dptune.tune(tr, SPACE, BestOfK(1), (20.0, 1e-5), seed=2, workdir=work, ledger=None)
    assert outcomes == [1]


def test_cli_refuses_a_second_run_with_exit_code_2(holder):
    """What a user sees: ``dptune`` on a workdir in use exits 2 with one ``dptune: refused:``
    line and leaves the workdir as it was."""
    work, proc = holder
    t0 = time.time()
    r = subprocess.run(
        [sys.executable, "-m", "dptune.cli.main", "--config=smoke", f"--workdir={work}", "--seed=1",
         "--noprogress", f"--config.ledger.path={work.parent / 'ledger.sqlite'}"],
        capture_output=True, text=True, env={**_env(), "JAX_PLATFORMS": "cpu"}, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    refusals = [ln for ln in r.stderr.splitlines() if ln.startswith("dptune: refused:")]
    assert len(refusals) == 1 and f"pid {proc.pid}" in refusals[0], r.stderr
    assert "Traceback" not in r.stderr
    assert sorted(p.name for p in work.iterdir()) == [LOCK_FILE]
    assert not (work.parent / "ledger.sqlite").exists()  # refused before the ledger is charged
    assert proc.poll() is None  # the first run is untouched
    assert time.time() - t0 < 120
