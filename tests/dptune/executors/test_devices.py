"""Several devices on one host, tested on 4 forced CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=4``, in a subprocess: the flag must be set
before JAX starts):

* data-parallel DP-SGD (``trainers.parallel``): the clipped sum reduced over 4 shards equals the
  single-device one (<= 1e-5 relative), and the noise added once has std sigma*C (a statistical
  test that a per-shard noise, std 2 sigma C on 4 devices, or no noise, would fail);
* the ``"devices"`` executor releases what ``"sequential"`` releases for the same seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.paths import REPO

ROOT = REPO

SCRIPT = textwrap.dedent(
    """
    import json, math
    import jax, jax.numpy as jnp, numpy as np
    from trainers import dpsgd, models, parallel

    out = {"devices": len(jax.devices())}
    spec = models.get_model("cnn26k", 10)
    apply_fn = spec.module.apply
    params = spec.module.init(jax.random.PRNGKey(0), jnp.zeros((1, 28, 28, 1)))["params"]
    rng = np.random.default_rng(0)
    b = 64
    x = rng.normal(size=(b, 28, 28, 1)).astype(np.float32)
    y = rng.integers(0, 10, size=b).astype(np.int32)
    mask = (rng.uniform(size=b) < 0.8).astype(np.float32)
    clip = 0.7
    mesh = parallel.data_mesh()
    xs, ys, ms = parallel.shard_batch(mesh, x, y, mask)
    ref = {}
    # The book-keeping path (cnn26k's default) on the real model; the naive vmap(grad) path on a
    # small linear model (its compile is short; the code path is the same for every model).
    import flax.linen as nn
    lin = nn.Sequential([lambda v: v.reshape(v.shape[0], -1), nn.Dense(10)])
    lparams = lin.init(jax.random.PRNGKey(1), jnp.zeros((1, 28, 28, 1)))["params"]
    for name, fn, params in [
            ("naive", parallel.naive_clipped_sum(lin.apply), lparams),
            ("bookkeeping", dpsgd.clipped_sum_bookkeeping, params)]:
        one, loss1, _ = jax.jit(fn)(params, x, y, mask, clip)
        many, loss4 = jax.jit(lambda p, a, c, m, fn=fn: parallel.clipped_sum_sharded(
            fn, mesh, p, a, c, m, clip))(params, xs, ys, ms)
        d = jnp.sqrt(sum(jnp.sum((u - v) ** 2) for u, v in zip(
            jax.tree_util.tree_leaves(one), jax.tree_util.tree_leaves(many))))
        n = jnp.sqrt(sum(jnp.sum(u ** 2) for u in jax.tree_util.tree_leaves(one)))
        out[f"rel_{name}"] = float(d / n)
        out[f"loss_rel_{name}"] = float(abs(loss1 - loss4) / abs(loss1))
        out[f"sharded_{name}"] = str(jax.tree_util.tree_leaves(many)[0].sharding)

    # Noise: with every example masked the clipped sum is exactly 0, so the output is the noise.
    # The linear model (7,850 parameters): the noise does not depend on the model.
    sigma = 1.3
    zeros = parallel.shard_batch(mesh, np.zeros(b, np.float32))[0]
    noisy = jax.jit(lambda p, a, c, m, k: parallel.noisy_sum_sharded(
        parallel.naive_clipped_sum(lin.apply), mesh, p, a, c, m, k, clip, sigma))
    draws = np.concatenate([
        np.concatenate([np.ravel(l) for l in jax.tree_util.tree_leaves(
            noisy(lparams, xs, ys, zeros, jax.random.PRNGKey(s))[0])]) for s in range(8)])
    out["noise_n"] = int(draws.size)
    out["noise_std"] = float(draws.std())
    out["noise_mean"] = float(draws.mean())
    out["target_std"] = sigma * clip

    # The training loop data-parallel (trainers.loop under parallel.data_parallel): the same
    # candidate as on one device, a compiled step that reduces across devices, and its noise
    # added once (std sigma C) although the clipped sums come from 4 shards.
    from trainers import step as step_mod
    from trainers.data import make_synthetic
    from trainers.evaluate import device_arrays
    from trainers.loop import train_candidate
    from trainers.spec import Hyperparams

    # A small user CNN (the generic ghost path; its compile is short): the loop and the step's
    # cross-device reduction are the same code for every model, and the shipped cnn26k trains
    # data-parallel end to end in the slow test below.
    class Small(nn.Module):
        @nn.compact
        def __call__(self, v):
            v = jnp.tanh(nn.Conv(4, (3, 3), strides=(2, 2))(v))
            return nn.Dense(10)(v.reshape(v.shape[0], -1))

    small = models.user_model(Small(), (28, 28, 1), num_classes=10, name="small")
    data = make_synthetic(num_train=700, num_test=100, validation_size=100)
    hp = Hyperparams(learning_rate=0.5, clip_norm=1.0, noise_multiplier=1.0, batch_size=60,
                     epochs=1, optimizer="sgd", model=small, score_noise_std=5.0)
    one = train_candidate(hp, data, jax.random.PRNGKey(3))
    with parallel.data_parallel(mesh):
        par = train_candidate(hp, data, jax.random.PRNGKey(3))
    la, lb = jax.tree_util.tree_leaves(one.params), jax.tree_util.tree_leaves(par.params)
    out["loop_rel"] = float(np.sqrt(sum(np.sum((u - v) ** 2) for u, v in zip(la, lb)))
                            / np.sqrt(sum(np.sum(u ** 2) for u in la)))
    out["loop_scores"] = [one.validation_score, par.validation_score]
    out["loop_failed"] = [one.failed, par.failed, par.error]
    init = models.init_params(small, jax.random.split(jax.random.PRNGKey(3), 4)[0])  # loop's init
    out["loop_moved"] = float(np.sqrt(sum(np.sum((u - v) ** 2) for u, v in zip(
        la, jax.tree_util.tree_leaves(init)))))
    impl = step_mod.resolve_grad_impl(small, None, (28, 28, 1), 0)
    out["loop_impl"] = impl
    fns = step_mod.get_step_functions(small, 10, "sgd", impl, mesh=mesh)
    p0 = models.init_params(fns.spec, jax.random.PRNGKey(0))
    opt = step_mod.make_optimizer(hp).init(p0)
    zero = jax.tree_util.tree_map(jnp.zeros_like, p0)
    dx, dy = device_arrays(data)
    idx, m0 = np.zeros(64, np.int32), np.zeros(64, np.float32)  # every slot masked: sum is 0
    c_clip, c_sigma, c_b = 0.7, 1.3, 60.0
    args = lambda s: (p0, opt, zero, jnp.float32(0), dx, dy, idx, m0, jax.random.PRNGKey(s),
                      jnp.int32(0), jnp.float32(c_clip), jnp.float32(c_sigma), jnp.float32(c_b))
    out["loop_allreduce"] = "all-reduce" in fns.step.lower(*args(0)).compile().as_text()
    draws = []
    for s in range(4):
        new = fns.step(*args(s))[0]
        draws.append(np.concatenate([np.ravel(np.asarray(a) - np.asarray(b)) for a, b in zip(
            jax.tree_util.tree_leaves(new), jax.tree_util.tree_leaves(p0))]) * c_b / 0.5)
    draws = np.concatenate(draws)
    out["loop_noise"] = [int(draws.size), float(draws.std()), float(draws.mean()), c_sigma * c_clip]

    # The devices executor with a cheap JAX trainer: where each candidate ran, and its release.
    import dptune
    from dptune.accounting.events import DpSgdCandidate
    from dptune.executors import SequentialExecutor
    from dptune.executors.devices import DevicesExecutor
    from dptune.space import log_uniform
    from dptune.trainer_protocol import FunctionTrainer
    from selection import RandomStopping

    ran_on = []

    @jax.jit
    def work(k, lr):
        m = jax.random.normal(k, (64, 64))
        return jnp.tanh(m @ m.T * lr).mean()

    def fn(hp, rng):
        k = jax.random.PRNGKey(int(rng.integers(2**31)))
        v = work(k, hp["lr"])
        ran_on.append(str(list(v.devices())[0]))
        return float(v) + 0.01 * rng.standard_normal(), {"v": float(v)}

    def priv(hp):
        return DpSgdCandidate(0.01, 100, hp["noise_multiplier"])

    rel = {}
    for name, ex in [("sequential", SequentialExecutor()), ("devices", DevicesExecutor())]:
        ran_on.clear()
        r = dptune.tune(FunctionTrainer(fn, priv, num_examples=10_000, fingerprint="t",
                                        score_kind="covered"),
                        {"lr": log_uniform(0.1, 1.0), "noise_multiplier": 3.0},
                        RandomStopping.logarithmic(6), (8.0, 1e-5), seed=5, executor=ex,
                        progress=False, ledger=None)
        rel[name] = {"hparams": r.hparams, "score": r.validation_score, "privacy": r.privacy,
                     "k": r.private.num_trials, "scores": r.private.scores,
                     "ran_on": sorted(set(ran_on))}
    out["release"] = rel
    out["parallelism"] = DevicesExecutor().parallelism
    out["parallelism_dp"] = DevicesExecutor(data_parallel=True).parallelism
    print("RESULT " + json.dumps(out))
    """
)

SLOW_SCRIPT = textwrap.dedent(
    """
    import json
    import dptune
    from dptune.learners.dpsgd import DpSgdTrainer
    from dptune.executors import SequentialExecutor
    from dptune.executors.devices import DevicesExecutor
    from dptune.space import log_uniform
    from selection import RandomStopping
    from trainers.data import make_synthetic

    out = {}
    data = make_synthetic(num_train=1200, num_test=200, validation_size=300)
    base = dict(model="cnn26k", batch_size=128, epochs=1, optimizer="sgd", score_noise_std=5.0,
                noise_multiplier=1.0)
    space = dict(learning_rate=log_uniform(0.5, 4.0), clip_norm=log_uniform(0.5, 2.0))
    rel = {}
    for name, ex in [("sequential", SequentialExecutor()), ("devices", DevicesExecutor()),
                     ("data_parallel", DevicesExecutor(data_parallel=True))]:
        trainer = DpSgdTrainer(data, base, epoch_progress=False, test_curve=False)
        r = dptune.tune(trainer, space, RandomStopping.logarithmic(3), (30.0, 1e-3), seed=9,
                        executor=ex, progress=False, ledger=None)
        rel[name] = {"hparams": r.hparams, "score": r.validation_score, "privacy": r.privacy,
                     "k": r.private.num_trials, "scores": r.private.scores}
    out["release"] = rel
    out["parallelism"] = DevicesExecutor().parallelism
    print("RESULT " + json.dumps(out))
    """
)


def _on_four_devices(script: str) -> dict:
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=4",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT ") :])


@pytest.fixture(scope="module")
def four_devices():
    out = _on_four_devices(SCRIPT)
    assert out["devices"] == 4
    return out


@pytest.mark.parametrize("impl", ["naive", "bookkeeping"])
def test_data_parallel_clipped_sum_equals_single_device(four_devices, impl):
    assert four_devices[f"rel_{impl}"] <= 1e-5
    assert four_devices[f"loss_rel_{impl}"] <= 1e-5
    # ... and it was computed over the mesh (a replicated result of a 4-device computation)
    assert "data" in four_devices[f"sharded_{impl}"] or "4" in four_devices[f"sharded_{impl}"]


def test_data_parallel_noise_std_is_sigma_c_whatever_the_device_count(four_devices):
    n, std, target = four_devices["noise_n"], four_devices["noise_std"], four_devices["target_std"]
    # The sample std of n Gaussians has relative sd ~ 1/sqrt(2n) (~0.2% at n ~ 100k); 6 of them:
    tol = 6 / (2 * n) ** 0.5
    assert abs(std / target - 1) < tol, (std, target, tol)
    assert abs(four_devices["noise_mean"]) < 6 * target / n**0.5
    # Per-shard noise on 4 devices would give 2 sigma C: far outside the tolerance.
    assert tol < 0.5


def _same_release(seq, dev):
    assert seq["k"] == dev["k"] >= 2
    assert dev["hparams"] == seq["hparams"]
    assert dev["score"] == seq["score"]
    assert dev["scores"] == seq["scores"]
    assert dev["privacy"] == seq["privacy"]


def test_data_parallel_training_loop_is_the_single_device_candidate(four_devices):
    """trainers.loop under parallel.data_parallel: the same candidate as on one device (the same
    key; the clipped sums differ only in float summation order), and it actually trained."""
    assert four_devices["loop_failed"] == [False, False, None]
    assert four_devices["loop_rel"] <= 1e-5
    assert four_devices["loop_moved"] > 1e-3  # not a vacuous comparison of two untrained models
    one, par = four_devices["loop_scores"]
    assert abs(one - par) <= 0.02  # equal unless a validation prediction flipped


def test_data_parallel_training_step_reduces_across_devices_and_noises_once(four_devices):
    assert four_devices["loop_impl"] == "ghost"  # the generic path of a user's model
    assert four_devices["loop_allreduce"]  # the compiled step sums over the 4 shards
    n, std, mean, target = four_devices["loop_noise"]
    tol = 6 / (2 * n) ** 0.5  # 4 x 7,890 draws: ~2.4 % (6 sd of the sample std)
    assert abs(std / target - 1) < tol, (std, target, tol)
    assert abs(mean) < 6 * target / n**0.5
    assert tol < 0.5  # per-shard noise (2 sigma C on 4 devices) or none would fail


def test_devices_executor_releases_what_sequential_releases(four_devices):
    seq, dev = four_devices["release"]["sequential"], four_devices["release"]["devices"]
    assert four_devices["parallelism"] == 4
    assert four_devices["parallelism_dp"] == 1  # data-parallel: one candidate at a time
    _same_release(seq, dev)
    assert len(seq["ran_on"]) == 1  # sequential: the default device only
    assert len(dev["ran_on"]) >= 2  # devices: candidates spread over several devices


@pytest.mark.slow
def test_devices_executor_dpsgd_releases_what_sequential_releases():
    """The same with this project's DP-SGD trainer (a cnn26k per candidate, 1 epoch)."""
    out = _on_four_devices(SLOW_SCRIPT)
    assert out["parallelism"] == 4
    _same_release(out["release"]["sequential"], out["release"]["devices"])
    # One candidate at a time over the 4 devices: the same plan, hyperparameters and statement;
    # the scores agree up to a flipped validation prediction (float summation order).
    seq, dp = out["release"]["sequential"], out["release"]["data_parallel"]
    assert dp["k"] == seq["k"] and dp["hparams"] == seq["hparams"]
    assert dp["privacy"] == seq["privacy"]
    assert dp["score"] == pytest.approx(seq["score"], abs=0.02)


