"""``dptune.audit`` end to end on a user's hand-written DP-SGD (numpy, MNIST-10k): the correct
function's bound stays below its stated epsilon, the same function without noise is caught; the
workdir, ledger and refusals. Fixed seeds: deterministic, not flaky."""

from __future__ import annotations

import json

import numpy as np
import pytest

import dptune
from dptune import space as sp
from dptune._state.ledger import Ledger
from dptune.errors import TuningConfigError
from selection import RandomStopping
from tests.dptune.auditing import user_trainer as ut

BUDGET = (1.0, 1e-5)
M = 100


@pytest.fixture(scope="module")
def data():
    return ut.load_flat()


def _space():
    return dict(learning_rate=sp.log_uniform(0.5, 2.0), clip_norm=1.0, noise_multiplier="auto")


def _audit(trainer, data, **kw):
    cx, cy = ut.pixel_canaries(data[0], M)
    kw.setdefault("what", "training")
    return dptune.audit(
        trainer, _space(), RandomStopping.logarithmic(2.0), BUDGET, canaries=(cx, cy),
        score=ut.margin_score, seed=kw.pop("seed", 3), progress=False, **kw,
    )  # fmt: skip


def test_correct_user_function_stays_below_its_epsilon(data):
    result = _audit(ut.make_trainer(*data), data)
    assert result.released and result.canaries == M
    assert 0 < result.stated_epsilon <= BUDGET[0]
    assert result.epsilon_lower_bound <= result.stated_epsilon
    assert not result.exceeds


def test_user_function_without_noise_is_caught(data):
    """Same declaration (the same epsilon is stated), no noise: the audit exceeds it."""
    result = _audit(ut.make_trainer(*data, noise=False), data)
    assert result.exceeds, result
    assert result.epsilon_lower_bound > result.stated_epsilon
    assert result.guesses > 0 and result.correct / result.guesses > 0.9


def test_tuning_run_workdir_ledger_and_resume(data, tmp_path):
    """what="tuning": audit.json / audit.md, the release says it is an audit, the ledger charges an
    audit entry and not the dataset, and a rerun returns the finished result."""
    ledger = tmp_path / "ledger.sqlite"
    work = tmp_path / "audit"
    trainer = ut.make_trainer(*data)
    result = _audit(trainer, data, what="tuning", workdir=work, ledger=ledger)
    saved = json.loads((work / "audit.json").read_text())
    assert saved["status"] == "done"
    assert saved["epsilon_lower_bound"] == result.epsilon_lower_bound
    assert saved["stated_epsilon"] == pytest.approx(BUDGET[0], rel=1e-2)  # tuning: the total
    assert "lower bound" in (work / "audit.md").read_text()
    assert "AUDIT RUN" in (work / "release" / "privacy.txt").read_text()
    with Ledger(ledger) as led:
        rows = led._db.execute("SELECT fingerprint FROM charges").fetchall()
    assert len(rows) == 1 and rows[0][0].startswith("audit-")
    # the coins are private: not in the audit's public files
    assert "included" not in (work / "audit.md").read_text()
    again = _audit(trainer, data, what="tuning", workdir=work, ledger=ledger)
    assert again == result
    # killed after the release but before the audit's own files: the rerun scores the release
    # folder's payload (the same coins, read back from private/) and charges nothing more
    (work / "audit.json").write_text(json.dumps({**saved, "status": "running"}))
    assert _audit(trainer, data, what="tuning", workdir=work, ledger=ledger) == result
    with Ledger(ledger) as led:
        assert led._db.execute("SELECT COUNT(*) FROM charges").fetchone()[0] == 1


def test_refusals(data, tmp_path):
    trainer = ut.make_trainer(*data)
    cx, cy = ut.pixel_canaries(data[0], M)
    run = dict(space=_space(), selection=RandomStopping.logarithmic(2.0), budget=BUDGET)
    with pytest.raises(TuningConfigError, match="score="):
        dptune.audit(trainer, canaries=(cx, cy), progress=False, **run)
    with pytest.raises(TuningConfigError, match="does not design canaries"):
        dptune.audit(trainer, score=ut.margin_score, progress=False, **run)
    with pytest.raises(TuningConfigError, match="break="):
        dptune.audit(trainer, canaries=(cx, cy), score=ut.margin_score, break_="typo", **run)
    with pytest.raises(TuningConfigError, match="needs a trainer that can inject"):
        dptune.audit(
            trainer, canaries=(cx, cy), score=ut.margin_score, break_="noise_reused", **run
        )
    no_kwarg = dptune.trainer(privacy=trainer.privacy_fn, score_kind="covered")(
        lambda hp, rng: (0.0, None)
    )
    with pytest.raises(TuningConfigError, match="canaries=\\(x, y\\)"):
        dptune.audit(no_kwarg, canaries=(cx, cy), score=ut.margin_score, **run)
    # a tuning run's folder is never reused for an audit
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "journal.sqlite").write_bytes(b"")
    with pytest.raises(TuningConfigError, match="holds a tuning run"):
        dptune.audit(trainer, canaries=(cx, cy), score=ut.margin_score, workdir=tmp_path, **run)


def test_coins_are_fair_and_from_os_entropy():
    from dptune.auditing.canaries import draw_inclusion

    a, b = draw_inclusion(4000, None), draw_inclusion(4000, None)
    assert not np.array_equal(a, b)  # OS entropy: two audits never share their coins
    assert abs(a.mean() - 0.5) < 0.05
    assert np.array_equal(draw_inclusion(50, 7), draw_inclusion(50, 7))


def test_dpsgd_gradient_canaries_refuse_a_feature_model():
    """Refused while planning, before anything trains: the marker pixel of a gradient canary
    would not survive the scattering transform."""
    from dptune.learners.dpsgd import DpSgdTrainer
    from trainers.data import make_synthetic

    data = make_synthetic(num_train=300, num_test=10, validation_size=50)
    trainer = DpSgdTrainer(data, dict(epochs=1, batch_size=64, model="scatter_linear"))
    space = dict(learning_rate=sp.log_uniform(1.0, 2.0), noise_multiplier="auto")
    with pytest.raises(TuningConfigError, match="reads features"):
        dptune.audit(
            trainer, space, RandomStopping.logarithmic(2.0), (1.0, 1e-3), canaries=16,
            progress=False,
        )  # fmt: skip
