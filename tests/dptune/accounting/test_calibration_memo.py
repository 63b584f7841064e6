"""A remembered calibration (``calibrate(..., memo=)``) saves the search of a second identical
calibration and nothing else: the statement is recomputed at the remembered sigma, and a value
that does not pass the same tightness test is searched again."""

import pytest

from dptune.accounting import calibration
from dptune.accounting.calibration import FileMemo, calibrate
from dptune.accounting.events import DpSgdCandidate

ARGS = dict(target_epsilon=2.0, delta=1e-5, accountant="rdp", compare=False)


def calibrate_noise(memo=None, **kw):
    """One DP-SGD setting (q = 0.01, 200 steps), calibrated by RDP (fast)."""
    return calibrate(lambda s: DpSgdCandidate(0.01, 200, s), None, **{**ARGS, **kw}, memo=memo)


def _counting(monkeypatch):
    calls = []
    real = calibration._solve

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(calibration, "_solve", counted)
    return calls


def test_a_second_identical_calibration_skips_the_search(monkeypatch, tmp_path):
    calls = _counting(monkeypatch)
    memo = FileMemo(tmp_path / "calibration.json")
    first = calibrate_noise(memo)
    searched = len(calls)
    assert searched >= 1 and len(memo) == 1
    second = calibrate_noise(memo)
    assert len(calls) == searched  # no search: the remembered sigma, checked
    assert second.noise_multiplier == first.noise_multiplier
    assert second.statement == first.statement
    # anything else the search depends on is another entry
    calibrate_noise(memo, target_epsilon=2.5)
    assert len(calls) > searched and len(memo) == 2


@pytest.mark.parametrize("factor", [0.5, 2.0])  # over the budget / needlessly loose
def test_a_wrong_remembered_sigma_is_searched_again(monkeypatch, tmp_path, factor):
    fresh = calibrate_noise()
    memo: dict = {}
    calibrate_noise(memo)
    (key,) = memo
    memo[key] = fresh.noise_multiplier * factor
    calls = _counting(monkeypatch)
    again = calibrate_noise(memo)
    assert calls and again.noise_multiplier == fresh.noise_multiplier
    assert memo[key] == fresh.noise_multiplier
    assert again.statement.total_epsilon <= ARGS["target_epsilon"]


def test_a_damaged_memo_file_reads_as_empty(tmp_path):
    path = tmp_path / "calibration.json"
    path.write_text("{not json")
    memo = FileMemo(path)
    assert len(memo) == 0
    first = calibrate_noise(memo)
    assert list(FileMemo(path).values()) == [first.noise_multiplier]


def test_the_plan_remembers_unless_warm_starts_are_off(monkeypatch, tmp_path):
    import dptune
    from dptune.accounting.calibration import default_memo
    from selection import RandomStopping

    monkeypatch.setenv("DPTUNE_CACHE", str(tmp_path))
    monkeypatch.setenv("DPTUNE_COMPILATION_CACHE", "off")
    assert default_memo() is None
    monkeypatch.delenv("DPTUNE_COMPILATION_CACHE")
    assert default_memo().path == tmp_path / "calibration.json"
    trainer = dptune.FunctionTrainer(
        lambda hp, rng: (0.5, None),
        lambda hp: calibration.DpSgdCandidate(0.01, 200, hp["noise_multiplier"]),
        num_examples=10_000,
        score_kind="covered",
    )
    space = dict(learning_rate=dptune.space.choice(0.1, 1.0), noise_multiplier="auto")
    plans = [
        dptune.plan_privacy(trainer, space, RandomStopping.logarithmic(mean=2), (3.0, 1e-5),
                            accountant="rdp")[1]
        for _ in range(2)
    ]  # fmt: skip
    assert len(FileMemo(tmp_path / "calibration.json")) == 1
    assert plans[0] == plans[1]
