#!/usr/bin/env bash
# Issue 27 on the lent GPU machine: the accelerator table, the smoke run cold vs warm, and what a
# tuning run chooses (vectorised or sequential candidates) there. Declared (committed) before it
# ran; each stage run ONCE on the lent machine (offline) from the checkout's root, with $OUT set by
# the device runner and the wheels dp_accounting 0.6.0, dm-tree 0.1.10, ml_collections 1.1.0,
# jax-privacy 2.0.0 (+ pydantic 2.14.4, pydantic-core 2.50.5, annotated-types 0.8.0,
# typing-inspection 0.4.5) and opacus 1.6.0 in .whl/ (the machine has jax, flax, optax, torch).
#
#   bash results/runs/issue27_gpu.sh check    # environment + the tiny accelerator suite: a check
#                                             # that everything runs there, NOT a result
#   bash results/runs/issue27_gpu.sh smoke    # result: bench_warm_start.py --rounds 2 (smoke run
#                                             # off / cold / warm) + one smoke run's choice line
#   bash results/runs/issue27_gpu.sh table    # result: the accelerator suite at full size
#                                             # (batch 256, K = 2, 4, 8, 5 rounds x 5 steps, torch
#                                             # rows for cnn26k), --json
#   bash results/runs/issue27_gpu.sh table2   # result, declared after `table` ran (commit 19cfc4e
#                                             # found its harness unfair: dptune's rows copied four
#                                             # host arguments per step, the peers' one; torch ran on
#                                             # the CPU): the same command on the fixed suite, in
#                                             # two processes so that one call's 10 minutes hold it:
#                                             # cnn26k, CIFAR CNN, user CNN (+ torch on the GPU),
#                                             # then WRN-16-4 (now on the ghost path, merge abc9a3d)
#   bash results/runs/issue27_gpu.sh table2_wrn  # result, declared after table2's WRN-16-4 half
#                                             # stopped with an exception (the ghost plan's probe
#                                             # compared TF32 products and refused WRN-16-4; fixed
#                                             # in the commit that declares this): WRN-16-4 alone,
#                                             # K = 8 only (what the session's device time left)
#   bash results/runs/issue27_gpu.sh probe    # result: the vectorisation probe's choice (trainers.
#                                             # probe, as a tuning run calls it) for cnn26k, the
#                                             # CIFAR CNN and WRN-16-4 at batch 256 on this device
# Everything each stage prints goes to $OUT/<stage>.txt as well.
set -u -o pipefail
: "${OUT:?OUT must name the output folder}"
stage=${1:?check, smoke or table}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export DPTUNE_COMPILATION_CACHE=/tmp/dptune-jax-cache DPTUNE_LEDGER=/tmp/issue27-ledger.sqlite
log="$OUT/$stage.txt"
{
  date -u; git log -1 --format=%H 2>/dev/null; nvidia-smi -L; nproc
  python3 -c "import sys, jax, flax, optax, torch; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'torch', torch.__version__, jax.devices())"
} 2>&1 | tee "$log"
start=$SECONDS
case "$stage" in
  check)
    python3 scripts/bench_dpsgd.py --suite=accelerator --tiny --no-torch 2>&1 | tee -a "$log"
    ;;
  smoke)
    python3 scripts/bench_warm_start.py --rounds 2 --json 2>&1 | tee -a "$log"
    python3 -m dptune --config=smoke --workdir=/tmp/issue27-smoke --seed=1 --noprogress 2>&1 \
        | tee -a "$log"
    ;;
  table)
    python3 scripts/bench_dpsgd.py --suite=accelerator --json 2>&1 | tee -a "$log"
    ;;
  table2)
    python3 scripts/bench_dpsgd.py --suite=accelerator --json --models cnn26k,cifar_cnn,user_cnn \
        2>&1 | tee -a "$log"
    python3 scripts/bench_dpsgd.py --suite=accelerator --json --models wrn16_4 2>&1 \
        | tee "$OUT/table2_wrn16_4.txt"
    ;;
  table2_wrn)
    python3 scripts/bench_dpsgd.py --suite=accelerator --json --models wrn16_4 --ks 8 2>&1 \
        | tee -a "$log"
    ;;
  probe)
    python3 -c "
from trainers import probe
from trainers.spec import Hyperparams
for m, shape in (('cnn26k', (28, 28, 1)), ('cifar_cnn', (32, 32, 3)), ('wrn16_4', (32, 32, 3))):
    print('probe:', m, probe.choose(Hyperparams(model=m, batch_size=256), 10, shape).describe())
" 2>&1 | tee -a "$log"
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
rc=$?
echo "stage $stage: exit $rc, wall $((SECONDS - start)) s" | tee -a "$log"
exit $rc
