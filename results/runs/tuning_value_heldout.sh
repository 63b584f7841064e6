#!/usr/bin/env bash
# Declared check (value-of-tuning issue, item 2): dptune's new defaults for a user's model and for
# fine-tuning (SGD learning-rate ranges that scale with the batch, C 0.5 to 2, a geometric count
# of mean 4; the `finetune` config on plain SGD at batch 64 for 10 epochs), chosen on the public
# tasks of results/runs/tuning_value.sh and scripts/tuning_landscape.py, checked ONCE on four tasks
# held out of that choice: tabular_b (generated, 40 features, 6 classes), text_b (generated, 64
# tokens, vocabulary 2000), lm_b (a Markov chain of 48 tokens, sequences of 24) and finetune_b
# (the shipped digits-0-4 start fine-tuned on Fashion-MNIST classes 0-4). Arms: dptune (new
# defaults), dptune_before (the defaults of 90e49a0), one untuned run at Opacus's and at
# jax_privacy's example defaults, and the non-private best of the dptune arm's own candidates
# (its journal). Total epsilon 1 and 3, delta 1e-5, five runs per cell, OS entropy, 2-core CPU
# (about 40 minutes). Committed before it runs; run once; reported whatever it shows
# (docs/privacy_utility.md, "Better defaults"), as medians and 10th/90th percentiles.
# Goal (issue text): on every held-out task, dptune's median release at epsilon 3 >= each untuned
# default's median and within 2 points of the non-private reference. Also reported: new vs before.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHONPATH=. nice -n 5 python scripts/tuning_value.py --out=results/tuning_value_heldout \
    --tasks tabular_b text_b lm_b finetune_b --arms dptune dptune_before opacus jax_privacy \
    --eps 1 3 --reps 5 --fashion_dir=../shared/data/fashion-mnist 2>&1 \
    | tee results/tuning_value_heldout.log
