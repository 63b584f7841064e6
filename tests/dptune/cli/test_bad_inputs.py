"""Ordinary mistakes and hostile inputs, through the ``dptune`` command and the library.

Every refusal is exit code 2 and ONE ``dptune: refused:`` line on stderr that names the field (or
file) and the fix, no traceback, and the budget ledger exactly as it was (nothing private ran).
Per-record problems in private data are dropped and counted, not refused; failed candidates are
recorded and never released as a success (exit code 3).

Most cases run the command in this process (``dptune.cli.main.cli``: the console script's code
after ``sys.argv``) on one tiny config (DP-Fisher, NumPy only: nothing to compile) and a few hundred
synthetic digits written once as IDX files, so each case costs milliseconds. The cases where the
process boundary matters (the installed entry point's exit codes, output before logging is set up)
run as subprocesses; the signal cases are in ``test_main.py`` (slow, a DP-SGD run to interrupt) with
their in-process twins here. docs/errors.md describes the rule and the exit codes.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import math
import os
import pickle
import re
import shutil
import signal
import sqlite3
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import dptune
from dptune import space
from dptune._state.ledger import Ledger
from dptune.accounting.events import DpSgdCandidate
from dptune.cli import inspect as inspect_cmd
from dptune.cli import ledger as ledger_cmd
from dptune.cli.main import cli
from dptune.errors import Refused
from dptune.learners import fisher
from dptune.tuner import FunctionTrainer
from selection import BestOfK, RandomStopping
from tests.dptune.cli.tiny import CONFIG, IDX, make_arrays, write_dataset
from tests.paths import REPO
from tests.release_whitelist import check_release_whitelist


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("tiny") / "data")


@dataclasses.dataclass
class Result:
    code: int
    out: str
    err: str


class Env:
    """One test's folder: a workdir, a ledger, and the command run in this process."""

    def __init__(self, tmp: Path, data: Path, capsys) -> None:
        self.tmp, self.data, self.capsys = tmp, data, capsys
        self.work = tmp / "run"
        self.ledger = tmp / "ledger.sqlite"

    def args(self, *extra: str, workdir: Path | None = None, data: Path | None = None) -> list:
        return [
            f"--config={CONFIG}", f"--config.data.dir={data or self.data}",
            f"--workdir={workdir or self.work}", "--noprogress", "--seed=1",
            f"--config.ledger.path={self.ledger}", *extra,
        ]  # fmt: skip

    def run(self, *extra: str, bare: bool = False, **kw) -> Result:
        """``dptune`` with the tiny config (``bare``: only ``extra``)."""
        return self.call(cli, ["dptune", *(list(extra) if bare else self.args(*extra, **kw))])

    def call(self, fn, argv: list) -> Result:
        self.capsys.readouterr()
        code = fn(argv)
        out, err = self.capsys.readouterr()
        return Result(code, out, err)

    def ledger_state(self) -> object:
        return ledger_state(self.ledger)


def ledger_state(path: Path) -> object:
    """Everything a ledger holds (None if there is none): compared before and after a refusal."""
    if not path.exists():
        return None
    if path.is_dir() or path.stat().st_size == 0 or path.read_bytes()[:6] != b"SQLite":
        return path.read_bytes() if path.is_file() else "dir"
    try:
        with sqlite3.connect(path) as db:
            return [db.execute(f"SELECT * FROM {t}").fetchall() for t in ("datasets", "charges")]
    except sqlite3.DatabaseError:
        return path.read_bytes()


@pytest.fixture
def env(tmp_path, data_dir, capsys, monkeypatch) -> Env:
    monkeypatch.chdir(tmp_path)
    return Env(tmp_path, data_dir, capsys)


def refused(r: Result, *fragments: str, code: int = 2, prefix: str = "dptune: refused:") -> str:
    """The one refusal line (asserts the exit code, one such line, no traceback)."""
    assert r.code == code, (r.code, r.err[-2000:], r.out[-500:])
    lines = [ln for ln in r.err.splitlines() if ln.startswith(prefix)]
    assert len(lines) == 1, r.err[-2000:]
    assert "Traceback" not in r.out + r.err
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def no_private_files(work: Path) -> None:
    assert not (work / "private").exists() and not (work / "release").exists()


# --- flags, config files, overrides: refused before anything is read (in-process) -----------------

#: (id, extra arguments, a fragment of the one line). Each runs as a real run AND as --dry_run: the
#: two share one validation, so they refuse the same settings with the same words.
ARG_CASES = [
    ("seed-negative", ["--seed=-1"], "seed=-1"),
    ("seed-not-int", ["--seed=abc"], "seed"),
    ("unknown-flag", ["--bogus=1"], "bogus"),
    ("extra-argument", ["extra"], "unexpected arguments"),
    ("override-unknown-field", ["--config.bogus=1"], "does not have"),
    ("override-wrong-type", ["--config.privacy.epsilon=abc"], "privacy.epsilon"),
    ("epsilon-zero", ["--config.privacy.epsilon=0"], "epsilon"),
    ("epsilon-negative", ["--config.privacy.epsilon=-1"], "epsilon"),
    ("epsilon-nan", ["--config.privacy.epsilon=nan"], "epsilon"),
    ("epsilon-inf", ["--config.privacy.epsilon=inf"], "epsilon"),
    ("delta-zero", ["--config.privacy.delta=0"], "delta"),
    ("delta-above-one", ["--config.privacy.delta=1.5"], "delta"),
    ("delta-above-1/n", ["--config.privacy.delta=0.01"], "1/n"),
    ("accountant", ["--config.privacy.accountant=magic"], "accountant"),
    ("adjacency", ["--config.privacy.adjacency=swap"], "adjacency"),
    ("dataset-name", ["--config.data.name=imagenet"], "unknown dataset name"),
    ("num-examples-zero", ["--config.data.num_examples=0"], "num_examples"),
    ("validation-size-zero", ["--config.data.validation_size=0"], "validation_size"),
    ("validation-size-negative", ["--config.data.validation_size=-5"], "validation_size"),
    ("validation-public-without-set", ["--config.data.validation_public=True"], "validation_dir"),
    ("selection-method", ["--config.selection.method=grid"], "selection.method"),
    ("thresholding-without-threshold", ["--config.selection.method=thresholding"], "threshold"),
    ("mean-trials-below-1", ["--config.selection.mean_trials=0.5"], "mean_trials"),
    ("mean-trials-1e9", ["--config.selection.mean_trials=1e9"], "mean_trials"),
    (
        "not-private-selection",
        ["--config.selection.method=non_private_best", "--config.selection.k=3"],
        "not private",
    ),  # fmt: skip
    ("group-size-zero", ["--config.executor.group_size=0"], "group_size"),
    ("executor-kind", ["--config.executor.kind=quantum"], "quantum"),
    ("trainer-name", ["--config.trainer=svm"], "svm"),
    ("space-low-negative", ["--config.space.clip_norm.low=-1.0"], "low"),
    ("fixed-noise-not-a-number", ["--config.space.noise_multiplier=lots"], "noise_multiplier"),
    ("fixed-noise-too-small", ["--config.space.noise_multiplier=0.5"], "budget"),
    ("budget-too-small-for-any-noise", ["--config.privacy.epsilon=0.001"], "no noise"),
    ("ledger-budget-below-run", ["--config.ledger.budget_epsilon=1.0"], "budget_epsilon"),
    ("ledger-delta-below-run", ["--config.ledger.budget_delta=1e-6"], "budget_delta"),
    ("debug-with-ledger", ["--debug_nonprivate"], "debug_nonprivate"),
]


