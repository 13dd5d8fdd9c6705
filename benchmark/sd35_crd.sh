#!/usr/bin/env bash
# CRD on SD3.5-Medium with the paper's hyperparameters (Table 3, OCR task, as restated by the authors in
# Flow-Factory PR #121 / examples/crd/lora/sd3_5/default.yaml), 8 GPUs.
# Paper: GenEval and OCR with "competitive SOTA"; its exact numbers could not be verified (see docs/crd.md).
# DATA: a folder with train.txt / test.txt (e.g. flow_grpo's dataset/ocr or dataset/pickscore).
# Evaluation follows the authors' config: 40 steps, no CFG, the trained weights themselves (no EMA).
# Sigma schedule: Flow-Factory's shifted linspace(1, 1/N) (--sigma-schedule pipeline; SD3's own default is the scheduler's).
# Differences from the official config (checked by tests/test_paper_configs.py), one "# DIFF[task] --flag VALUE: reason" each:
# DIFF --kl-adaptive batch: the reward level, as the paper describes it; Flow-Factory feeds the [0, 1]-mapped group
# advantage, whose mean never changes (the paper's own equation could not be found: docs/crd.md, detail 8)
# DIFF --micro-batch 24: Flow-Factory's 8 per GPU centres over mixed prompts; 24 = one whole group (within-prompt centring)
# Timesteps: T=20 stratified over the 10 indices trains each exactly twice; Flow-Factory draws them at random and never
# the last index (docs/crd.md): kept on purpose, no flag.
# DIFF --centering group: the paper's within-prompt centring; Flow-Factory centres each per-device batch of 8
set -euo pipefail
DATA=${DATA:?set DATA to a prompt folder with train.txt and test.txt}
# TASK=ocr: the hyperparameters above are already the paper's OCR settings (Table 3); needs `pip install -r rewards/requirements-ocr.txt` and OCR prompts (text in double quotes).
# GenEval needs a detector-based reward that cleanflow does not have for real images (only the tiny-shapes checker).
case "${TASK:-pickscore}" in
  pickscore) TASK_FLAGS=() ;;
  ocr) TASK_FLAGS=(--reward ocr) ;;
  *) echo "TASK must be pickscore or ocr" >&2; exit 2 ;;
esac
# geometry: M=48 prompts x K=24 images = 1152 per epoch; 8 GPUs x micro-batch 24 = whole groups per micro-batch
# (the paper's B=8 mixes prompts inside a centring set; within-prompt centring needs micro_batch = K)
torchrun --nproc-per-node 8 algos/crd.py \
  --model stabilityai/stable-diffusion-3.5-medium --base-dtype bfloat16 --mixed-precision --resolution 512 \
  --reward pickscore --train-prompts "$DATA/train.txt" --test-prompts "$DATA/test.txt" \
  --num-steps 10 --sigma-schedule pipeline --guidance-scale 1.0 --dynamics ODE \
  --lora-rank 32 --lora-alpha 64 --learning-rate 3e-4 --weight-decay 1e-4 --max-grad-norm 1.0 \
  --num-prompts 48 --group-size 24 --micro-batch 24 --grad-steps-per-epoch 2 \
  --num-train-timesteps 20 --timestep-range 0.99 --adv-clip 5 --advantage-std global \
  --crd-beta 1.0 --loss-type mse --weight-temp -1 --centering group \
  --old-decay-start 0.25 --old-decay-flat-steps 0 --old-decay-ramp 0.005 --old-decay-max 0.999 \
  --sampling-decay-start 0 --sampling-decay-flat-steps 75 --sampling-decay-ramp 0.0075 --sampling-decay-max 0.999 \
  --kl-beta 0.1 --kl-cfg 4.5 --kl-adaptive batch --kl-floor 1e-4 \
  --eval-num-steps 40 --eval-guidance-scale 1.0 --eval-ema-decay 0 \
  --num-epochs 1000 --eval-every 20 --save-every 20 ${TASK_FLAGS[@]+"${TASK_FLAGS[@]}"}
