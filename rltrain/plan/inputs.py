"""The planner's reading of a config: a small adapter over the resolved config (an OmegaConf DictConfig or the
plain dict `OmegaConf.to_container(cfg, resolve=True)` gives) and the model's shape, without building anything.

Only the keys the planner needs are read, by name, so the typed-dataclass config that replaces the DictConfig can be
passed as a dict too. The model's shape comes from `model.builtin` (the presets, reached through rltrain.config),
a local `model.path` directory's config.json (read as JSON: no transformers), the Hugging Face cache, or, for the
Qwen3 hub names whose shapes the presets copy, the preset. Anything else is a PlanInputError naming the fix.

The placement is rltrain/workers/placement.py's (plan/ may import only config/, data/, utils/ and compat/, so both ask
config/parallel.py): colocated, one group of trainer.n_gpus_per_node * trainer.nnodes GPUs holds every role; split,
the training group has those GPUs and the rollout group `rollout_replicas` replicas of rollout.tensor_parallel_size
GPUs. The actor's degrees are `ParallelDims`'s, whose rank order puts GPU r of the training group in pipeline stage
r // (TP * DP).
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from rltrain.config.parallel import ParallelDims, rollout_replicas
from rltrain.config.schema import resolve_targets
from rltrain.data.lengths import DataLengths  # noqa: F401 (the planner's input type, re-exported)
from rltrain.utils import flops
from rltrain.utils.errors import UserError


class PlanInputError(UserError, ValueError):
    """The planner cannot read the model's shape or a key it needs (the message names the fix)."""


# Vocabulary of the built-in character tokenizer (rltrain/data/tokenizer.py: 64 ids); tiny and small take theirs.
CHAR_VOCAB = 64
# Qwen3 hub names whose public config.json the presets copy (rltrain/models/presets.py).
HUB_PRESETS = {"qwen/qwen3-0.6b": "qwen3-0.6b", "qwen/qwen3-4b": "qwen3-4b", "qwen/qwen3-8b": "qwen3-8b"}


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


def _builtins() -> dict[str, dict]:
    # the presets, as rltrain.config.validate imports them (plan/ may not import models/ itself)
    from rltrain.config.validate import BUILTINS

    return BUILTINS


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


def model_shape(model: Mapping[str, Any]) -> Shape:
    """The shape of `model.*` (builtin preset, local directory, HF cache, or a known Qwen3 hub name), with
    model.overrides applied."""
    overrides = dict(model.get("overrides") or {})
    builtin, path = model.get("builtin"), model.get("path")
    if builtin is not None:
        presets = _builtins()
        if builtin not in presets:
            raise PlanInputError(f"model.builtin={builtin!r} is unknown; choose one of {', '.join(presets)}")
        f = dict(presets[builtin])
        f.setdefault("vocab_size", CHAR_VOCAB if (model.get("tokenizer") in (None, "char")) else 512)
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
    preset = HUB_PRESETS.get(str(path).lower())
    if preset is not None:
        return shape_from_fields(str(path), {**_builtins()[preset], **overrides})
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
    enforce_eager: bool
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
    ep: int = 1  # actor.expert_parallel_size: the experts split over this many (data-parallel) ranks
    moe_grouped_gemm: bool = True  # actor.moe_grouped_gemm: torch._grouped_mm over the local experts, not a loop
    free_cache_engine: bool = True  # rollout.free_cache_engine: a colocated engine sleeps through the training phases
    recompute_old_logprobs: bool = True  # actor.recompute_old_logprobs: false skips the old-log-prob pass
    # the prompt length time is planned at (the data's mean: timing.phase_seconds); None: max_prompt_length
    mean_prompt_length: float | None = None
    lengths_from: str = "config"  # where max_prompt_length came from: config (the bound) | data | given
    lora_rank: int = 0  # actor.lora.rank (0: full fine-tuning)
    lora_targets: tuple[str, ...] = ()  # actor.lora.target_modules as PEFT names
    extra: dict = field(default_factory=dict)

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