@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry_run"])
@pytest.mark.parametrize(
    "extra, fragment", [c[1:] for c in ARG_CASES], ids=[c[0] for c in ARG_CASES]
)
def test_bad_flags_and_settings_are_refused_in_one_line(env, extra, fragment, dry):
    before = env.ledger_state()
    r = env.run(*extra, *(["--dry_run"] if dry else []))
    refused(r, fragment)
    assert env.ledger_state() == before
    assert not (env.work / "private").exists()


def test_a_fixed_noise_multiplier_from_the_command_line_is_a_number(env):
    """``--config.space.noise_multiplier=1.5`` (the field's default is the string "auto")."""
    r = env.run("--config.space.noise_multiplier=1.5", "--dry_run")
    assert r.code == 0, r.err
    assert "'noise_multiplier': 1.5" in r.out


# --- config files and names -----------------------------------------------------------------------

CONFIG_FILES = {
    "syntax-error": ("def get_config(:\n", "could not be loaded"),
    "raises": ("def get_config():\n    return 1 / 0\n", "ZeroDivisionError"),
    "no-get-config": ("x = 1\n", "could not be loaded"),
    "returns-a-list": ("def get_config():\n    return [1, 2]\n", "get_config"),
    "misspelt-field": (
        "from dptune.configs import base\n\ndef get_config():\n    c = base.get_config()\n"
        "    c.data.nme = 'mnist'\n    return c\n",
        "did you mean config.data.name",
    ),
    "hyperparameter-no-learner-knows": (
        "from tests.dptune.cli.bad_inputs_config import get_config as tiny\n\n"
        "def get_config():\n    c = tiny()\n    c.train.nmu_features = 3\n    return c\n",
        "unknown hyperparameters ['nmu_features']",
    ),
    "unknown-section": (
        "from dptune.configs import base\n\ndef get_config():\n    c = base.get_config()\n"
        "    c.optimiser = {'lr': 1}\n    return c\n",
        "config.optimiser",
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIG_FILES))
def test_broken_config_files_are_refused(env, name):
    text, fragment = CONFIG_FILES[name]
    (env.tmp / "mine.py").write_text(text)
    r = env.run("--config=mine.py", f"--workdir={env.work}", "--noprogress", bare=True)
    refused(r, fragment)
    assert env.ledger_state() is None and not env.work.exists()


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--workdir=w"], "--config=NAME is required"),
        (["--config=smoke"], "--workdir=DIR is required"),
        (["--config=nofile.py", "--workdir=w"], "no such config file"),
        (["--config=smok", "--workdir=w"], "did you mean --config=smoke"),
        (["--config", "--workdir=w"], "no such config file"),
        (["--config"], "needs a value"),
    ],
    ids=[
        "no-config",
        "no-workdir",
        "missing-file",
        "typo-of-a-shipped-name",
        "flag-as-value",
        "config-at-the-end",
    ],  # fmt: skip
)
def test_missing_or_misnamed_config_is_refused(env, args, fragment):
    refused(env.run(*args, bare=True), fragment)
    assert not Path("w").exists()


def test_a_config_folder_and_a_shadowing_file_are_refused_but_a_folder_named_smoke_is_not(env):
    Path("configs_dir").mkdir()
    refused(env.run("--config=configs_dir", "--workdir=w", bare=True), "is a folder")
    Path("smoke").write_text("def get_config():\n    return None\n")
    refused(env.run("--config=smoke", "--workdir=w", bare=True), "ambiguous")
    Path("smoke").unlink()
    Path("smoke").mkdir()  # a local folder named like the shipped config: the shipped one is meant
    r = env.run("--config", "smoke", "--workdir=w", "--dry_run", "--noprogress",
                f"--config.ledger.path={env.ledger}", bare=True)  # fmt: skip
    assert r.code == 0 and "Dry run" in r.out, r.err[-1500:]


@pytest.mark.parametrize("flag", ["--help", "-h", "--helpfull"])
def test_help_exits_0(env, flag):
    r = env.run(flag, bare=True)
    assert r.code == 0 and "--workdir" in r.out and "Traceback" not in r.err


# --- the workdir ----------------------------------------------------------------------------------


def test_workdir_that_is_a_file_or_under_a_file_is_refused(env):
    Path("afile").write_text("x")
    refused(env.run(workdir=env.tmp / "afile"), "is a file")
    refused(env.run(workdir=env.tmp / "afile" / "run"), "is a file")
    env.work.mkdir()
    (env.work / "private").write_text("x")
    refused(env.run(), "private is a file")
    assert env.ledger_state() is None


