"""Your own model and arrays from a config: --config.model=pkg.module:factory, data from an npz
file or a loader function; refusals name the field and charge nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dptune.cli.build import ConfigError, load_data, run_config
from dptune.configs import user
from tests.paths import REPO

MODULE = """
import flax.linen as nn
import jax.numpy as jnp
import numpy as np


class MLP(nn.Module):
    num_classes: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.num_classes)(jnp.tanh(nn.Dense(8)(x)))


def make_mlp(num_classes):
    return MLP(num_classes)


def load():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((700, 5)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    return {"x_train": x[:600], "y_train": y[:600], "x_test": x[600:], "y_test": y[600:]}
"""


@pytest.fixture
def pkg(tmp_path, monkeypatch):
    (tmp_path / "user_pkg_mod.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("user_pkg_mod", None)


def _cfg(tmp_path, **data):
    c = user.get_config().to_dict()
    c["model"] = "user_pkg_mod:make_mlp"
    c["data"].update(num_examples=600, validation_size=100, **data)
    c["train"].update(epochs=1, batch_size=50)
    c["selection"]["mean_trials"] = 2.0
    c["ledger"]["path"] = str(tmp_path / "ledger.sqlite")
    return c


def test_npz_data_and_factory_model_tune_end_to_end(pkg):
    import user_pkg_mod

    a = user_pkg_mod.load()
    np.savez(pkg / "d.npz", **a)
    release = run_config(_cfg(pkg, source="npz", path=str(pkg / "d.npz")), pkg / "w",
                         seed=0, progress=False)  # fmt: skip
    assert release.privacy["total_epsilon"] <= 3.0
    assert (pkg / "w" / "release" / "result.json").is_file()


def test_a_fresh_compilation_cache_folder_gets_the_compiled_steps(pkg):
    """Warm starts from the command line: ``dptune --compilation_cache=DIR`` with a fresh folder
    compiles the run's steps into it (the suite's own cache is set in the environment: the flag
    wins). A tiny model, so the cold compilation is cheap; the end-to-end CLI test on cnn26k
    (test_main.py) uses the suite's warm cache."""
    import user_pkg_mod

    np.savez(pkg / "d.npz", **user_pkg_mod.load())
    fresh, work = pkg / "jax-cache", pkg / "w"
    flags = [f"--{k}={v}" for k, v in {
        "config.model": "user_pkg_mod:make_mlp", "config.data.path": pkg / "d.npz",
        "config.data.num_examples": 600, "config.data.validation_size": 100,
        "config.train.epochs": 1, "config.train.batch_size": 50,
        "config.selection.mean_trials": 2, "config.ledger.path": pkg / "ledger.sqlite",
    }.items()]  # fmt: skip
    path = os.pathsep.join([str(pkg), str(REPO), os.environ.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-m", "dptune", "--config=user", f"--workdir={work}", "--seed=0",
         "--noprogress", f"--compilation_cache={fresh}", *flags],
        cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": path},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((work / "release" / "privacy.json").read_text())["total_epsilon"] <= 3.0
    compiled = [p.name for p in fresh.iterdir()]
    # the training step (the epoch-on-device loop compiles it as _run_step)
    assert any(name.startswith(("jit__step", "jit__run_step")) for name in compiled), compiled


def test_loader_data_dry_run_and_refusals(pkg):
    dry = run_config(_cfg(pkg, loader="user_pkg_mod:load"), pkg / "w", dry_run=True)
    assert dry.statement.total_epsilon <= 3.0
    data = load_data(_cfg(pkg, loader="user_pkg_mod:load"))
    assert data.public_num_train == 500 and data.num_classes == 2 and len(data.test_x) == 100
    bad = _cfg(pkg, source="npz", path=str(pkg / "d.npz"))
    bad["data"]["num_examples"] = None
    with pytest.raises(ConfigError, match="num_examples is required for your own data"):
        run_config(bad, pkg / "w", dry_run=True)
    with pytest.raises(ConfigError, match="needs config.data.path"):
        run_config(_cfg(pkg, source="npz"), pkg / "w", dry_run=True)
    with pytest.raises(ConfigError, match="no npz file"):
        load_data(_cfg(pkg, source="npz", path=str(pkg / "missing.npz")))
    wrong = _cfg(pkg, loader="user_pkg_mod:load")
    wrong["model"] = "user_pkg_mod:nothere"
    with pytest.raises(ConfigError, match="config.model='user_pkg_mod:nothere' cannot be imported"):
        run_config(wrong, pkg / "w", dry_run=True)
    wrong["model"] = "resnet"
    with pytest.raises(ConfigError, match="pkg.module:factory"):
        run_config(wrong, pkg / "w", dry_run=True)
