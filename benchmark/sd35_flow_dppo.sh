#!/usr/bin/env bash
# Flow-DPPO on SD3.5-Medium with the official PickScore recipe (Tencent-Hunyuan/UniRL @ 1a7b501,
# examples/diffusion/sd3_flowdppo.yaml, the authors' code: FlowDPPO/README.md), 8 GPUs as there.
# Flow-GRPO's SDE rollout, the KL trust-region mask in place of the ratio clip (--kl-mask, paper Eq. 14 and 18),
# no CFG, 3 SDE steps drawn from the first half of the 10 steps, independent initial noise per image, per-prompt mean
# with one batch-wide std. Paper: arXiv 2606.11025; the README's curve: PickScore reward ~0.75 -> ~0.89 in ~270
# rollouts. Not run here (no GPU).
# Not a flag: UniRL caps Flow-SDE's sigma / (1 - sigma) at sigma = 1 with 0.99 (unirl/sde/kernels.py:223), cleanflow
# with the schedule's second sigma (flow_grpo's sigma_max = sigmas[1]); UniRL's batch std is Bessel-corrected with eps
# 1e-8 (unirl/types/rollout_resp.py), cleanflow's the population std + 1e-4. The recipe does no eval EMA.
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
  --sde-window 0 5 --window-mode subset --num-sde-steps 3 --no-shared-group-noise \
  --lora-rank 32 --lora-alpha 64 --learning-rate 3e-4 --weight-decay 0 --max-grad-norm 1.0 \
  --num-prompts 48 --group-size 16 --micro-batch 8 --grad-steps-per-epoch 2 --num-inner-epochs 1 \
  --kl-mask 1e-5 --advantage-std global --kl-beta 0 \
  --num-epochs 1000 --eval-every 60 --save-every 60 ${TASK_FLAGS[@]+"${TASK_FLAGS[@]}"}
