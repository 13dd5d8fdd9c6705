#!/usr/bin/env bash
# DMD2 on SD3.5-Medium: a 4-step generator, with the values of Flow-Factory's flow-matching port (branch DMDR,
# examples/dmd/lora/sd3_5.yaml, as read there: LoRA generator and fake score, lr 1e-5 each, real score without CFG,
# 5 fake-score steps per generator step); DMD2's own paper trains SDXL and SD1.5 only (docs/dmd2.md). 8 GPUs.
# No reward trains it: --reward only scores the held-out evaluation (DATA/test.txt), at the generator's 4 steps.
# Differences from that port: no DINOv2 term (it is off there until cold_start_iter); the re-noising sigma is uniform in
# [0.02, 0.98] for both scores (the port draws the fake score's from a logit-normal).
set -euo pipefail
DATA=${DATA:?set DATA to a prompt folder with train.txt and test.txt}
case "${TASK:-pickscore}" in
  pickscore) TASK_FLAGS=() ;;
  ocr) TASK_FLAGS=(--reward ocr) ;;  # the held-out metric; needs `pip install -r rewards/requirements-ocr.txt`
  *) echo "TASK must be pickscore or ocr" >&2; exit 2 ;;
esac
# geometry: M=32 prompts x K=2 = 64 samples per epoch; 8 GPUs x micro-batch 4 x 2 micro-batches
torchrun --nproc-per-node 8 algos/dmd2.py \
  --model stabilityai/stable-diffusion-3.5-medium --base-dtype bfloat16 --mixed-precision --resolution 512 \
  --reward pickscore --train-prompts "$DATA/train.txt" --test-prompts "$DATA/test.txt" \
  --num-steps 4 --guidance-scale 1.0 --real-guidance-scale 1.0 --fake-updates 5 --min-sigma 0.02 --max-sigma 0.98 \
  --lora-rank 32 --lora-alpha 64 --learning-rate 1e-5 --fake-learning-rate 1e-5 --weight-decay 1e-4 --max-grad-norm 1.0 \
  --num-prompts 32 --group-size 2 --micro-batch 4 --grad-steps-per-epoch 1 \
  --num-epochs 4000 --eval-every 100 --save-every 100 ${TASK_FLAGS[@]+"${TASK_FLAGS[@]}"}
