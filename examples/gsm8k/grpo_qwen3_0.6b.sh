#!/usr/bin/env bash
# GRPO on Qwen3-0.6B with GSM8K (configs/grpo_qwen3.yaml): Megatron actor with the fused LM head, colocated
# vLLM rollout, strict "#### n" reward.
# GPUs: 1 node of 8 x >= 24 GB (one 80 GB GPU also works: NGPUS=1). Data (needs network once):
#   python -m rltrain.data.prepare gsm8k --out-dir data/gsm8k --format parquet
# Run from the repository root: bash examples/gsm8k/grpo_qwen3_0.6b.sh [extra overrides]
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python}
NGPUS=${NGPUS:-8}

if [ ! -f data/gsm8k/train.parquet ]; then
  $PYTHON -m rltrain.data.prepare gsm8k --out-dir data/gsm8k --format parquet
fi

#   rollout.n=8                       samples per prompt (the GRPO group)
#   rollout.max_response_length=1024  new tokens per response
#   data.train_batch_size=64          prompts per step; actor.ppo_mini_batch_size=32 -> 2 optimizer steps
#   actor.lr=1e-6                     constant lr
#   actor.use_kl_loss=true actor.kl_loss_coef=0.001 actor.kl_loss_type=low_var_kl   KL to the reference
#   actor.clip_low=0.2 actor.clip_high=0.28   clip-higher
#   actor.loss_agg_mode=token-mean
#   trainer.fused_linear_logprob=true trainer.logprobs_response_only=true   the fused head on response rows
#   trainer.total_steps=200 trainer.test_freq=10 trainer.save_freq=20
$PYTHON -m rltrain.main --config-name grpo_qwen3 \
  data.train_files="[data/gsm8k/train.parquet]" \
  data.val_files="[data/gsm8k/test.parquet]" \
  data.train_batch_size=64 \
  rollout.n=8 \
  rollout.max_response_length=1024 \
  actor.lr=1e-6 \
  actor.ppo_mini_batch_size=32 \
  actor.use_kl_loss=true \
  actor.kl_loss_coef=0.001 \
  actor.kl_loss_type=low_var_kl \
  actor.clip_low=0.2 \
  actor.clip_high=0.28 \
  actor.loss_agg_mode=token-mean \
  trainer.fused_linear_logprob=true \
  trainer.logprobs_response_only=true \
  trainer.n_gpus_per_node="$NGPUS" \
  trainer.total_steps=200 \
  trainer.test_freq=10 \
  trainer.save_freq=20 \
  "$@"
