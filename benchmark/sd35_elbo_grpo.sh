#!/usr/bin/env bash
# ELBO-GRPO on SD3.5-Medium with the settings of the official code of "Rethinking the Design Space of RL for Diffusion
# Models" (jaemoo-choi/rethinking-diffusion-rl @ c257000: config/sd3.py `sd3_pickscore` / `sd3_ocr` (ODE base),
# config/base.py, src/utils/base.py `compute_policy_loss` method "grpo", the shared env block of scripts/sd3/*.sh), 8 GPUs.
# Paper (README table, GenEval): GRPO + ELBO + ODE 0.94; its best objective (PEPG) 0.96 in ~90 H100 GPU-hours. The
# repository publishes no script for the GRPO row: METHOD=grpo ADV=standard with the other scripts' shared values
# (BETA 1e-4 girsanov KL, ELBO adaptive, LEARNING_RATE 3e-4, MAX_GRAD_NORM 5, GRADIENT_STEP_PER_EPOCH 1, no CFG).
# V-GRPO (arXiv 2604.23380) is the same surrogate; its own hyperparameters could not be read (docs/elbo_grpo.md).
# DATA: a folder with train.txt / test.txt (e.g. flow_grpo's dataset/pickscore or dataset/ocr).
# Evaluation follows the official code: an EMA (decay 0.9, every optimizer step) of the LoRA weights, 40 steps, no CFG.
# Not a flag here: the official code samples with, and takes its old ELBOs from, a lagged copy of the policy
# (old <- d old + (1 - d) theta after each epoch, d = min(0.001 step, 0.5), DECAY_TYPE 1); this script samples with the
# current weights and takes the old ELBOs from them before the epoch's update (PPO's old policy). With one optimizer step
# per epoch the official ratio is the lagged copy's, ours is exactly 1 (the clip never binds, the loss is -A ELBO).
# Official timesteps: 9 distinct of the 10 per image (a random permutation); here 9 stratified draws of the 10 indices.
# Differences from the official config (checked by tests/test_paper_configs.py), one "# DIFF --flag VALUE: reason" each:
# DIFF --base-dtype bfloat16: the official code keeps the frozen transformer in fp32 (9 GB); bf16 halves it, and under
# autocast its matmuls run in half precision either way
# DIFF --mixed-precision True: the official config runs in fp32 (mixed_precision "no"); bf16 autocast here, as the other
# SD3.5 scripts (fp32 SD3.5-M training forwards of 72 images per GPU do not fit the budget of the others' settings)
# DIFF --dynamics ODE: the official rollout is a deterministic 2nd-order DPM solver (solver "dpm2"); cleanflow's ODE is Euler
set -euo pipefail
DATA=${DATA:?set DATA to a prompt folder with train.txt and test.txt}
# TASK=ocr: the official `sd3_ocr` config is `sd3_pickscore` with the OCR reward and prompts; needs
# `pip install -r rewards/requirements-ocr.txt` and OCR prompts (text in double quotes).
# GenEval needs a detector-based reward that cleanflow does not have for real images (only the tiny-shapes checker).
case "${TASK:-pickscore}" in
  pickscore) TASK_FLAGS=() ;;
  ocr) TASK_FLAGS=(--reward ocr) ;;
  *) echo "TASK must be pickscore or ocr" >&2; exit 2 ;;
esac
torchrun --nproc-per-node 8 algos/elbo_grpo.py \
  --model stabilityai/stable-diffusion-3.5-medium --base-dtype bfloat16 --mixed-precision --resolution 512 \
  --reward pickscore --train-prompts "$DATA/train.txt" --test-prompts "$DATA/test.txt" \
  --lora-rank 32 --lora-alpha 64 --learning-rate 3e-4 --weight-decay 1e-4 --max-grad-norm 5.0 \
  --num-prompts 48 --group-size 24 --micro-batch 9 --grad-steps-per-epoch 1 \
  --num-steps 10 --sigma-schedule scheduler --guidance-scale 1.0 --dynamics ODE \
  --num-train-timesteps 9 --timestep-range 0.99 --elbo-weighting adaptive --no-shared-group-noise \
  --advantage-std global --adv-clip 5 --clip-low 1e-3 --clip-high 1e-3 --kl-beta 1e-4 \
  --eval-num-steps 40 --eval-guidance-scale 1.0 --eval-ema-decay 0.9 \
  --num-epochs 360 --eval-every 20 --save-every 20 ${TASK_FLAGS[@]+"${TASK_FLAGS[@]}"}