def _cli_release(workdir: Path, ledger: Path, *extra: str, devices: int = 1) -> tuple[dict, dict]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    proc = subprocess.run(
        [sys.executable, "-m", "dptune.cli.main", "--config=smoke", f"--workdir={workdir}",
         "--noprogress", f"--config.ledger.path={ledger}", *extra],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rel = workdir / "release"
    return (
        json.loads((rel / "result.json").read_text()),
        json.loads((rel / "privacy.json").read_text()),
    )


@pytest.mark.slow
def test_smoke_seed7_devices_releases_what_sequential_releases(tmp_path):
    """`dptune --config=smoke --seed=7`: the default executor on one device, and
    `--config.executor.kind=devices` on 4 forced host devices: the same release."""
    seq = _cli_release(tmp_path / "seq", tmp_path / "l1.sqlite", "--seed=7")
    dev = _cli_release(
        tmp_path / "dev", tmp_path / "l2.sqlite", "--seed=7", "--config.executor.kind=devices",
        devices=4,
    )  # fmt: skip
    (rs, ps), (rd, pd) = seq, dev
    assert rs["released"] == rd["released"]
    assert rs["hparams"] == rd["hparams"]
    # Same seed, same program on a CPU device: the same score, not a close one.
    assert rs["validation_score"] == rd["validation_score"]
    assert ps == pd
