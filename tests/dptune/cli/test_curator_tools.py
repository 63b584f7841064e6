"""The curator's tools and the run's state on disk: ``dptune ledger``
sets and lists budgets, a first run's registration is said out loud, absl's ``--verbosity``
controls the log, a workdir moved (with its data) resumes and holds no absolute path, and
dp_accounting's expected warnings come as one line.

In-process runs of the tiny DP-Fisher config (``tiny.py``): milliseconds each."""

from __future__ import annotations

import logging
import re
import shutil
import sqlite3

import pytest

import dptune
from dptune import space
from dptune.accounting import DpSgdCandidate, total_privacy
from dptune.accounting.quiet import summarised_accounting_warnings
from dptune.cli import inspect as inspect_cmd
from dptune.cli import ledger as ledger_cmd
from dptune.cli.common import setup_logging
from dptune.cli.main import cli
from dptune.learners import fisher
from dptune.tuner import FunctionTrainer
from selection import BestOfK, RandomStopping
from tests.dptune.cli.tiny import CONFIG, write_dataset


@pytest.fixture
def run(tmp_path, capsys, monkeypatch):
    data = write_dataset(tmp_path / "data")
    monkeypatch.chdir(tmp_path)

    def call(*extra, workdir="run", data_dir=None, ledger="ledger.sqlite", fn=cli, bare=False):
        argv = list(extra) if bare else [
            f"--config={CONFIG}", f"--config.data.dir={data_dir or data}", f"--workdir={workdir}",
            "--noprogress", "--seed=1", f"--config.ledger.path={ledger}", *extra,
        ]  # fmt: skip
        capsys.readouterr()
        code = fn(["dptune", *argv])
        out, err = capsys.readouterr()
        return code, out, err

    call.data = data
    return call


def test_ledger_budget_set_before_the_first_run_then_listed_and_shown(run, tmp_path):
    code, out, _ = run("--dry_run")
    assert code == 0
    fp = re.search(r"dataset ([0-9a-f]{64}) has no lifetime budget yet", out).group(1)
    assert not (tmp_path / "ledger.sqlite").exists()  # the dry run wrote nothing
    set_ = ["--ledger=ledger.sqlite", f"--dataset={fp}", "--budget_epsilon=100",
            "--budget_delta=0.01", "--name=tiny digits"]  # fmt: skip
    code, out, _ = run(*set_, fn=ledger_cmd.cli, bare=True)
    assert code == 0 and "registered" in out
    code, out, err = run()
    assert code == 0 and "had no lifetime budget" not in err  # it was set explicitly
    code, out, _ = run("--ledger=ledger.sqlite", fn=ledger_cmd.cli, bare=True)
    row = next(ln for ln in out.splitlines() if ln.startswith(fp[:12]))
    assert "tiny digits" in row and row.split()[-1] == "1"  # one run charged
    code, out, _ = run(
        "--ledger=ledger.sqlite", f"--dataset={fp[:8]}", fn=ledger_cmd.cli, bare=True
    )
    assert code == 0 and "in 1 run(s)" in out and "run" in out.splitlines()[-1]
    raise_ = ["--ledger=ledger.sqlite", f"--dataset={fp[:8]}", "--budget_epsilon=200",
              "--budget_delta=0.01"]  # fmt: skip
    code, out, _ = run(*raise_, fn=ledger_cmd.cli, bare=True)
    assert code == 0 and "changed from (epsilon=100" in out


def test_library_first_run_says_it_fixed_the_datasets_budget(tmp_path, caplog):
    def train(hp, rng):
        return -abs(hp["learning_rate"] - 0.3), {}

    tr = FunctionTrainer(train, lambda hp: DpSgdCandidate(0.01, 200, hp["noise_multiplier"]),
                         10_000, "my-data", score_kind="covered")  # fmt: skip
    sp = dict(learning_rate=space.log_uniform(0.01, 1.0), noise_multiplier="auto")
    with caplog.at_level(logging.INFO, logger="dptune"):
        dptune.tune(tr, sp, BestOfK(2), (2.0, 1e-5), seed=1, ledger=tmp_path / "l.sqlite",
                    progress=False)  # fmt: skip
    warned = [r for r in caplog.records if "had no lifetime budget" in r.message]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert "the default: 10 runs like this one" in warned[0].message
    assert "dptune ledger --dataset=" in warned[0].message


