"""The released curve's epsilons computed while candidates train (dptune.curve_warmup): the warm-up
fills the accountant's caches with exactly the numbers the release computes, and whatever it does
(finish, stop, fail) the release shows the same curve."""

import os
import sys

import numpy as np

import dptune
from dptune import space
from dptune.accounting import epsilon
from dptune.curve_warmup import CurveWarmup
from dptune.plan import make_privacy_plan
from selection import BestOfK
from tests.paths import REPO
from trainers.data import make_synthetic


def _plan(noise=(1.5, 3.0)):
    data = make_synthetic(num_train=400, num_test=50, validation_size=100, seed=0)
    tr = dptune.DpSgdTrainer(data, dict(batch_size=64, epochs=3), epoch_progress=False)
    sp = dict(learning_rate=space.choice(0.3, 1.0), noise_multiplier=space.choice(*noise))
    return tr, make_privacy_plan(tr, sp, BestOfK(2), (50.0, 1e-5))


def test_the_warm_up_computes_what_the_release_reads():
    tr, plan = _plan()
    drawn = [
        dict(learning_rate=0.3, noise_multiplier=1.5),
        dict(learning_rate=1.0, noise_multiplier=3.0),
    ]
    epsilon.clear_caches()
    warm = CurveWarmup(tr, plan, drawn)
    warm._thread.join()  # let it finish (stop() would end it early)
    if sys.platform.startswith("linux"):
        assert warm.nice == 19  # the thread's own nice value ...
        assert os.getpriority(os.PRIO_PROCESS, 0) < 19  # ... not the process's
    warm.stop()
    built = epsilon._event_pld.cache_info().misses
    assert built == 2 * 3 + 1  # two settings x three epochs of training; one score branch
    curves = [[plan.single_run_epsilon(c) for c in tr.planned_privacy_by_epoch(hp)] for hp in drawn]
    assert epsilon._event_pld.cache_info().misses == built  # the release builds nothing more
    epsilon.clear_caches()  # ... and reads the numbers it would compute cold
    cold = [[plan.single_run_epsilon(c) for c in tr.planned_privacy_by_epoch(hp)] for hp in drawn]
    assert curves == cold
    assert all(np.all(np.diff(c) > 0) for c in curves)  # epsilon so far grows by the epoch


def test_a_stopped_or_failing_warm_up_leaves_nothing_running():
    tr, plan = _plan()
    warm = CurveWarmup(tr, plan, [dict(learning_rate=0.3, noise_multiplier=1.5)])
    warm.stop()
    warm.stop()  # idempotent
    assert warm._thread is None

    class Broken:
        def planned_privacy_by_epoch(self, hparams):
            raise ValueError("no curve")

    warm = CurveWarmup(Broken(), plan, [dict(learning_rate=0.3, noise_multiplier=1.5)])
    warm.stop()  # the error stays in the thread (logged at debug level)
    assert CurveWarmup(object(), plan, [{}])._thread is None  # a trainer without the hook


_EXIT_SCRIPT = """
import atexit, sys, threading, time
# registered first, so it runs last: after the warm-up's own exit handler
atexit.register(lambda: print("alive", any(t.name == "dptune-curve" and t.is_alive()
                                           for t in threading.enumerate()), flush=True))
from dptune.curve_warmup import CurveWarmup

class SlowPlan:
    def hparams(self, hp):
        return hp
    def single_run_epsilon(self, candidate):
        time.sleep(0.3)

class Trainer:
    def planned_privacy_by_epoch(self, hp):
        return list(range(50))  # 15 s of work

CurveWarmup(Trainer(), SlowPlan(), [{}])
time.sleep(0.2)
if sys.argv[1] == "leave":
    from dptune.cli import exits
    exits.leave(0)
"""


def test_at_exit_the_warm_up_is_stopped_and_waited_for():
    """At the interpreter's exit, the warm-up's daemon thread is stopped after the epsilon it is
    computing and waited for: a daemon thread still inside the accountant's C++ when Python
    finalises can abort the process ("terminate called without an active exception", seen at the
    end of a user's script right after dptune.tune returned). dptune's own exit (exits.leave,
    os._exit: no finalisation) takes the handler off, so a command never waits for the thread."""
    import subprocess
    import time

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    for how, alive in (("return", "False"), ("leave", "True")):
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-c", _EXIT_SCRIPT, how], capture_output=True, text=True, env=env,
            timeout=60,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["alive", alive], (how, out.stdout)
        assert time.monotonic() - t0 < 10  # stopped after one 0.3 s epsilon, not 15 s of work
