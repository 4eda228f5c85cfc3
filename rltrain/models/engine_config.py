"""The typed config a model engine is built with (besides the model, its device, dtype and seed): the schema's key
groups (config/schema.py) plus the micro-batch token budget, the lr schedule's length and the vocab padding. Every
default is the schema's: a group's own defaults, and actor.max_tokens_per_micro_batch's for the budget.

models/builder.py makes one from a run's sections; tests and tools that build an engine by hand set the typed fields
(`EngineConfig(optim=OptimizerConfig(lr=1e-3), parallel=ParallelConfig(tensor_parallel_size=2))`). No torch, no
megatron here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rltrain.config.schema import (
    ELEMENTWISE_FUSIONS,
    ActorConfig,
    LayerComputeConfig,
    LogprobHeadConfig,
    LoraConfig,
    MoEConfig,
    OptimizerConfig,
    ParallelConfig,
)
from rltrain.utils.lr_schedule import LR_SCHEDULES

ENGINE_ROLES = ("actor", "ref", "critic")  # a critic has a value head and no LM head; a ref has no optimizer

# The vocab is padded only to a multiple of the TP size: Qwen3's 151,936 needs none, and padded rows cost the fused
# head a masked copy of the weight shard.
VOCAB_PADDING = 1


@dataclass(frozen=True)
class SampledDistribution:
    """rollout.true_on_policy for the actor: its forward computes with the rollout engine's arithmetic
    (models/megatron/invariant.py) and its log-probs are of the distribution the engine samples from, softmax of the
    logits / temperature restricted to the top-k / top-p set (rollout.top_k, rollout.top_p; -1 / 1.0: off)."""

    top_k: int = -1
    top_p: float = 1.0
    engine: str = "hf"  # the rollout engine whose kernels the actor runs: "hf" (ops/invariant.py) or "vllm" (CUDA)


@dataclass
class EngineConfig:
    optim: OptimizerConfig = field(default_factory=OptimizerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    compute: LayerComputeConfig = field(default_factory=LayerComputeConfig)
    head: LogprobHeadConfig = field(default_factory=LogprobHeadConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # the actor's adapters (rank 0: off; other roles ignore it)
    max_tokens_per_micro_batch: int = ActorConfig.max_tokens_per_micro_batch
    # the forward-only passes' budget (forward_logprobs, forward_values); None: max_tokens_per_micro_batch
    forward_max_tokens_per_micro_batch: int | None = None
    total_steps: int = 1000  # optimizer steps of the lr schedule (the builder passes the run's)
    # a forward-only engine (the reference) keeps its decoder layers on the host and streams them in (ref.offload)
    offload_layers: bool = False
    make_vocab_size_divisible_by: int = VOCAB_PADDING
    true_on_policy: SampledDistribution | None = None  # rollout.true_on_policy (None: the plain forward and head)

    def check(self, role: str) -> None:
        """ValueError for a config or role an engine cannot run (config validation refuses them earlier for a run;
        tests and tools build engines by hand)."""
        if role not in ENGINE_ROLES:
            raise ValueError(f"role must be one of {ENGINE_ROLES}, got {role!r}")
        if self.optim.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {tuple(LR_SCHEDULES)}, got {self.optim.lr_schedule!r}")
        if self.max_tokens_per_micro_batch < 1:
            raise ValueError(f"max_tokens_per_micro_batch must be >= 1, got {self.max_tokens_per_micro_batch}")
        if self.forward_max_tokens_per_micro_batch is not None and self.forward_max_tokens_per_micro_batch < 1:
            raise ValueError("forward_max_tokens_per_micro_batch must be >= 1 (or None: the update's budget), got "
                             f"{self.forward_max_tokens_per_micro_batch}")
        if self.compute.elementwise_fusion not in ELEMENTWISE_FUSIONS:
            raise ValueError(f"elementwise_fusion must be one of {ELEMENTWISE_FUSIONS}, got "
                             f"{self.compute.elementwise_fusion!r}")
        if not self.parallel.grad_reduce_bucket_mb > 0:
            raise ValueError(f"grad_reduce_bucket_mb must be > 0, got {self.parallel.grad_reduce_bucket_mb}")
