"""The one engine builder (models/builder.py) and the engine's typed config (models/engine_config.py): a run's
sections reach the engine key by key, and an engine built without them has the schema's defaults."""

from __future__ import annotations

import pytest
import torch

from rltrain.config.schema import (
    ActorConfig,
    CriticConfig,
    LayerComputeConfig,
    LogprobHeadConfig,
    OptimizerConfig,
    ParallelConfig,
    SFTOptimConfig,
    TrainerConfig,
)
from rltrain.models.builder import build_engine
from rltrain.models.engine_config import EngineConfig
from rltrain.models.megatron import MegatronEngine, tiny_qwen3_config


def test_engine_defaults_are_the_schemas():
    c = EngineConfig()
    assert c.optim == OptimizerConfig() and c.parallel == ParallelConfig() and c.head == LogprobHeadConfig()
    assert c.compute == LayerComputeConfig()
    assert c.max_tokens_per_micro_batch == ActorConfig().max_tokens_per_micro_batch == 16384
    assert c.make_vocab_size_divisible_by == 1 and c.optim.weight_decay == 0.01


def test_builder_passes_every_section_key_to_the_engine():
    actor = ActorConfig(lr=3e-4, weight_decay=0.05, betas=[0.8, 0.9], eps=1e-6, grad_clip=0.7, lr_warmup_steps=2,
                        lr_schedule="cosine", min_lr_ratio=0.1, max_tokens_per_micro_batch=321)
    trainer = TrainerConfig(fused_linear_logprob=False, fused_linear_logprob_backend="torch", logprobs_chunk_size=7)
    eng = build_engine(tiny_qwen3_config(64), role="actor", device="cpu", dtype=torch.float32, seed=0,
                       total_steps=10, max_tokens_per_micro_batch=actor.max_tokens_per_micro_batch,
                       optim=actor.group(OptimizerConfig), parallel=actor.group(ParallelConfig),
                       compute=actor.group(LayerComputeConfig), head=trainer.group(LogprobHeadConfig))
    g = eng.optimizer.param_groups[0]
    assert (g["weight_decay"], g["betas"], g["eps"]) == (0.05, (0.8, 0.9), 1e-6)
    assert g["lr"] == pytest.approx(3e-4 * 0.5)  # warmup step 1 of 2
    assert eng.optim.grad_clip == 0.7 and eng.max_tokens_per_micro_batch == 321
    assert (eng.fused, eng.backend, eng.chunk_size) == (False, "torch", 7)
    assert eng.config.optim.lr_schedule == "cosine" and eng.config.total_steps == 10
    assert eng.forward_max_tokens_per_micro_batch == 321  # unset: the update's budget
    fwd = build_engine(tiny_qwen3_config(64), role="ref", device="cpu", dtype=torch.float32, seed=0, total_steps=1,
                       max_tokens_per_micro_batch=321, forward_max_tokens_per_micro_batch=4096)
    assert (fwd.max_tokens_per_micro_batch, fwd.forward_max_tokens_per_micro_batch) == (321, 4096)


@pytest.mark.parametrize("section", [CriticConfig(), SFTOptimConfig()])
def test_each_sections_optimizer_defaults_reach_the_engine(section):
    eng = build_engine(tiny_qwen3_config(64), role="critic" if isinstance(section, CriticConfig) else "actor",
                       device="cpu", dtype=torch.float32, seed=0, total_steps=4, max_tokens_per_micro_batch=64,
                       optim=section.group(OptimizerConfig))
    g = eng.optimizer.param_groups[0]
    assert g["initial_lr"] == section.lr and g["betas"] == tuple(section.betas)
    assert isinstance(eng, MegatronEngine)
