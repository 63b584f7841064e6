"""The executor seam (``dptune.executors``) in the default test run, without Ray or several
devices: what the Ray and devices executors promise, checked through the seam with in-process
executors.

* An executor may finish candidates in any order and several at a time: the release is the
  sequential one (the tuner journals by index and selects in index order).
* An infrastructure error in the executor (a lost cluster, a killed driver) stops the run; a rerun
  trains only the unfinished candidates, with the same seeds, and releases what an uninterrupted
  run releases.
* A retried job (a lost Ray worker) is the same computation: same seed, same score.
* Bad executor input is refused with one clear message before anything private runs, including
  ``kind=ray`` where Ray is not installed (simulated by hiding the module).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest

import dptune
from dptune import space
from dptune.accounting.events import DpSgdCandidate
from dptune.executors import Job, SequentialExecutor, make_executor, train_one
from dptune.trainer_protocol import FunctionTrainer
from selection import RandomStopping, Thresholding
from tests.paths import REPO

ROOT = REPO
SPACE = dict(learning_rate=space.log_uniform(0.01, 10.0), noise_multiplier="auto")


class Toy:
    """Score peaks at lr = 0.3 and depends on the candidate's generator (its seed)."""

    def __init__(self):
        self.calls: list[float] = []

    def __call__(self, hp, rng):
        self.calls.append(hp["learning_rate"])
        score = -abs(math.log(hp["learning_rate"] / 0.3)) + 0.05 * rng.normal()
        return score, {"lr": hp["learning_rate"]}


def _trainer(toy):
    return FunctionTrainer(
        toy,
        lambda hp: DpSgdCandidate(0.01, 500, hp["noise_multiplier"]),
        num_examples=10_000,
        fingerprint="toy-data",
        score_kind="covered",
    )


class Reversed:
    """``parallelism`` candidates at a time, finished in reverse order (as a cluster may)."""

    def __init__(self, parallelism=3, die_after=None):
        self.parallelism = parallelism
        self.die_after = die_after  # yield this many results, then raise (a lost cluster)
        self.yielded = 0

    def run(self, trainer, jobs):
        for job in reversed(list(jobs)):
            if self.die_after is not None and self.yielded >= self.die_after:
                raise ConnectionError("the cluster went away")
            score, payload = train_one(trainer, job)
            self.yielded += 1
            yield job.index, score, payload


def _tune(executor, toy=None, selection=None, **kw):
    return dptune.tune(
        _trainer(toy or Toy()), SPACE, selection or RandomStopping.logarithmic(6), (2.0, 1e-5),
        seed=kw.pop("seed", 9), executor=executor, progress=False,
        **{"ledger": None, **kw},  # several runs of one toy dataset: no budget to protect
    )  # fmt: skip


def _same(a, b):
    assert a.released == b.released
    assert a.hparams == b.hparams
    assert a.validation_score == b.validation_score  # same seeds, same program: equal
    assert a.privacy == b.privacy


def test_out_of_order_parallel_executor_releases_the_sequential_release():
    want = _tune(SequentialExecutor())
    assert want.private.num_trials >= 3, "pick a seed with a few trials"
    got = _tune(Reversed(parallelism=3))
    _same(got, want)
    assert got.private.scores == want.private.scores


def test_thresholding_with_speculative_out_of_order_batches_keeps_its_semantics():
    sel = Thresholding(threshold=-0.2, stop_probability=0.2)
    want = _tune(SequentialExecutor(), selection=sel, seed=4)
    got = _tune(Reversed(parallelism=4), selection=sel, seed=4)
    _same(got, want)