def test_read_only_workdir_is_refused(env, monkeypatch):
    """As root (this sandbox) a read-only folder is still writable, so the check is driven here
    through ``os.access``, the call it makes."""
    env.work.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if Path(p) == env.work else real(p, m))
    refused(env.run(), "not writable")
    assert env.ledger_state() is None


def test_workdir_in_use_is_refused(env):
    from dptune._state.workdir_lock import workdir_lock

    with workdir_lock(env.work):  # another run holds it (flock is per open file, even here)
        refused(env.run(), "in use by another dptune run")
    assert env.ledger_state() is None and not (env.work / "private").exists()


# --- malformed data files -------------------------------------------------------------------------


def _corrupt(folder: Path, key: str, how: str) -> None:
    path = folder / IDX[key]
    raw = path.read_bytes()
    if how == "truncated":
        path.write_bytes(raw[: len(raw) // 2])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "text":
        path.write_text("not an IDX file at all\n")
    elif how == "header-only":
        path.write_bytes(raw[:6])
    elif how == "gz-truncated":
        path.unlink()
        (folder / (IDX[key] + ".gz")).write_bytes(gzip.compress(raw)[:40])
    elif how == "gz-garbage":
        path.unlink()
        (folder / (IDX[key] + ".gz")).write_bytes(b"\x1f\x8b" + os.urandom(64))
    elif how == "missing":
        path.unlink()


DATA_FILE_CASES = [
    ("train_x", "truncated", "header says shape"),
    ("train_y", "truncated", "header says shape"),
    ("train_x", "empty", "not an unsigned-byte IDX file"),
    ("train_x", "text", "not an unsigned-byte IDX file"),
    ("train_x", "header-only", "cut short"),
    ("train_x", "gz-truncated", "cannot be read"),
    ("train_y", "gz-garbage", "cannot be read"),
    ("train_y", "missing", "lacks IDX files"),
    ("test_x", "truncated", "header says shape"),
    ("test_y", "missing", "lacks IDX files"),
]


@pytest.mark.parametrize(
    "key, how, fragment", DATA_FILE_CASES, ids=[f"{k}-{h}" for k, h, _ in DATA_FILE_CASES]
)
def test_corrupt_data_files_are_refused_with_their_path(env, key, how, fragment):
    folder = write_dataset(env.tmp / "data")
    _corrupt(folder, key, how)
    r = env.run(data=folder)
    line = refused(r, fragment, "config.data")
    assert str(folder) in line
    assert env.ledger_state() is None
    no_private_files(env.work)


def _with(**changes) -> dict[str, np.ndarray]:
    arrays = make_arrays()
    for key, value in changes.items():
        arrays[key] = value(arrays[key]) if callable(value) else value
    return arrays


SHAPE_CASES = {
    "counts-differ": (_with(train_y=lambda y: y[:-7]), "the two files must describe"),
    "images-2d": (_with(train_x=lambda x: x.reshape(len(x), -1)), "(n, height, width)"),
    "labels-2d": (_with(train_y=lambda y: np.stack([y, y], 1)), "labels have shape (n,)"),
    "test-labels-out-of-range": (
        _with(test_y=lambda y: np.where(np.arange(len(y)) < 3, 77, y)),
        "label out of range",
    ),
}


@pytest.mark.parametrize("name", sorted(SHAPE_CASES))
def test_malformed_arrays_are_refused(env, name):
    arrays, fragment = SHAPE_CASES[name]
    folder = write_dataset(env.tmp / "data", arrays)
    refused(env.run(data=folder), fragment)
    assert env.ledger_state() is None
    no_private_files(env.work)


def test_missing_data_folder_and_validation_folder_are_refused(env):
    refused(env.run(data=env.tmp / "nowhere"), "not a folder")
    (env.tmp / "val").mkdir()
    r = env.run("--config.data.validation_dir=" + str(env.tmp / "val"))
    refused(r, "lacks IDX files")
    assert env.ledger_state() is None


CIFAR_CASES = {
    "garbage": (lambda p: p.write_bytes(os.urandom(100)), "not a CIFAR-10 python batch"),
    "no-labels-key": (
        lambda p: p.write_bytes(pickle.dumps({b"data": np.zeros((2, 3072), np.uint8)})),
        "b'labels'",
    ),
    "wrong-width": (
        lambda p: p.write_bytes(
            pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]})
        ),
        "(n, 3072)",
    ),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:50]), "not a CIFAR-10 python batch"),
}


@pytest.mark.parametrize("name", sorted(CIFAR_CASES))
def test_corrupt_cifar_pickles_are_refused(env, name):
    folder = env.tmp / "cifar"
    folder.mkdir()
    good = {b"data": np.zeros((10, 3072), np.uint8), b"labels": list(range(10))}
    for f in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (folder / f).write_bytes(pickle.dumps(good))
    damage, fragment = CIFAR_CASES[name]
    damage(folder / "data_batch_3")
    r = env.run("--config.data.name=cifar10", "--config.data.source=cifar_pickle",
                "--config.data.num_examples=50", "--config.data.validation_size=10",
                data=folder)  # fmt: skip
    line = refused(r, fragment)
    assert "data_batch_3" in line
    assert env.ledger_state() is None


def test_private_records_with_bad_labels_are_dropped_and_counted_not_refused(env):
    """A label out of range in the PRIVATE training file is that person's record's problem: the
    record is dropped on its own (a stable transformation, docs/privacy-model.md), the run goes
    on, the curator's view counts it, and the console warns without the count."""
    arrays = _with(train_y=lambda y: np.where(np.isin(np.arange(len(y)), [5, 17]), 200, y))
    folder = write_dataset(env.tmp / "data", arrays)
    r = env.run(data=folder)
    assert r.code == 0, r.err[-2000:]
    assert "dropped malformed private records (label out of range)" in r.err
    assert "Traceback" not in r.err
    view = inspect_cmd.read_run(env.work)["curator_view"]
    assert view == {"label_out_of_range": 2}
    shown = env.call(inspect_cmd.cli, ["inspect", str(env.work)])
    assert "loader: label_out_of_range: 2" in shown.out


