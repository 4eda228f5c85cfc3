"""The planner's reading of a typed RLConfig (every default the schema's) as `Inputs`, and the model's shape without
building anything: from `model.builtin` (rltrain/config/presets.py), a local `model.path`'s config.json (read as
JSON), the Hugging Face cache, or a Qwen3 hub name whose shape a preset copies; else a PlanInputError naming the fix.
The placement is workers/placement.py's, both asking config/parallel.py (`ParallelDims`: GPU r of the training group
is in pipeline stage r // (TP * DP)); split placement adds `rollout_replicas` x rollout.tensor_parallel_size GPUs.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any, Mapping

from rltrain.config.parallel import ParallelDims, rollout_replicas
from rltrain.config.presets import BUILTINS
from rltrain.config.schema import ModelConfig, RLConfig, resolve_targets
from rltrain.data.lengths import DataLengths  # noqa: F401 (the planner's input type, re-exported)
from rltrain.utils import flops
from rltrain.utils.errors import UserError


class PlanInputError(UserError, ValueError):
    """The planner cannot read the model's shape or a key it needs (the message names the fix)."""


# Vocabulary of the built-in character tokenizer (rltrain/data/tokenizer.py: 64 ids); tiny and small take theirs.
CHAR_VOCAB = 64


@dataclass(frozen=True)
class Shape:
    """A decoder's shape (Qwen3/Llama-like: GQA attention, SwiGLU MLP, RMSNorm)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    model_type: str = "qwen3"
    # Mixture-of-Experts (Qwen3-MoE; 0 experts: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    @property
    def sparse(self) -> tuple[int, ...]:
        """Per layer, 1 where a sparse MoE block (utils/flops.sparse_layers: Qwen3-MoE's rule)."""
        return tuple(flops.sparse_layers(self))

    @property
    def moe(self) -> bool:
        return any(self.sparse)

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim


def shape_from_fields(name: str, f: Mapping[str, Any]) -> Shape:
    heads = int(f["num_attention_heads"])
    hd = f.get("head_dim") or int(f["hidden_size"]) // heads
    return Shape(name=name, vocab_size=int(f["vocab_size"]), hidden_size=int(f["hidden_size"]),
                 intermediate_size=int(f["intermediate_size"]), num_hidden_layers=int(f["num_hidden_layers"]),
                 num_attention_heads=heads, num_key_value_heads=int(f.get("num_key_value_heads") or heads),
                 head_dim=int(hd), max_position_embeddings=int(f.get("max_position_embeddings") or 4096),
                 tie_word_embeddings=bool(f.get("tie_word_embeddings", False)),
                 model_type=str(f.get("model_type", "qwen3")),
                 num_experts=int(f.get("num_experts") or 0), num_experts_per_tok=int(f.get("num_experts_per_tok") or 0),
                 moe_intermediate_size=int(f.get("moe_intermediate_size") or 0),
                 decoder_sparse_step=int(f.get("decoder_sparse_step") or 1),
                 mlp_only_layers=tuple(int(i) for i in (f.get("mlp_only_layers") or ())))


def _hf_cache_config(hub_name: str) -> str | None:
    home = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.join(os.path.expanduser("~"), ".cache", "huggingface")), "hub")
    hits = sorted(glob.glob(os.path.join(home, "models--" + hub_name.replace("/", "--"), "snapshots", "*",
                                         "config.json")))
    return hits[-1] if hits else None


