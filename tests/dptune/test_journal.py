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
