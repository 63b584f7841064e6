"""Subsampled tuning through an executor that runs both phases: the final run must train the
trainer on ALL the data, not the tuning phase's subset trainer.

The Ray executor is driven here by an in-process stand-in for the ``ray`` module (tasks run
eagerly, objects are kept in a dict), so the test needs neither Ray nor a cluster; the real
executor code (``RayExecutor.run``, ``_train_task``, the worker's trainer cache) is what runs.
"""

from __future__ import annotations

import importlib.machinery
import itertools
import sys
import types

import pytest

import dptune
from dptune.executors import ray as ray_executor
from selection import RandomStopping
from tests.dptune.test_subsampled import SPACE, N, SubsetToy


def _fake_ray() -> types.ModuleType:
    """The part of Ray's API that ``RayExecutor.run`` uses, run in this process."""
    store: dict[int, object] = {}
    ids = itertools.count()

    def put(value):
        ref = next(ids)
        store[ref] = value
        return ref

    class _Remote:
        def __init__(self, fn):
            self.fn = fn

        def options(self, **_):
            return self

        def remote(self, *args):
            return put(self.fn(*args))

    mod = types.ModuleType("ray")
    mod.__spec__ = importlib.machinery.ModuleSpec("ray", None)  # "installed"
    mod.put = put
    mod.get = store.__getitem__
    mod.remote = _Remote
    mod.wait = lambda refs, num_returns=1: (refs[:num_returns], refs[num_returns:])
    mod.cancel = lambda ref, force=False: None
    return mod


@pytest.fixture
def fake_ray(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", _fake_ray())
    monkeypatch.setattr(ray_executor, "_WORKER_TRAINERS", {})


def test_the_final_run_trains_on_all_the_data_through_the_ray_executor(fake_ray, tmp_path):
    ex = ray_executor.RayExecutor()
    ex._connected, ex.parallelism = True, 2  # connect() would start Ray: the stand-in needs none
    toy = SubsetToy()
    rel = dptune.tune_subsampled(
        toy, SPACE, RandomStopping.logarithmic(3), (2.0, 1e-5), fraction=0.2,
        tuning_epsilon=0.3, seed=4, workdir=tmp_path / "run", executor=ex, progress=False,
    )  # fmt: skip
    assert rel.released
    sizes = [n for n, _, _ in toy.calls]
    # Every tuning candidate on the subset (2,000 public records), then one run on all N.
    assert sizes[-1] == N and set(sizes[:-1]) == {2000}, sizes
    assert rel.payload == {"n": N}


def test_one_ray_executor_serves_each_run_its_own_trainer(fake_ray):
    ex = ray_executor.RayExecutor()
    ex._connected, ex.parallelism = True, 1
    first, second = SubsetToy(n=500), SubsetToy(n=N)
    kw = dict(seed=1, progress=False, ledger=None, executor=ex)
    dptune.tune(first, SPACE, RandomStopping.logarithmic(2), (2.0, 1e-5), **kw)
    dptune.tune(second, SPACE, RandomStopping.logarithmic(2), (2.0, 1e-5), **kw)
    assert second.calls and {n for n, _, _ in second.calls} == {N}
    assert {n for n, _, _ in first.calls} == {500}
