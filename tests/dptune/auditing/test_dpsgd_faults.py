"""The DP-SGD trainer under audit (``dptune.auditing.dpsgd``) breaks the engine only through the
loop's arguments: ``noise_reused`` sets the trainer's ``noise_step`` (every step's noise key
folded with 0), every other setting keeps the default, and the DP-SGD trainer itself has no audit
hooks. Fast twin of the slow negative control in ``test_dpsgd_audit.py``."""

from __future__ import annotations

import numpy as np
import pytest

from dptune.auditing.dpsgd import AuditDpSgdTrainer
from dptune.auditing.run import _hooks
from dptune.learners.dpsgd import DpSgdTrainer
from trainers import loop
from trainers.data import make_synthetic


@pytest.fixture(scope="module")
def parent():
    data = make_synthetic(num_train=200, num_test=10, validation_size=40, seed=0)
    return DpSgdTrainer(data, dict(batch_size=50, epochs=1), epoch_progress=False)


def test_noise_reused_is_an_argument_of_the_loop(parent):
    canaries = AuditDpSgdTrainer.design(parent, "gradient", 4, np.random.default_rng(0))
    included = np.array([True, False, True, False])
    broken = AuditDpSgdTrainer(parent, canaries, included, "noise_reused")
    assert [broken.noise_step(s) for s in (0, 1, 7)] == [0, 0, 0]
    for fault in (None, "exact_score"):
        kept = AuditDpSgdTrainer(parent, canaries, included, fault)
        assert kept.noise_step is loop.same_step and kept.noise_step(7) == 7
    assert parent.noise_step is loop.same_step  # the parent is untouched
    assert not hasattr(parent, "with_canaries") and not hasattr(parent, "audit_canaries")
    design, with_canaries = _hooks(parent)
    assert len(design("input", 3, np.random.default_rng(1))) == 3
    assert isinstance(with_canaries(canaries, included, None), AuditDpSgdTrainer)
