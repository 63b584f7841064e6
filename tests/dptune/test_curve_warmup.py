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
