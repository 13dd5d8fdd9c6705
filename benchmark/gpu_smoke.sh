#!/usr/bin/env bash
# Every script on a CUDA device: 2 epochs, a resume to 3, the export, in two precisions -- fp32 with every weight
# trained (the tiny models' default) and a LoRA on a bf16 base with --mixed-precision (the real models' path) -- and
# GRPO's four variant flags. Tiny default model, runs in parallel (~1 min on one H200). Prints one line per run.
#   bash benchmark/gpu_smoke.sh [OUT_DIR]     # logs and runs under OUT_DIR (default: a new temp folder)
set -u
cd "$(dirname "$0")/.."
OUT=${1:-$(mktemp -d)}
PY=${PYTHON:-python3}
mkdir -p "$OUT/logs" "$OUT/runs"
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
# small: 2 prompts x 4 images, 4 sampling steps (GRPO: one trained SDE step of the 2 in its window), eval every epoch
SMALL="--num-prompts 2 --group-size 4 --micro-batch 4 --num-steps 4 --save-every 1 --eval-every 1 --eval-noises 1 --device cuda"
one() {  # NAME ALGO [FLAGS...]
  local name=$1 algo=$2 rc resume=- export=no
  shift 2
  $PY "algos/$algo.py" $SMALL --num-epochs 2 --output-dir "$OUT/runs/$name" "$@" >"$OUT/logs/$name.log" 2>&1
  rc=$?
  if [ $rc = 0 ]; then
    $PY "algos/$algo.py" --resume "$OUT/runs/$name"/* --num-epochs 3 --device cuda >>"$OUT/logs/$name.log" 2>&1
    resume=$?
  fi
  ls -d "$OUT/runs/$name"/*/transformer "$OUT/runs/$name"/*/lora >/dev/null 2>&1 && export=yes
  echo "| $name | $rc | $resume | $export |" >>"$OUT/results.md"
}
for algo in awm crd dgpo dpo elbo_grpo grpo nft; do
  extra=""
  [ $algo = grpo ] && extra="--num-sde-steps 1"
  one "${algo}_fp32" $algo $extra &
  one "${algo}_bf16_lora" $algo $extra --no-full-finetune --base-dtype bfloat16 --mixed-precision &
done
one grpo_mixgrpo grpo_variants --num-sde-steps 1 --window-mode sliding --window-shift 1 1 &
one grpo_tempflow grpo_variants --num-sde-steps 1 --noise-weight 2.25 &
one grpo_flow_dppo grpo_variants --num-sde-steps 1 --kl-mask 1e-5 &
one grpo_pref grpo_variants --num-sde-steps 1 --win-rate-reward &
wait
echo "| run | train rc | resume rc | export |"
echo "|---|---|---|---|"
sort "$OUT/results.md"
echo "logs: $OUT/logs"
