#!/usr/bin/env bash
# AWM on SD3.5-Medium with the official code's PickScore recipe (scxue/advantage_weighted_matching @ be51372,
# config/dgx_awm.py::pickscore_sd3_no_cfg_1node), 8 GPUs. GenEval/OCR configs differ in: 72 prompts/epoch,
# --skip-pure-noise ("discrete_wo_init"), --kl-beta 1e-3 (GenEval) / 3e-3 (OCR), SA-Solver noise 0.4.
# Paper: "up to 24x faster than Flow-GRPO" on GenEval/OCR/PickScore; no table number could be verified (docs/awm.md).
# DATA: a folder with train.txt / test.txt (e.g. flow_grpo's dataset/pickscore).
# Evaluation follows the official configs: an EMA (decay 0.99) of the LoRA weights, 40 steps, no CFG.
# Differences from the official config (checked by tests/test_paper_configs.py), one "# DIFF[task] --flag VALUE: reason" each:
# DIFF --base-dtype bfloat16: the official code keeps the frozen transformer in fp32 (9 GB); bf16 halves it, and under
# autocast its matmuls run in half precision either way
# DIFF --mixed-precision True: the official autocast is fp16, cleanflow's bf16 (no fp16 path: bf16 needs no loss scaling)
# DIFF --dynamics ODE: the official rollout is SA-Solver (use_sa_solver; deterministic at the PickScore noise 0); Euler ODE here
# DIFF[ocr] --eta 0.7: SA-Solver noise 0.4 has no counterpart in the Euler ODE used here
set -euo pipefail
DATA=${DATA:?set DATA to a prompt folder with train.txt and test.txt}
# TASK=ocr: OCR (official dgx_awm.py `ocr_sd3_no_cfg_1node`): KL 3e-3, discrete_wo_init timesteps, 72 prompts x 24 per epoch; its SA-Solver noise 0.4 is not available here (Euler ODE); needs `pip install -r rewards/requirements-ocr.txt` and OCR prompts (text in double quotes).
# GenEval needs a detector-based reward that cleanflow does not have for real images (only the tiny-shapes checker).
case "${TASK:-pickscore}" in
  pickscore) TASK_FLAGS=() ;;
  ocr) TASK_FLAGS=(--reward ocr --kl-beta 3e-3 --skip-pure-noise --num-prompts 72 --micro-batch 3
                   --eval-every 20 --save-every 20) ;;
  *) echo "TASK must be pickscore or ocr" >&2; exit 2 ;;
esac
# geometry: M=24 prompts x K=24 images = 576 per epoch = 72 per GPU; 1 optimizer step per epoch (so the ratio is 1);
# micro-batches of 2 (OCR 3) images, the official train.batch_size: each draws its own training timesteps
# sigma schedule: the scheduler's own set_timesteps(N) (official sigmas=None); timestep window: the official "first 90%
# of the 14 step indices" (indices 0..11, sigma >= 0.357 on that schedule) is --timestep-range 0.65
torchrun --nproc-per-node 8 algos/awm.py \
  --model stabilityai/stable-diffusion-3.5-medium --base-dtype bfloat16 --mixed-precision --resolution 512 \
  --reward pickscore --train-prompts "$DATA/train.txt" --test-prompts "$DATA/test.txt" \
  --num-steps 14 --sigma-schedule scheduler --guidance-scale 1.0 --dynamics ODE \
  --lora-rank 32 --lora-alpha 64 --learning-rate 3e-4 --weight-decay 1e-4 --max-grad-norm 1.0 \
  --num-prompts 24 --group-size 24 --micro-batch 2 --grad-steps-per-epoch 1 \
  --num-train-timesteps 6 --timestep-range 0.65 --adv-clip 5 --advantage-max 1 --advantage-std global \
  --weighting ghuber --ghuber-power 0.25 --clip-low 1 --clip-high 1 \
  --kl-beta 1e-4 --ema-kl-beta 1 --ema-decay-max 0.3 --ema-decay-ramp 0.001 \
  --eval-num-steps 40 --eval-guidance-scale 1.0 --eval-ema-decay 0.99 \
  --num-epochs 1000 --eval-every 50 --save-every 50 ${TASK_FLAGS[@]+"${TASK_FLAGS[@]}"}
