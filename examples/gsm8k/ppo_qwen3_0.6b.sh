#!/usr/bin/env bash
# PPO (GAE + critic) on Qwen3-0.6B with GSM8K (configs/ppo_qwen3.yaml): Megatron actor and critic with the
# fused LM head, colocated vLLM rollout, KL-in-reward against the frozen reference.
# GPUs: 1 node of 8 x >= 40 GB (actor, critic, reference and rollout share each GPU). Data (network once):
#   python -m rltrain.data.prepare gsm8k --out-dir data/gsm8k --format parquet
# Run from the repository root: bash examples/gsm8k/ppo_qwen3_0.6b.sh [extra overrides]
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python}
NGPUS=${NGPUS:-8}

if [ ! -f data/gsm8k/train.parquet ]; then
  $PYTHON -m rltrain.data.prepare gsm8k --out-dir data/gsm8k --format parquet
fi

#   algorithm.adv_estimator=gae algorithm.gamma=1.0 algorithm.lam=1.0   GAE with the critic's values
#   algorithm.use_kl_in_reward=true algorithm.kl_coef=0.001              per-token KL penalty in the reward
#   rollout.n=1                        one sample per prompt (PPO needs no group)
#   data.train_batch_size=256 actor.ppo_mini_batch_size=64   4 actor/critic optimizer steps per step
#   actor.lr=1e-6 critic.lr=1e-5       critic.value_clip=0.5
#   actor.use_kl_loss=false            KL lives in the reward instead
$PYTHON -m rltrain.main --config-name ppo_qwen3 \
  data.train_files="[data/gsm8k/train.parquet]" \
  data.val_files="[data/gsm8k/test.parquet]" \
  data.train_batch_size=256 \
  rollout.n=1 \
  rollout.max_response_length=1024 \
  algorithm.adv_estimator=gae \
  algorithm.gamma=1.0 \
  algorithm.lam=1.0 \
  algorithm.use_kl_in_reward=true \
  algorithm.kl_coef=0.001 \
  actor.lr=1e-6 \
  actor.ppo_mini_batch_size=64 \
  actor.use_kl_loss=false \
  critic.lr=1e-5 \
  critic.value_clip=0.5 \
  trainer.fused_linear_logprob=true \
  trainer.n_gpus_per_node="$NGPUS" \
  trainer.total_steps=200 \
  trainer.test_freq=10 \
  trainer.save_freq=20 \
  "$@"