def test_drop_invalid_records_is_per_record():
    from trainers.data import drop_invalid_records

    x = np.zeros((6, 2, 2, 1), np.float32)
    x[1, 0, 0, 0] = np.nan
    x[4, 1, 1, 0] = np.inf
    y = np.array([0, 1, 10, 3, -1, 9])
    kept_x, kept_y, counts = drop_invalid_records(x, y, 10)
    assert kept_y.tolist() == [0, 3, 9] and kept_y.dtype == np.int32
    # record 4 has both problems: counted once, under the first reason
    assert counts == {"label_out_of_range": 2, "non_finite_features": 1}
    # adding one bad or good record changes the output by at most that record
    x2, y2, _ = drop_invalid_records(np.concatenate([x, x[:1]]), np.append(y, 7), 10)
    assert y2.tolist() == [0, 3, 9, 7]
    _, y3, c3 = drop_invalid_records(x, np.array([0, 1, 2.5, 3, 4, 5]), 10)
    assert c3["label_out_of_range"] == 1 and 2 not in y3.tolist()


# --- state on disk: journals and ledgers ----------------------------------------------------------


@pytest.fixture(scope="module")
def finished_template(tmp_path_factory, data_dir):
    """One finished run of the tiny config (workdir and ledger), copied by the tests that damage
    one: a workdir is bound to no absolute path, so a copy is the same run."""
    root = tmp_path_factory.mktemp("finished")
    ledger = root / "ledger.sqlite"
    code = cli(["dptune", f"--config={CONFIG}", f"--config.data.dir={data_dir}",
                f"--workdir={root / 'run'}", "--noprogress", "--seed=1",
                f"--config.ledger.path={ledger}"])  # fmt: skip
    assert code == 0
    return root / "run", ledger


@pytest.fixture
def finished(env, finished_template) -> Env:
    """``env`` holding a finished run (a copy of the template's workdir and ledger)."""
    work, ledger = finished_template
    shutil.copytree(work, env.work)
    shutil.copy(ledger, env.ledger)
    return env


JOURNAL_DAMAGE = {
    "garbage": (lambda p: p.write_bytes(os.urandom(4096)), "not an SQLite file"),
    "empty": (lambda p: p.write_bytes(b""), "is empty"),
    "foreign": (
        lambda p: (p.unlink(), sqlite3.connect(p).execute("CREATE TABLE songs (title TEXT)")),
        "not a dptune journal",
    ),
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:1500]), "journal"),
}


@pytest.mark.parametrize("name", sorted(JOURNAL_DAMAGE))
@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry_run"])
def test_damaged_journal_is_refused_not_restarted(finished, name, dry):
    env = finished
    shutil.rmtree(env.work / "release")  # as if killed before the release: a rerun would resume
    journal = env.work / "private" / "journal.sqlite"
    for side in ("-wal", "-shm"):
        Path(str(journal) + side).unlink(missing_ok=True)
    damage, fragment = JOURNAL_DAMAGE[name]
    damage(journal)
    before, damaged = env.ledger_state(), journal.read_bytes()
    r = env.run(*(["--dry_run"] if dry else []))
    line = refused(r, fragment)
    assert str(journal) in line or "journal" in line
    assert env.ledger_state() == before and journal.read_bytes() == damaged  # left as it was


def test_results_without_their_journal_are_refused(finished):
    env = finished
    (env.work / "private" / "journal.sqlite").unlink()
    refused(env.run(), "release", "journal")
    shutil.rmtree(env.work / "release")
    refused(env.run(), "candidates", "journal")


def test_partial_journal_missing_a_candidate_result_is_refused(finished):
    env = finished
    shutil.rmtree(env.work / "release")
    next((env.work / "private" / "candidates").iterdir()).unlink()
    refused(env.run(), "is missing", "candidates")


def test_other_config_or_other_code_on_a_workdir_is_refused(finished):
    env = finished
    refused(env.run("--config.privacy.epsilon=7"), "different config")
    journal = env.work / "private" / "journal.sqlite"
    with sqlite3.connect(journal) as db:  # as if the trainer's code had been edited since
        db.execute("UPDATE meta SET value = ? WHERE key = 'code'", (json.dumps({"trainer": "x"}),))
    refused(env.run(), "other code", "new --workdir")


LEDGER_DAMAGE = {
    "garbage": (lambda p: p.write_bytes(os.urandom(2048)), "not an SQLite file"),
    "empty": (lambda p: p.write_bytes(b""), "is empty"),
    "foreign": (
        lambda p: sqlite3.connect(p).execute("CREATE TABLE songs (title TEXT)"),
        "not a dptune ledger",
    ),
    "folder": (lambda p: p.mkdir(), "is a folder"),
    "missing-columns": (
        lambda p: (
            sqlite3.connect(p).execute("CREATE TABLE datasets (fingerprint TEXT)"),
            sqlite3.connect(p).execute("CREATE TABLE charges (run_id TEXT)"),
        ),
        "lacks the columns",
    ),
}


@pytest.mark.parametrize("name", sorted(LEDGER_DAMAGE))
@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry_run"])
def test_damaged_ledger_is_refused(env, name, dry):
    damage, fragment = LEDGER_DAMAGE[name]
    damage(env.ledger)
    before = env.ledger_state()
    line = refused(env.run(*(["--dry_run"] if dry else [])), fragment)
    assert str(env.ledger) in line and "backup" in line
    assert env.ledger_state() == before
    assert not (env.work / "private").exists()


def test_exhausted_or_mismatched_ledger_budget_is_refused(finished):
    env = finished  # a run that spent 8 of the stated 100
    before = env.ledger_state()
    fp = before[0][0][0]
    with Ledger(env.ledger) as led:
        led.charge(fp, "someone-else", 90.0, 1e-3)
    before = env.ledger_state()
    refused(env.run(workdir=env.tmp / "second"), "has spent", "dptune ledger")
    assert env.ledger_state() == before
    refused(env.run("--config.ledger.budget_epsilon=50", workdir=env.tmp / "third"),
            "holds a lifetime budget")  # fmt: skip
    assert env.ledger_state() == before
    assert not (env.tmp / "second" / "private").exists()


