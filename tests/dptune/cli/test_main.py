"""The dptune command end to end on the shipped MNIST digits: release folder, SIGKILL + resume,
and malformed configs refused before any private computation."""

import importlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest

from dptune import configs, learners
from dptune.cli import build as cli
from dptune.cli.build import ConfigError
from dptune.errors import Refused
from tests.journal_rows import journal_rows
from tests.paths import REPO

ROOT = REPO
SMOKE = str(ROOT / "configs" / "smoke.py")
# A tiny version of the smoke run: 1 epoch per candidate, logarithmic K with mean 3; seed 9 draws
# K = 3 (checked in test_resume), so a kill can land after the first candidate.
# Groups of 2 exercise the executor's train_many path (trainers.loop.train_candidates).
TINY = [
    "--config.train.epochs=1",
    "--config.selection.mean_trials=3",
    "--config.executor.group_size=2",
    "--seed=9",
    "--noprogress",
]


def _run(workdir, ledger, *extra, wait=True):
    cmd = [sys.executable, "-m", "dptune.cli.main", f"--config={SMOKE}", f"--workdir={workdir}"]
    cmd += [*TINY, f"--config.ledger.path={ledger}", *extra]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    if not wait:
        # A run to interrupt: Ctrl-C's default handling even where the test runner was started
        # as a background job, whose children inherit SIGINT ignored (then Python never raises
        # KeyboardInterrupt: seen in a `.ci/run &`). The same entry point as `python -m`.
        child = (
            "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "from dptune.cli.main import run; run()"
        )
        return subprocess.Popen(
            [sys.executable, "-c", child, *cmd[3:]], cwd=ROOT, env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One uninterrupted tiny run (the end-to-end test and the resume test's reference). It uses
    the suite's compilation cache (warm: ~10 s, not ~50 s compiling cnn26k's steps cold); that a
    fresh ``--compilation_cache`` folder receives a run's compiled steps is checked on a tiny
    model (test_user_data_cli.py::test_a_fresh_compilation_cache_folder_gets_the_compiled_steps)."""
    work = tmp_path_factory.mktemp("ref")
    proc = _run(work / "run", work / "ledger.sqlite")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return work / "run", proc


def test_end_to_end_release_folder(reference):
    run, proc = reference
    rel = run / "release"
    names = {p.name for p in rel.iterdir()}
    assert {
        "result.json",
        "privacy.json",
        "privacy.txt",
        "epsilon.png",
        "training_curve.png",
    } <= names
    assert (rel / "checkpoint").is_dir()
    result = json.loads((rel / "result.json").read_text())
    assert result["released"] is True
    assert set(result["hparams"]) == {"learning_rate", "clip_norm", "noise_multiplier"}
    assert 0.5 < result["test_accuracy"] <= 1.0  # one private epoch on 7,000 digits
    privacy = json.loads((rel / "privacy.json").read_text())
    assert privacy["total_epsilon"] <= 4.0 and privacy["delta"] == 1e-5
    assert privacy["single_run_epsilon"] < privacy["total_epsilon"]
    assert privacy["selection"]["mean"] == pytest.approx(3.0)
    assert privacy["seeded"] is True
    assert "secret" in (rel / "privacy.txt").read_text()
    # nothing about the other candidates: not K, not their scores, in the release or the console
    shown = " ".join(p.read_text() for p in rel.glob("*.json")) + (rel / "privacy.txt").read_text()
    shown += proc.stdout + proc.stderr
    with sqlite3.connect(run / "private" / "journal.sqlite") as db:
        scores = [r[0] for r in db.execute("SELECT score FROM candidates ORDER BY idx")]
    others = [x for x in scores if x != result["validation_score"]]
    assert len(others) == 2
    for x in others:
        assert repr(x) not in shown and f"{x:.4g}" not in shown and f"{x:.3f}" not in shown
    assert '"num_trials"' not in shown and "K=" not in shown
    rows = journal_rows(run)
    assert len(rows) == 3 and all(r[1] == "done" and r[2] == 1 for r in rows)
    # the released training curve: public per-epoch quantities only (the epsilon so far and the
    # test accuracy on the public test split; never the exact training loss)
    curve = json.loads((rel / "training_curve.json").read_text())
    assert [row["epoch"] for row in curve] == list(range(1, len(curve) + 1))
    assert all(set(row) == {"epoch", "epsilon_one_run", "test_accuracy"} for row in curve)
    assert curve[-1]["test_accuracy"] == pytest.approx(result["test_accuracy"])
    assert curve[-1]["epsilon_one_run"] == pytest.approx(privacy["single_run_epsilon"], rel=1e-3)
    # the released checkpoint restores and reproduces the released test accuracy
    from dptune.data import MNIST_10K_DIR
    from dptune.release import load_params
    from trainers.data import load_dataset
    from trainers.evaluate import evaluate

    data = load_dataset(
        "mnist", str(MNIST_10K_DIR), validation_size=1000, source="idx", num_examples=8000
    )
    acc = evaluate(load_params(rel), "cnn26k", data.test_x, data.test_y)
    assert acc == pytest.approx(result["test_accuracy"], abs=1e-6)
    # the release and the journal name no absolute path (orbax's commit note included): the
    # workdir can be moved or copied and still resumes or restores
    for path in [*rel.rglob("*"), *(run / "private").rglob("*")]:
        if path.is_file():
            assert str(run.parent).encode() not in path.read_bytes(), path


@pytest.mark.slow  # an interrupted and a resumed CLI run (~65 s); the twins: test_bad_inputs.py
@pytest.mark.parametrize("sig, code, name", [(signal.SIGINT, 130, "SIGINT"),
                                             (signal.SIGTERM, 143, "SIGTERM")])  # fmt: skip
def test_signal_stops_with_one_line_and_its_resume_command_completes_the_same_release(
    reference, tmp_path, sig, code, name
):
    """Item 5: Ctrl-C (or SIGTERM) while a candidate trains: exit 130 (143), no traceback, one
    line saying what was saved and the exact command that resumes; that command, run as printed,
    finishes the run with the release an uninterrupted run gives, charged once."""
    import shlex

    ref_run, _ = reference
    work, ledger = tmp_path / "run", tmp_path / "ledger.sqlite"
    proc = _run(work, ledger, wait=False)
    deadline = time.time() + 300
    while time.time() < deadline:  # once a candidate is done and the next one is training
        rows = journal_rows(work)
        if any(r[1] == "done" for r in rows) and any(r[1] == "running" for r in rows):
            break
        if proc.poll() is not None:
            pytest.fail(
                "the run ended before it could be interrupted: " + proc.stdout.read().decode()
            )
        time.sleep(0.05)  # the last group trains for about a second, its release takes 0.2 s
    proc.send_signal(sig)
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == code, out[-2000:]
    assert "Traceback" not in out
    lines = [ln for ln in out.splitlines() if ln.startswith("dptune: interrupted")]
    assert len(lines) == 1 and f"({name})" in lines[0] and "saved in" in lines[0], out[-2000:]
    command = shlex.split(lines[0].split("Resume with: ")[1])
    assert command[0] == "dptune" and f"--workdir={work}" in command
    again = subprocess.run(
        [sys.executable, "-m", "dptune", *command[1:]], cwd=ROOT, capture_output=True, text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=400,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming the run" in again.stderr
    assert json.loads((work / "release" / "result.json").read_text()) == json.loads(
        (ref_run / "release" / "result.json").read_text()
    )
    with sqlite3.connect(ledger) as db:
        assert db.execute("SELECT COUNT(*) FROM charges").fetchone()[0] == 1


@pytest.mark.slow  # a killed and a resumed CLI run (~65 s)
def test_resume_after_sigkill_gives_same_release(reference, tmp_path):
    ref_run, _ = reference
    work, ledger = tmp_path / "run", tmp_path / "ledger.sqlite"
    proc = _run(work, ledger, wait=False)
    deadline = time.time() + 300
    while time.time() < deadline:  # kill -9 once a candidate is done and the next one is running
        rows = journal_rows(work)
        if any(r[1] == "done" for r in rows) and any(r[1] == "running" for r in rows):
            break
        if proc.poll() is not None:
            pytest.fail("the run ended before it could be killed: " + proc.stdout.read().decode())
        time.sleep(0.2)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = journal_rows(work)
    done_before = {r[0] for r in before if r[1] == "done"}
    assert done_before and not (work / "release").exists()

    again = _run(work, ledger)
    assert again.returncode == 0, again.stdout + again.stderr
    after = {r[0]: r for r in journal_rows(work)}
    assert all(after[i][2] == 1 for i in done_before)  # finished candidates were not retrained
    assert json.loads((work / "release" / "result.json").read_text()) == json.loads(
        (ref_run / "release" / "result.json").read_text()
    )
    # charged once although started twice
    with sqlite3.connect(ledger) as db:
        assert db.execute("SELECT COUNT(*) FROM charges").fetchone()[0] == 1
    # the same workdir with another config is refused
    changed = _run(work, ledger, "--config.privacy.epsilon=3.5")
    assert changed.returncode == 2 and "different config" in changed.stderr


# --- malformed configs: refused with a clear message before any private computation --------------


@pytest.fixture(scope="module")
def smoke_data():
    from dptune.data import MNIST_10K_DIR
    from trainers.data import load_dataset

    return load_dataset(
        "mnist", str(MNIST_10K_DIR), validation_size=1000, source="idx", num_examples=8000
    )


def _smoke(**changes):
    from ml_collections import config_dict

    spec = __import__("importlib.util").util.spec_from_file_location("smoke_cfg", SMOKE)
    mod = __import__("importlib.util").util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = cli._plain(mod.get_config())
    for path, value in changes.items():
        cur = cfg
        *parents, last = path.split("__")
        for p in parents:
            cur = cur[p]
        if value is _DELETE:
            del cur[last]
        else:
            cur[last] = value.to_dict() if isinstance(value, config_dict.ConfigDict) else value
    return cfg


_DELETE = object()
LOG_U = {"distribution": "log_uniform", "low": 0.5, "high": 2.0, "privacy": False}

MALFORMED = [
    (dict(privacy__epsilon=0.0), "epsilon"),
    (dict(privacy__epsilon=-1.0), "epsilon"),
    (dict(privacy__epsilon=float("nan")), "epsilon"),
    (dict(privacy__delta=0.0), "delta"),
    (dict(privacy__delta=1.5), "delta"),
    (dict(privacy__delta=1e-3), "1/n"),
    (dict(privacy__epsilon=0.01), "no noise multiplier meets"),
    (dict(privacy__accountant="magic"), "accountant"),
    (dict(data__name="imagenet"), "unknown dataset name"),
    (dict(data__name="cifar10", data__source="auto", data__dir=None), "config.data"),
    (dict(data__dir="/nonexistent/mnist"), "config.data"),
    (dict(data__validation_size=0), "validation_size"),
    (dict(selection__mean_trials=0.5), "mean_trials"),
    (dict(selection__mean_trials=0), "mean_trials"),
    (dict(selection__method="grid"), "selection.method"),
    (dict(selection__method="tnb"), "needs ['--config.selection.shape']"),
    (dict(selection__method="thresholding"), "threshold"),
    (dict(selection__method="non_private_best", selection__k=3), "not private"),
    (dict(space={}), "empty"),
    (dict(space={"learning_rate": 1.0, "noise_multiplier": "auto"}), "empty"),
    (dict(space__learning_rate={**LOG_U, "low": -1.0}), "low > 0"),
    (dict(space__dropout=LOG_U), "unknown hyperparameters"),
    (dict(space__noise_multiplier={**LOG_U, "distribution": "uniform"}), "worst case"),
    (dict(space__noise_multiplier=0.3), "budget"),
    (dict(space__noise_multiplier=0.0), "noise_multiplier"),
    (dict(train__batch_size=9000), "--config.train.batch_size=9000 exceeds"),
    (dict(space__epochs=1), "both"),
    (dict(train__model="resnet"), "model"),
    (dict(executor__group_size=0), "group_size"),
    (dict(ledger__budget_epsilon=1.0), "--config.ledger.budget_epsilon"),
]


@pytest.mark.parametrize("changes, message", MALFORMED)
def test_malformed_config_refused_before_private_computation(
    changes, message, smoke_data, monkeypatch, tmp_path
):
    import trainers.loop

    def forbidden(*a, **k):
        raise AssertionError("private computation started")

    monkeypatch.setattr(trainers.loop, "train_candidate", forbidden)
    monkeypatch.setattr(trainers.loop, "train_candidates", forbidden)
    if "data__name" not in changes and "data__dir" not in changes:
        monkeypatch.setattr(cli, "load_data", lambda cfg: smoke_data)
    cfg = _smoke(**changes, ledger__path=str(tmp_path / "ledger.sqlite"))
    with pytest.raises(Refused) as err:
        cli.run_config(cfg, tmp_path / "run", progress=False)
    assert message in err.value.for_command()
    assert not (tmp_path / "run" / "private").exists()


def test_dry_run_plans_without_private_computation(smoke_data, monkeypatch, tmp_path):
    import trainers.loop

    monkeypatch.setattr(trainers.loop, "train_candidates", None)  # any call would fail
    monkeypatch.setattr(cli, "load_data", lambda cfg: smoke_data)
    dry = cli.run_config(_smoke(), tmp_path / "run", dry_run=True, progress=False)
    space, statement = dry.space, dry.statement
    assert 3.9 < statement.total_epsilon <= 4.0
    assert space.fields["noise_multiplier"] > 0.5  # calibrated, not "auto"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", configs.NAMES)
def test_every_shipped_config_passes_the_checks_it_is_run_with(name, tmp_path):
    """The one validation the run and --dry_run share accepts every shipped config as shipped
    (the declared Fashion-MNIST runs were once refused here: the space's text constant
    ``model="scatter_linear"`` was read as a malformed number)."""
    cfg = _load_shipped(name)
    if name == "user":  # the template: the user names their file and model on the command line
        cfg.data.update(path=str(tmp_path / "data.npz"), num_examples=50_000)
    checked = cli.validate(cfg, tmp_path / "run")
    assert checked.space.fields  # something to search or fix


def _load_shipped(name):
    return importlib.import_module(f"dptune.configs.{name}").get_config()


def test_a_text_constant_in_the_space_stays_text_and_a_bad_auto_field_is_refused(tmp_path):
    cfg = _load_shipped("smoke")
    del cfg.train.model
    cfg.space.model = "cnn26k"
    checked = cli.validate(cfg, tmp_path / "run")
    assert checked.space.fields["model"] == "cnn26k"
    cfg.space.noise_multiplier = "lots"
    with pytest.raises(ConfigError, match="noise_multiplier='lots' must be 'auto'"):
        cli.validate(cfg, tmp_path / "run")


@pytest.mark.parametrize("learner", ["dpsgd", "fisher", "public_data"])
@pytest.mark.parametrize("name", configs.NAMES)
def test_every_learner_runs_from_every_shipped_config(name, learner):
    """A config's hyperparameter sections belong to the learner they were written for:
    ``--config.trainer=NAME`` on any shipped config takes the fields NAME knows and its own
    defaults for the rest, instead of refusing the other learner's fields."""
    cfg = importlib.import_module(f"dptune.configs.{name}").get_config()
    cfg.trainer = learner
    if cfg.data.source == "npz":
        cfg.data.update(path="arrays.npz", num_examples=50_000)  # the user config's own fields
    if learner == "public_data":
        cfg.learner.num_public = 1000  # its option without a default (refused when unset)
    checked = cli.validate(cfg, None)
    known = set(learners.get(learner).trainer_class().hyperparams_class.__dataclass_fields__)
    assert set(checked.cfg["train"]) | set(checked.cfg["space"]) <= known
    assert "noise_multiplier" in checked.cfg["space"]


def test_the_user_config_derives_its_size_dependent_defaults_from_the_declared_size():
    """The ``user`` config leaves validation size, batch, epochs, learning-rate range and the mean
    number of candidates unset; a run fills them from config.data.num_examples (public) and the
    optimiser, and keeps any that the user set."""
    from dptune.configs import user
    from dptune.learners.dpsgd import LEARNING_RATE_RANGES, suggested_settings

    def checked(n, **train):
        cfg = user.get_config()
        cfg.data.update(path="arrays.npz", num_examples=n)
        cfg.train.update(**train)
        return cli.validate(cfg, None).cfg

    for n in (2_000, 60_000):
        got, want = checked(n), suggested_settings(n, "momentum", 10.0)
        assert got["data"]["validation_size"] == want["validation_size"]
        assert (got["train"]["batch_size"], got["train"]["epochs"]) == (
            want["batch_size"], want["epochs"])  # fmt: skip
        assert got["selection"]["mean_trials"] == want["mean_trials"]
        lr = got["space"]["learning_rate"]
        assert (lr["low"], lr["high"]) == pytest.approx(want["learning_rate"])
        assert lr["low"] == pytest.approx(LEARNING_RATE_RANGES["momentum"][0] * want["batch_size"])
    assert checked(2_000)["train"]["epochs"] != checked(60_000)["train"]["epochs"]
    mine = checked(2_000, epochs=3, optimizer="adam")
    assert mine["train"]["epochs"] == 3  # the user's value is kept
    assert (mine["space"]["learning_rate"]["low"], mine["space"]["learning_rate"]["high"]) == (
        LEARNING_RATE_RANGES["adam"])  # fmt: skip


def test_a_space_entry_that_is_not_an_open_range_is_left_as_given():
    """Only a learning-rate range whose ends are unset is filled: a one-value choice (the
    privacy-utility script's untuned arm) or a set range is kept as it is."""
    from dptune.configs import user

    cfg = user.get_config().to_dict()
    cfg["data"].update(path="arrays.npz", num_examples=5_000)
    cfg["space"]["learning_rate"] = {"distribution": "choice", "values": [0.3]}
    assert cli.validate(cfg, None).cfg["space"]["learning_rate"] == {
        "distribution": "choice", "values": [0.3]}  # fmt: skip
