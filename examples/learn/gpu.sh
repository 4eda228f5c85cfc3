#!/usr/bin/env bash
# The learning recipe on one GPU (examples/learn/README.md): random init -> SFT cold start -> GRPO, and the ReTool
# variant with the real sandbox, each line one driver command that fits a 10-minute slot on one H100.
# Run from anywhere: bash examples/learn/gpu.sh [driver options, e.g. --engine vllm]
#   RUN_DIR  where models, checkpoints and run logs go (default outputs/learn)
#   EXPORT   where the small results (summaries, plots, metrics) are copied (default $OUT, else $RUN_DIR/export)
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python}
RUN_DIR=${RUN_DIR:-outputs/learn}
EXPORT=${EXPORT:-${OUT:-$RUN_DIR/export}}

# 1. data + tokenizer; SFT cold starts of the ~55M model on the sloppy teacher's addition traces and on the
#    tool-use traces (~4 min)
$PYTHON tools/learn_gpu.py data sft retool_sft --out "$RUN_DIR" --export "$EXPORT" "$@"
# 2. GRPO, three runs at once: fused head seed 1 and 2, materialized logits seed 1 (~7.5 min)
$PYTHON tools/learn_gpu.py grpo --out "$RUN_DIR" --export "$EXPORT" "$@"
# 3. ReTool GRPO with the multi-turn tool loop and the real sandbox, seeds 1 and 2 at once (~7 min)
$PYTHON tools/learn_gpu.py retool_grpo --out "$RUN_DIR" --export "$EXPORT" "$@"
# 4. optional: every model on its held-out set again, one table (summary.md) (~1 min)
$PYTHON tools/learn_gpu.py eval --out "$RUN_DIR" --export "$EXPORT" "$@"
