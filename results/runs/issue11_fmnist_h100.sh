#!/usr/bin/env bash
# Issue 11: the three declared Fashion-MNIST tuned runs at total (3, 1e-5) (docs/results.md) and,
# in parallel on the same machine, the Fashion-MNIST privacy-utility study, one process per
# repetition (docs/privacy_utility.md). Declared (committed) before it ran; run ONCE on the lent
# H100 machine (offline) from the checkout's root, with $OUT set by the device runner, the
# Fashion-MNIST IDX files in .carry/fashion-mnist and the wheels dp_accounting 0.6.0,
# ml_collections 1.1.0 and kymatio 0.3.0 in .whl/. Everything it prints goes to $OUT.
set -u
: "${OUT:?OUT must name the output folder}"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD DPTUNE_CACHE=/tmp/dptune-cache
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # four processes share the GPU
{ nvidia-smi -L; nproc; python -c "import jax, flax, optax; print(jax.__version__, flax.__version__, optax.__version__, jax.devices())"; git log -1 --format=%H; } > "$OUT/machine.txt" 2>&1
start=$SECONDS
python scripts/scatter_cache.py --name fashion_mnist --data_dir .carry/fashion-mnist > "$OUT/cache.json" 2> "$OUT/cache.err"
echo "cache: exit $?, wall $((SECONDS - start)) s" | tee -a "$OUT/wall.txt"
for r in 0 1 2; do
  ( s=$SECONDS
    timeout 470 python scripts/privacy_utility.py --config fashion_mnist \
        --set data.dir=.carry/fashion-mnist --only_rep $r --out runs/pu-fmnist-r$r > "$OUT/pu-r$r.log" 2>&1
    echo "privacy-utility repetition $r: exit $?, wall $((SECONDS - s)) s" >> "$OUT/wall.txt" ) &
done
for r in 1 2 3; do
  start=$SECONDS
  python -m dptune --config=fashion_mnist \
      --workdir=/tmp/fmnist-scatter-eps3-r$r --config.data.dir=.carry/fashion-mnist \
      --config.ledger.path=/tmp/ledger-issue11.sqlite --config.ledger.budget_epsilon=9 \
      --config.ledger.budget_delta=3e-5 --noprogress > "$OUT/fmnist-scatter-eps3-r$r.log" 2>&1
  echo "run $r: exit $?, wall $((SECONDS - start)) s" | tee -a "$OUT/wall.txt"
  cp -r /tmp/fmnist-scatter-eps3-r$r/release "$OUT/release-r$r"
done
wait
cp -r runs/pu-fmnist-r0 runs/pu-fmnist-r1 runs/pu-fmnist-r2 "$OUT/" 2>/dev/null
cat "$OUT/wall.txt"
