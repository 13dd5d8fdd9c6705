#!/usr/bin/env bash
# DiffusionOPD on SD3.5-Medium with the authors' hyperparameters (arXiv 2605.15055; their code's config/opd.py and
# scripts/train_sd3_opd.py, read in a copy of ali-vilab/DiffusionOPD: docs/opd.md), 8 GPUs.
# Teachers: one RL export per task, trained first with any script here (e.g. benchmark/sd35_crd.sh with TASK=ocr, and
# with TASK=pickscore), each distilled on its own prompts; no reward model trains the student (--reward: the log only).
# Paper (abstract): one student that matches each task's teacher, and beats multi-reward RL and cascaded RL; its numbers
# could not be verified here (docs/opd.md).
# DATA: a folder with train.txt / test.txt (the held-out evaluation); TEACHERS: the teachers' run folders, space
# separated; TEACHER_PROMPTS: each teacher's training prompt file, in the same order.
# Differences from the authors' code: their per-teacher CFG (1.0 for GenEval, 4.5 otherwise) is one --teacher-guidance-scale
# here; their fp16 autocast is bf16 (--mixed-precision); their "KL" under a noise level > 0 divides by s^2, not the
# step's variance s^2 |dt| (docs/opd.md); at their noise level 0 (--dynamics ODE, as here) the two agree.
set -euo pipefail
DATA=${DATA:?set DATA to a prompt folder with train.txt and test.txt}
read -r -a TEACHER_DIRS <<< "${TEACHERS:-$DATA/teacher_pickscore $DATA/teacher_ocr}"
read -r -a PROMPT_FILES <<< "${TEACHER_PROMPTS:-$DATA/pickscore_train.txt $DATA/ocr_train.txt}"
case "${TASK:-pickscore}" in
  pickscore) TASK_FLAGS=() ;;
  ocr) TASK_FLAGS=(--reward ocr) ;;  # the held-out metric; needs `pip install -r rewards/requirements-ocr.txt`
  *) echo "TASK must be pickscore or ocr" >&2; exit 2 ;;
esac
# geometry: 8 GPUs x micro-batch 3 x 3 micro-batches = 72 rollouts per optimizer step, one image per prompt in the
# paper (K = 2 here: the shared batch layout asks for groups of at least 2; OPD forms no groups, so K only sets the batch)
torchrun --nproc-per-node 8 algos/opd.py \
  --model stabilityai/stable-diffusion-3.5-medium --base-dtype bfloat16 --mixed-precision --resolution 512 \
  --reward pickscore --train-prompts "$DATA/train.txt" --test-prompts "$DATA/test.txt" \
  --teachers "${TEACHER_DIRS[@]}" --teacher-prompts "${PROMPT_FILES[@]}" --teacher-guidance-scale 4.5 \
  --num-steps 10 --guidance-scale 4.5 --dynamics ODE --timestep-fraction 0.99 \
  --lora-rank 32 --lora-alpha 64 --learning-rate 3e-4 --weight-decay 1e-4 --max-grad-norm 1.0 \
  --num-prompts 36 --group-size 2 --micro-batch 3 --grad-steps-per-epoch 1 \
  --eval-num-steps 40 --eval-guidance-scale 4.5 --eval-ema-decay 0.9 --eval-ema-interval 8 \
  --num-epochs 1000 --eval-every 20 --save-every 20 ${TASK_FLAGS[@]+"${TASK_FLAGS[@]}"}
