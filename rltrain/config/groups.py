"""The key groups several config sections carry (the engine's: optimizer, parallelism, MoE, layer compute, the
log-prob head, LoRA), each declared once and inherited by the sections that have it (config/schema.py, which
re-exports them: import them from there).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import List, Optional, TypeVar

# ---------------------------------------------------------------------------- shared groups
# Key groups that several sections carry (the keys users type stay flat: `actor.lr`, `optim.lr`,
# `trainer.fused_linear_logprob`): each group is declared once here and inherited by the sections that have
# it; a section may override a default of its own key (optim.lr). `section.group(Group)` gives the group alone,
# which is what the model engine builder takes (models/builder.py).

G = TypeVar("G")


@dataclass
class Section:
    def group(self, cls: type[G]) -> G:
        """This section's keys of group `cls` as a `cls` object (e.g. actor.group(OptimizerConfig))."""
        return cls(**{f.name: getattr(self, f.name) for f in fields(cls)})


@dataclass
class OptimizerConfig(Section):
    """AdamW + lr schedule of a trained model (actor.*, critic.*, SFT optim.*)."""

    lr: float = 1e-6  # peak learning rate of AdamW
    weight_decay: float = 0.01  # AdamW's decoupled weight decay
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])  # AdamW's (beta1, beta2)
    eps: float = 1e-8  # AdamW's epsilon
    grad_clip: float = 1.0  # clip the global gradient norm to this value before each optimizer step
    lr_warmup_steps: int = 0  # optimizer steps of linear warm-up from 0 to lr
    lr_schedule: str = "constant"  # the learning rate after warm-up: constant, or cosine decay to min_lr_ratio * lr
    min_lr_ratio: float = 0.0  # cosine: the final learning rate as a fraction of lr
    optimizer_offload_fraction: float = 0.0  # share of each rank's fp32 master + AdamW state stepped on the host


@dataclass
class ParallelConfig(Section):
    """Model parallelism of the trained engines (actor.*; the critic and reference share the actor's)."""

    tensor_parallel_size: int = 1  # GPUs each layer's matrices are split over (Megatron tensor parallel)
    pipeline_parallel_size: int = 1  # pipeline stages the layers are split into
    # Mixture-of-Experts models: experts split over this many ranks (it divides the data-parallel size; each
    # expert's matrices are split over the tensor-parallel ranks as the dense MLP's)
    expert_parallel_size: int = 1  # MoE: ranks the experts are split over (divides data parallel)
    # data parallel > 1: grads reduce-scattered in buckets (each rank steps its shard of the optimizer state), started
    # during the last micro-batch's backward when overlap_grad_reduce (models/megatron/shards.py)
    grad_reduce_bucket_mb: float = 64.0  # data parallel: gradients reduce-scattered in buckets of this many MiB
    overlap_grad_reduce: bool = True  # start each bucket's reduce-scatter during the backward (data parallel > 1)


@dataclass
class MoEConfig(Section):
    """The router of a Mixture-of-Experts actor (actor.*; ignored by dense models)."""

    # load-balancing loss (Switch/GShard, per micro-batch) and router z-loss added to the actor's loss; 0 = off.
    # RL starts from a trained router: the peers' RL recipes keep both off or tiny
    moe_aux_loss_coeff: float = 0.0  # MoE load-balancing loss added to the actor's loss; 0 = off
    moe_z_loss_coeff: float = 0.0  # router z-loss (ST-MoE) added to the actor's loss; 0 = off
    # the experts' GEMMs as one torch._grouped_mm per projection over all local experts (megatron's SequentialMLP,
    # used without Transformer Engine, loops over them); false: megatron's loop
    moe_grouped_gemm: bool = True  # MoE: the experts' GEMMs grouped in one call (false: a loop)


# The allowed values of LayerComputeConfig's keys, named once here (validate.py checks them; models/megatron implements
# each: build.py the recompute options, fusion.py one function per fusion).
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_MODULES = ("mlp", "core_attn")  # megatron's "layernorm" too where Transformer Engine is installed
ELEMENTWISE_FUSIONS = ("none", "mcore", "compile")


@dataclass
class LayerComputeConfig(Section):
    """How a trained engine's layers run forward/backward (actor.*; the critic and SFT keep these defaults)."""

    # full activation recomputation (one layer at a time): long-context updates need it on GPU
    recompute_activations: bool = False  # recompute activations in the backward (less memory)
    # full: whole layers; selective: only recompute_modules (mlp, core_attn) of each layer (less memory
    # saved, much less recomputed; docs/benchmarks/update.md)
    recompute_granularity: str = "full"  # full: whole layers; selective: only recompute_modules
    recompute_modules: List[str] = field(default_factory=lambda: ["mlp"])  # what selective recomputation recomputes
    # none | mcore (megatron's fused SwiGLU + bias-dropout-add) | compile (torch.compile of each layer)
    elementwise_fusion: str = "none"  # fuse elementwise ops: mcore (megatron's) or compile (torch.compile)


@dataclass
class LogprobHeadConfig(Section):
    """The loss path's LM head (trainer.* of RL and SFT): fused log-probs from the hidden states (ops/logprob.py)."""

    fused_linear_logprob: bool = True  # log-probs and entropy from hidden states + LM-head weight, no [T, V] logits
    fused_linear_logprob_backend: str = "auto"  # the head's kernel; auto: cute on Hopper, triton on GPU, else torch
    logprobs_chunk_size: Optional[int] = None  # tokens per chunk of the fused head; null picks from a memory budget


# The linear layers a LoRA adapter can sit on, as PEFT names them (actor.lora.target_modules; "all": every one)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def resolve_targets(names) -> tuple[str, ...]:
    """actor.lora.target_modules -> the PEFT names in LORA_TARGETS order ("all": every one). ValueError names an
    unknown one."""
    names = list(names)
    unknown = [n for n in names if n != "all" and n not in LORA_TARGETS]
    if unknown or not names:
        raise ValueError(f"actor.lora.target_modules={names}: {unknown or 'empty'}; choose from {list(LORA_TARGETS)} "
                         "or [all]")
    return LORA_TARGETS if "all" in names else tuple(t for t in LORA_TARGETS if t in names)


@dataclass
class LoraConfig:
    """Low-rank adapters on the actor (actor.lora.*; models/lora.py, models/megatron/lora.py): the base frozen, only
    the adapters trained, synced into the rollout engine and checkpointed; the reference is the base (adapters off)."""

    rank: int = 0  # r of every adapter; 0 = off (full fine-tuning)
    alpha: float = 32.0  # the adapters' output is scaled by alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on the adapters' input while training (PEFT's lora_dropout)
    # PEFT's names: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or [all] (every one of them);
    # the LM head and the embedding are never adapted
    target_modules: List[str] = field(default_factory=lambda: ["all"])  # PEFT names, or [all]
