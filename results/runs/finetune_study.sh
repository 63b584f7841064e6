#!/usr/bin/env bash
# Declared fine-tuning study (issue: fine-tune privately): released test accuracy of six arms on
# the shipped `finetune` task (cnn26k pretrained on the public digits 0-4, tuned privately on the
# digits 5-9) at total epsilon 1 and 3, tuning included, three runs per arm, OS entropy, run once
# and reported whatever it shows (docs/finetune.md). Committed before it runs.
#   arms: scratch (dptune's cnn26k recipe from random init), full, lora, last_layer,
#         public_recipe (untuned: Adam 1e-3, C 1e-3), full_subsampled (subsampled strategy)
# Goal (issue text): a pretrained arm >= 5 points above scratch at epsilon 1.
set -euo pipefail
cd "$(dirname "$0")/../.."
nice -n 10 python scripts/finetune_study.py --out=results/finetune_study 2>&1 \
    | tee results/finetune_study.log
