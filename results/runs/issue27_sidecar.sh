#!/usr/bin/env bash
# Issue 27's warm-start goal (a warm smoke run at most 40 % of a cold one), measured once more
# after the sidecar (dptune/sidecar.py: the one-step PLD built ahead on a second core while the
# command imports; the release's plots drawn there while the command writes the rest).
# Declared (committed) before it ran; run ONCE, from the checkout's root, with nothing else
# running on the machine:
#   bash results/runs/issue27_sidecar.sh
# Output in results/performance_issue27_sidecar/:
#   warm_start_{before,after}_N: bench_warm_start.py --rounds 1 --json, 7e007ba (the code before
#     the sidecar) and this commit, interleaved, 5 rounds each, each tree run with itself as the
#     current folder (python -m puts the current folder first on sys.path) and printing the
#     dptune/release.py it imported; medians.txt: medians and ratios per code;
#   sidecar_used: two smoke runs of one command line in a fresh cache, --verbosity=1; the second
#     must say "is the sidecar's" (its step PLD came from the sidecar), the first must not;
#   suite: the default `pytest` (the fast suite), its wall time, with the suite's cache as it is.
set -u -o pipefail
out=$PWD/results/performance_issue27_sidecar
mkdir -p "$out"
export PYTHONUNBUFFERED=1
here=$PWD
before=/tmp/dptune-before-7e007ba
[ -d "$before" ] || git worktree add --detach "$before" 7e007ba >/dev/null 2>&1
run() {  # name, folder, command...
  local name=$1 dir=$2; shift 2
  { echo "\$ (cd $dir && $*)"; echo "start $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg)"; } > "$out/$name.txt"
  (cd "$dir" && PYTHONPATH="$dir" python -c "import dptune.release as r; print('code:', r.__file__)" && PYTHONPATH="$dir" "$@") >> "$out/$name.txt" 2>&1
  echo "exit $?, end $(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg)" >> "$out/$name.txt"
  tail -n 6 "$out/$name.txt"
}
git log -1 --format=%H > "$out/commit.txt"
nproc >> "$out/commit.txt"
for r in 1 2 3 4 5; do
  run "warm_start_before_$r" "$before" python "$here/scripts/bench_warm_start.py" --rounds 1 --json
  run "warm_start_after_$r" "$here" python "$here/scripts/bench_warm_start.py" --rounds 1 --json
done
python - "$out" > "$out/medians.txt" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
for code in ("before", "after"):
    rows = [json.loads([l for l in (out / f"warm_start_{code}_{r}.txt").read_text().splitlines()
                        if l.startswith("{")][-1]) for r in (1, 2, 3, 4, 5)]
    med = {k: statistics.median(row["times"][k][0] for row in rows) for k in ("off", "cold", "warm")}
    ratios = sorted(row["times"]["warm"][0] / row["times"]["cold"][0] for row in rows)
    print(f"{code}: off {med['off']:.2f} s, cold {med['cold']:.2f} s, warm {med['warm']:.2f} s; "
          f"warm / cold {med['warm'] / med['cold']:.3f}, warm / off {med['warm'] / med['off']:.3f}; "
          f"per-round warm / cold {', '.join(f'{x:.3f}' for x in ratios)}")
PY
cat "$out/medians.txt"
cache=$(mktemp -d)
for n in first second; do
  rm -rf "/tmp/dptune-sidecar-$n"
  run "sidecar_used_$n" "$here" env DPTUNE_CACHE="$cache" python -m dptune --config=smoke \
    "--workdir=/tmp/dptune-sidecar-$n" --seed=1 --noprogress --verbosity=1
  echo "$n: $(grep -c "is the sidecar's" "$out/sidecar_used_$n.txt") lines 'is the sidecar's'" >> "$out/medians.txt"
done
rm -rf "$cache"
{ echo "start $(date -u +%H:%M:%S)"; s=$(date +%s); pytest 2>&1 | tail -n 3; echo "wall $(( $(date +%s) - s )) s, end $(date -u +%H:%M:%S)"; } > "$out/suite.txt"
cat "$out/medians.txt" "$out/suite.txt"