@pytest.mark.parametrize(
    "flags, info_shown",
    [([], True), (["--verbosity=-1"], False), (["-v", "-1"], False), (["--verbosity=1"], True)],
    ids=["default", "warnings-only", "short-flag", "debug"],
)
def test_verbosity_flags_control_what_the_run_prints(run, flags, info_shown):
    code, _, err = run(*flags)
    assert code == 0, err[-2000:]
    assert ("accounting: checking the total budget" in err) == info_shown
    assert "Traceback" not in err


def test_a_moved_workdir_resumes_and_holds_no_absolute_path(run, tmp_path, monkeypatch):
    """Item 4: interrupted at its second candidate, the workdir is moved elsewhere (and the data
    too, as on another machine); the same command with the new paths resumes it to the release an
    uninterrupted run gives. Nothing in the journal, the payloads or the release names a path."""
    k = ["--config.selection.method=best_of_k", "--config.selection.k=3"]
    assert run(*k, workdir="ref")[0] == 0
    calls = []
    real = fisher.FisherTrainer.__call__

    def once_interrupted(self, hp, rng):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, hp, rng)

    with monkeypatch.context() as m:
        m.setattr(fisher.FisherTrainer, "__call__", once_interrupted)
        code, _, err = run(*k, workdir="first/run")
    assert code == 130 and "Resume with: dptune" in err
    shutil.move(tmp_path / "first" / "run", tmp_path / "elsewhere")
    shutil.move(run.data, tmp_path / "moved-data")
    code, _, err = run(*k, workdir="elsewhere", data_dir=tmp_path / "moved-data")
    assert code == 0 and "resuming the run" in err, err[-2000:]
    for name in ("result.json", "privacy.json", "privacy.txt"):
        assert (tmp_path / "elsewhere" / "release" / name).read_text() == (
            tmp_path / "ref" / "release" / name
        ).read_text()
    assert len(calls) == 2  # the first candidate was not trained again
    with sqlite3.connect(tmp_path / "ledger.sqlite") as db:  # charged once (plus the reference)
        assert db.execute("SELECT COUNT(*) FROM charges").fetchone()[0] == 2
    for path in (tmp_path / "elsewhere").rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert str(tmp_path).encode() not in data, path
            assert b"first/run" not in data and b"moved-data" not in data, path


def test_inspect_lists_every_candidate_under_the_private_warning(run):
    assert run("--config.selection.method=best_of_k", "--config.selection.k=3")[0] == 0
    code, out, _ = run("run", fn=inspect_cmd.cli, bare=True)
    assert code == 0 and out.startswith("PRIVATE") and "Never publish" in out
    rows = [ln for ln in out.splitlines() if re.match(r"\s+\d+\s+done", ln)]
    assert len(rows) == 3 and all(re.search(r"noise_multiplier=\d\.\d+", r) for r in rows)
    code, out, _ = run("run", "--json", fn=inspect_cmd.cli, bare=True)
    assert code == 0 and '"candidates"' in out


def test_excluded_renyi_orders_are_one_line_not_dozens(capsys, caplog):
    """dp_accounting logs one warning per Renyi order whose series does not converge (high
    sampling rates); dptune counts them and says it once."""
    sel = RandomStopping.logarithmic(3).privacy
    with caplog.at_level(logging.WARNING, logger="absl"):
        total_privacy(DpSgdCandidate(0.5, 101, 0.7), sel, 1e-5, "rdp")
    dumped = [r for r in caplog.records if "failed to converge" in r.getMessage()]
    assert len(dumped) > 3  # what a newcomer would see without the summary
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dptune"), caplog.at_level(logging.INFO, "absl"):
        with summarised_accounting_warnings():
            total_privacy(DpSgdCandidate(0.5, 103, 0.71), sel, 1e-5, "rdp")  # not cached
    assert not [r for r in caplog.records if "failed to converge" in r.getMessage()]
    summary = [r for r in caplog.records if "Renyi order" in r.getMessage()]
    assert len(summary) == 1 and "stays valid" in summary[0].getMessage()


def test_the_trainers_packages_warnings_print_as_dptune_lines(capsys):
    """A size far from the declared one (trainers.data) or a model falling back to the generic
    clipping path (trainers.step) reaches the curator as a ``dptune:`` line, not as Python's bare
    ``WARNING:trainers.data:`` fallback."""
    setup_logging()
    logging.getLogger("trainers.data").warning("the file holds %d records", 8000)
    logging.getLogger("dptune").info("and dptune's own")
    err = capsys.readouterr().err
    assert err == "dptune: the file holds 8000 records\ndptune: and dptune's own\n"
