"""The shipped `finetune` config: its public and private digits are disjoint records, the shipped
start is what scripts/pretrain_digits.py builds, and the command refuses a mismatching
``--config.init`` in one line with nothing charged."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dptune.cli.main import cli
from dptune.configs import finetune as F
from trainers import finetune


def test_the_public_and_private_digits_are_disjoint_records_and_the_sizes_are_published():
    from dptune.data import load_mnist_10k

    _, y, _, _ = load_mnist_10k()
    pub, priv = F.digits(F.PUBLIC_DIGITS), F.digits(F.PRIVATE_DIGITS)
    assert len(priv[1]) == F.PRIVATE_NUM_TRAIN
    assert len(pub[1]) + len(priv[1]) == len(y)  # every record in exactly one task
    assert set(np.unique(priv[1])) == set(np.unique(pub[1])) == set(range(5))
    # no image is in both (the records themselves, not only their labels)
    seen = {row.tobytes() for row in pub[0]}
    assert not any(row.tobytes() in seen for row in priv[0])


def test_the_shipped_start_matches_the_model_and_is_small():
    from trainers import models

    start = finetune.read_init(F.PRETRAINED)
    spec = models.get_model("cnn26k", 5)
    import jax

    shapes = jax.eval_shape(lambda: models.init_params(spec, jax.random.PRNGKey(0)))
    assert set(finetune.match_init(start, shapes)) == set(finetune.flat_paths(shapes))
    assert F.PRETRAINED.stat().st_size < 1_000_000


@pytest.mark.slow
def test_the_pretraining_script_rebuilds_the_shipped_start_bit_for_bit(tmp_path):
    import subprocess
    import sys

    from tests.paths import REPO

    out = tmp_path / "start.npz"
    p = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "pretrain_digits.py"), f"--out={out}", "--check"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    assert finetune.fingerprint(finetune.read_init(out)) == finetune.fingerprint(
        finetune.read_init(F.PRETRAINED)
    )


def _run(tmp_path, capsys, *extra):
    capsys.readouterr()
    code = cli(
        ["dptune", "--config=finetune", f"--workdir={tmp_path / 'w'}", "--noprogress",
         f"--config.ledger.path={tmp_path / 'ledger.sqlite'}", *extra]
    )  # fmt: skip
    return code, *capsys.readouterr()


@pytest.mark.parametrize("dry", [False, True], ids=["run", "dry_run"])
def test_a_mismatching_init_on_the_command_line_is_one_line_and_charges_nothing(
    tmp_path, capsys, monkeypatch, dry
):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.npz"
    start = finetune.flat_paths(finetune.read_init(F.PRETRAINED))
    start["dense2/kernel"] = start["dense2/kernel"][:, :3]
    np.savez(bad, **start)
    code, out, err = _run(tmp_path, capsys, f"--config.init={bad}", *(["--dry_run"] * dry))
    lines = [ln for ln in err.splitlines() if ln.startswith("dptune: refused:")]
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert "config.init=" in lines[0] and "'dense2/kernel'" in lines[0]
    assert "float32[32, 3]" in lines[0] and "Traceback" not in out + err
    assert not (tmp_path / "ledger.sqlite").exists()
    assert not (tmp_path / "w" / "private").exists() and not (tmp_path / "w" / "release").exists()


def test_the_dry_run_states_the_public_start(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(tmp_path, capsys, "--dry_run", "--config.learner.trainable=dense2")
    assert code == 0, err[-2000:]
    assert "public-init" in out and finetune.fingerprint(finetune.read_init(F.PRETRAINED)) in out
    code, out, err = _run(tmp_path, capsys, "--dry_run", "--config.init=")
    assert code == 0, err[-2000:]
    assert "public-init" not in out
    json.dumps(F.get_config().to_dict())  # the config is plain data


def test_the_recipe_is_the_plain_sgd_default_at_its_batch():
    """The config's learning-rate range is the library's plain-SGD default at batch 64 (a config
    may not import the learners, so the numbers are written out there)."""
    from dptune.learners.dpsgd import LEARNING_RATE_RANGES

    c = F.get_config()
    low, high = LEARNING_RATE_RANGES["sgd"]
    assert (c.train.optimizer, c.train.batch_size) == ("sgd", 64)
    lr = c.space.learning_rate
    assert (lr.low, lr.high) == pytest.approx((low * 64, high * 64))
