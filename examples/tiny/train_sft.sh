#!/usr/bin/env bash
# Train the embedded tiny model from scratch with `quickstart sft`, then pick the saved
# checkpoint whose greedy accuracy on the held-out split lies in [20%, 60%] (the SFT start
# must leave RL room to improve) and copy it into realhf/assets/tiny.
#
#     bash examples/tiny/train_sft.sh [WORKDIR]
#
# Takes about 10 minutes on 2 CPU cores (0.3 s/step, 2000 steps of 64 sequences).
# Deterministic for the committed tokenizer/data and seed 1.
set -euo pipefail
cd "$(dirname "$0")/../.."
work=${1:-/tmp/realhf-tiny-sft}
python examples/tiny/make_model.py --out "$work/init"
python -m realhf.apps.quickstart sft model.path="$work/init" \
  exp_ctrl.total_train_epochs=40 exp_ctrl.benchmark_steps=2000 exp_ctrl.save_freq_steps=100 \
  fileroot="$work" trial_name=scratch overwrite=true
python examples/tiny/pick_checkpoint.py "$work/sft/scratch/checkpoints/default" \
  --low 0.20 --high 0.60 --install realhf/assets/tiny
