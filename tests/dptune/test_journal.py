"""Run journal: config binding, plan written once, candidate status across reopen."""

import pytest

from dptune._state.journal import ConfigChangedError, Journal


def test_journal_survives_reopen_and_refuses_changed_config(tmp_path):
    j = Journal(tmp_path / "private")
    assert j.bind_config({"a": 1, "b": {"c": 2}}) is False
    assert j.set_once("plan", {"num_trials": 3}) == {"num_trials": 3}
    j.add_candidates([(0, 11, {"lr": 0.1}), (1, 12, {"lr": 0.2})])
    j.mark_running(0)
    j.mark_done(0, 0.9, failed=False)
    j.mark_running(1)
    j.set("started_at", 1.0)
    j.close()

    j = Journal(tmp_path / "private")
    assert j.bind_config({"b": {"c": 2}, "a": 1}) is True
    assert j.set_once("plan", {"num_trials": 99}) == {"num_trials": 3}  # never re-drawn
    j.add_candidates([(0, 99, {"lr": 9.0})])  # ignored: index 0 exists
    rows = j.candidates()
    assert [(r.index, r.seed, r.status, r.score) for r in rows] == [
        (0, 11, "done", 0.9),
        (1, 12, "running", None),
    ]
    assert rows[1].attempts == 1
    with pytest.raises(ConfigChangedError, match="b.c"):
        j.bind_config({"a": 1, "b": {"c": 3}})
    p = j.write_payload(0, b"xyz")
    assert p.read_bytes() == b"xyz"


class _SignalAfterCommit:
    """A connection whose COMMIT succeeds and is then interrupted, as a SIGTERM handler raising
    between two bytecodes lands after SQLite committed."""

    def __init__(self, db):
        self._db = db

    def __getattr__(self, name):
        return getattr(self._db, name)

    def execute(self, sql, *args):
        out = self._db.execute(sql, *args)
        if sql == "COMMIT":
            raise KeyboardInterrupt("signal after COMMIT")
        return out


def test_a_signal_after_commit_stops_the_run_with_the_write_kept(tmp_path):
    """The signal propagates as itself (not as SQLite's 'cannot rollback - no transaction is
    active', which the run reported as an unexpected error) and what was committed stays."""
    j = Journal(tmp_path / "private")
    j._db = _SignalAfterCommit(j._db)
    with pytest.raises(KeyboardInterrupt, match="after COMMIT"):
        j.set("k", "v")
    j._db = j._db._db
    assert j.get("k") == "v"
