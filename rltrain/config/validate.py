"""Value rules for a composed config: ranges, allowed names and cross-field rules.

Runs before anything starts (no Ray, no model); every error names the key, the value and what is allowed.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from omegaconf import DictConfig, OmegaConf

from rltrain.models.presets import BUILTINS
from rltrain.utils.errors import UserError


class ConfigError(UserError, ValueError):
    """A user-fixable problem in the configuration."""


ROLLOUT_ENGINES = ("hf", "vllm")
LOGPROB_BACKENDS = ("auto", "torch", "triton")
LOGGERS = ("console", "jsonl", "wandb")
DEVICES = ("auto", "cpu", "cuda")
DATA_SOURCES = ("file", "synthetic")
LR_SCHEDULES = ("constant", "cosine")
MODEL_DTYPES = ("bfloat16", "float32")
BUILTIN_MODELS = tuple(BUILTINS)  # the presets of rltrain/models/presets.py
TOOL_PATTERNS = ("code_block", "code_tag")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_MODULES = ("mlp", "core_attn")  # megatron's "layernorm" needs Transformer Engine
ELEMENTWISE_FUSIONS = ("none", "mcore", "compile")


def _is_dotted_path(name: str) -> bool:
    return ":" in name


def _choice(errors: list, key: str, value: Any, allowed: Iterable[str], *, dotted_ok: bool = False) -> None:
    allowed = tuple(allowed)
    if value in allowed or (dotted_ok and isinstance(value, str) and _is_dotted_path(value)):
        return
    extra = " or a 'module:function' path" if dotted_ok else ""
    errors.append(f"{key}={value!r} is not allowed; choose one of {', '.join(allowed)}{extra}")


def _positive(errors: list, key: str, value: Any, *, allow_zero: bool = False, allow_minus_one: bool = False) -> None:
    if value is None:
        errors.append(f"{key} must be set")
        return
    if allow_minus_one and value == -1:
        return
    ok = value >= 0 if allow_zero else value > 0
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        tail = " (or -1 to disable)" if allow_minus_one else ""
        errors.append(f"{key}={value} is impossible; it must be {bound}{tail}")


def _range(errors: list, key: str, value: float, lo: float, hi: float) -> None:
    if not (lo <= value <= hi):
        errors.append(f"{key}={value} is out of range; it must be in [{lo}, {hi}]")


def _on_gpu(device: str) -> bool:
    """trainer.device as the run will resolve it (auto: CUDA when this machine has it)."""
    if device != "auto":
        return device == "cuda"
    import torch

    return torch.cuda.is_available()


def validate_config(cfg: DictConfig) -> None:
    """Raise ConfigError listing every problem found in `cfg` (a composed RLConfig)."""
    # Lazy: the registries are the single source of allowed names.
    from rltrain.algorithms import ADV_ESTIMATORS, AGG_MODES, KL_KINDS, POLICY_LOSS_MODES, TIS_MODES

    e: list[str] = []
    r, a, c, al, d, t, m = cfg.rollout, cfg.actor, cfg.critic, cfg.algorithm, cfg.data, cfg.trainer, cfg.model

    # model
    if m.builtin is None and not m.path:
        e.append("model.path is not set; give an HF model id or local directory, or set model.builtin="
                 f"{'|'.join(BUILTIN_MODELS)}")
    if m.builtin is not None:
        _choice(e, "model.builtin", m.builtin, BUILTIN_MODELS)
    _choice(e, "model.dtype", m.dtype, MODEL_DTYPES)

    # rollout
    _choice(e, "rollout.engine", r.engine, ROLLOUT_ENGINES)
    _positive(e, "rollout.n", r.n)
    _positive(e, "rollout.val_n", r.val_n)
    _positive(e, "rollout.max_response_length", r.max_response_length)
    _positive(e, "rollout.max_batch_size", r.max_batch_size)
    _positive(e, "rollout.weight_sync_bucket_mb", r.weight_sync_bucket_mb)
    _positive(e, "rollout.temperature", r.temperature, allow_zero=True)
    _positive(e, "rollout.val_temperature", r.val_temperature, allow_zero=True)
    _range(e, "rollout.top_p", r.top_p, 1e-6, 1.0)
    if r.top_k != -1 and r.top_k <= 0:
        e.append(f"rollout.top_k={r.top_k} is impossible; use -1 (off) or a positive integer")
    _range(e, "rollout.gpu_memory_utilization", r.gpu_memory_utilization, 0.01, 1.0)
    if r.kv_cache_memory_gb is not None and not r.kv_cache_memory_gb > 0:
        e.append(f"rollout.kv_cache_memory_gb={r.kv_cache_memory_gb} must be a positive number of GiB, or null "
                 "(sized by rollout.gpu_memory_utilization)")
    _positive(e, "rollout.tensor_parallel_size", r.tensor_parallel_size)
    _positive(e, "rollout.engines_per_gpu", r.engines_per_gpu)
    if r.engines_per_gpu > 1 and (r.engine != "vllm" or r.tensor_parallel_size != 1 or not t.colocate
                                  or t.device == "cpu"):
        e.append(f"rollout.engines_per_gpu={r.engines_per_gpu} runs several vLLM engines on each GPU of a colocated "
                 "run (rollout.engine=vllm, rollout.tensor_parallel_size=1, trainer.colocate=true, a CUDA device: "
                 "weights reach them by CUDA IPC); set rollout.engines_per_gpu=1")
    if r.engine == "vllm" and r.tensor_parallel_size > 1 and m.builtin in BUILTINS and _on_gpu(t.device):
        from types import SimpleNamespace

        from rltrain.compat.vllm import tp_head_dim_error  # the rule and its measurement (vLLM 0.26 TP on GPUs)
        from rltrain.utils import flops

        head_dim = flops.head_dim(SimpleNamespace(**{**BUILTINS[m.builtin], **(m.overrides or {})}))
        why = tp_head_dim_error(head_dim, int(r.tensor_parallel_size))
        if why:
            e.append(f"model.builtin={m.builtin} has head_dim {head_dim}: {why}")
    mt = r.multi_turn
    if mt.enable:
        _positive(e, "rollout.multi_turn.max_turns", mt.max_turns)
        _positive(e, "rollout.multi_turn.max_total_tokens", mt.max_total_tokens)
        _positive(e, "rollout.multi_turn.tool_timeout_s", mt.tool_timeout_s)
        _positive(e, "rollout.multi_turn.tool_memory_mb", mt.tool_memory_mb)
        if mt.tool_pattern not in TOOL_PATTERNS and "(" not in mt.tool_pattern:
            e.append(f"rollout.multi_turn.tool_pattern={mt.tool_pattern!r}: choose one of "
                     f"{', '.join(TOOL_PATTERNS)} or a regex with one capture group")

    # actor
    _positive(e, "actor.lr", a.lr)
    _positive(e, "actor.weight_decay", a.weight_decay, allow_zero=True)
    _positive(e, "actor.grad_clip", a.grad_clip)
    _positive(e, "actor.ppo_epochs", a.ppo_epochs)
    _positive(e, "actor.ppo_mini_batch_size", a.ppo_mini_batch_size)
    _positive(e, "actor.max_tokens_per_micro_batch", a.max_tokens_per_micro_batch)
    _positive(e, "actor.lr_warmup_steps", a.lr_warmup_steps, allow_zero=True)
    _choice(e, "actor.lr_schedule", a.lr_schedule, LR_SCHEDULES)
    _range(e, "actor.min_lr_ratio", a.min_lr_ratio, 0.0, 1.0)
    _choice(e, "actor.loss_mode", a.loss_mode, POLICY_LOSS_MODES)
    _choice(e, "actor.loss_agg_mode", a.loss_agg_mode, AGG_MODES)
    _range(e, "actor.clip_low", a.clip_low, 0.0, 1.0)
    _positive(e, "actor.clip_high", a.clip_high, allow_zero=True)
    if a.dual_clip is not None and a.dual_clip <= 1.0:
        e.append(f"actor.dual_clip={a.dual_clip} is impossible; it must be > 1 (or null to disable)")
    _positive(e, "actor.entropy_coef", a.entropy_coef, allow_zero=True)
    _positive(e, "actor.kl_loss_coef", a.kl_loss_coef, allow_zero=True)
    _choice(e, "actor.kl_loss_type", a.kl_loss_type, KL_KINDS)
    if len(a.betas) != 2 or not all(0.0 <= b < 1.0 for b in a.betas):
        e.append(f"actor.betas={list(a.betas)} must be two numbers in [0, 1)")
    _choice(e, "actor.recompute_granularity", a.recompute_granularity, RECOMPUTE_GRANULARITIES)
    for m in a.recompute_modules:
        _choice(e, "actor.recompute_modules[]", m, RECOMPUTE_MODULES)
    _choice(e, "actor.elementwise_fusion", a.elementwise_fusion, ELEMENTWISE_FUSIONS)
    _positive(e, "actor.grad_reduce_bucket_mb", a.grad_reduce_bucket_mb)
    _positive(e, "actor.tensor_parallel_size", a.tensor_parallel_size)
    _positive(e, "actor.pipeline_parallel_size", a.pipeline_parallel_size)
    _choice(e, "actor.tis.mode", a.tis.mode, TIS_MODES)
    if not a.tis.cap >= 1.0:
        e.append(f"actor.tis.cap={a.tis.cap} is impossible; it must be >= 1 (the ratio's upper truncation)")
    if d.train_batch_size > 0 and a.ppo_mini_batch_size > d.train_batch_size:
        e.append(f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} is larger than the batch "
                 f"(data.train_batch_size={d.train_batch_size}); it must be <= data.train_batch_size")

    # critic
    _positive(e, "critic.lr", c.lr)
    _positive(e, "critic.ppo_epochs", c.ppo_epochs)
    _positive(e, "critic.value_clip", c.value_clip)
    _choice(e, "critic.loss_agg_mode", c.loss_agg_mode, AGG_MODES)
    _positive(e, "critic.max_tokens_per_micro_batch", c.max_tokens_per_micro_batch)

    # algorithm
    _choice(e, "algorithm.adv_estimator", al.adv_estimator, ADV_ESTIMATORS, dotted_ok=True)
    _range(e, "algorithm.gamma", al.gamma, 0.0, 1.0)
    _range(e, "algorithm.lam", al.lam, 0.0, 1.0)
    _choice(e, "algorithm.kl_penalty", al.kl_penalty, KL_KINDS)
    _positive(e, "algorithm.kl_coef", al.kl_coef, allow_zero=True)
    _positive(e, "algorithm.dynamic_sampling.max_tries", al.dynamic_sampling.max_tries)
    if al.overlong.enable:
        _positive(e, "algorithm.overlong.buffer_len", al.overlong.buffer_len)
        if al.overlong.buffer_len >= r.max_response_length:
            e.append(f"algorithm.overlong.buffer_len={al.overlong.buffer_len} must be smaller than "
                     f"rollout.max_response_length={r.max_response_length}")

    # reward
    from rltrain.rewards import REWARD_FNS

    fn = cfg.reward.fn
    if ":" in fn:
        path = fn.rsplit(":", 1)[0]
        if path.endswith(".py") and not os.path.isfile(path):
            e.append(f"reward.fn={fn!r}: file {path!r} does not exist")
    else:
        _choice(e, "reward.fn", fn, REWARD_FNS, dotted_ok=True)
    _positive(e, "reward.timeout_s", cfg.reward.timeout_s)
    _positive(e, "reward.max_workers", cfg.reward.max_workers, allow_zero=True)  # 0: in-process

    # data
    _choice(e, "data.source", d.source, DATA_SOURCES)
    _positive(e, "data.train_batch_size", d.train_batch_size)
    _positive(e, "data.val_batch_size", d.val_batch_size)
    _positive(e, "data.max_prompt_length", d.max_prompt_length)
    if d.source == "file":
        if not d.train_files:
            e.append("data.train_files is empty; give one or more .jsonl/.parquet files "
                     "(or set data.source=synthetic)")
    else:
        _positive(e, "data.synthetic.train_size", d.synthetic.train_size)
        _positive(e, "data.synthetic.val_size", d.synthetic.val_size)

    # trainer
    _positive(e, "trainer.total_steps", t.total_steps)
    _positive(e, "trainer.save_freq", t.save_freq, allow_minus_one=True)
    _positive(e, "trainer.test_freq", t.test_freq, allow_minus_one=True)
    _choice(e, "trainer.fused_linear_logprob_backend", t.fused_linear_logprob_backend, LOGPROB_BACKENDS)
    if t.logprobs_chunk_size is not None:
        _positive(e, "trainer.logprobs_chunk_size", t.logprobs_chunk_size)
    _choice(e, "trainer.device", t.device, DEVICES)
    for lg in t.logger:
        _choice(e, "trainer.logger", lg, LOGGERS)
    if t.resume not in ("auto", "never") and not os.path.exists(t.resume):
        e.append(f"trainer.resume={t.resume!r}: use auto, never, or an existing checkpoint directory")
    _positive(e, "trainer.max_ckpt_to_keep", t.max_ckpt_to_keep)
    _positive(e, "trainer.n_gpus_per_node", t.n_gpus_per_node)
    _positive(e, "trainer.nnodes", t.nnodes)
    _positive(e, "trainer.max_staleness", t.max_staleness)
    if t.async_rollout and t.colocate:
        e.append("trainer.async_rollout=true overlaps generation with training on separate workers; it needs "
                 "split placement: set trainer.colocate=false (or trainer.async_rollout=false)")
    if t.async_rollout and not t.use_ray:
        e.append("trainer.async_rollout=true needs Ray (trainer.use_ray=true): the in-process worker cannot "
                 "generate and train at once")
    from rltrain.workers.placement import placement_errors  # the one placement rule (no Ray, no torch)

    e.extend(placement_errors(cfg, device=t.device if t.device != "auto" else None))

    if e:
        raise ConfigError("invalid configuration:\n  - " + "\n  - ".join(e))


def validate_sft_config(cfg: DictConfig) -> None:
    """Raise ConfigError listing every problem found in `cfg` (a composed SFTConfig, rltrain.sft)."""
    e: list[str] = []
    m, d, o, t = cfg.model, cfg.data, cfg.optim, cfg.trainer
    if m.builtin is None and not m.path:
        e.append("model.path is not set; give an HF model id or local directory, or set model.builtin="
                 f"{'|'.join(BUILTIN_MODELS)}")
    if m.builtin is not None:
        _choice(e, "model.builtin", m.builtin, BUILTIN_MODELS)
    _choice(e, "model.dtype", m.dtype, MODEL_DTYPES)
    if not d.train_files:
        e.append("data.train_files is empty; give one or more .jsonl/.parquet files of chat rows "
                 "({\"messages\": [...]}); see rltrain/data/sft_data.py")
    _positive(e, "data.max_length", d.max_length)
    _positive(e, "data.batch_size", d.batch_size)
    _positive(e, "optim.lr", o.lr)
    _positive(e, "optim.weight_decay", o.weight_decay, allow_zero=True)
    _positive(e, "optim.grad_clip", o.grad_clip)
    _positive(e, "optim.lr_warmup_steps", o.lr_warmup_steps, allow_zero=True)
    _choice(e, "optim.lr_schedule", o.lr_schedule, LR_SCHEDULES)
    _range(e, "optim.min_lr_ratio", o.min_lr_ratio, 0.0, 1.0)
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        e.append(f"optim.betas={list(o.betas)} must be two numbers in [0, 1)")
    _positive(e, "trainer.epochs", t.epochs)
    if t.total_steps is not None:
        _positive(e, "trainer.total_steps", t.total_steps)
    _positive(e, "trainer.test_freq", t.test_freq, allow_minus_one=True)
    _choice(e, "trainer.device", t.device, DEVICES)
    _choice(e, "trainer.fused_linear_logprob_backend", t.fused_linear_logprob_backend, LOGPROB_BACKENDS)
    if t.logprobs_chunk_size is not None:
        _positive(e, "trainer.logprobs_chunk_size", t.logprobs_chunk_size)
    _positive(e, "trainer.tensor_parallel_size", t.tensor_parallel_size)
    _positive(e, "trainer.max_tokens_per_micro_batch", t.max_tokens_per_micro_batch)
    for lg in t.logger:
        _choice(e, "trainer.logger", lg, LOGGERS)
    if e:
        raise ConfigError("invalid SFT configuration:\n  - " + "\n  - ".join(e))


def to_container(cfg: DictConfig) -> dict:
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
