#!/usr/bin/env bash
# The learning recipe on one GPU (examples/learn/README.md): random init -> SFT cold start -> GRPO, and the ReTool
# variant with the real sandbox. Each STEP is one command that fits a 10-minute slot on one H100: the driver gets
# a --deadline of what is left of DEVICE_LIMIT_S, stops what still runs in time to evaluate and export, and the
# same STEP run again resumes it (GRPO from its last checkpoint). Steps skip what earlier steps finished under
# RUN_DIR and redo a missing prerequisite (data, SFT) first, so a step also runs on a fresh machine.
#
#   bash examples/learn/gpu.sh STEP [driver options, e.g. --engine vllm]
#     sft           data + BPE tokenizer + SFT cold start of the ~55M model (~3 min estimated)
#     grpo_fused    GRPO, fused Triton LM head, seed 1 (~5 min)
#     grpo_unfused  the same with trainer.fused_linear_logprob=false (materialized logits), seed 1 (~5 min)
#     grpo_seed2    fused head, seed 2: the run-to-run noise the fused/unfused gap is compared with (~5 min)
#     retool        ReTool SFT + GRPO with the multi-turn tool loop and the real sandbox (~8 min)
#     grpo_all      the three GRPO runs at once, one device command instead of three (~7.5 min estimated)
#     grpo_engines  hf and vLLM rollout side by side from one SFT model: fused head, seeds 1 and 2 with each
#                   engine (four runs at once; vLLM colocated, sleeping during the update; needs vLLM staged)
#     grpo_lora     LoRA (rank 32, lr x10) against full fine-tuning: fused seed 1, LoRA seeds 1 and 2, 20 steps
#                   each, held-out accuracy every 2 steps; data + SFT + GRPO in one command under ${RUN_DIR}_lora
#     all           sft, grpo_fused, grpo_unfused, grpo_seed2, retool, one after another (default; each with its own
#                   deadline)
#   RUN_DIR         models, checkpoints and run logs (default outputs/learn; git-ignored, kept while the machine is)
#   EXPORT          where the small results go (default $OUT, else $RUN_DIR/export): at most 8 flat files
#   DEVICE_T0       `date +%s` taken when the device command started (default: now); DEVICE_LIMIT_S (default 570)
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
RUN_DIR=${RUN_DIR:-outputs/learn}
EXPORT=${EXPORT:-${OUT:-$RUN_DIR/export}}
DEVICE_T0=${DEVICE_T0:-$(date +%s)}
DEVICE_LIMIT_S=${DEVICE_LIMIT_S:-570}
STEP=${1:-all}
shift || true

driver() {  # the driver with the time left of this device command as its deadline
  local left=$((DEVICE_LIMIT_S - ($(date +%s) - DEVICE_T0)))
  $PYTHON tools/learn_gpu.py "$@" --out "$RUN_DIR" --export "$EXPORT" --deadline "$left"
}

case "$STEP" in
  sft)          driver data sft "$@" ;;
  grpo_fused)   driver data sft grpo --runs fused:1 "$@" ;;
  grpo_unfused) driver data sft grpo --runs unfused:1 "$@" ;;
  grpo_seed2)   driver data sft grpo --runs fused:2 "$@" ;;
  grpo_all)     driver data sft grpo --runs fused:1 unfused:1 fused:2 "$@" ;;
  grpo_engines) driver data sft grpo --runs fused:1 fused:2 fused:1:vllm fused:2:vllm "$@" ;;
  grpo_lora)    RUN_DIR=${RUN_DIR%/}_lora driver data sft grpo --runs fused:1 lora:1 lora:2 \
                  --set grpo:trainer.total_steps=20 --set grpo:trainer.test_freq=2 --set grpo:trainer.save_freq=10 "$@" ;;
  retool)       driver data retool_sft retool_grpo --retool-runs fused:1 "$@" ;;
  all)
    for s in sft grpo_fused grpo_unfused grpo_seed2 retool; do
      DEVICE_T0=$(date +%s) bash "$0" "$s" "$@"
    done ;;
  *) echo "gpu.sh: unknown STEP '$STEP' (sft | grpo_fused | grpo_unfused | grpo_seed2 | grpo_all | grpo_engines |" \
          "grpo_lora | retool | all)" >&2; exit 2 ;;
esac
