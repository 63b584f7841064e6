"""DpSgdTrainer: warm starts through JAX's persistent compilation cache, and candidates that compute
only what the selection consumes (the test split is read once, for the released candidate; the
curve's privacy travels with the candidate's result)."""

import os
import subprocess
import sys

import numpy as np
import pytest

import dptune
import dptune.learners.dpsgd as dpsgd_mod
import trainers.loop
from dptune import space
from dptune.accounting import total_privacy
from selection import BestOfK
from tests.paths import REPO
from trainers.data import make_synthetic

# A subprocess (JAX's cache is process-wide state): resolve the setting as the library does, then
# compile one small function; prints the folder in use.
CACHE_PROBE = """
import jax, jax.numpy as jnp
from dptune.learners.dpsgd import use_compilation_cache
print(use_compilation_cache({setting}))
jax.jit(lambda x: jnp.tanh(x) @ x.T + 1.0)(jnp.ones((64, 64))).block_until_ready()
"""


def _probe(tmp_path, setting="None", **env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DPTUNE_C", "JAX_COMP"))}
    env.update(XDG_CACHE_HOME=str(tmp_path / "xdg"), JAX_PLATFORMS="cpu", **env_extra)
    out = subprocess.run(
        [sys.executable, "-c", CACHE_PROBE.format(setting=setting)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def _entries(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_compilation_cache_on_by_default_in_the_user_cache_folder(tmp_path):
    default = tmp_path / "xdg" / "dptune" / "jax"
    assert _probe(tmp_path) == str(default)
    assert _entries(default)  # the compiled function was written there
    assert oct(default.stat().st_mode & 0o777) == "0o700"  # JAX trusts what it loads from it


def test_compilation_cache_folder_from_the_environment_or_an_argument(tmp_path):
    env_dir, arg_dir = tmp_path / "from-env", tmp_path / "from-arg"
    assert _probe(tmp_path, DPTUNE_COMPILATION_CACHE=str(env_dir)) == str(env_dir)
    assert _entries(env_dir)
    assert _probe(tmp_path, setting=repr(str(arg_dir))) == str(arg_dir)
    assert _entries(arg_dir)
    assert not (tmp_path / "xdg").exists()


def test_compilation_cache_can_be_turned_off(tmp_path):
    assert _probe(tmp_path, DPTUNE_COMPILATION_CACHE="off") == "None"
    assert _probe(tmp_path, setting="False") == "None"
    assert not (tmp_path / "xdg").exists()


def test_a_cache_jax_was_given_is_kept(tmp_path):
    mine = tmp_path / "mine"
    assert _probe(tmp_path, JAX_COMPILATION_CACHE_DIR=str(mine)) == str(mine)
    assert not (tmp_path / "xdg").exists()


def _tiny_run(tmp_path, monkeypatch, executor=None, **trainer_kw):
    """Three one-epoch candidates on a tiny synthetic set; returns (release, trainer, evaluate
    calls, on_epoch hooks passed to the loop)."""
    calls, hooks = [], []
    real_eval, real_train = dpsgd_mod.evaluate, trainers.loop.train_candidates

    def counting_eval(*a, **kw):
        calls.append(1)
        return real_eval(*a, **kw)

    def spy_train(*a, **kw):
        hooks.append(kw.get("on_epoch"))
        return real_train(*a, **kw)

    monkeypatch.setattr(dpsgd_mod, "evaluate", counting_eval)
    monkeypatch.setattr(trainers.loop, "train_candidates", spy_train)
    monkeypatch.setenv("DPTUNE_COMPILATION_CACHE", "off")
    data = make_synthetic(num_train=400, num_test=50, validation_size=100, seed=0)
    tr = dptune.DpSgdTrainer(
        data, dict(batch_size=64, epochs=2, optimizer="sgd"), epoch_progress=False, **trainer_kw
    )
    rel = dptune.tune(
        tr, dict(learning_rate=space.choice(0.3, 1.0), noise_multiplier=2.0), BestOfK(3),
        (50.0, 1e-5), seed=3, workdir=tmp_path, progress=False, executor=executor,
    )  # fmt: skip
    return rel, tr, calls, hooks


def test_candidates_skip_the_test_split_and_their_privacy_travels(tmp_path, monkeypatch):
    rel, tr, calls, hooks = _tiny_run(tmp_path, monkeypatch, test_curve=False)
    assert rel.released
    assert hooks == [None, None, None]  # no per-epoch callback: nothing but the validation score
    assert len(calls) == 1  # the test split once, for the released candidate (release_view)
    assert 0.0 <= rel.test_accuracy <= 1.0
    # The curve: the privacy each epoch of training spent (from the candidate's result), as
    # epsilon at the plan's delta; no test accuracy per epoch when test curves are off.
    hp = tr.hyperparams(rel.hparams)
    spe = -(-tr.num_examples // 64)  # ceil(N_public / B)
    assert [row["epoch"] for row in rel.curve] == [1, 2]
    assert all(set(row) == {"epoch", "epsilon_one_run"} for row in rel.curve)
    one_run = [total_privacy(tr._privacy(hp, e * spe), None, 1e-5) for e in (1, 2)]
    assert [row["epsilon_one_run"] for row in rel.curve] == pytest.approx(
        [s.total_epsilon for s in one_run], rel=1e-9
    )
    assert tr._privacy(hp, 2 * spe) == tr.privacy(rel.hparams)  # the last row is the whole run
    assert rel.curve[-1]["epsilon_one_run"] == pytest.approx(
        rel.privacy["single_run_epsilon"], rel=1e-6
    )


def test_test_curves_by_default_are_the_curators_view_and_the_releases_curve(tmp_path, monkeypatch):
    rel, _, calls, hooks = _tiny_run(tmp_path, monkeypatch)
    assert all(h is not None for h in hooks)
    assert len(calls) == 3 * 2  # every candidate, every epoch; the release reuses the last
    assert [set(row) for row in rel.curve] == [{"epoch", "epsilon_one_run", "test_accuracy"}] * 2
    assert rel.curve[-1]["test_accuracy"] == rel.test_accuracy


def test_payload_carries_privacy_by_epoch(monkeypatch):
    monkeypatch.setenv("DPTUNE_COMPILATION_CACHE", "off")
    data = make_synthetic(num_train=400, num_test=50, validation_size=100, seed=0)
    tr = dptune.DpSgdTrainer(data, dict(batch_size=64, epochs=2), epoch_progress=False,
                             test_curve=False)  # fmt: skip
    (score, payload), = tr.train_many([{}], [np.random.default_rng(0)])  # fmt: skip
    steps = [h["steps"] for h in payload["history"]]
    assert steps == [5, 10]  # ceil(300 / 64) steps per epoch
    assert payload["privacy_by_epoch"] == [tr._privacy(tr.hyperparams({}), s) for s in steps]
    view = tr.release_view({}, payload)
    assert list(view.privacy_by_epoch) == payload["privacy_by_epoch"]
    assert [set(h) for h in view.history] == [{"epoch"}] * 2  # exact losses stay private


def test_the_vectorisation_choice_is_journaled_not_released(tmp_path, monkeypatch):
    """Groups of 2 (VectorizedExecutor): the probe (here: a stand-in measurement finding vmap
    slower) decides, and each candidate's journaled payload says what was chosen and why; the
    release holds none of it."""

    from dptune._state.journal import Journal
    from dptune.executors import VectorizedExecutor
    from trainers import probe

    monkeypatch.setattr(probe, "_memo", {})
    monkeypatch.setattr(probe, "_cache_file", None)
    # the run's first compilation-cache decision in this process would point the probe at the
    # suite's cache folder, where an earlier test's measurement may be saved
    monkeypatch.setattr(probe, "set_cache_file", lambda path: None)
    monkeypatch.setattr(probe, "_time_steps", lambda *a: (2.0, 1.0))
    rel, _, _, hooks = _tiny_run(tmp_path, monkeypatch, executor=VectorizedExecutor(2))
    assert len(hooks) == 2  # two calls of train_many: a group of 2, then the third candidate
    with Journal(tmp_path / "private") as j:
        execs = [j.read_payload(r.index)["execution"] for r in j.candidates()]
    assert execs[0] == execs[1] and execs[0]["vectorized"] is False
    assert execs[0]["probe"]["vmapped_s"] == 2.0 and execs[0]["probe"]["source"] == "probe"
    assert "one after another" in execs[0]["reason"]
    assert execs[2] == {"vectorized": False}  # alone: nothing to decide
    texts = [p for p in (tmp_path / "release").glob("*.*") if p.suffix != ".png"]
    shown = " ".join(p.read_text() for p in texts)
    assert "vectorized" not in shown and "one after another" not in shown
