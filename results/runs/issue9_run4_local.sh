#!/usr/bin/env bash
# Issue 9, "speed no worse than before", run 4: after trainers.step.Group (a single candidate runs
# the plain jitted step again), this checkout (A) against the checkout before the trainers split
# (B = .bench_old, `git archive fead3f4`), on the 2-core development machine with nothing else of
# ours running. Declared (committed) before it runs; run ONCE; docs/performance.md reports what it
# prints whatever it shows.
#   (a) the training loop: scripts/bench_revisions.py, 15 interleaved rounds of 3 epochs;
#   (b) the step-level ratios of scripts/bench_dpsgd.py (JAX rows; PyTorch is not installed here),
#       full row set, run 3 times per checkout, alternating A, B, B, A, A, B.
set -eu
OUT=${OUT:-results/performance_issue9_run4}
mkdir -p "$OUT"
{ nproc; lscpu | grep -i "model name"; python -c "import jax; print(jax.__version__)"; git rev-parse HEAD; uptime; } > "$OUT/machine.txt" 2>&1
PYTHONPATH=. python scripts/bench_revisions.py --other .bench_old --rounds 15 --epochs 3 2>&1 | tee "$OUT/bench_revisions.txt"
here=$PWD
n=0
for side in A B B A A B; do
  n=$((n + 1))
  if [ "$side" = A ]; then dir=$here; else dir=$here/.bench_old; fi
  (cd "$dir" && PYTHONPATH="$dir" python scripts/bench_dpsgd.py --json --no-torch) > "$OUT/bench_dpsgd_${n}_${side}.txt" 2>&1
  tail -1 "$OUT/bench_dpsgd_${n}_${side}.txt" | cut -c1-200
done
uptime >> "$OUT/machine.txt"
