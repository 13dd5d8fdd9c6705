#!/usr/bin/env bash
# DGPO on SD3.5-Medium, PickScore, the official `pickscore_sd3_4gpu` settings (mirrored by Flow-Factory
# examples/dgpo/lora/sd3_5/default.yaml), 4 GPUs. Paper (SD3.5-M): GenEval 0.63 -> 0.97, OCR 0.59 -> 0.96 (dpo_beta 100
# for those tasks; 10 for PickScore as here). Not verified here: no GPU.
set -euo pipefail
DATA=${DATA:?set DATA to a prompt folder with train.txt and test.txt}
# TASK=ocr: OCR (paper: 0.59 -> 0.96): dpo_beta 100 and KL 0.02; needs `pip install -r rewards/requirements-ocr.txt` and OCR prompts (text in double quotes).
# GenEval needs a detector-based reward that cleanflow does not have for real images (only the tiny-shapes checker).
case "${TASK:-pickscore}" in
  pickscore) TASK_FLAGS=() ;;
  ocr) TASK_FLAGS=(--reward ocr --dpo-beta 100 --kl-beta 0.02) ;;
  *) echo "TASK must be pickscore or ocr" >&2; exit 2 ;;
esac
# geometry: M=24 prompts x K=24 = 576 images per epoch; 4 GPUs x micro-batch 24 = whole groups per micro-batch
torchrun --nproc-per-node 4 algos/dgpo.py \
  --model stabilityai/stable-diffusion-3.5-medium --base-dtype bfloat16 --mixed-precision --resolution 512 \
  --reward pickscore --train-prompts "$DATA/train.txt" --test-prompts "$DATA/test.txt" \
  --num-steps 10 --guidance-scale 4.5 --dynamics ODE \
  --lora-rank 64 --lora-alpha 128 --learning-rate 3e-4 --weight-decay 1e-4 --max-grad-norm 1.0 \
  --num-prompts 24 --group-size 24 --micro-batch 24 --grad-steps-per-epoch 1 \
  --num-train-timesteps 4 --timestep-range 0.6 --adv-clip 5 --advantage-std global \
  --dpo-beta 10 --clip-dsm --clip-range 5e-2 --switch-ema-ref 200 --ema-ref-max-decay 0.3 --ema-ref-ramp-rate 1e-3 \
  --kl-beta 1e-3 --kl-cfg 1.0 \
  --num-epochs 1000 --eval-every 60 --save-every 20 ${TASK_FLAGS[@]+"${TASK_FLAGS[@]}"}