# --- failed candidates: recorded, never released --------------------------------------------------


FAILURES = {
    "raises": (
        lambda self, hp, rng: (_ for _ in ()).throw(ValueError("boom in the trainer")),
        "ValueError",
        "boom in the trainer",
    ),  # fmt: skip
    "nan": (lambda self, hp, rng: (float("nan"), {}), "NonFiniteScore", "nan"),
    "inf": (lambda self, hp, rng: (float("inf"), {}), "NonFiniteScore", "inf"),
    "not-a-number": (lambda self, hp, rng: ("high", {}), "InvalidScore", "'high'"),
    "wrong-arity": (lambda self, hp, rng: (0.5,), "ValueError", "unpack"),
}


@pytest.mark.parametrize("name", sorted(FAILURES))
def test_every_candidate_failing_releases_nothing_and_exits_3(env, monkeypatch, name):
    fn, kind, text = FAILURES[name]
    monkeypatch.setattr(fisher.FisherTrainer, "__call__", fn)
    r = env.run()
    line = refused(r, "stays charged", "dptune inspect", code=3,
                   prefix="dptune: no candidate succeeded")  # fmt: skip
    assert "nan" not in line.lower()
    result = check_release_whitelist(env.work / "release")
    assert result == {"released": False, "reason": "no_candidate_succeeded"}
    report = (env.work / "release" / "report.md").read_text()
    assert "no candidate succeeded" in report and "DP-Fisher" in report
    assert not re.search(r"\bnan\b", report, re.I)
    assert env.ledger_state()[1], "the candidates touched the data: the run stays charged"
    run = inspect_cmd.read_run(env.work)
    assert run["candidates"] and all(c["failed"] for c in run["candidates"])
    assert {c["failure"]["type"] for c in run["candidates"]} == {kind}
    assert text in run["candidates"][0]["failure"]["message"]


def test_a_failing_trainers_traceback_is_readable_through_inspect(env, monkeypatch):
    """Item 2: the exception's type, message and traceback are in private/, and `dptune inspect
    DIR --candidate=N` prints them under the curator-only warning; never in the release."""
    calls = []
    real = fisher.FisherTrainer.__call__

    def sometimes(self, hp, rng):
        calls.append(1)
        if len(calls) == 2:
            raise FloatingPointError("diverged at step 17")
        return real(self, hp, rng)

    monkeypatch.setattr(fisher.FisherTrainer, "__call__", sometimes)
    r = env.run("--config.selection.method=best_of_k", "--config.selection.k=3")
    assert r.code == 0 and "Released:" in r.out, r.err[-2000:]
    listing = env.call(inspect_cmd.cli, ["inspect", str(env.work)])
    assert listing.code == 0 and listing.out.startswith("PRIVATE")
    assert "FloatingPointError: diverged at step 17" in listing.out
    one = env.call(inspect_cmd.cli, ["inspect", str(env.work), "--candidate=1"])
    assert one.code == 0 and "Traceback (most recent call last)" in one.out
    assert "in sometimes" in one.out and "diverged at step 17" in one.out
    released = " ".join(p.read_text(errors="ignore") for p in (env.work / "release").glob("*.*"))
    assert "diverged" not in released and "FloatingPointError" not in released


@pytest.mark.parametrize(
    "error, traceback, kind",
    [
        (
            "FloatingPointError: diverged",
            "Traceback (most recent call last): ...",
            "FloatingPointError",
        ),
        (None, None, "NonFiniteParameters"),
    ],  # fmt: skip
    ids=["raised", "non-finite"],
)
def test_dpsgd_failures_carry_their_reason(monkeypatch, error, traceback, kind):
    """DP-SGD's loop reports a failed candidate (an exception, or non-finite parameters) in its
    result; the trainer hands the reason on as the journal's failure record, not a payload."""
    import trainers.loop
    from dptune.errors import CandidateFailure
    from dptune.learners.dpsgd import DpSgdTrainer
    from trainers.data import make_synthetic
    from trainers.spec import CandidateResult

    failed = CandidateResult(None, float("nan"), [], True, error, traceback)
    monkeypatch.setattr(trainers.loop, "train_candidates", lambda hps, *a, **k: [failed] * len(hps))
    trainer = DpSgdTrainer(make_synthetic(num_train=300, num_test=10, validation_size=50),
                           epoch_progress=False)  # fmt: skip
    score, payload = trainer({"noise_multiplier": 1.0, "batch_size": 50}, np.random.default_rng(0))
    assert math.isnan(score) and isinstance(payload, CandidateFailure)
    assert payload.type == kind and payload.traceback == (traceback or "")


INSPECT_CASES = [
    (["inspect"], "one WORKDIR"),
    (["inspect", "nowhere"], "holds no run"),
    (["inspect", "a", "b"], "one WORKDIR"),
    (["inspect", "--bogus", "x"], "bogus"),
]


@pytest.mark.parametrize("argv, fragment", INSPECT_CASES, ids=["none", "missing", "two", "flag"])
def test_inspect_refuses_in_one_line(env, argv, fragment):
    refused(env.call(inspect_cmd.cli, argv), fragment)


def test_inspect_refuses_a_damaged_journal_and_an_unknown_candidate(finished):
    env = finished
    refused(env.call(inspect_cmd.cli, ["inspect", str(env.work), "--candidate=99"]),
            "no candidate 99")  # fmt: skip
    (env.work / "private" / "journal.sqlite").write_bytes(b"junk" * 100)
    refused(env.call(inspect_cmd.cli, ["inspect", str(env.work)]), "not an SQLite file")


