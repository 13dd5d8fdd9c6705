#!/usr/bin/env bash
# Diffusion-DPO on SD3.5-Medium with flow_grpo's DPO settings (yifan123/flow_grpo @ ac4c86e, config/dpo.py
# `pickscore_sd3`, scripts/train_sd3_dpo.py), 8 GPUs with the official per-process geometry (one prompt x 24 images).
# Online pairs from each group's best and worst rollout, sampled by the frozen reference (flow_grpo's `ref` adapter,
# never refreshed: ref_update_step 10^7), 39 logit-normal training timesteps per pair. No published numbers for this
# config; not run here (no GPU).
# beta: flow_grpo's 100 multiplies -0.5 inside the sigmoid; cleanflow's --dpo-beta is the whole factor: 50 (docs/dpo.md).
# Evaluation as in flow_grpo: an EMA (decay 0.9, every 8th optimizer step) of the LoRA weights, 40 steps, CFG 4.5.
# Differences from the official config (checked by tests/test_paper_configs.py), one "# DIFF --flag VALUE: reason" each:
# DIFF --num-prompts 8: official 1 prompt per process per epoch (train_batch_size 24 = 24 images of one prompt) on the
# 1-process script (scripts/single_node/dpo.sh); one per GPU here, 8 GPUs
# DIFF --base-dtype bfloat16: the official code keeps the frozen transformer in fp32 (9 GB); bf16 halves it, and under
# autocast its matmuls run in half precision either way
# DIFF --mixed-precision True: the official autocast is fp16, cleanflow's bf16 (no fp16 path: bf16 needs no loss scaling)
# Not a flag: flow_grpo pairs samples 0 and 1 of a group whose rewards are all equal; cleanflow skips such groups.
set -euo pipefail
DATA=${DATA:?set DATA to a prompt folder with train.txt and test.txt}
# TASK=ocr: flow_grpo has no OCR config for DPO; the PickScore values with the OCR reward (needs
# `pip install -r rewards/requirements-ocr.txt` and OCR prompts, text in double quotes).
case "${TASK:-pickscore}" in
  pickscore) TASK_FLAGS=() ;;
  ocr) TASK_FLAGS=(--reward ocr) ;;
  *) echo "TASK must be pickscore or ocr" >&2; exit 2 ;;
esac
# geometry: M=8 prompts x K=24 = 192 images per epoch; 8 GPUs x micro-batch 24 = one group per rank, one optimizer step
torchrun --nproc-per-node 8 algos/dpo.py \
  --model stabilityai/stable-diffusion-3.5-medium --base-dtype bfloat16 --mixed-precision --resolution 512 \
  --reward pickscore --train-prompts "$DATA/train.txt" --test-prompts "$DATA/test.txt" \
  --num-steps 40 --sigma-schedule scheduler --guidance-scale 4.5 --dynamics Flow-SDE --eta 0.7 \
  --lora-rank 32 --lora-alpha 64 --learning-rate 3e-4 --weight-decay 1e-4 --max-grad-norm 1.0 \
  --num-prompts 8 --group-size 24 --micro-batch 24 --grad-steps-per-epoch 1 \
  --num-train-timesteps 39 --timestep-sampling logit-normal --logit-mean 0 --logit-std 1 \
  --dpo-beta 50 --pairs-per-group best-worst --rollout-policy base \
  --eval-num-steps 40 --eval-guidance-scale 4.5 --eval-ema-decay 0.9 --eval-ema-interval 8 --eval-ema-repeats 1 \
  --num-epochs 1000 --eval-every 60 --save-every 60 ${TASK_FLAGS[@]+"${TASK_FLAGS[@]}"}