def test_lost_executor_then_rerun_resumes_without_retraining_finished(tmp_path):
    ref = Toy()
    want = _tune(SequentialExecutor(), toy=ref)
    k = want.private.num_trials
    work, ledger = tmp_path / "run", tmp_path / "ledger.sqlite"
    first = Toy()
    with pytest.raises(ConnectionError):
        _tune(Reversed(parallelism=k, die_after=2), toy=first, workdir=work, ledger=ledger)
    assert len(first.calls) == 2 and not (work / "release").exists()
    again = Toy()
    got = _tune(SequentialExecutor(), toy=again, workdir=work, ledger=ledger)
    # the two finished candidates (the last two indices) were journaled and not trained again
    assert len(again.calls) == k - 2
    # ... and every candidate was trained exactly once over the two runs, with the planned hparams
    assert sorted(first.calls + again.calls) == sorted(ref.calls)
    _same(got, want)


def test_a_retried_job_is_the_same_computation():
    toy = Toy()
    job = Job(index=0, seed=2**100 + 12345, hparams={"learning_rate": 0.5, "noise_multiplier": 1.0})
    assert train_one(_trainer(toy), job) == train_one(_trainer(toy), job)
    other = Job(index=0, seed=2**100 + 12346, hparams=job.hparams)
    assert train_one(_trainer(toy), other)[0] != train_one(_trainer(toy), job)[0]


def test_a_trainer_exception_is_the_candidates_failure_not_an_abort():
    def boom(hp, rng):
        raise FloatingPointError("diverged")

    job = Job(index=0, seed=1, hparams={"learning_rate": 0.5, "noise_multiplier": 1.0})
    score, payload = train_one(_trainer(boom), job)
    assert math.isnan(score) and payload.type == "FloatingPointError"  # journaled, not released


# --- make_executor: the config's vocabulary ------------------------------------------------------

# The base config's executor fields at their defaults: what `dptune` passes for every kind.
BASE = dict(cpus_per_candidate=1.0, gpus_per_candidate=0.0, max_retries=3, data_parallel=False)


def test_devices_and_sequential_accept_the_base_configs_ray_defaults():
    assert make_executor("sequential", **BASE).parallelism == 1
    assert make_executor("vectorized", **BASE).parallelism == 4
    ex = make_executor("devices", **BASE)
    assert ex.parallelism >= 1
    dp = make_executor("devices", **{**BASE, "data_parallel": True})
    assert dp.data_parallel and dp.parallelism == 1  # one candidate at a time, over every device


@pytest.mark.parametrize(
    "kind, options, message",
    [
        ("sequential", dict(gpus_per_candidate=1.0), "takes no options"),
        ("devices", dict(address="auto"), "takes no options"),
        ("devices", dict(devices=10_000), "JAX devices"),
        ("devices", dict(devices=0), ">= 1"),
        ("devices", dict(data_parallel="yes"), "True or False"),
        ("sequential", dict(data_parallel=True), "takes no options"),
        ("vectorized", dict(data_parallel=True), "takes no options"),
        ("cluster", {}, "unknown"),
    ],
)
def test_bad_executor_options_are_refused(kind, options, message):
    with pytest.raises(ValueError, match=message):
        make_executor(kind, **options)


def test_ray_not_installed_is_one_clear_message(monkeypatch):
    # sys.modules[name] = None makes `import ray` raise ImportError and find_spec return None:
    # this process behaves as one without the extra.
    monkeypatch.setitem(sys.modules, "ray", None)
    from dptune.executors.ray import RayExecutorError

    with pytest.raises(RayExecutorError, match=r"needs Ray, which is not installed.*dptune\[ray\]"):
        make_executor("ray", **BASE)


HIDE_RAY = (
    "import sys; sys.modules['ray'] = None\n"
    "from dptune.cli.main import run\n"
    "sys.argv[0] = 'dptune'\n"
    "run()\n"
)


def test_cli_kind_ray_without_ray_is_refused_before_any_data(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", HIDE_RAY, "--config=smoke", f"--workdir={tmp_path / 'w'}",
         "--config.executor.kind=ray", "--noprogress", "--seed=7",
         f"--config.ledger.path={tmp_path / 'ledger.sqlite'}"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "dptune: refused:" in proc.stderr and "pip install 'dptune[ray]'" in proc.stderr
    assert not (tmp_path / "w").exists()  # no journal, no ledger charge, nothing trained
    assert not (tmp_path / "ledger.sqlite").exists()