def as_dict(cfg: Any) -> dict:
    """A resolved plain dict of `cfg` (a DictConfig, a dataclass instance, or a dict)."""
    if isinstance(cfg, dict):
        return cfg
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(cfg):
            return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
        return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)  # type: ignore[return-value]
    except Exception as err:  # pragma: no cover - an object neither OmegaConf nor a dict
        raise PlanInputError(f"cannot read the config ({type(cfg).__name__}): {err}") from err


def read(cfg: Any) -> Inputs:
    """Inputs of a resolved config (DictConfig or plain dict)."""
    c = as_dict(cfg)
    try:
        m, a, r, t, d = c["model"], c["actor"], c["rollout"], c["trainer"], c["data"]
        crit, alg = c.get("critic", {}), c.get("algorithm", {})
        dtype = str(m.get("dtype", "bfloat16"))
        mt = r.get("multi_turn") or {}
        return Inputs(
            shape=model_shape(m), dtype_bytes=4 if dtype == "float32" else 2,
            tp=int(a.get("tensor_parallel_size", 1)), pp=int(a.get("pipeline_parallel_size", 1)),
            recompute=bool(a.get("recompute_activations", False)),
            recompute_granularity=str(a.get("recompute_granularity", "full")),
            recompute_modules=tuple(a.get("recompute_modules") or ("mlp",)),
            fusion=str(a.get("elementwise_fusion", "none")),
            mb_tokens=int(a["max_tokens_per_micro_batch"]),
            fwd_mb_tokens=int(a.get("log_prob_max_tokens_per_micro_batch") or a["max_tokens_per_micro_batch"]),
            critic_mb_tokens=int(crit.get("max_tokens_per_micro_batch", a["max_tokens_per_micro_batch"])),
            ppo_mini_batch_size=int(a.get("ppo_mini_batch_size", 16)), ppo_epochs=int(a.get("ppo_epochs", 1)),
            critic_ppo_epochs=int(crit.get("ppo_epochs", 1)),
            use_ref=bool(a.get("use_kl_loss", False) or alg.get("use_kl_in_reward", False)),
            use_critic=alg.get("adv_estimator") == "gae",
            fused_head=bool(t.get("fused_linear_logprob", True)),
            logprob_backend=str(t.get("fused_linear_logprob_backend", "auto")),
            chunk_size=t.get("logprobs_chunk_size"),
            engine=str(r.get("engine", "hf")), n=int(r.get("n", 1)), max_response_length=int(r["max_response_length"]),
            gpu_memory_utilization=float(r.get("gpu_memory_utilization", 0.5)),
            kv_cache_memory_gb=r.get("kv_cache_memory_gb"), rollout_tp=int(r.get("tensor_parallel_size", 1)),
            engines_per_gpu=int(r.get("engines_per_gpu", 1)), enforce_eager=bool(r.get("enforce_eager", False)),
            max_batch_size=int(r.get("max_batch_size", 256)), num_replicas=r.get("num_replicas"),
            weight_sync_bucket_mb=int(r.get("weight_sync_bucket_mb", 256)),
            multi_turn_total=int(mt["max_total_tokens"]) if mt.get("enable") else None,
            train_batch_size=int(d["train_batch_size"]), max_prompt_length=int(d["max_prompt_length"]),
            colocate=bool(t.get("colocate", True)), n_gpus_per_node=int(t.get("n_gpus_per_node", 1)),
            nnodes=int(t.get("nnodes", 1)), device=str(t.get("device", "auto")), use_ray=bool(t.get("use_ray", True)),
            async_rollout=bool(t.get("async_rollout", False)), ep=int(a.get("expert_parallel_size", 1) or 1),
            moe_grouped_gemm=bool(a.get("moe_grouped_gemm", True)),
            free_cache_engine=bool(r.get("free_cache_engine", True)),
            recompute_old_logprobs=bool(a.get("recompute_old_logprobs", True)),
            lora_rank=int((a.get("lora") or {}).get("rank", 0) or 0),
            lora_targets=resolve_targets((a.get("lora") or {}).get("target_modules") or ["all"]),
        )
    except KeyError as err:
        raise PlanInputError(f"the config has no key {err}; rltrain.plan reads a composed RL config "
                             "(python -m rltrain.plan --config-name NAME)") from err
