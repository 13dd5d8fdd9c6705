#!/usr/bin/env bash
# MixGRPO on SD3.5-Medium with its authors' SD3.5 recipe (Tencent-Hunyuan/UniRL @ 1a7b501,
# examples/diffusion/sd3_mixgrpo.yaml), 8 GPUs for the recipe's 16 (same global batch).
# The paper's own runs (arXiv 2507.21802, Tencent-Hunyuan/MixGRPO) train FLUX.1-dev at 25 steps with a window of 4
# SDE steps moved 1 step every 25 iterations; on SD3.5 at 10 steps the recipe moves it 3 steps (window 4, overlap 1),
# over all 10 steps, rolling back to the first: windows 0-3, 3-6, 6-9. Everything outside the window is ODE and
# untrained (--window-mode sliding). One epoch here is one of the recipe's rollouts (iterations). Not run here (no GPU).
# Not a flag: UniRL recomputes the old log-probs by a replay before the update (old_logp_source replay), cleanflow takes
# them from the rollout (identical weights; PPO's ratio); UniRL caps Flow-SDE's sigma / (1 - sigma) at sigma = 1 with
# 0.99, cleanflow with the schedule's second sigma. The recipe does no eval EMA.
# Differences from the official config (checked by tests/test_paper_configs.py), one "# DIFF --flag VALUE: reason" each:
# DIFF --adv-clip 5.0: UniRL does not clip advantages; with one batch-wide std they rarely pass 5 (cleanflow's default)
set -euo pipefail
DATA=${DATA:?set DATA to a prompt folder with train.txt and test.txt}
# TASK=ocr: the recipe has no OCR config; the PickScore values with the OCR reward (needs
# `pip install -r rewards/requirements-ocr.txt` and OCR prompts, text in double quotes).
case "${TASK:-pickscore}" in
  pickscore) TASK_FLAGS=() ;;
  ocr) TASK_FLAGS=(--reward ocr) ;;
  *) echo "TASK must be pickscore or ocr" >&2; exit 2 ;;
esac
# geometry: M=48 prompts x K=16 = 768 images per epoch, 8 GPUs x micro-batch 8 -> 12 micro-batches per rank, 2 steps
torchrun --nproc-per-node 8 algos/grpo_variants.py \
  --model stabilityai/stable-diffusion-3.5-medium --base-dtype bfloat16 --mixed-precision --resolution 512 \
  --reward pickscore --train-prompts "$DATA/train.txt" --test-prompts "$DATA/test.txt" \
  --num-steps 10 --sigma-schedule pipeline --guidance-scale 1.0 --dynamics Flow-SDE --eta 0.7 \
  --sde-window 0 10 --window-mode sliding --num-sde-steps 4 --window-shift 25 3 --shared-group-noise \
  --lora-rank 32 --lora-alpha 64 --learning-rate 3e-4 --weight-decay 1e-4 --max-grad-norm 1.0 \
  --num-prompts 48 --group-size 16 --micro-batch 8 --grad-steps-per-epoch 2 --num-inner-epochs 1 \
  --clip-low 1e-4 --clip-high 1e-4 --advantage-std global --kl-beta 0 \
  --num-epochs 1000 --eval-every 60 --save-every 60 ${TASK_FLAGS[@]+"${TASK_FLAGS[@]}"}
