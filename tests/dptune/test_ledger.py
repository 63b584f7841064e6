"""Privacy ledger: per-dataset budget, refusal, idempotent charges, no overspend when concurrent."""

import threading

import pytest

from dptune._state.ledger import BudgetExceededError, Ledger, LedgerBudgetMismatchError


def test_charges_add_up_and_refuse_overspend(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    kw = dict(budget_epsilon=5.0, budget_delta=1e-5)
    s = led.charge("fp", "run1", 2.0, 2e-6, **kw)
    assert (s.spent_epsilon, s.runs) == (2.0, 1)
    s = led.charge("fp", "run1", 2.0, 2e-6, **kw)  # a resume: charged once
    assert (s.spent_epsilon, s.runs) == (2.0, 1)
    led.charge("fp", "run2", 3.0, 2e-6, **kw)  # exactly at the budget is allowed
    with pytest.raises(BudgetExceededError, match="of its lifetime budget"):
        led.charge("fp", "run3", 0.01, 0.0, **kw)
    assert led.spend("fp").runs == 2 and not led.is_charged("run3")
    # another dataset has its own budget
    assert led.charge("other", "run4", 5.0, 1e-5, **kw).runs == 1
    with pytest.raises(LedgerBudgetMismatchError, match="holds a lifetime budget"):
        led.charge("fp", "run5", 0.1, 0.0, budget_epsilon=50.0, budget_delta=1e-5)
    with pytest.raises(BudgetExceededError):
        led.charge("fresh", "run6", 1.0, 2e-5, **kw)  # delta over budget


def test_concurrent_runs_cannot_overspend(tmp_path):
    path = tmp_path / "l.sqlite"
    Ledger(path).charge("fp", "first", 1.0, 0.0, budget_epsilon=10.0, budget_delta=1e-5)
    ok, refused = [], []
    barrier = threading.Barrier(12)

    def worker(i):
        led = Ledger(path)  # one connection per "process"
        barrier.wait()
        try:
            led.charge("fp", f"r{i}", 2.0, 0.0, budget_epsilon=10.0, budget_delta=1e-5)
            ok.append(i)
        except BudgetExceededError:
            refused.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(ok) == 4 and len(refused) == 8  # 1 + 4*2 = 9 <= 10 < 11
    assert Ledger(path).spend("fp").spent_epsilon == pytest.approx(9.0)


# --- a ledger's first run ------------------------------------------------------------------------


def test_a_dataset_without_a_stated_budget_gets_the_default_of_ten_runs(tmp_path):
    """The policy (_state/ledger.py): no lifetime budget stated -> DEFAULT_LIFETIME_RUNS times the
    first run's (epsilon, delta); a second run like it is charged, not refused."""
    from dptune._state.ledger import DEFAULT_LIFETIME_RUNS

    with Ledger(tmp_path / "l.sqlite") as led:
        first = led.charge("fp", "run1", 3.0, 1e-5)
        assert first.registered
        assert (first.budget_epsilon, first.budget_delta) == pytest.approx(
            (DEFAULT_LIFETIME_RUNS * 3.0, DEFAULT_LIFETIME_RUNS * 1e-5)
        )
        second = led.charge("fp", "run2", 3.0, 1e-5)
        assert second.runs == 2 and not second.registered
        for i in range(3, DEFAULT_LIFETIME_RUNS + 1):
            led.charge("fp", f"run{i}", 3.0, 1e-5)
        with pytest.raises(BudgetExceededError):
            led.charge("fp", "one-too-many", 3.0, 1e-5)


def test_the_same_library_call_runs_twice_on_one_ledger(tmp_path):
    """The README's "your model" block, twice (two workdirs, the curator's default ledger, no
    dataset_budget): the second run is charged, not refused by a budget the first one set."""
    import dptune
    from dptune import space
    from dptune.accounting.events import DpSgdCandidate
    from dptune.tuner import FunctionTrainer
    from selection import BestOfK

    def trainer():
        return FunctionTrainer(lambda hp, rng: (-hp["learning_rate"], {}),
                               lambda hp: DpSgdCandidate(0.01, 200, hp["noise_multiplier"]),
                               10_000, "readme-data", score_kind="covered")  # fmt: skip

    sp = dict(learning_rate=space.log_uniform(0.1, 1.0), noise_multiplier="auto")
    for run in ("one", "two"):
        dptune.tune(trainer(), sp, BestOfK(2), (3.0, 1e-5), seed=1, workdir=tmp_path / run,
                    ledger=tmp_path / "l.sqlite", progress=False)  # fmt: skip
    with Ledger(tmp_path / "l.sqlite") as led:
        assert led.spend("readme-data").runs == 2


def test_library_refusals_name_keywords_and_the_command_names_config_fields(tmp_path):
    with Ledger(tmp_path / "l.sqlite") as led:
        led.charge("fp", "run1", 2.0, 1e-6, budget_epsilon=2.0, budget_delta=1e-5)
        with pytest.raises(BudgetExceededError) as err:
            led.charge("fp", "run2", 1.0, 1e-6)
        with pytest.raises(LedgerBudgetMismatchError) as mismatch:
            led.charge("fp", "run3", 0.1, 0.0, budget_epsilon=5.0, budget_delta=1e-5)
    for e in (err.value, mismatch.value):
        assert "dataset_budget=" in str(e) and "config." not in str(e)
        assert "--config.ledger.budget_epsilon" in e.for_command()
    assert "budget=" in str(err.value) and "--config.privacy.epsilon" in err.value.for_command()


def test_a_new_ledger_is_created_whole_and_named_in_a_warning(tmp_path, caplog):
    """A typo in a ledger path starts a new ledger: the warning names the file. The file appears
    under its name only with its tables (no 0-byte file, no temporary file left)."""
    import logging

    path = tmp_path / "typo" / "ledgr.sqlite"
    with caplog.at_level(logging.WARNING, logger="dptune"):
        Ledger(path).close()
        Ledger(path).close()  # an existing ledger: no second warning
    created = [r.getMessage() for r in caplog.records if "created a new budget ledger" in r.message]
    assert len(created) == 1 and str(path) in created[0]
    assert sorted(p.name for p in path.parent.iterdir()) == ["ledgr.sqlite"]
    assert (path.stat().st_mode & 0o777) == 0o600


def test_a_ledger_being_created_is_never_seen_empty(tmp_path, monkeypatch):
    """Another process opening the ledger while this one creates it sees no file or a whole
    ledger, never an empty 0-byte one (which it would refuse, with advice that loses charges)."""
    import sqlite3

    path = tmp_path / "l.sqlite"
    real = sqlite3.connect
    seen: list = []

    def connect(*args, **kwargs):
        if not seen:  # the creating process, just before SQLite writes: the other one opens
            seen.append(None)
            try:
                Ledger(path).close()
                seen.append("ok")
            except Exception as e:  # noqa: BLE001 - what the other process would have hit
                seen.append(repr(e))
        return real(*args, **kwargs)

    monkeypatch.setattr(sqlite3, "connect", connect)
    with Ledger(path) as led:
        led.charge("fp", "run1", 1.0, 1e-6)
    assert seen[1] == "ok", seen
