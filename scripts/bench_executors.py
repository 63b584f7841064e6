"""Cost of the executor layer: the Ray executor against in-process training, in one run.

Two measurements (docs/performance.md, "Executors"):

1. **Per-candidate overhead for short candidates.** A candidate that sleeps ``--sleep`` seconds
   (no CPU, so load from other processes does not move it) is run ``--short`` times in process
   (``SequentialExecutor``) and ``--short`` times through a local Ray instance, one task at a
   time (the latency a tuner pays per candidate once the workers are up). The first Ray task
   (worker start-up and imports) is timed separately. Overhead = Ray's wall time per candidate
   minus the in-process one; the issue's target is <= 1.5 s per candidate and <= 2 % of a 60-s
   candidate.
2. **Throughput of 2 local Ray workers against sequential** on the same machine: ``--dpsgd``
   real DP-SGD candidates (the smoke config: cnn26k on the shipped MNIST-10k, ``--epochs``
   epochs each) trained in process one after another, then by 2 Ray workers
   (``cpus_per_candidate=1`` on ``ray.init(num_cpus=2)``), each worker loading the data from its
   spec and compiling once, as in a real run. Both wall times include compilation.

Usage::

    python scripts/bench_executors.py            # ~3-5 minutes on 2 CPU cores
    python scripts/bench_executors.py --quick    # fewer and shorter candidates (~1-2 minutes)

Prints one table and the ratios; ``--json`` adds one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# Ray workers start from the driver's environment: let them import this checkout too.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _sleeper(seconds: float):
    def fn(hparams, rng):
        time.sleep(seconds)
        return float(rng.standard_normal()), {"x": hparams["x"]}

    return fn


def _short_trainer(seconds: float):
    from dptune.accounting.events import DpSgdCandidate
    from dptune.trainer_protocol import FunctionTrainer

    return FunctionTrainer(
        _sleeper(seconds),
        lambda hp: DpSgdCandidate(0.01, 100, 1.0),
        num_examples=10_000,
        fingerprint="bench",
        score_kind="covered",
    )


def _jobs(n: int, hparams_of, start: int = 0):
    from dptune.executors import Job

    return [Job(start + i, 2**100 + start + i, hparams_of(start + i)) for i in range(n)]


def _drain(executor, trainer, jobs) -> float:
    t0 = time.perf_counter()
    out = list(executor.run(trainer, jobs))
    assert len(out) == len(jobs) and all(s == s for _, s, _ in out), out  # no NaN: no failure
    return time.perf_counter() - t0


def bench_overhead(n: int, seconds: float) -> dict:
    from dptune.executors import SequentialExecutor
    from dptune.executors.ray import RayExecutor

    trainer = _short_trainer(seconds)
    hp = lambda i: {"x": float(i)}  # noqa: E731
    in_process = _drain(SequentialExecutor(), trainer, _jobs(n, hp))
    with RayExecutor(num_cpus=2) as ex:
        first = _drain(ex, trainer, _jobs(1, hp))  # worker start-up, imports, the trainer's put
        t_ray = 0.0
        for job in _jobs(n, hp, start=1):  # one at a time: the latency per candidate
            t_ray += _drain(ex, trainer, [job])
    per_in, per_ray = in_process / n, t_ray / n
    return {
        "short_candidates": n,
        "candidate_s": seconds,
        "in_process_per_candidate_s": per_in,
        "ray_per_candidate_s": per_ray,
        "ray_first_candidate_s": first,
        "overhead_per_candidate_s": per_ray - per_in,
        "overhead_of_60s_candidate": (per_ray - per_in) / 60.0,
    }


def bench_throughput(k: int, epochs: int) -> dict:
    from dptune import configs
    from dptune.cli.build import _worker_config, load_data, trainer_from_config
    from dptune.executors import SequentialExecutor
    from dptune.executors.ray import RayExecutor
    from dptune.learners.dpsgd import DpSgdTrainer

    spec = importlib.util.spec_from_file_location("smoke_cfg", configs.path_of("smoke"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    cfg = mod.get_config().to_dict()
    cfg["train"]["epochs"] = epochs
    wcfg = _worker_config(cfg)
    hp = lambda i: {  # noqa: E731  spread like the smoke space; sigma fixed (no calibration here)
        "learning_rate": 1.0 + 3.0 * (i % 4) / 3,
        "clip_norm": 0.5 + 1.5 * (i % 3) / 2,
        "noise_multiplier": 1.0,
    }
    t0 = time.perf_counter()
    trainer = DpSgdTrainer(load_data(cfg), cfg["train"], epoch_progress=False)
    load_s = time.perf_counter() - t0
    seq = _drain(SequentialExecutor(), trainer, _jobs(k, hp))
    trainer.remote_factory = functools.partial(trainer_from_config, wcfg)
    with RayExecutor(num_cpus=2, cpus_per_candidate=1.0) as ex:
        workers = ex.parallelism
        ray_s = _drain(ex, trainer, _jobs(k, hp))
    return {
        "dpsgd_candidates": k,
        "epochs": epochs,
        "ray_workers": workers,
        "driver_data_load_s": load_s,
        "sequential_s": seq,
        "ray_2_workers_s": ray_s,
        "throughput_ratio_ray_over_sequential": seq / ray_s,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short", type=int, default=20, help="short candidates per executor")
    p.add_argument("--sleep", type=float, default=0.5, help="length of a short candidate (s)")
    p.add_argument("--dpsgd", type=int, default=6, help="DP-SGD candidates per executor")
    p.add_argument("--epochs", type=int, default=2, help="epochs per DP-SGD candidate")
    p.add_argument("--quick", action="store_true", help="--short=5 --dpsgd=2 --epochs=1")
    p.add_argument("--json", action="store_true", help="also print one JSON object")
    a = p.parse_args(argv)
    if a.quick:
        a.short, a.dpsgd, a.epochs = 5, 2, 1
    import jax
    import ray

    t0 = time.time()
    over = bench_overhead(a.short, a.sleep)
    thr = bench_throughput(a.dpsgd, a.epochs)
    wall = time.time() - t0
    load = os.getloadavg()
    print(
        f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; "
        f"python {platform.python_version()}, jax {jax.__version__}, ray {ray.__version__}; "
        f"load average after: {load[0]:.1f}; wall {wall:.0f} s"
    )
    print()
    print("| measurement | value |")
    print("|---|---:|")
    rows = [
        (f"short candidate ({a.sleep:g} s sleep), in process, per candidate",
         f"{over['in_process_per_candidate_s']:.3f} s"),
        ("... through Ray (warm worker, one task at a time), per candidate",
         f"{over['ray_per_candidate_s']:.3f} s"),
        ("**Ray overhead per candidate** (target <= 1.5 s)",
         f"**{over['overhead_per_candidate_s']:.3f} s**"),
        ("... as a share of a 60-s candidate (target <= 2 %)",
         f"{100 * over['overhead_of_60s_candidate']:.2f} %"),
        ("first Ray task (local Ray start-up excluded; worker start, imports)",
         f"{over['ray_first_candidate_s']:.2f} s"),
        (f"{thr['dpsgd_candidates']} DP-SGD candidates (smoke, {thr['epochs']} epochs), "
         "sequential in process", f"{thr['sequential_s']:.1f} s"),
        (f"... {thr['ray_workers']} local Ray workers (each loads data, compiles)",
         f"{thr['ray_2_workers_s']:.1f} s"),
        ("**throughput ratio, 2 Ray workers / sequential**",
         f"**{thr['throughput_ratio_ray_over_sequential']:.2f}x**"),
    ]  # fmt: skip
    for name, value in rows:
        print(f"| {name} | {value} |")
    if a.json:
        print(json.dumps({**over, **thr, "wall_s": wall, "loadavg_after": load[0]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
