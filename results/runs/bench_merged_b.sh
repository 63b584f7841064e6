#!/usr/bin/env bash
# The models-people-write and LoRA speed rows on the merged tree after the ghost form rule
# (Gram form for sequence Dense layers when T^2 < d_in d_out, shared Grams), on the quiet
# 2-core machine after the value-of-tuning benchmark ended; each command run once, output kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=results/performance_merged_2026-11-27b
for args in "--lm" "--lora --rounds=3 --steps=2" "--user"; do
  name=$(echo "$args" | tr -d ' =-')
  { echo "# python scripts/bench_dpsgd.py $args  ($(date -u +%H:%M) UTC, load $(cut -d' ' -f1-3 /proc/loadavg))";
    PYTHONPATH=. python scripts/bench_dpsgd.py $args 2>&1;
    echo "# load after: $(cut -d' ' -f1-3 /proc/loadavg)"; } > "$out/$name.txt"
done