def model_shape(model: ModelConfig) -> Shape:
    """The shape of `model.*` (preset, local directory, HF cache, or a Qwen3 hub name), with model.overrides."""
    overrides = dict(model.overrides or {})
    builtin, path = model.builtin, model.path
    if builtin is not None:
        if builtin not in BUILTINS:
            raise PlanInputError(f"model.builtin={builtin!r} is unknown; choose one of {', '.join(BUILTINS)}")
        f = dict(BUILTINS[builtin])
        f.setdefault("vocab_size", CHAR_VOCAB if model.tokenizer in (None, "char") else 512)
        return shape_from_fields(builtin, {**f, **overrides})
    if not path:
        raise PlanInputError("model.path is not set; give an HF model id or local directory, or set model.builtin")
    local = os.path.join(str(path), "config.json")
    source = local if os.path.isfile(local) else _hf_cache_config(str(path))
    if source is not None:
        with open(source) as fh:
            f = json.load(fh)
        f = f.get("text_config", f) if "hidden_size" not in f else f
        return shape_from_fields(str(path), {**f, **overrides})
    preset = str(path).lower().removeprefix("qwen/")  # a Qwen3 hub name whose public config.json a preset copies
    if str(path).lower().startswith("qwen/qwen3-") and preset in BUILTINS:
        return shape_from_fields(str(path), {**BUILTINS[preset], **overrides})
    raise PlanInputError(f"model.path={path!r}: no config.json there or in the Hugging Face cache, and not a known "
                         "preset; download the model (huggingface-cli download), point model.path at a local "
                         "directory with config.json, or, to plan before that checkpoint exists, add the preset of "
                         "its shape (e.g. model.builtin=qwen3-4b)")


@dataclass(frozen=True)
class Inputs:
    """What the planner reads from a config (names follow the config keys)."""

    shape: Shape
    dtype_bytes: int
    # actor (and ref/critic trunk)
    tp: int
    pp: int
    recompute: bool
    recompute_granularity: str
    recompute_modules: tuple[str, ...]
    fusion: str
    mb_tokens: int
    critic_mb_tokens: int
    fwd_mb_tokens: int  # the forward-only passes' budget (actor.log_prob_max_tokens_per_micro_batch, else mb_tokens)
    ppo_mini_batch_size: int
    ppo_epochs: int
    critic_ppo_epochs: int
    use_ref: bool
    use_critic: bool
    fused_head: bool
    logprob_backend: str
    chunk_size: int | None
    # rollout
    engine: str
    n: int
    max_response_length: int
    gpu_memory_utilization: float
    kv_cache_memory_gb: float | None
    rollout_tp: int
    engines_per_gpu: int
    max_batch_size: int
    num_replicas: int | None
    weight_sync_bucket_mb: int
    multi_turn_total: int | None
    # data / trainer
    train_batch_size: int
    max_prompt_length: int
    colocate: bool
    n_gpus_per_node: int
    nnodes: int
    device: str
    use_ray: bool
    async_rollout: bool
    ep: int  # actor.expert_parallel_size: the experts split over this many (data-parallel) ranks
    moe_grouped_gemm: bool  # actor.moe_grouped_gemm: torch._grouped_mm over the local experts, not a loop
    free_cache_engine: bool  # rollout.free_cache_engine: a colocated engine sleeps through the training phases
    recompute_old_logprobs: bool  # actor.recompute_old_logprobs: false skips the old-log-prob pass
    lora_rank: int  # actor.lora.rank (0: full fine-tuning)
    lora_targets: tuple[str, ...]  # actor.lora.target_modules as PEFT names
    optimizer_offload_fraction: float = 0.0  # actor.optimizer_offload_fraction: that share of the state on the host
    offload_while_rollout: bool = False  # actor.offload_while_rollout: the actor's state on the host during generation
    ref_offload: bool = False  # ref.offload: the reference's layers on the host, streamed in per forward
    replay_compare: bool = False  # actor.moe_routing_replay_compare: the old log-probs' pass once more
    direct_expert_sync_after: int = 1  # rollout.direct_expert_sync_after: -1, the experts through vLLM's loader
    # the engine before issue 59 (whole optimizer state on every rank, all fp32 grads at the step, stacked expert
    # copies), as the calibration runs ran: the calibration harness plans those so; false: the engine now
    legacy_engine: bool = False
    # the prompt length time is planned at (the data's mean: timing.phase_seconds); None: max_prompt_length
    mean_prompt_length: float | None = None
    lengths_from: str = "config"  # where max_prompt_length came from: config (the bound) | data | given

    @property
    def world(self) -> int:
        return self.n_gpus_per_node * self.nnodes

    @property
    def dims(self) -> ParallelDims:
        """The actor's degrees over the training group (raises ParallelDimsError where they cannot be arranged)."""
        return ParallelDims(world_size=self.world, tp=self.tp, pp=self.pp, ep=self.ep)

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def colocated(self) -> bool:
        """One group holds every role: trainer.colocate, or no Ray (the in-process worker)."""
        return self.colocate or not self.use_ray

    @property
    def rollout_replicas(self) -> int:
        return rollout_replicas(world_size=self.world, tensor_parallel_size=self.rollout_tp,
                                num_replicas=None if self.colocated else self.num_replicas)

    @property
    def seq_len(self) -> int:
        """Longest sequence a step can hold: prompt + response (multi-turn: its total budget)."""
        if self.multi_turn_total:
            return int(self.multi_turn_total)
        return self.max_prompt_length + self.max_response_length


