#!/usr/bin/env bash
# Issue 9, "speed no worse than before": this checkout against the checkout before the trainers
# split (commit fead3f4, unpacked with `git archive fead3f4 | tar -x -C .bench_old` and carried to
# the device), interleaved, on the lent GPU machine's CPU with JAX on CPU, pinned to 2 cores
# (taskset -c 0,1) like the development machine, nothing else running. Declared (committed) before
# it runs; run ONCE; docs/performance.md reports what it prints whatever it shows.
set -u
: "${OUT:?OUT must name the output folder}"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site JAX_PLATFORMS=cpu
{ nproc; lscpu | grep -i "model name"; python -c "import jax; print(jax.__version__, jax.devices())"; } > "$OUT/machine.txt" 2>&1
taskset -c 0,1 python scripts/bench_revisions.py --other .bench_old --rounds 15 --epochs 3 2>&1 | tee "$OUT/bench_revisions.txt"
