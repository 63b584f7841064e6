#!/usr/bin/env bash
# Issue 14 (b): 26k- vs 52k-parameter CNN under DP-SGD across total epsilon, each run tuned
# privately by dptune -- the MNIST-10k variant declared in docs/reproductions/cnn-width.md
# ("--config=smoke", unchanged except the model and the total epsilon). Declared (committed)
# before it runs; run ONCE on the lent H100 machine (offline) from the checkout's root, with $OUT
# set by the device runner and the wheels dp_accounting 0.6.0, ml_collections 1.1.0 in .whl/.
# The eight cells (model x epsilon) run as eight processes side by side, three repetitions each.
set -u
: "${OUT:?OUT must name the output folder}"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD DPTUNE_CACHE=/tmp/dptune-cache
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # eight processes share the GPU
{ nvidia-smi -L; nproc; python -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())"; } > "$OUT/machine.txt" 2>&1
start=$SECONDS
for model in cnn26k cnn52k; do
  for eps in 1 2 3 8; do
    ( s=$SECONDS
      timeout 520 python scripts/repro_cnn_width.py --out=runs/repro-b --config=smoke \
          --only=$model:$eps > "$OUT/cell-$model-eps$eps.log" 2>&1
      echo "cell $model eps $eps: exit $?, wall $((SECONDS - s)) s" >> "$OUT/wall.txt" ) &
  done
done
wait
echo "all cells: wall $((SECONDS - start)) s" >> "$OUT/wall.txt"
python scripts/repro_cnn_width.py --out=runs/repro-b --plot
cp runs/repro-b/results.jsonl runs/repro-b/cnn_width.png "$OUT/"
cat "$OUT/wall.txt"