def read(cfg: RLConfig) -> Inputs:
    """Inputs of a typed RLConfig (as_config made it: every key has its schema default)."""
    m, a, r, t, d = cfg.model, cfg.actor, cfg.rollout, cfg.trainer, cfg.data
    mt = r.multi_turn
    return Inputs(
        shape=model_shape(m), dtype_bytes=4 if m.dtype == "float32" else 2,
        tp=a.tensor_parallel_size, pp=a.pipeline_parallel_size, ep=a.expert_parallel_size,
        recompute=a.recompute_activations, recompute_granularity=a.recompute_granularity,
        recompute_modules=tuple(a.recompute_modules), fusion=a.elementwise_fusion,
        mb_tokens=a.max_tokens_per_micro_batch,
        fwd_mb_tokens=a.log_prob_max_tokens_per_micro_batch or a.max_tokens_per_micro_batch,
        critic_mb_tokens=cfg.critic.max_tokens_per_micro_batch, ppo_mini_batch_size=a.ppo_mini_batch_size,
        ppo_epochs=a.ppo_epochs, critic_ppo_epochs=cfg.critic.ppo_epochs,
        use_ref=a.use_kl_loss or cfg.algorithm.use_kl_in_reward, use_critic=cfg.algorithm.adv_estimator == "gae",
        fused_head=t.fused_linear_logprob, logprob_backend=t.fused_linear_logprob_backend,
        chunk_size=t.logprobs_chunk_size, engine=r.engine, n=r.n, max_response_length=r.max_response_length,
        gpu_memory_utilization=r.gpu_memory_utilization, kv_cache_memory_gb=r.kv_cache_memory_gb,
        rollout_tp=r.tensor_parallel_size, engines_per_gpu=r.engines_per_gpu,
        max_batch_size=r.max_batch_size, num_replicas=r.num_replicas, weight_sync_bucket_mb=r.weight_sync_bucket_mb,
        multi_turn_total=mt.max_total_tokens if mt.enable else None, train_batch_size=d.train_batch_size,
        max_prompt_length=d.max_prompt_length, colocate=t.colocate, n_gpus_per_node=t.n_gpus_per_node,
        nnodes=t.nnodes, device=t.device, use_ray=t.use_ray, async_rollout=t.async_rollout,
        moe_grouped_gemm=a.moe_grouped_gemm, free_cache_engine=r.free_cache_engine,
        recompute_old_logprobs=a.recompute_old_logprobs, lora_rank=a.lora.rank,
        lora_targets=resolve_targets(a.lora.target_modules), optimizer_offload_fraction=a.optimizer_offload_fraction,
        offload_while_rollout=a.offload_while_rollout, ref_offload=cfg.ref.offload,
        replay_compare=a.moe_routing_replay_compare, direct_expert_sync_after=r.direct_expert_sync_after,
    )