LEDGER_CMD_CASES = [
    (["--budget_epsilon=1", "--budget_delta=1e-5"], "--dataset=ID is required"),
    (["--dataset=abc", "--budget_epsilon=1", "--budget_delta=1e-5"], "full 64-character id"),
    (["--dataset=" + "a" * 64, "--budget_epsilon=-1", "--budget_delta=1e-5"], "> 0"),
    (["--dataset=" + "a" * 64, "--budget_epsilon=nan", "--budget_delta=1e-5"], "finite"),
    (["--dataset=" + "a" * 64, "--budget_epsilon=1", "--budget_delta=2"], "(0, 1)"),
    (["--dataset=" + "a" * 64, "--budget_epsilon=1"], "give both"),
    (["--bogus"], "bogus"),
    (["extra"], "unexpected arguments"),
]


@pytest.mark.parametrize("argv, fragment", LEDGER_CMD_CASES)
def test_ledger_command_refuses_in_one_line(env, argv, fragment):
    r = env.call(ledger_cmd.cli, ["ledger", f"--ledger={env.ledger}", *argv])
    refused(r, fragment)
    assert env.ledger_state() is None


def test_ledger_command_refuses_a_damaged_ledger_and_an_unknown_dataset(finished):
    env = finished
    before = env.ledger_state()
    r = env.call(ledger_cmd.cli, ["ledger", f"--ledger={env.ledger}", "--dataset=ffff"])
    refused(r, "no registered dataset")
    fp = before[0][0][0]
    r = env.call(ledger_cmd.cli, ["ledger", f"--ledger={env.ledger}", f"--dataset={fp[:10]}",
                                  "--budget_epsilon=1", "--budget_delta=1e-3"])  # fmt: skip
    refused(r, "cannot be set below")
    assert env.ledger_state() == before
    env.ledger.write_bytes(b"")
    refused(env.call(ledger_cmd.cli, ["ledger", f"--ledger={env.ledger}"]), "is empty")


# --- the library: the same checks, the same words -------------------------------------------------


def _toy(calls=None):
    def train(hp, rng):
        (calls if calls is not None else []).append(hp)
        return -abs(math.log(hp["learning_rate"] / 0.3)), {"lr": hp["learning_rate"]}

    return FunctionTrainer(train, lambda hp: DpSgdCandidate(0.01, 200, hp["noise_multiplier"]),
                           10_000, "toy-data", score_kind="covered")  # fmt: skip


SPACE = dict(learning_rate=space.log_uniform(0.01, 10.0), noise_multiplier="auto")

LIBRARY_CASES = [
    ("seed", dict(seed=-1), "seed=-1"),
    ("seed-bool", dict(seed=True), "seed=True"),
    ("group-size", dict(group_size=0), "group_size"),
    ("accountant", dict(accountant="magic"), "accountant"),
    ("adjacency", dict(adjacency="swap"), "adjacency"),
    ("budget-epsilon", dict(budget=(0.0, 1e-5)), "epsilon"),
    ("budget-delta", dict(budget=(1.0, 2.0)), "delta"),
    ("budget-type", dict(budget="lots"), "budget"),
    ("empty-space", dict(space={}), "empty"),
    ("selection-size", dict(selection=RandomStopping.logarithmic(1e9)), "mean_trials"),
    ("debug-with-default-ledger", dict(debug_nonprivate=True), "debug_nonprivate"),
    (
        "no-dataset-id",
        dict(
            trainer=FunctionTrainer(
                lambda hp, rng: (0.0, {}),
                DpSgdCandidate(0.01, 200, 1.0),
                10_000,
                score_kind="covered",
            ),
            space=dict(learning_rate=space.log_uniform(0.1, 1.0)),
        ),
        "names no dataset",
    ),  # fmt: skip
    ("workdir-is-a-file", dict(workdir="afile"), "is a file"),
    ("ledger-corrupt", dict(ledger="bad.sqlite"), "not an SQLite file"),
    ("dataset-budget-below", dict(dataset_budget=(0.5, 1e-5)), "dataset_budget="),
]


@pytest.mark.parametrize("kwargs, fragment", [c[1:] for c in LIBRARY_CASES],
                         ids=[c[0] for c in LIBRARY_CASES])  # fmt: skip
def test_library_refuses_like_the_command(tmp_path, monkeypatch, kwargs, fragment):
    monkeypatch.chdir(tmp_path)
    Path("afile").write_text("x")
    Path("bad.sqlite").write_bytes(b"junk" * 50)
    calls: list = []
    args = dict(trainer=_toy(calls), space=SPACE, selection=BestOfK(2), budget=(2.0, 1e-5),
                seed=1, workdir=tmp_path / "run", progress=False)  # fmt: skip
    args.update(kwargs)
    default_ledger = Path(os.environ["DPTUNE_LEDGER"])
    with pytest.raises(Refused) as err:
        dptune.tune(**args)
    assert fragment in str(err.value) and "\n" not in str(err.value).strip()
    assert calls == [] and not (tmp_path / "run" / "private").exists()
    assert not default_ledger.exists()


def test_a_fixed_trainer_is_not_handed_its_old_failed_release(tmp_path):
    """A user's trainer failed every candidate; they fix the function and rerun with the same
    workdir: refused (the workdir is bound to the code), not the old "no candidate succeeded"."""

    def broken(hp, rng):
        raise RuntimeError("typo in my trainer")

    def fixed(hp, rng):
        return -abs(math.log(hp["learning_rate"] / 0.3)), {}

    def trainer(fn):
        return FunctionTrainer(fn, lambda hp: DpSgdCandidate(0.01, 200, hp["noise_multiplier"]),
                               10_000, "toy-data", score_kind="covered")  # fmt: skip

    args = (SPACE, BestOfK(2), (2.0, 1e-5))
    kw = dict(seed=1, workdir=tmp_path / "run", progress=False, ledger=None)
    assert dptune.tune(trainer(broken), *args, **kw).outcome == "no_candidate_succeeded"
    with pytest.raises(Refused, match="other code"):
        dptune.tune(trainer(fixed), *args, **kw)
    assert dptune.tune(trainer(fixed), *args, **{**kw, "workdir": tmp_path / "new"}).released


