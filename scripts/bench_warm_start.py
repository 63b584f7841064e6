r"""The smoke run cold and warm: ``dptune --config=smoke`` in a fresh process, with dptune's cache
folder (``$DPTUNE_CACHE``: JAX's compiled steps and the remembered noise calibrations) empty
(cold: a first run on a new machine, which also fills the cache), already filled by the previous
run (warm: a second run, a resumed run), and with warm starts turned off
(``--compilation_cache=off``: neither cache is read or written).

Each round runs the three variants one after another (interleaved, so load hits all alike), each
in a fresh workdir and a fresh cache folder of its own (warm reuses cold's); the ratios are of
medians over the rounds. Before 2026-11-26 every variant shared the user's
``~/.cache/dptune/calibration.json``, so "cold" started with a remembered calibration from an
earlier round or run: a cold run that had skipped the noise search.

    python scripts/bench_warm_start.py                  # 3 rounds
    python scripts/bench_warm_start.py --rounds 5 --json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _run(work: Path, cache: Path, extra: list[str], *, off: bool = False) -> float:
    cmd = [sys.executable, "-m", "dptune", "--config=smoke", f"--workdir={work}", "--seed=1",
           "--noprogress", *(["--compilation_cache=off"] if off else []), *extra]  # fmt: skip
    env = {
        **os.environ,
        "DPTUNE_LEDGER": str(work.parent / f"{work.name}-ledger.sqlite"),
        "DPTUNE_CACHE": str(cache),
    }
    for name in ("DPTUNE_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR"):
        env.pop(name, None)  # the default folder under DPTUNE_CACHE, as a user gets it
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-2000:]}")
    return elapsed


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("extra", nargs="*", help="more flags for dptune (e.g. config overrides)")
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {"off": [], "cold": [], "warm": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for r in range(args.rounds):
            cache = root / f"cache{r}"
            off_cache = root / f"cache{r}-off"
            times["off"].append(_run(root / f"off{r}", off_cache, args.extra, off=True))
            times["cold"].append(_run(root / f"cold{r}", cache, args.extra))
            times["warm"].append(_run(root / f"warm{r}", cache, args.extra))
            size = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
            shutil.rmtree(cache)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; {args.rounds} rounds; cache "
          f"{size / 2**20:.1f} MiB")  # fmt: skip
    for k, v in times.items():
        print(f"{k:5s} median {med[k]:6.2f} s   ({', '.join(f'{x:.1f}' for x in v)})")
    ratio_cold, ratio_off = med["warm"] / med["cold"], med["warm"] / med["off"]
    print(f"warm / cold: {ratio_cold:.2f} (goal <= 0.40); warm / off: {ratio_off:.2f}")
    out = {"times": times, "median": med, "warm_over_cold": med["warm"] / med["cold"],
           "warm_over_off": med["warm"] / med["off"]}  # fmt: skip
    if args.json:
        print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
