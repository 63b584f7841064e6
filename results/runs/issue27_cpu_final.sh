#!/usr/bin/env bash
# Issue 27, the final CPU figures after the session of 2026-11-25 afternoon (WRN-16-4 on the ghost
# path, the accountant's repeated numbers computed once, the curve's epsilons while candidates
# train, the process exit without teardown). Declared (committed) before it ran; run ONCE on this
# project's 2-core machine with nothing else of ours running, from the checkout's root:
#   bash results/runs/issue27_cpu_final.sh
# Each command's output goes to results/performance_issue27_cpu_final/, with the load average.
set -u -o pipefail
out=results/performance_issue27_cpu_final
mkdir -p "$out"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
py=/work/venv/bin/python
run() {  # name, command...
  local name=$1; shift
  { echo "\$ $*"; echo "start $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg)"; } > "$out/$name.txt"
  "$@" >> "$out/$name.txt" 2>&1
  echo "exit $?, end $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/$name.txt"
  tail -n 25 "$out/$name.txt"
}
git log -1 --format=%H > "$out/commit.txt"
run accelerator_cpu $py scripts/bench_dpsgd.py --suite=accelerator --batch 32 --ks 2,4 --rounds 3 --steps 2
run warm_start $py scripts/bench_warm_start.py --rounds 3
run tuning_overhead $py scripts/bench_tuning_overhead.py --rounds 3 --epochs 10
run cpu_quick /work/venv_bench/bin/python scripts/bench_dpsgd.py --quick
