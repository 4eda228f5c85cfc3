"""The one builder of a model engine: the actor, the reference and the critic (workers/), SFT (trainer/sft.py) and
the tools get their MegatronEngine from `build_engine`, which maps the schema's key groups (config/schema.py:
OptimizerConfig, ParallelConfig, LayerComputeConfig, LogprobHeadConfig) onto the engine's arguments in this one
place. A group not given takes the schema's defaults, so every key has one default: the schema's.

Must not know RL (the caller's loss_fn holds the algorithm) nor read the root config; trainer/ builds engines only
through here (docs/architecture.md: trainer/ does not reach into models/megatron/).
"""

from __future__ import annotations

from typing import Any

import torch

from rltrain.config.schema import LayerComputeConfig, LogprobHeadConfig, OptimizerConfig, ParallelConfig

# The vocab is padded only to a multiple of the TP size: Qwen3's 151,936 needs none, and padded rows cost the fused
# head a masked copy of the weight shard.
VOCAB_PADDING = 1


def build_engine(hf_config: Any, *, role: str, max_tokens_per_micro_batch: int, total_steps: int, device: str,
                 dtype: torch.dtype, seed: int, optim: OptimizerConfig | None = None,
                 parallel: ParallelConfig | None = None, compute: LayerComputeConfig | None = None,
                 head: LogprobHeadConfig | None = None, hf_state_dict: dict | None = None):
    """A MegatronEngine of `role` ("actor", "ref", "critic") for the model `hf_config` describes on this rank,
    loaded from `hf_state_dict` (HF names -> full tensors) when given. total_steps: optimizer steps of the lr
    schedule."""
    from rltrain.models.megatron.engine import MegatronEngine

    optim, parallel = optim or OptimizerConfig(), parallel or ParallelConfig()
    compute, head = compute or LayerComputeConfig(), head or LogprobHeadConfig()
    engine = MegatronEngine(
        hf_config, role=role, params_dtype=dtype, device=device, seed=seed,
        tp_size=parallel.tensor_parallel_size, pp_size=parallel.pipeline_parallel_size,
        grad_reduce_bucket_mb=parallel.grad_reduce_bucket_mb, overlap_grad_reduce=parallel.overlap_grad_reduce,
        fused_linear_logprob=head.fused_linear_logprob, fused_linear_logprob_backend=head.fused_linear_logprob_backend,
        logprobs_chunk_size=head.logprobs_chunk_size,
        lr=optim.lr, weight_decay=optim.weight_decay, betas=tuple(optim.betas), eps=optim.eps,
        grad_clip=optim.grad_clip, warmup_steps=optim.lr_warmup_steps, total_steps=total_steps,
        lr_schedule=optim.lr_schedule, min_lr_ratio=optim.min_lr_ratio,
        max_tokens_per_micro_batch=max_tokens_per_micro_batch, make_vocab_size_divisible_by=VOCAB_PADDING,
        recompute_activations=compute.recompute_activations, recompute_granularity=compute.recompute_granularity,
        recompute_modules=tuple(compute.recompute_modules), elementwise_fusion=compute.elementwise_fusion,
    )
    if hf_state_dict is not None:
        engine.load_hf_weights(hf_state_dict)
    return engine
