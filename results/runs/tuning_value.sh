#!/usr/bin/env bash
# Declared benchmark (issue: the value of tuning where no recipe is known): released test score of
# dptune's default tuning vs one untuned run at Opacus's and jax_privacy's example defaults vs
# naive best-of-k, plus the non-private best of dptune's own candidates (from its journal), on five
# tasks without a recipe (tabular, text, cnn on Fashion-MNIST, tiny LM, finetune), at total
# epsilon 1 and 3, five runs per cell, OS entropy, on the 2-core CPU with nothing else running
# (about 90 minutes). Committed before it runs; run once; reported whatever it shows
# (docs/privacy_utility.md), as medians and 10th/90th percentiles.
# Goal (issue text): on every task, dptune's median release >= the untuned defaults' median at
# epsilon 3, and within 2 points of the non-private reference.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHONPATH=. nice -n 5 python scripts/tuning_value.py --out=results/tuning_value \
    --tasks tabular text cnn lm finetune --eps 1 3 --reps 5 \
    --fashion_dir=../shared/data/fashion-mnist 2>&1 | tee results/tuning_value.log
