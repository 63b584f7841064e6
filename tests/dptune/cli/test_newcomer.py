"""A newcomer's mistakes on the command line, each refused in the command's own words: the
``--config.`` field to fix (never a library keyword) in one ``dptune:`` line, exit code 2, nothing
charged. In-process (``dptune.cli.main.cli``) on the tiny DP-Fisher config: milliseconds each."""

from __future__ import annotations

from pathlib import Path

import pytest

from dptune.cli import build
from dptune.cli.main import cli
from tests.dptune.cli.tiny import CONFIG, write_dataset
from trainers import data as trainers_data


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("tiny") / "data")


def run(capsys, tmp: Path, data: Path, *extra: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = cli([
        "dptune", f"--config={CONFIG}", f"--config.data.dir={data}", f"--workdir={tmp / 'run'}",
        "--noprogress", "--seed=1", f"--config.ledger.path={tmp / 'ledger.sqlite'}", *extra,
    ])  # fmt: skip
    out, err = capsys.readouterr()
    return code, out, err


def refusal(code: int, err: str, tmp: Path) -> str:
    """The one refusal line: exit 2, no traceback, no other warning, no ledger, no journal."""
    assert code == 2, err[-2000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("dptune: refused:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert not (tmp / "ledger.sqlite").exists() and not (tmp / "run" / "private").exists()
    return lines[0]


def test_an_unknown_override_is_named_with_the_field_it_meant(capsys, tmp_path, data_dir):
    line = refusal(*run(capsys, tmp_path, data_dir, "--config.train.num_featurs=3")[:3:2], tmp_path)
    assert "--config.train.num_featurs" in line and "--config.train.num_features" in line, line
    assert "--config.ledger.path" not in line, line  # not every override given: the wrong one
    line = refusal(*run(capsys, tmp_path, data_dir, "--config.foo=1")[:3:2], tmp_path)
    assert "--config.foo" in line and "--config.data.dir" not in line, line


def test_an_impossible_budget_names_the_config_fields_once(capsys, tmp_path, data_dir):
    code, _, err = run(capsys, tmp_path, data_dir, "--config.privacy.epsilon=0.001")
    line = refusal(code, err, tmp_path)
    assert "calibration failed" not in err, err  # the refusal says it once, in the command's words
    for field in ("--config.privacy.epsilon", "--config.selection.mean_trials",
                  "--config.train.score_noise_std"):  # fmt: skip
        assert field in line, (field, line)


def test_a_dataset_not_found_names_the_config_fields(capsys, tmp_path, data_dir, monkeypatch):
    def not_found(*args, **kwargs):
        raise build.dpsgd.DatasetNotFoundError(
            "tensorflow-datasets could not load 'mnist': no module. " + trainers_data._HOW_TO_POINT
        )

    monkeypatch.setattr(build.dpsgd, "load_dataset", not_found)
    line = refusal(*run(capsys, tmp_path, data_dir, "--dry_run")[:3:2], tmp_path)
    assert "--config.data.dir=<folder>" in line and "--config.data.source=idx" in line, line
    assert " data_dir=<folder>" not in line and "source='idx'" not in line, line


def test_the_dry_run_says_a_stated_ledger_budget_is_the_configs_not_the_default(
    capsys, tmp_path, data_dir
):
    code, out, err = run(capsys, tmp_path, data_dir, "--dry_run")  # the config states (100, 0.01)
    assert code == 0, err[-2000:]
    assert "would register the budget this run states (epsilon=100, delta=0.01)" in out, out[-800:]
    assert "the default" not in out, out[-800:]


@pytest.mark.parametrize(
    "override, words",
    [
        ("--config.privacy.delta=0.1", "--config.privacy.delta=0.1 must be below 1/n"),
        ("--config.train.num_features=0", "--config.train.num_features=0"),
        ("--config.space.clip_norm.low=9.0", "--config.space.clip_norm: log_uniform"),
        ("--config.executor.group_size=0", "refused: --config.executor.group_size=0 must be"),
    ],
    ids=["delta-above-1/n", "hyperparameter", "space-field", "executor-option"],
)
def test_a_refused_value_names_its_config_field(capsys, tmp_path, data_dir, override, words):
    line = refusal(*run(capsys, tmp_path, data_dir, override)[:3:2], tmp_path)
    assert words in line, line
    assert "Hyperparams." not in line and "space field" not in line, line


@pytest.mark.parametrize(
    "override, words",
    [
        ("--config.train.num_features=two", "--config.train.num_features=two must be an integer"),
        ("--config.privacy.delta=abc", "--config.privacy.delta=abc must be a number"),
        ("--config.ledger.enabled=maybe", "--config.ledger.enabled=maybe must be True or False"),
        ("--config.space.clip_norm=4.0", "--config.space.clip_norm.FIELD="),
        ("--config.seed=3", "did you mean the command's flag --seed?"),
        ("--config.train.clip_norm=1.0", "did you mean --config.space.clip_norm?"),
        ("--config.space.epochs=2", "did you mean --config.train.epochs?"),
    ],
    ids=["int", "float", "bool", "section", "command-flag", "space-field", "train-field"],
)
def test_a_misplaced_or_mistyped_override_says_what_the_field_takes(
    capsys, tmp_path, data_dir, override, words
):
    line = refusal(*run(capsys, tmp_path, data_dir, override)[:3:2], tmp_path)
    assert words in line, line
    assert "invalid literal" not in line and "Non-boolean" not in line, line


def test_a_learner_option_without_a_default_is_asked_for(capsys, tmp_path, data_dir):
    """``--config.trainer=public_data`` needs ``config.learner.num_public`` (it was an unexpected
    TypeError from the trainer's constructor, exit 1)."""
    line = refusal(*run(capsys, tmp_path, data_dir, "--config.trainer=public_data")[:3:2], tmp_path)
    assert "--config.learner.num_public=" in line, line


def test_an_override_before_config_is_read_after_it(capsys, tmp_path, data_dir):
    """ml_collections applies ``--config.x`` only after ``--config=``: the order on the command
    line does not matter."""
    capsys.readouterr()
    code = cli([
        "dptune", "--config.train.num_features=7", f"--config.data.dir={data_dir}",
        f"--workdir={tmp_path / 'run'}", f"--config.ledger.path={tmp_path / 'ledger.sqlite'}",
        "--noprogress", "--dry_run", f"--config={CONFIG}",
    ])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0 and "Dry run" in out, err[-2000:]


def test_a_refusal_says_refused_once(capsys, tmp_path, data_dir):
    """The ledger's refusal starts "refused before any private computation": not after
    "dptune: refused:" again."""
    line = refusal(*run(capsys, tmp_path, data_dir, "--config.ledger.budget_epsilon=1.0")[:3:2],
                   tmp_path)  # fmt: skip
    assert line.startswith("dptune: refused: this run costs"), line


def test_account_names_a_missing_selection_option_as_its_flag(capsys):
    from dptune.cli import account

    capsys.readouterr()
    code = account.cli(["account", "--sampling_rate=0.01", "--noise_multiplier=1.1",
                        "--steps=100", "--selection=poisson"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "needs ['--mean_trials']" in err, err


def make_mlp(num_classes: int):
    """A newcomer's ``config.model`` factory: a head of ``num_classes`` outputs."""
    import flax.linen as nn

    return nn.Dense(num_classes)


def _user_dry_run(tmp_path, *flags: str) -> int:
    """``dptune --config=user --dry_run`` on ``tmp_path/d.npz`` (100 declared records) with a
    workdir and ledger of the test's own, plus ``flags``: the exit code."""
    return cli([
        "dptune", "--config=user", f"--config.data.path={tmp_path / 'd.npz'}",
        "--config.data.num_examples=100", f"--workdir={tmp_path / 'run'}",
        f"--config.ledger.path={tmp_path / 'ledger.sqlite'}", "--noprogress", "--dry_run", *flags,
    ])  # fmt: skip


def test_float_labels_with_a_bare_module_say_which_loss_is_missing(capsys, tmp_path):
    """Regression targets (float labels: ``num_classes=0``) and a factory returning a module
    without a loss: the refusal says the default loss needs class ids (it was a
    ``ZeroDivisionError`` from initialising a head of 0 outputs)."""
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x_train=rng.normal(size=(100, 4)), y_train=rng.normal(size=100))
    capsys.readouterr()
    code = _user_dry_run(tmp_path, f"--config.model={__name__}:make_mlp")
    line = refusal(code, capsys.readouterr().err, tmp_path)
    assert "config.model=" in line and "not class ids" in line and "'loss'" in line, line
    assert "ZeroDivisionError" not in line, line


def test_the_users_config_without_config_model_names_the_model_it_trained(capsys, tmp_path):
    """``--config=user`` on tabular rows without ``--config.model``: the config's own model (a
    shipped CNN) is named as its field, with the flag that gives yours."""
    import numpy as np

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(120, 4)), rng.integers(0, 2, 120)
    np.savez(tmp_path / "d.npz", x_train=x[:100], y_train=y[:100], x_test=x[100:], y_test=y[100:])
    capsys.readouterr()
    code = _user_dry_run(tmp_path)
    line = refusal(code, capsys.readouterr().err, tmp_path)
    assert "--config.train.model='cnn26k'" in line and "--config.model=" in line, line


def test_arrays_without_a_test_split_ask_for_config_data_num_classes(capsys, tmp_path):
    """An ``.npz`` of ``x_train``, ``y_train`` only (the test split is optional): the number of
    classes cannot be read from public labels, and the refusal names the field that gives it."""
    import numpy as np

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x_train=rng.normal(size=(100, 4)), y_train=rng.integers(0, 2, 100))
    capsys.readouterr()
    code = _user_dry_run(tmp_path, f"--config.model={__name__}:make_mlp")
    line = refusal(code, capsys.readouterr().err, tmp_path)
    assert "--config.data.num_classes=K" in line and "num_classes=..." not in line, line
    code = _user_dry_run(
        tmp_path, f"--config.model={__name__}:make_mlp", "--config.data.num_classes=2"
    )
    assert code == 0, capsys.readouterr().err[-2000:]


def test_the_audit_names_the_config_field_not_the_librarys_keyword(capsys, tmp_path, data_dir):
    """``dptune audit`` on a trainer that designs no canaries (DP-Fisher): the command cannot
    pass ``canaries=(x, y)``, so the line names config.trainer (it asked for keywords)."""
    from dptune.cli import audit

    capsys.readouterr()
    code = audit.cli([
        "dptune audit", f"--config={CONFIG}", f"--config.data.dir={data_dir}",
        f"--workdir={tmp_path / 'run'}", "--noprogress", "--seed=1",
        f"--config.ledger.path={tmp_path / 'ledger.sqlite'}",
    ])  # fmt: skip
    line = refusal(code, capsys.readouterr().err, tmp_path)
    assert "config.trainer" in line and "dptune.audit(" in line, line


def audit_with_epochs_0(capsys, tmp_path) -> tuple[int, str]:
    from dptune.cli import audit

    capsys.readouterr()
    code = audit.cli([
        "dptune audit", "--config=smoke", f"--workdir={tmp_path / 'run'}", "--noprogress",
        f"--config.ledger.path={tmp_path / 'ledger.sqlite'}", "--config.train.epochs=0",
    ])  # fmt: skip
    return code, capsys.readouterr().err


def test_the_audit_names_a_refused_hyperparameter_as_its_config_field(capsys, tmp_path):
    code, err = audit_with_epochs_0(capsys, tmp_path)
    lines = [ln for ln in err.splitlines() if ln.startswith("dptune: refused:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert "--config.train.epochs=0: must be a positive integer" in lines[0], lines[0]
    assert not (tmp_path / "ledger.sqlite").exists()


def test_a_refused_audit_leaves_its_folder_empty(capsys, tmp_path):
    code, err = audit_with_epochs_0(capsys, tmp_path)
    assert code == 2, err
    assert (
        not (tmp_path / "run" / "private").exists()
        and not (tmp_path / "run" / "audit.json").exists()
    )


def test_a_batch_larger_than_the_training_set_names_config_train_batch_size(capsys, tmp_path):
    """A batch over the public training count was refused in the library's words
    (``DpSgdSchedule(num_examples=7000 < batch_size=...)``), naming no ``--config.`` field."""
    capsys.readouterr()
    code = cli([
        "dptune", "--config=smoke", f"--workdir={tmp_path / 'run'}", "--noprogress", "--dry_run",
        f"--config.ledger.path={tmp_path / 'ledger.sqlite'}", "--config.train.batch_size=100000",
    ])  # fmt: skip
    line = refusal(code, capsys.readouterr().err, tmp_path)
    assert "refused: --config.train.batch_size=100000 exceeds the 7000 public" in line, line
    assert line.endswith("lower it to 7000 or less") and "DpSgdSchedule" not in line, line


def test_a_refused_selection_option_is_named_as_its_config_field(capsys, tmp_path, data_dir):
    """The selection's options were named by their keywords (``mean_trials=``) after the
    ``config.selection.method=`` prefix."""
    for override, words in (
        ("--config.selection.mean_trials=0.5", "--config.selection.mean_trials=0.5 must be"),
        ("--config.selection.method=tnb", "needs ['--config.selection.shape']"),
    ):
        line = refusal(*run(capsys, tmp_path, data_dir, override)[:3:2], tmp_path)
        assert words in line and " mean_trials=" not in line, line
