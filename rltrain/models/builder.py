"""The one builder of a model engine: the actor, the reference and the critic (workers/), SFT (trainer/sft.py) and
the tools get their MegatronEngine from `build_engine`, which maps the schema's key groups (config/schema.py:
OptimizerConfig, ParallelConfig, LayerComputeConfig, LogprobHeadConfig, MoEConfig) onto the engine's arguments in this one
place, into the engine's typed EngineConfig (models/engine_config.py). A group not given takes the schema's defaults,
so every key has one default: the schema's.

Must not know RL (the caller's loss_fn holds the algorithm) nor read the root config; trainer/ builds engines only
through here (docs/architecture.md: trainer/ does not reach into models/megatron/).
"""

from __future__ import annotations

from typing import Any

import torch

from rltrain.config.schema import (LayerComputeConfig, LogprobHeadConfig, LoraConfig, MoEConfig, OptimizerConfig,
                                  ParallelConfig)
from rltrain.models.engine_config import EngineConfig, SampledDistribution


def build_engine(hf_config: Any, *, role: str, max_tokens_per_micro_batch: int, total_steps: int, device: str,
                 dtype: torch.dtype, seed: int, optim: OptimizerConfig | None = None,
                 parallel: ParallelConfig | None = None, compute: LayerComputeConfig | None = None,
                 head: LogprobHeadConfig | None = None, moe: MoEConfig | None = None,
                 hf_state_dict: dict | None = None, forward_max_tokens_per_micro_batch: int | None = None,
                 lora: LoraConfig | None = None, true_on_policy: SampledDistribution | None = None,
                 offload_layers: bool = False):
    """A MegatronEngine of `role` ("actor", "ref", "critic") for the model `hf_config` describes on this rank,
    loaded from `hf_state_dict` (HF names -> full tensors) when given. total_steps: optimizer steps of the lr
    schedule. forward_max_tokens_per_micro_batch: the forward-only passes' budget (None: the update's). lora: the
    actor's adapters (actor.lora; None or rank 0: full fine-tuning). true_on_policy: the rollout engine's arithmetic
    and sampled distribution (rollout.true_on_policy). offload_layers: a reference keeps its decoder layers in host
    memory, streamed in per forward (ref.offload)."""
    from rltrain.models.megatron.engine import MegatronEngine

    config = EngineConfig(optim=optim or OptimizerConfig(), parallel=parallel or ParallelConfig(),
                          compute=compute or LayerComputeConfig(), head=head or LogprobHeadConfig(),
                          moe=moe or MoEConfig(), lora=lora or LoraConfig(),
                          max_tokens_per_micro_batch=max_tokens_per_micro_batch, total_steps=total_steps,
                          forward_max_tokens_per_micro_batch=forward_max_tokens_per_micro_batch,
                          true_on_policy=true_on_policy, offload_layers=offload_layers)
    engine = MegatronEngine(hf_config, config, role=role, params_dtype=dtype, device=device, seed=seed)
    if hf_state_dict is not None:
        engine.load_hf_weights(hf_state_dict)
    return engine
