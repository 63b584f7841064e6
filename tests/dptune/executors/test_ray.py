"""The "ray" executor with a real local Ray (``ray.init(num_cpus=2)``): same release as
sequential, a killed worker retried with the same seed, a killed driver resumed from the journal,
nothing private left in Ray, and bad input refused before anything private runs.

Skipped without Ray (``pip install -e '.[ray]'``); ``kind=ray`` without Ray installed, and the
executor seam itself (out-of-order results, a lost executor then a resume), are tested without Ray
in ``tests/dptune/executors/test_local.py``. The end-to-end runs of the smoke config are ``slow``
(several minutes on 2 shared cores); the fast tests cover the same executor code with a cheap
trainer.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from dptune import tune
from dptune.accounting.events import DpSgdCandidate
from dptune.executors import SequentialExecutor
from dptune.executors.ray import RayExecutor, RayExecutorError
from dptune.space import log_uniform
from dptune.trainer_protocol import FunctionTrainer
from selection import RandomStopping, Thresholding
from tests.journal_rows import journal_rows
from tests.paths import REPO

ray = pytest.importorskip("ray", reason="the ray extra is not installed: pip install 'dptune[ray]'")

ROOT = REPO


# --- bad input: one clear message before anything private runs (no cluster needed) -----------


def test_unreachable_address_is_refused_quickly():
    ex = RayExecutor(address=f"127.0.0.1:{_free_port()}")
    t0 = time.time()
    if ray.is_initialized():
        pytest.skip("a Ray instance is already connected in this process")
    with pytest.raises(RayExecutorError, match="cannot reach a Ray cluster"):
        ex.connect()
    assert time.time() - t0 < 10


@pytest.mark.parametrize("address", ["127.0.0.1:6379", "ray://head:10001"])
def test_the_command_names_the_address_field_when_no_cluster_answers(
    address, tmp_path, capsys, monkeypatch
):
    """No cluster answers (the connection's failure mocked: no Ray starts): one line naming
    --config.executor.address and the fix, exit 2, nothing written or charged."""
    from dptune.cli.main import cli
    from dptune.executors import ray as ray_executor

    if ray.is_initialized():
        pytest.skip("a Ray instance is already connected in this process")

    def refused(*args, **kwargs):
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(ray_executor.socket, "create_connection", refused)  # HOST:PORT
    monkeypatch.setattr(ray, "init", lambda **kw: refused())  # ray://: Ray Client's own dial
    code = cli(["dptune", "--config=smoke", f"--workdir={tmp_path / 'w'}", "--noprogress",
                "--config.executor.kind=ray", f"--config.executor.address={address}",
                f"--config.ledger.path={tmp_path / 'ledger.sqlite'}"])  # fmt: skip
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("dptune: refused:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert f"--config.executor.address={address} cannot " in lines[0], lines[0]
    assert "ray status" in lines[0] or "ray start --head" in lines[0], lines[0]
    assert not (tmp_path / "w").exists() and not (tmp_path / "ledger.sqlite").exists()


@pytest.fixture(scope="module")
def cluster():
    """One local Ray instance for the module (2 CPUs); its GCS address lets subprocess drivers
    join it, so killing a driver does not kill the cluster."""
    # Workers unpickle this module's trainer functions by value (the tests are not a package).
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()


# --- a cheap trainer: deterministic function of (hparams, seed) ---------------------------------


def _score(hparams, rng):
    # The score depends on the candidate's generator: a different seed gives a different score.
    return float(-((hparams["x"] - 0.3) ** 2) + 0.01 * rng.standard_normal()), {"x": hparams["x"]}


def _privacy(hp):
    return DpSgdCandidate(0.01, 500, hp["noise_multiplier"])


def _trainer(fn=_score):
    return FunctionTrainer(
        fn, _privacy, num_examples=10_000, fingerprint="toy", score_kind="covered"
    )


SPACE = {"x": log_uniform(0.01, 1.0), "noise_multiplier": "auto"}


def _tune(executor, selection=None, seed=11, workdir=None, epsilon=3.0, trainer=None):
    return tune(
        trainer or _trainer(),
        SPACE,
        selection or RandomStopping.logarithmic(4),
        (epsilon, 1e-5),
        seed=seed,
        workdir=workdir,
        executor=executor,
        progress=False,
        ledger=None,  # several runs of one toy dataset: no budget to protect
    )


def test_same_release_as_sequential_cheap_trainer(cluster):
    with RayExecutor(address=cluster) as ex:
        assert ex.parallelism == 2
        got = _tune(ex)
    want = _tune(SequentialExecutor())
    assert got.released and got.hparams == want.hparams
    assert got.validation_score == want.validation_score
    assert got.privacy == want.privacy


def test_thresholding_keeps_sequential_semantics(cluster):
    sel = Thresholding(threshold=-0.02, stop_probability=0.2)
    with RayExecutor(address=cluster) as ex:
        got = _tune(ex, sel, seed=3, epsilon=8.0)
    want = _tune(SequentialExecutor(), sel, seed=3, epsilon=8.0)
    assert (got.released, got.hparams, got.validation_score) == (
        want.released,
        want.hparams,
        want.validation_score,
    )


def test_nothing_private_left_in_the_object_store(cluster):
    core = ray._private.worker.global_worker.core_worker
    big = np.arange(200_000, dtype=np.float64)  # > 100 KB: results go through the object store

    def trainer_fn(hparams, rng):
        return float(rng.standard_normal()), {"w": big * hparams["x"]}

    assert not core.get_all_reference_counts()
    seen = []
    ex = RayExecutor(address=cluster)
    real_run = ex.run

    def run(trainer, jobs):  # what the driver owns in Ray while candidates are in flight
        for out in real_run(trainer, jobs):
            seen.append(len(core.get_all_reference_counts()))
            yield out

    ex.run = run
    with ex:
        release = _tune(ex, RandomStopping.logarithmic(4), seed=5, trainer=_trainer(trainer_fn))
    assert release.released and seen and max(seen) >= 1  # the trainer object, at least
    import gc

    gc.collect()
    # Every object the driver put in Ray (the trainer, each candidate's result) is freed: Ray
    # deletes an object when its owner holds no reference.
    assert not core.get_all_reference_counts()


# --- bad input: one clear message before anything private runs ---------------------------------


def test_more_gpus_than_the_cluster_has(cluster):
    ex = RayExecutor(address=cluster, gpus_per_candidate=1)
    with pytest.raises(RayExecutorError, match="largest node has 0 GPUs"):
        ex.connect()


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


@pytest.mark.parametrize("problem", ["too_many_gpus", "unreachable"])
def test_cli_refuses_before_loading_data(tmp_path, cluster, problem):
    if problem == "too_many_gpus":
        args = [f"--config.executor.address={cluster}", "--config.executor.gpus_per_candidate=4"]
        says = "gpus_per_candidate=4"
    else:
        args = [f"--config.executor.address=127.0.0.1:{_free_port()}"]
        says = "--config.executor.address=127.0.0.1:"
    proc = subprocess.run(
        [sys.executable, "-m", "dptune.cli.main", "--config=smoke", f"--workdir={tmp_path / 'w'}",
         "--config.executor.kind=ray", *args, "--noprogress", "--seed=7",
         f"--config.ledger.path={tmp_path / 'ledger.sqlite'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env(),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "dptune: refused:" in proc.stderr and says in proc.stderr, proc.stderr
    assert not (tmp_path / "w").exists()  # no journal, no ledger charge, nothing trained
    assert not (tmp_path / "ledger.sqlite").exists()


# --- the smoke config end to end (slow) ---------------------------------------------------------


def _env():
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def _cmd(workdir, ledger, *extra):
    return [sys.executable, "-m", "dptune.cli.main", "--config=smoke", f"--workdir={workdir}",
            "--noprogress", f"--config.ledger.path={ledger}", *extra]  # fmt: skip


def _release(workdir):
    rel = Path(workdir) / "release"
    result = json.loads((rel / "result.json").read_text())
    privacy = json.loads((rel / "privacy.json").read_text())
    return result, privacy


def _same_release(a, b):
    (ra, pa), (rb, pb) = a, b
    assert ra["released"] == rb["released"]
    assert ra["hparams"] == rb["hparams"]
    # The same seed gives the same noise and the same program: the same score, not a close one.
    assert ra["validation_score"] == rb["validation_score"]
    assert pa == pb


def _train_task_pids():
    """Ray worker processes running a candidate right now (Ray titles them ``ray::_train_task``)."""
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if (p / "cmdline").read_bytes().startswith(b"ray::_train_task"):
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


@pytest.mark.slow
def test_smoke_seed7_same_release_sequential_and_ray(tmp_path, cluster):
    seq = subprocess.run(_cmd(tmp_path / "seq", tmp_path / "l1.sqlite", "--seed=7"), cwd=ROOT,
                         capture_output=True, text=True, timeout=900, env=_env())  # fmt: skip
    assert seq.returncode == 0, seq.stderr
    ray_run = subprocess.run(
        _cmd(tmp_path / "ray", tmp_path / "l2.sqlite", "--seed=7", "--config.executor.kind=ray",
             f"--config.executor.address={cluster}"),
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=_env(),
    )  # fmt: skip
    assert ray_run.returncode == 0, ray_run.stderr
    _same_release(_release(tmp_path / "seq"), _release(tmp_path / "ray"))


# Seed 9 draws K = 3 candidates for the smoke config (seed 7 draws one, which cannot show that a
# finished candidate is kept); one epoch each keeps the three runs below within minutes.
KILL = ["--seed=9", "--config.train.epochs=1"]


@pytest.fixture(scope="module")
def seq9(tmp_path_factory):
    work = tmp_path_factory.mktemp("seq9")
    proc = subprocess.run(_cmd(work / "run", work / "l.sqlite", *KILL), cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env=_env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return _release(work / "run")


@pytest.mark.slow
def test_killing_a_worker_mid_candidate_changes_nothing(tmp_path, cluster, seq9):
    ray_args = ["--config.executor.kind=ray", f"--config.executor.address={cluster}"]
    proc = subprocess.Popen(_cmd(tmp_path / "w", tmp_path / "l.sqlite", *KILL, *ray_args),
                            cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    killed = None
    deadline = time.time() + 600
    while killed is None and time.time() < deadline and proc.poll() is None:
        pids = _train_task_pids()
        if pids:
            # mid-candidate: the task is loading the data, compiling or training (with warm
            # compilation caches a one-epoch smoke candidate takes only a few seconds)
            time.sleep(0.5)
            if pids[0] in _train_task_pids():
                os.kill(pids[0], signal.SIGKILL)
                killed = pids[0]
        time.sleep(0.2)
    _, err = proc.communicate(timeout=900)
    assert killed is not None, "no Ray worker was seen training"
    assert proc.returncode == 0, err
    _same_release(seq9, _release(tmp_path / "w"))


@pytest.mark.slow
def test_kill9_driver_then_rerun_resumes(tmp_path, cluster, seq9):
    args = [*KILL, "--config.executor.kind=ray", f"--config.executor.address={cluster}"]
    cmd = _cmd(tmp_path / "w", tmp_path / "l.sqlite", *args)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    deadline = time.time() + 600
    finished: list[int] = []
    while time.time() < deadline and proc.poll() is None:
        rows = journal_rows(tmp_path / "w")
        finished = [i for i, status, _ in rows if status == "done"]
        if finished and len(finished) < len(rows):
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert finished, "no candidate finished before the kill"
    before = {
        i: attempts for i, status, attempts in journal_rows(tmp_path / "w") if status == "done"
    }
    rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=_env())
    assert rerun.returncode == 0, rerun.stderr
    after = {i: attempts for i, _, attempts in journal_rows(tmp_path / "w")}
    for i, attempts in before.items():
        assert after[i] == attempts, f"finished candidate {i} was trained again"
    assert len(after) > len(before)
    _same_release(seq9, _release(tmp_path / "w"))
