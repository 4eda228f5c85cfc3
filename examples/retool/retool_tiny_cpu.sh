#!/usr/bin/env bash
# The whole ReTool pipeline in miniature on a laptop CPU (a few minutes on 2 cores, no downloads, no GPU):
# synthetic tool-use traces (a*b+c solved with <code>print(a*b+c)</code>), SFT of the tiny random-init
# model, then GRPO with the real sandbox (configs/retool_tiny_sft.yaml, configs/retool_tiny.yaml).
# Run from anywhere: bash examples/retool/retool_tiny_cpu.sh [extra RL overrides]
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python}
DATA=${DATA:-data/retool_tiny}
SFT_OUT=${SFT_OUT:-outputs/retool_tiny/sft_hf}

# 1. data: sft.jsonl (traces), train.jsonl / val.jsonl (RL prompts + answers; val never seen in training)
$PYTHON -m rltrain.data.retool_synthetic --out "$DATA"

# 2. SFT: 300 steps of 32 traces, loss on assistant tokens only (tool output masked), lr 3e-3 cosine
$PYTHON -m rltrain.sft --config-name retool_tiny_sft \
  data.train_files="[$DATA/sft.jsonl]" \
  trainer.total_steps=300 \
  trainer.output_dir="$SFT_OUT"

# 3. GRPO: 8 prompts x 8 samples per step, up to 3 model turns, tool calls run in the sandbox,
#    reward gsm8k ("#### n"), no KL, clip-higher 0.2/0.28, token-mean
$PYTHON -m rltrain.main --config-name retool_tiny \
  model.path="$SFT_OUT" \
  data.train_files="[$DATA/train.jsonl]" \
  data.val_files="[$DATA/val.jsonl]" \
  rollout.multi_turn.enable=true \
  rollout.multi_turn.tool_pattern=code_tag \
  "$@"