def test_a_model_that_does_not_fit_the_images_is_refused_before_training(env):
    """The data's schema is public: a model whose input shape is not the images' is refused with
    the other settings, not discovered by every candidate failing (and the run charged)."""
    for dry in ([], ["--dry_run"]):
        r = env.run("--config=smoke", f"--workdir={env.work}", "--noprogress",
                    f"--config.ledger.path={env.ledger}", "--config.train.model=cifar_cnn", *dry,
                    bare=True)  # fmt: skip
        refused(r, "expects images of shape")
        assert env.ledger_state() is None and not (env.work / "private").exists()


def test_library_and_command_refuse_with_the_same_words(env):
    r = env.run("--seed=-1")
    with pytest.raises(Refused) as err:
        dptune.tune(_toy(), SPACE, BestOfK(2), (2.0, 1e-5), seed=-1)
    assert refused(r) == f"dptune: refused: {err.value}"


def test_library_charges_the_default_ledger_like_the_command(tmp_path, monkeypatch):
    """``tune()`` without ``ledger=`` charges ``$DPTUNE_LEDGER`` (~/.dptune/ledger.sqlite), as
    the command does without config.ledger.path; ``ledger=None`` charges nothing."""
    path = tmp_path / "default.sqlite"
    monkeypatch.setenv("DPTUNE_LEDGER", str(path))
    rel = dptune.tune(_toy(), SPACE, BestOfK(2), (2.0, 1e-5), seed=1, progress=False)
    with Ledger(path) as led:
        spend = led.spend("toy-data")
    assert spend.runs == 1 and spend.spent_epsilon == pytest.approx(rel.privacy["total_epsilon"])
    dptune.tune(_toy(), SPACE, BestOfK(2), (2.0, 1e-5), seed=1, progress=False, ledger=None)
    with Ledger(path) as led:
        assert led.spend("toy-data").runs == 1


# --- interruption (in-process twins of test_main.py's signal tests) -------------------------------


def _interrupting(after: int, exc: type[BaseException] | None = None):
    calls = []
    real = fisher.FisherTrainer.__call__

    def call(self, hp, rng):
        calls.append(1)
        if len(calls) == after:
            if exc is None:
                os.kill(os.getpid(), signal.SIGTERM)  # the handler raises where Python resumes
            else:
                raise exc()
        return real(self, hp, rng)

    return call


@pytest.mark.parametrize("how, code, name", [(KeyboardInterrupt, 130, "SIGINT"),
                                             (None, 143, "SIGTERM")])  # fmt: skip
def test_interrupt_prints_one_line_and_the_resume_completes_the_same_release(
    env, monkeypatch, how, code, name
):
    k = ["--config.selection.method=best_of_k", "--config.selection.k=3"]
    ref = env.run(*k, workdir=env.tmp / "ref")
    assert ref.code == 0, ref.err[-2000:]
    with monkeypatch.context() as m:
        m.setattr(fisher.FisherTrainer, "__call__", _interrupting(2, how))
        r = env.run(*k)
    line = refused(r, f"interrupted ({name})", "saved in", "Resume with: dptune", code=code,
                   prefix="dptune: interrupted")  # fmt: skip
    assert "--workdir=" + str(env.work) in line and "--seed=1" in line
    assert not (env.work / "release").exists()
    charged = env.ledger_state()
    again = env.run(*k)
    assert again.code == 0 and "resuming the run" in again.err, again.err[-2000:]
    assert env.ledger_state() == charged  # the resume is not charged again
    for f in ("result.json", "privacy.json"):
        assert (env.work / "release" / f).read_text() == (
            env.tmp / "ref" / "release" / f
        ).read_text()


def test_interrupt_before_anything_is_saved_says_so(env, monkeypatch):
    import dptune.cli.build as build

    def stop(cfg):
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "load_data", stop)
    r = env.run()
    refused(r, "nothing was trained, saved or charged", "Resume with", code=130,
            prefix="dptune: interrupted")  # fmt: skip


def test_an_unexpected_error_is_one_line_with_the_traceback_in_a_file(env, monkeypatch):
    import dptune.tuner as tuner

    def bug(*a, **k):
        raise TypeError("a bug, not the user's mistake")

    monkeypatch.setattr(tuner, "release_selected", bug)
    r = env.run()
    line = refused(r, "unexpected TypeError", "traceback is in", code=1, prefix="dptune: error")
    log_file = Path(line.split("traceback is in ")[1].split(";")[0])
    assert "Traceback" in log_file.read_text() and log_file.parent == env.work / "private"
    assert stat.S_IMODE(log_file.stat().st_mode) == 0o600  # owner-only, like all of private/


# --- through the installed entry point (a subprocess: exit codes, output before logging) ----------


