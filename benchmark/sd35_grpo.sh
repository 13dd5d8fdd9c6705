#!/usr/bin/env bash
# Flow-GRPO-Fast on SD3.5-Medium with the official PickScore settings (yifan123/flow_grpo config/grpo.py
# `pickscore_sd3_fast`, scripts/train_sd3_fast.py; its SDE window, which that config leaves unset, from
# `pickscore_sd3_fast_nocfg`), 8 GPUs for the official 32 (same global batch).
# Paper (Table 1, SD3.5-M, 512 px): PickScore 21.72 -> 23.31 with KL (beta 0.01) / 23.41 without; this is the
# Flow-GRPO-Fast config (kl 0, a contiguous window of 2 SDE steps with a random start in steps 0..4, clip 1e-5).
# GenEval 0.63 -> 0.95 and OCR 0.59 -> 0.92 use the full Flow-GRPO config with beta 0.04 (TASK=ocr below).
# Evaluation follows the paper: an EMA (decay 0.9) of the LoRA weights, 40 steps, CFG 4.5; the EMA is updated at every
# 8th optimizer step, twice (flow_grpo calls ema.step after each micro-batch: 2 per optimizer step on its 32 GPUs).
# Sigma schedule: the scheduler's own set_timesteps(N) (flow_grpo passes sigmas=None), 1 ... 0.278, 0.009, 0 at 10 steps.
# DATA: a folder with train.txt / test.txt (flow_grpo's dataset/pickscore).
# Differences from the official config (checked by tests/test_paper_configs.py), one "# DIFF --flag VALUE: reason" each:
# DIFF --micro-batch 8: official 9 images per forward; 8 here so that 1152 images split into whole micro-batches on 8 GPUs
# DIFF --base-dtype bfloat16: the official code keeps the frozen transformer in fp32 (9 GB); bf16 halves it, and under
# autocast its matmuls run in half precision either way
# DIFF --mixed-precision True: the official autocast is fp16, cleanflow's bf16 (no fp16 path: bf16 needs no loss scaling)
set -euo pipefail
DATA=${DATA:?set DATA to a prompt folder with train.txt and test.txt}
# TASK=ocr: the full Flow-GRPO OCR config (flow_grpo config/grpo.py `general_ocr_sd3`): beta 0.04 on flow_grpo's KL form,
# clip 1e-4, noise 0.7, 9 trained SDE steps (timestep_fraction 0.99), independent initial noise per image (same_latent
# False); needs `pip install -r rewards/requirements-ocr.txt`
# and OCR prompts (text in double quotes).
# GenEval needs a detector-based reward that cleanflow does not have for real images (only the tiny-shapes checker).
case "${TASK:-pickscore}" in
  pickscore) TASK_FLAGS=() ;;
  ocr) TASK_FLAGS=(--reward ocr --kl-beta 0.04 --clip-low 1e-4 --clip-high 1e-4 --eta 0.7 --sde-window 0 9 --num-sde-steps 9
                   --no-shared-group-noise
                   --eval-every 60 --save-every 60) ;;
  *) echo "TASK must be pickscore or ocr" >&2; exit 2 ;;
esac
# geometry: M=48 prompts x K=24 = 1152 images per epoch, 8 GPUs x micro-batch 8 -> 18 micro-batches per rank
torchrun --nproc-per-node 8 algos/grpo.py \
  --model stabilityai/stable-diffusion-3.5-medium --base-dtype bfloat16 --mixed-precision --resolution 512 \
  --reward pickscore --train-prompts "$DATA/train.txt" --test-prompts "$DATA/test.txt" \
  --num-steps 10 --sigma-schedule scheduler --guidance-scale 4.5 --dynamics Flow-SDE --eta 0.8 \
  --sde-window 0 5 --window-mode contiguous --num-sde-steps 2 --zero-adv-filter \
  --lora-rank 32 --lora-alpha 64 --learning-rate 3e-4 --weight-decay 1e-4 --max-grad-norm 1.0 \
  --num-prompts 48 --group-size 24 --micro-batch 8 --grad-steps-per-epoch 2 --num-inner-epochs 1 \
  --clip-low 1e-5 --clip-high 1e-5 --adv-clip 5 --advantage-std global --kl-beta 0 --kl-form official \
  --eval-num-steps 40 --eval-guidance-scale 4.5 --eval-ema-decay 0.9 --eval-ema-interval 8 --eval-ema-repeats 2 \
  --num-epochs 1000 --eval-every 60 --save-every 60 ${TASK_FLAGS[@]+"${TASK_FLAGS[@]}"}
