#!/usr/bin/env bash
# Issue 26: the declared Fashion-MNIST runs at total (3, 1e-5) (docs/results.md, "Issue 26"): the
# untuned reference (Tramer & Boneh's setting, one run) and three tuned runs of the revised
# --config=fashion_mnist, OS entropy, one after another, each ONCE. Declared (committed) before it
# runs; not run when it was committed (the lead decides). From the checkout's root:
#
#   OUT=/tmp/issue26 DATA=../shared/data/fashion-mnist nice -n 10 bash results/runs/issue26_fmnist.sh
#
# On a lent GPU machine (offline) put the IDX files in .carry/fashion-mnist (DATA defaults to it)
# and the wheels dp_accounting 0.6.0, ml_collections 1.1.0 and kymatio 0.3.0 in .whl/ (installed
# when the folder exists, as for issue 11). Everything it prints goes to $OUT; each release is
# copied there. Expected wall time: about 1 h 30 min per tuned run and 30 min for the reference on
# the shared 2-core CPU (an estimate from issue 11's 77 min, not a measurement); about a minute
# each on an H100.
set -u
: "${OUT:?OUT must name the output folder}"
DATA=${DATA:-.carry/fashion-mnist}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD DPTUNE_CACHE=/tmp/dptune-cache
else
  export PYTHONPATH=$PWD
fi
LEDGER=/tmp/ledger-issue26.sqlite  # a fresh ledger: four runs of (3, 1e-5) = (12, 4e-5)
{ nproc; python -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())"; git log -1 --format=%H; } > "$OUT/machine.txt" 2>&1
start=$SECONDS
python scripts/scatter_cache.py --name fashion_mnist --data_dir "$DATA" > "$OUT/cache.json" 2> "$OUT/cache.err"
echo "cache: exit $?, wall $((SECONDS - start)) s" | tee -a "$OUT/wall.txt"
run() {  # run NAME CONFIG: one dptune run, its log and release copied to $OUT
  local name=$1 config=$2 s=$SECONDS
  python -m dptune --config="$config" --workdir=/tmp/issue26-$name --config.data.dir="$DATA" \
      --config.ledger.path=$LEDGER --config.ledger.budget_epsilon=12 \
      --config.ledger.budget_delta=4e-5 --noprogress > "$OUT/$name.log" 2>&1
  echo "$name: exit $?, wall $((SECONDS - s)) s" | tee -a "$OUT/wall.txt"
  cp -r /tmp/issue26-$name/release "$OUT/release-$name"
}
run recipe results/runs/issue26_fmnist_recipe.py
for r in 1 2 3; do
  run tuned-r$r fashion_mnist
done
cat "$OUT/wall.txt"
