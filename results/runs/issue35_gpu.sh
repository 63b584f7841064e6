#!/usr/bin/env bash
# Fine-tune issue, GPU rows, for the first session lent a device (declared before it runs; each
# result stage run ONCE on the lent machine, offline, from the checkout's root, output kept
# whatever it shows). The machine has jax, flax, optax, orbax, absl, chex; the rest travels as
# wheels in .whl/ (ignored: `echo /.whl/ >> .git/info/exclude`), fetched here by
#
#   bash results/runs/issue35_gpu.sh wheels        # HERE, not on the device
#
# then, on the device (run(command=..., carry=[".whl"], timeout_s=...)):
#
#   bash results/runs/issue35_gpu.sh check   # the LoRA row set at tiny sizes: a check that it
#                                            # runs there (about a minute), NOT a result
#   bash results/runs/issue35_gpu.sh lora    # RESULT: the issue's rows on the GPU, one interleaved
#                                            # run per batch size: LoRA rank 8 on the 4-layer
#                                            # transformer (d 256, sequence 128) at batch 16 (the
#                                            # CPU rows' size) and at batch 64; goals: lora_dp >=
#                                            # 0.8x lora_nonprivate, >= 2x lora_jaxprivacy, and
#                                            # lora_candidate (a whole candidate through
#                                            # trainers.loop, per expected example) >= 0.9x lora_dp;
#                                            # peak memory of each compiled step
#
# Everything a stage prints goes to $OUT/<stage>.txt as well.
set -u -o pipefail
stage=${1:?wheels, check or lora}
if [ "$stage" = wheels ]; then
  cd "$(dirname "$0")/../.."
  mkdir -p .whl
  for w in dp_accounting==0.6.0 dm-tree==0.1.10 ml_collections==1.1.0 jax-privacy==2.0.0 \
           pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl "$w" || exit 1
  done
  ls -la .whl
  exit 0
fi
: "${OUT:?OUT must name the output folder}"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
log="$OUT/$stage.txt"
{
  date -u; git log -1 --format=%H 2>/dev/null; nvidia-smi -L; nproc
  python3 -c "import sys, jax, flax, optax; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())"
  python3 -c "import jax_privacy; print('jax_privacy', jax_privacy.__version__)" \
    || echo "jax_privacy does not import: its row is skipped"
} 2>&1 | tee "$log"
start=$SECONDS
case "$stage" in
  check)
    python3 scripts/bench_dpsgd.py --lora --quick --lora-d 64 --lora-seq 32 --lora-batch 8 \
        --rounds 1 --steps 2 2>&1 | tee -a "$log"
    ;;
  lora)
    for b in 16 64; do
      echo "## batch $b" | tee -a "$log"
      python3 scripts/bench_dpsgd.py --lora --lora-batch "$b" --rounds 5 --steps 10 --json 2>&1 \
          | tee -a "$log"
    done
    ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
rc=$?
echo "stage $stage: exit $rc, wall $((SECONDS - start)) s" | tee -a "$log"
exit $rc
