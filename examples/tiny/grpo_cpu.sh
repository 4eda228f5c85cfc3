#!/usr/bin/env bash
# The embedded default on a CPU (what `make demo` runs): GRPO on a tiny random-init Qwen3-architecture model
# with the character tokenizer, learning the synthetic copy_last task. No GPU, no downloads, minutes on 2 cores.
# Run from anywhere: bash examples/tiny/grpo_cpu.sh [extra overrides]
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python}
# Tiny models run fastest with one torch thread per worker.
export RLTRAIN_TORCH_THREADS=${RLTRAIN_TORCH_THREADS:-1}

#   trainer.device=cpu                  Megatron actor on CPU (gloo), HF rollout engine
#   rollout.n=8 data.train_batch_size=16   16 prompts x 8 samples per step
#   actor.lr=1e-3 actor.clip_high=0.28  actor.use_kl_loss=false
#   trainer.total_steps=300 trainer.test_freq=25   validation accuracy on held-out prompts every 25 steps
$PYTHON -m rltrain.main --config-name grpo_tiny \
  trainer.device=cpu \
  rollout.n=8 \
  data.train_batch_size=16 \
  actor.lr=1e-3 \
  actor.clip_high=0.28 \
  actor.use_kl_loss=false \
  trainer.total_steps=300 \
  trainer.test_freq=25 \
  "$@"
