"""Privacy ledger: per-dataset budget, refusal, idempotent charges, no overspend when concurrent."""

import threading

import pytest

from dptune.ledger import BudgetExceededError, Ledger, LedgerBudgetMismatchError


def test_charges_add_up_and_refuse_overspend(tmp_path):
    led = Ledger(tmp_path / "l.sqlite")
    kw = dict(budget_epsilon=5.0, budget_delta=1e-5)
    s = led.charge("fp", "run1", 2.0, 2e-6, **kw)
    assert (s.spent_epsilon, s.runs) == (2.0, 1)
    s = led.charge("fp", "run1", 2.0, 2e-6, **kw)  # a resume: charged once
    assert (s.spent_epsilon, s.runs) == (2.0, 1)
    led.charge("fp", "run2", 3.0, 2e-6, **kw)  # exactly at the budget is allowed
    with pytest.raises(BudgetExceededError, match="refused before any private computation"):
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
