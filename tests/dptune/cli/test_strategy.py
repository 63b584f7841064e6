"""config.strategy through the command's config path: subsampled tuning's dry run, a tiny run,
and malformed strategy options refused before any private computation."""

import subprocess
import sys

import pytest

from dptune import strategies
from dptune.cli import build as cli
from dptune.errors import Refused
from tests.dptune.cli.test_main import SMOKE, _smoke, smoke_data  # noqa: F401 (fixture)
from tests.paths import REPO

SUB = dict(strategy__name="subsampled", strategy__fraction=0.3, strategy__tuning_epsilon=0.5)

MALFORMED = [
    (dict(strategy__name="halving"), "strategy.name"),
    (dict(strategy__name="subsampled"), "strategy.fraction is required"),
    ({**SUB, "strategy__fraction": 1.0}, "in (0, 1)"),
    ({**SUB, "strategy__tuning_epsilon": 4.0}, "below the total epsilon"),
    (dict(strategy__fraction=0.3), "not options of strategy 'full'"),
    ({**SUB, "executor__kind": "ray"}, "not supported"),
    ({**SUB, "privacy__adjacency": "replace_one"}, "add/remove"),
]


@pytest.mark.parametrize("changes, message", MALFORMED)
def test_malformed_strategy_refused(changes, message, smoke_data, monkeypatch, tmp_path):  # noqa: F811
    import trainers.loop

    monkeypatch.setattr(trainers.loop, "train_candidates", None)  # any call would fail
    monkeypatch.setattr(cli, "load_data", lambda cfg: smoke_data)
    cfg = _smoke(**changes, ledger__path=str(tmp_path / "ledger.sqlite"))
    with pytest.raises(Refused) as err:
        cli.run_config(cfg, tmp_path / "run", progress=False)
    assert message in str(err.value)
    assert not (tmp_path / "run" / "private").exists()


def test_subsampled_dry_run(smoke_data, monkeypatch, tmp_path):  # noqa: F811
    import trainers.loop

    monkeypatch.setattr(trainers.loop, "train_candidates", None)
    monkeypatch.setattr(cli, "load_data", lambda cfg: smoke_data)
    dry = cli.run_config(_smoke(**SUB), tmp_path / "run", dry_run=True, progress=False)
    space, st = dry.space, dry.statement
    assert 3.95 < st.total_epsilon <= 4.0 and st.method.startswith("subsampled/")
    assert st.selection["fraction"] == 0.3 and st.selection["tuning_epsilon"] <= 0.5 + 1e-9
    # The final run's noise is below the full-data tuning's (the point of the strategy here).
    full = cli.run_config(_smoke(), tmp_path / "run", dry_run=True, progress=False).statement
    assert space.fields["noise_multiplier"] < full.candidates[0]["noise_multiplier"]
    assert not (tmp_path / "run").exists()


def test_help_lists_strategies():
    assert "subsampled" in strategies.describe() and "strategy.fraction" in strategies.describe()


@pytest.mark.slow
def test_subsampled_command_end_to_end(tmp_path):
    cmd = [sys.executable, "-m", "dptune.cli.main", f"--config={SMOKE}", f"--workdir={tmp_path}/r"]
    cmd += ["--config.train.epochs=1", "--config.selection.mean_trials=2", "--seed=3"]
    cmd += ["--noprogress", f"--config.ledger.path={tmp_path}/l.sqlite"]
    cmd += [f"--config.strategy.{k.split('__')[1]}={v}" for k, v in SUB.items()]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "subsampled tuning (Koskela & Kulkarni 2023" in proc.stdout
    assert (tmp_path / "r" / "release" / "checkpoint").exists()
    assert (tmp_path / "r" / "private" / "tuning" / "release").exists()
