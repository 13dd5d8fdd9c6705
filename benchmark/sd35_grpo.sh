#!/usr/bin/env bash
# Flow-GRPO(-Fast) on SD3.5-Medium with the paper's PickScore settings (flow_grpo `pickscore_sd3_fast`, mirrored by
# Flow-Factory examples/grpo/lora/sd3_5/default.yaml), 8 GPUs.
# Paper (Table 1, SD3.5-M, 512 px): PickScore 21.72 -> 23.31 with KL (beta 0.01) / 23.41 without; this is the
# Flow-GRPO-Fast config (kl 0, 2 SDE steps of the window 1..5). GenEval 0.63 -> 0.95 and OCR 0.59 -> 0.92 use beta 0.04.
# DATA: a folder with train.txt / test.txt (flow_grpo's dataset/pickscore).
set -euo pipefail
DATA=${DATA:?set DATA to a prompt folder with train.txt and test.txt}
# TASK=ocr: OCR (paper: 0.59 -> 0.92 with KL): beta 0.04, flow_grpo's dataset/ocr prompts; needs `pip install -r rewards/requirements-ocr.txt` and OCR prompts (text in double quotes).
# GenEval needs a detector-based reward that cleanflow does not have for real images (only the tiny-shapes checker).
case "${TASK:-pickscore}" in
  pickscore) TASK_FLAGS=() ;;
  ocr) TASK_FLAGS=(--reward ocr --kl-beta 0.04 --clip-low 1e-4 --clip-high 1e-4) ;;
  *) echo "TASK must be pickscore or ocr" >&2; exit 2 ;;
esac
# geometry: M=48 prompts x K=24 = 1152 images per epoch, 8 GPUs x micro-batch 8 -> 18 micro-batches per rank
torchrun --nproc-per-node 8 algos/grpo.py \
  --model stabilityai/stable-diffusion-3.5-medium --base-dtype bfloat16 --mixed-precision --resolution 512 \
  --reward pickscore --train-prompts "$DATA/train.txt" --test-prompts "$DATA/test.txt" \
  --num-steps 10 --guidance-scale 4.5 --dynamics Flow-SDE --eta 0.8 --sde-window 1 6 --num-sde-steps 2 \
  --lora-rank 32 --lora-alpha 64 --learning-rate 3e-4 --weight-decay 1e-4 --max-grad-norm 1.0 \
  --num-prompts 48 --group-size 24 --micro-batch 8 --grad-steps-per-epoch 2 --num-inner-epochs 1 \
  --clip-low 1e-4 --clip-high 1e-4 --adv-clip 5 --advantage-std global --kl-beta 0 \
  --num-epochs 1000 --eval-every 20 --save-every 20 ${TASK_FLAGS[@]+"${TASK_FLAGS[@]}"}