def _entry(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run([sys.executable, "-m", "dptune", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


# Each costs a fresh interpreter importing JAX (~2-5 s): one in the default suite, the others
# slow; every one has its in-process twin above.
_SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "args, code, fragment",
    [
        (["--config=nofile.py", "--workdir=w"], 2, "no such config file"),
        pytest.param(["--help"], 0, None, marks=_SLOW),
        pytest.param(["inspect", "nowhere"], 2, "holds no run", marks=_SLOW),
        pytest.param(
            ["ledger", "--budget_epsilon=-1", "--dataset=" + "a" * 64, "--budget_delta=1e-5"],
            2,
            "> 0",
            marks=_SLOW,
        ),  # fmt: skip
        pytest.param(
            ["account", "--sampling_rate=2", "--steps=10", "--noise_multiplier=1"],
            2,
            "sampling_rate",
            marks=_SLOW,
        ),  # fmt: skip
    ],
    ids=["config", "help", "inspect", "ledger", "account"],
)
def test_entry_point_exit_codes(tmp_path, args, code, fragment):
    p = _entry(*args, cwd=tmp_path)
    assert p.returncode == code, p.stderr[-2000:]
    assert "Traceback" not in p.stdout + p.stderr
    if fragment is not None:
        lines = [ln for ln in p.stderr.splitlines() if ln.startswith("dptune: refused:")]
        assert len(lines) == 1 and fragment in lines[0], p.stderr
    assert not (tmp_path / "w").exists()


# --- the refusal rule at the edges: the library's objects, released files, disks, pipes ---------


def test_dpsgd_trainer_given_bare_arrays_is_refused_in_one_line():
    from dptune.learners.dpsgd import DpSgdTrainer

    x, y = np.zeros((10, 4), np.float32), np.zeros(10, np.int32)
    with pytest.raises(Refused) as err:
        DpSgdTrainer((x, y), base=dict(batch_size=5, epochs=1))
    assert "Dataset.from_arrays" in str(err.value) and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def released(tmp_path_factory) -> Path:
    """A finished toy run whose release holds a model checkpoint (orbax)."""
    work = tmp_path_factory.mktemp("released") / "run"

    def train(hp, rng):
        return -abs(math.log(hp["learning_rate"] / 0.3)), {
            "params": {"w": np.arange(3.0, dtype=np.float32)}
        }

    trainer = FunctionTrainer(train, lambda hp: DpSgdCandidate(0.01, 200, hp["noise_multiplier"]),
                              10_000, "toy-release", score_kind="covered")  # fmt: skip
    rel = dptune.tune(trainer, SPACE, BestOfK(2), (2.0, 1e-5), seed=1, workdir=work,
                      progress=False, ledger=None)  # fmt: skip
    assert rel.released and (work / "release" / "checkpoint").is_dir()
    return work


@pytest.mark.parametrize("target", ["privacy.json", "result.json", "checkpoint-metadata"])
def test_a_damaged_release_names_the_damaged_file(released, tmp_path, target):
    work = tmp_path / "copy"
    shutil.copytree(released, work)
    if target == "checkpoint-metadata":
        found = sorted(p for p in (work / "release" / "checkpoint").rglob("*METADATA*")
                       if p.is_file())  # fmt: skip
        assert found, list((work / "release" / "checkpoint").rglob("*"))
        path = found[0]
    else:
        path = work / "release" / target
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(Refused) as err:
        dptune.load_release(work)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "error",
    [
        OSError(28, "No space left on device"),
        OSError(30, "Read-only file system"),
        sqlite3.OperationalError("database or disk is full"),
    ],
    ids=["full-disk", "read-only", "sqlite-full"],
)
def test_a_full_disk_or_a_read_only_folder_is_refused_naming_the_folder(env, monkeypatch, error):
    import dptune.cli.build as build

    if isinstance(error, OSError):
        error.filename = str(env.work / "private" / "journal.sqlite")

    def fail(workdir):
        raise error

    monkeypatch.setattr(build, "workdir_lock", fail)
    line = refused(env.run(), "cannot write to", str(env.work))
    assert "bug" not in line
    assert env.ledger_state() is None


def test_a_syntax_error_in_the_users_model_names_the_module_and_line(env):
    Path("badmodel.py").write_text("import flax.linen as nn\n\ndef make(num_classes:\n    pass\n")
    r = env.run("--config.trainer=dpsgd", "--config.model=badmodel:make")
    refused(r, "config.model", "syntax error", "badmodel.py", "line 3")
    assert env.ledger_state() is None
    no_private_files(env.work)


def test_a_csv_given_as_an_npz_is_refused_as_not_an_npz(env):
    Path("data.csv").write_text("x,y\n" + "".join(f"{i},{i % 2}\n" for i in range(50)))
    r = env.run("--config.data.source=npz", "--config.data.path=data.csv",
                "--config.data.num_examples=50", "--config.data.validation_size=10")  # fmt: skip
    line = refused(r, "is not an npz file", "data.csv")
    assert "allow_pickle" not in line
    assert env.ledger_state() is None


@pytest.mark.parametrize(
    "command, flag",
    [("account", "--sampling_rate"), ("inspect", "--candidate"), ("ledger", "--budget_epsilon"),
     ("audit", "--canaries")],
)  # fmt: skip
def test_every_subcommand_help_prints_its_flags_and_exits_0(env, command, flag):
    import importlib

    module = importlib.import_module(f"dptune.cli.{command}")
    r = env.call(module.cli, [f"dptune {command}", "--help"])
    assert r.code == 0 and flag in r.out and "Traceback" not in r.err, (r.out[-500:], r.err)


def test_audit_without_a_workdir_is_refused_in_one_line(env):
    from dptune.cli import audit as audit_cmd

    r = env.call(audit_cmd.cli, ["dptune audit", f"--config={CONFIG}"])
    refused(r, "--workdir=DIR is required")
    assert env.ledger_state() is None


class _ClosedPipe:
    """stdout whose reader has gone (``| head``): every write and flush raises."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        raise ValueError("no file descriptor")


def test_a_closed_pipe_ends_the_command_quietly(monkeypatch, capsys):
    from dptune.cli import common

    monkeypatch.setattr(sys, "argv", ["dptune inspect", "--help"])
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    with pytest.raises(SystemExit) as ended:
        common.entry(inspect_cmd.cli)
    sys.stdout = sys.__stdout__  # the replacement devnull is the test's to drop
    assert ended.value.code == 0
    assert capsys.readouterr().err == ""


def test_a_huge_epsilon_calibrates_without_numeric_noise(env):
    """epsilon = 1000 ("almost no noise", a usual sanity run): the accountant's numbers overflow
    for sigma near the answer; those sigmas count as giving no guarantee, and the calibration
    ends with a sigma whose epsilon is a number at most 1000, without warnings."""
    from dptune.cli import account

    argv = ["dptune account", "--sampling_rate=0.01", "--steps=50", "--target_epsilon=1000",
            "--selection=logarithmic", "--mean_trials=2", "--json"]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # an overflow warning fails the test
        r = env.call(account.cli, argv)
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert 0 < out["total_epsilon"] <= 1000 and out["noise_multiplier"] > 0
    assert "NaN" not in r.err and "Warning" not in r.err
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        r = env.run("--config.privacy.epsilon=1000", "--config.ledger.budget_epsilon=1e4",
                    "--dry_run")  # fmt: skip
    assert r.code == 0 and "Traceback" not in r.err, r.err[-2000:]
