#!/usr/bin/env bash
# Issue 27: the before/after comparison of 2026-11-26 done right, and the tuning-overhead figure
# again. Declared (committed) before it ran; run ONCE, from the checkout's root, with nothing
# else running:
#   bash results/runs/issue27_warm_start_ab.sh
# Why again (docs/performance.md says it too): in issue27_warm_start.sh,
#   * the "before" rows ran this session's code, not 4e5ec19's: `python -m dptune` puts the
#     current folder (the checkout) first on sys.path, ahead of PYTHONPATH; both row sets are
#     the new code (reported as such). Here each tree's bench runs with that tree as the
#     current folder (and PYTHONPATH), and each row prints which trainers/loop.py it imported;
#   * its tuning_overhead stage ran while the session's lead ran other smoke runs on the same
#     2 cores (18:51-18:54 UTC), so that figure (1.178) is not a measurement of dptune.
# Output in results/performance_issue27_warm_start_ab/:
#   warm_start_{before,after}_N: bench_warm_start.py --rounds 1 --json, 4e5ec19 and this commit,
#     interleaved, 4 rounds each; medians.txt: medians and ratios per code;
#   tuning_overhead: bench_tuning_overhead.py --rounds 3 --epochs 10 (goal <= 1.1).
set -u -o pipefail
out=$PWD/results/performance_issue27_warm_start_ab
mkdir -p "$out"
export PYTHONUNBUFFERED=1
here=$PWD
before=/tmp/dptune-before-4e5ec19
[ -d "$before" ] || git worktree add --detach "$before" 4e5ec19 >/dev/null 2>&1
run() {  # name, folder, command...
  local name=$1 dir=$2; shift 2
  { echo "\$ (cd $dir && $*)"; echo "start $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg)"; } > "$out/$name.txt"
  (cd "$dir" && PYTHONPATH="$dir" python -c "import trainers.loop as l; print('code:', l.__file__)" && PYTHONPATH="$dir" "$@") >> "$out/$name.txt" 2>&1
  echo "exit $?, end $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/$name.txt"
  tail -n 6 "$out/$name.txt"
}
git log -1 --format=%H > "$out/commit.txt"
for r in 1 2 3 4; do
  run "warm_start_before_$r" "$before" python "$here/scripts/bench_warm_start.py" --rounds 1 --json
  run "warm_start_after_$r" "$here" python "$here/scripts/bench_warm_start.py" --rounds 1 --json
done
python - "$out" > "$out/medians.txt" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
for code in ("before", "after"):
    rows = [json.loads([l for l in (out / f"warm_start_{code}_{r}.txt").read_text().splitlines()
                        if l.startswith("{")][-1]) for r in (1, 2, 3, 4)]
    med = {k: statistics.median(row["times"][k][0] for row in rows) for k in ("off", "cold", "warm")}
    print(f"{code}: off {med['off']:.2f} s, cold {med['cold']:.2f} s, warm {med['warm']:.2f} s; "
          f"warm / cold {med['warm'] / med['cold']:.3f}, warm / off {med['warm'] / med['off']:.3f}")
PY
cat "$out/medians.txt"
run tuning_overhead "$here" python scripts/bench_tuning_overhead.py --rounds 3 --epochs 10
