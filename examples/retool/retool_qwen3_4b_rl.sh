#!/usr/bin/env bash
# ReTool on Qwen3-4B: SFT cold start on multi-turn code-interpreter traces, then GRPO with the sandboxed
# Python tool and the `retool` reward (configs/sft_qwen3_4b.yaml, configs/retool_qwen3_4b.yaml).
#
# GPUs: one node of 8 x 80 GB (H100/A100/H200). SFT: 8 processes (torchrun), tensor parallel 2 x data
#   parallel 4. RL: colocated actor + vLLM rollout on the same 8 GPUs (the rollout sleeps while training),
#   actor tensor parallel 2. Fewer GPUs: NGPUS=4 (same per-GPU load, half the batch throughput).
# CPU: the sandbox runs up to 32 tool calls at once (rollout.multi_turn.tool_max_workers); give the node
#   >= 32 cores. The sandbox has no network and per-call time/memory limits.
#
# Data preparation (needs network once):
#   1. SFT traces -> data/retool_sft/train.jsonl, one row per conversation:
#        {"messages": [{"role": "user", "content": "<problem>"},
#                      {"role": "assistant", "content": "<reasoning> ```python\n<code>\n```"},
#                      {"role": "tool", "content": "<stdout of the code>"},
#                      {"role": "assistant", "content": "<more reasoning> \\boxed{<answer>}"}]}
#      Assistant messages that call the tool end with the ```python fence itself; tool messages hold the raw
#      output (it is wrapped in <output>...</output> exactly as the RL rollout does, and masked from the loss).
#      Any ReTool-style cold-start set (e.g. the public ReTool-SFT traces) converted to this shape works.
#   2. RL prompts: python -m rltrain.data.prepare dapo_math (and --set aime2024, the validation set; offline: --from)
#
# Run from the repository root: bash examples/retool/retool_qwen3_4b_rl.sh [extra RL overrides]
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python}
TORCHRUN=${TORCHRUN:-torchrun}
NGPUS=${NGPUS:-8}
BASE_MODEL=${BASE_MODEL:-Qwen/Qwen3-4B}
SFT_DATA=${SFT_DATA:-data/retool_sft/train.jsonl}
RL_DATA=${RL_DATA:-data/dapo_math/train.parquet}
SFT_OUT=${SFT_OUT:-checkpoints/retool_qwen3_4b_sft/hf}

if [ ! -f "$RL_DATA" ]; then
  $PYTHON -m rltrain.data.prepare dapo_math --out "$RL_DATA"
fi
if [ ! -f data/dapo_math/aime2024.parquet ]; then  # the validation set configs/data/dapo_math.yaml reads
  $PYTHON -m rltrain.data.prepare dapo_math --set aime2024
fi

# ---- stage 1: SFT cold start (skipped when $SFT_OUT already holds a model) ---------------------------
#   model.path                   base model (HF id or local dir)
#   data.train_files             the multi-turn traces above; data.max_length drops longer rows (counted)
#   data.batch_size              conversations per optimizer step (global)
#   optim.lr / lr_schedule       1e-5, cosine to 10%, 10 warmup steps; trainer.epochs: passes over the data
#   trainer.tensor_parallel_size Megatron TP inside each group of 2 GPUs; the rest is data parallel
#   trainer.fused_linear_logprob the loss is -log p(label) from the fused head ([tokens, vocab] never built)
#   trainer.output_dir           where the HF model (config + safetensors + tokenizer) is written
if [ ! -f "$SFT_OUT/config.json" ]; then
  $TORCHRUN --standalone --nproc_per_node="$NGPUS" -m rltrain.sft --config-name sft_qwen3_4b \
    model.path="$BASE_MODEL" \
    data.train_files="[$SFT_DATA]" \
    data.max_length=16384 \
    data.batch_size=64 \
    optim.lr=1e-5 \
    optim.lr_schedule=cosine \
    trainer.epochs=3 \
    trainer.tensor_parallel_size=2 \
    trainer.fused_linear_logprob=true \
    trainer.output_dir="$SFT_OUT"
fi

# ---- stage 2: GRPO with the tool ---------------------------------------------------------------------
#   model.path=$SFT_OUT model.tokenizer=$SFT_OUT   start from the SFT model and its saved tokenizer
#   rollout.n=16                          samples per prompt (the GRPO group)
#   rollout.max_response_length=16384     tokens per model turn
#   rollout.multi_turn.enable=true        the tool loop: generate -> run ```python code -> append output
#   rollout.multi_turn.tool_pattern       code_block = ```python ... ``` fences
#   rollout.multi_turn.max_turns=16       up to 16 model turns (tool calls) per response
#   rollout.multi_turn.max_total_tokens   cap on the whole response, model + tool tokens
#   rollout.multi_turn.tool_timeout_s / tool_memory_mb   per-call sandbox limits
#   actor.clip_low=0.2 actor.clip_high=0.28   clip-higher (DAPO)
#   actor.use_kl_loss=false algorithm.use_kl_in_reward=false   no KL anywhere (no reference model is built)
#   actor.loss_agg_mode=token-mean        every model token of the mini-batch weighs the same
#   actor.lr=1e-6 actor.ppo_mini_batch_size=16 data.train_batch_size=64   64 prompts x 16 samples per step,
#                                          4 optimizer steps of 16 prompts each
#   reward.fn=retool                      strict \boxed{} +1/-1, wrong answers that used the tool get up to +0.4
#   trainer.logprobs_response_only=true   log-probs only for response rows (prompt rows skip the head)
#   trainer.fused_linear_logprob=true     fused LM head for old/new log-probs and entropy
#   trainer.n_gpus_per_node / actor.tensor_parallel_size   8 GPUs, TP 2
$PYTHON -m rltrain.main --config-name retool_qwen3_4b \
  model.path="$SFT_OUT" \
  model.tokenizer="$SFT_OUT" \
  data.train_files="[$RL_DATA]" \
  data.train_batch_size=64 \
  rollout.n=16 \
  rollout.max_response_length=16384 \
  rollout.multi_turn.enable=true \
  rollout.multi_turn.tool_pattern=code_block \
  rollout.multi_turn.max_turns=16 \
  rollout.multi_turn.max_total_tokens=16384 \
  rollout.multi_turn.tool_timeout_s=10 \
  rollout.multi_turn.tool_memory_mb=1024 \
  actor.clip_low=0.2 \
  actor.clip_high=0.28 \
  actor.use_kl_loss=false \
  algorithm.use_kl_in_reward=false \
  actor.loss_agg_mode=token-mean \
  actor.lr=1e-6 \
  actor.ppo_mini_batch_size=16 \
  actor.tensor_parallel_size=2 \
  reward.fn=retool \
  trainer.logprobs_response_only=true \
  trainer.fused_linear_logprob=true \
  trainer.n_gpus_per_node="$NGPUS" \
  "$@"
