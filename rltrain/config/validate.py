"""Value rules for a composed config: ranges, allowed names and cross-field rules, one validator per section.

Runs before anything starts (no Ray, no model); every error names the key, the value and what is allowed.

What is checked where (config/ imports no rollout/, workers/, trainer/, models/ or plan/: docs/architecture.md):
- here, pure rules on the keys: ranges (finite numbers), seeds in numpy's range, allowed names whose owner config/
  may import (algorithms/ registries, rewards/, ops.logprob.BACKENDS, config/presets.py, utils/lr_schedule.py,
  config/schema.py's recompute and fusion names, utils/tracking.LOGGERS),
  model shapes the overrides can build, a 'module:function' estimator importable, cross-field rules;
- by the rooms that own the rule, called from trainer/setup.py `check_config` after these (one report): the rollout
  engine names and tool patterns (rollout/), the vLLM head_dim rules (compat/vllm.py), the placement and
  rollout.engines_per_gpu rules (workers/placement.py, which asks config/parallel.py's ParallelDims for the rules of
  the degrees of parallelism over the training group), and whether trainer.device=cuda has a GPU.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterable

from rltrain.config.distill import distill_errors
from rltrain.config.presets import BUILTINS, shape_errors
from rltrain.config.scale_rules import scale_errors
from rltrain.config.schema import (ELEMENTWISE_FUSIONS, RECOMPUTE_GRANULARITIES, RECOMPUTE_MODULES, OffPolicyConfig,
                                   RLConfig, SFTConfig, resolve_targets)
from rltrain.config.true_on_policy import true_on_policy_errors
from rltrain.utils.errors import UserError, nearest


class ConfigError(UserError, ValueError):
    """A user-fixable problem in the configuration."""


# Names whose owner config/ may not import, so they are stated here; tests/config/test_copied_names.py checks each
# against its owner. trainer.device: workers/hybrid.resolve_device (workers/) and models/megatron/compat.torch_device;
# trainer.plan_check: trainer/setup.plan_check; data.source: trainer/setup.build_datasets (trainer/); model.dtype:
# a torch dtype by name, read by workers/hybrid.py and trainer/sft.py, which models/megatron/build.py and the
# planner (plan/inputs.py: 2 or 4 bytes) support. No room below config/ holds a table of any of them.
TRAINER_DEVICES = ("auto", "cpu", "cuda")
PLAN_CHECKS = ("error", "warn", "off")
DATA_SOURCES = ("file", "synthetic")
MODEL_DTYPES = ("bfloat16", "float32")
BUILTIN_MODELS = tuple(BUILTINS)  # the presets of rltrain/config/presets.py
SEED_MAX = 2**32 - 1  # numpy's seeds are in [0, 2**32 - 1]


def _is_dotted_path(name: str) -> bool:
    return ":" in name


def _choice(errors: list, key: str, value: Any, allowed: Iterable[str], *, dotted_ok: bool = False) -> None:
    allowed = tuple(allowed)
    if isinstance(getattr(errors, "allowed", None), dict):  # rltrain/config_reference.py records what each key allows
        errors.allowed[key] = allowed + (("a 'module:function' path",) if dotted_ok else ())
    if value in allowed or (dotted_ok and isinstance(value, str) and _is_dotted_path(value)):
        return
    extra = " or a 'module:function' path" if dotted_ok else ""
    near = nearest(value, list(allowed)) if isinstance(value, str) else []
    errors.append(f"{key}={value!r} is not allowed; {f'did you mean {near[0]}? ' if near else ''}choose one of "
                  f"{', '.join(allowed)}{extra}")


def _finite(errors: list, key: str, value: Any) -> bool:
    if isinstance(value, float) and not math.isfinite(value):
        errors.append(f"{key}={value} is not a finite number")
        return False
    return True


def _positive(errors: list, key: str, value: Any, *, allow_zero: bool = False, allow_minus_one: bool = False) -> None:
    if value is None:
        errors.append(f"{key} must be set")
        return
    if allow_minus_one and value == -1:
        return
    if not _finite(errors, key, value):
        return
    ok = value >= 0 if allow_zero else value > 0
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        tail = " (or -1 to disable)" if allow_minus_one else ""
        errors.append(f"{key}={value} is impossible; it must be {bound}{tail}")


def _range(errors: list, key: str, value: float, lo: float, hi: float) -> None:
    if not (lo <= value <= hi):  # NaN fails too
        errors.append(f"{key}={value} is out of range; it must be in [{lo}, {hi}]")


def _seed(errors: list, key: str, value: int) -> None:
    if not 0 <= value <= SEED_MAX:
        errors.append(f"{key}={value} is out of range; a seed must be in [0, 2**32 - 1] (numpy's range)")


# ---------------------------------------------------------------------------- shared groups (schema.py)

def _optimizer(e: list, prefix: str, o) -> None:
    """An OptimizerConfig's keys under `prefix` (actor, critic, optim)."""
    from rltrain.utils.lr_schedule import LR_SCHEDULES

    _positive(e, f"{prefix}.lr", o.lr)
    _positive(e, f"{prefix}.weight_decay", o.weight_decay, allow_zero=True)
    _positive(e, f"{prefix}.grad_clip", o.grad_clip)
    _positive(e, f"{prefix}.eps", o.eps)
    _positive(e, f"{prefix}.lr_warmup_steps", o.lr_warmup_steps, allow_zero=True)
    _choice(e, f"{prefix}.lr_schedule", o.lr_schedule, LR_SCHEDULES)
    _range(e, f"{prefix}.min_lr_ratio", o.min_lr_ratio, 0.0, 1.0)
    _range(e, f"{prefix}.optimizer_offload_fraction", o.optimizer_offload_fraction, 0.0, 1.0)
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        e.append(f"{prefix}.betas={list(o.betas)} must be two numbers in [0, 1)")


def _logprob_head(e: list, prefix: str, t) -> None:
    """A LogprobHeadConfig's keys under `prefix` (trainer of RL and SFT); the backends are ops/logprob.py's."""
    from rltrain.ops.logprob import BACKENDS

    _choice(e, f"{prefix}.fused_linear_logprob_backend", t.fused_linear_logprob_backend, ("auto", *BACKENDS))
    if t.logprobs_chunk_size is not None:
        _positive(e, f"{prefix}.logprobs_chunk_size", t.logprobs_chunk_size)


def _model(e: list, m, key: str = "model") -> None:  # a ModelConfig's keys under `key` (model, teacher)
    if m.builtin is None and not m.path:
        e.append(f"{key}.path is not set; give an HF model id or local directory, or set {key}.builtin="
                 f"{'|'.join(BUILTIN_MODELS)}")
    if m.builtin is not None:
        _choice(e, f"{key}.builtin", m.builtin, BUILTIN_MODELS)
        if m.builtin in BUILTINS:
            e.extend(shape_errors({**BUILTINS[m.builtin], **(m.overrides or {})}, key=f"{key}.overrides"))
    _choice(e, f"{key}.dtype", m.dtype, MODEL_DTYPES)


# ---------------------------------------------------------------------------- RL sections (RLConfig)
def _rollout(e: list, cfg) -> None:
    r = cfg.rollout
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
    if r.kv_cache_memory_gb is not None and not (r.kv_cache_memory_gb > 0 and math.isfinite(r.kv_cache_memory_gb)):
        e.append(f"rollout.kv_cache_memory_gb={r.kv_cache_memory_gb} must be a positive number of GiB, or null "
                 "(sized by rollout.gpu_memory_utilization)")
    _positive(e, "rollout.tensor_parallel_size", r.tensor_parallel_size)
    _positive(e, "rollout.engines_per_gpu", r.engines_per_gpu)
    mt = r.multi_turn
    if mt.enable:
        _positive(e, "rollout.multi_turn.max_turns", mt.max_turns)
        _positive(e, "rollout.multi_turn.max_total_tokens", mt.max_total_tokens)
        _positive(e, "rollout.multi_turn.tool_timeout_s", mt.tool_timeout_s)
        _positive(e, "rollout.multi_turn.tool_memory_mb", mt.tool_memory_mb)
        _positive(e, "rollout.multi_turn.tool_max_workers", mt.tool_max_workers)


def _routing_replay(e: list, cfg) -> None:
    """Where actor.moe_routing_replay=true cannot apply (the model's being MoE is checked where it is built)."""
    a, r = cfg.actor, cfg.rollout
    why = []
    if r.multi_turn.enable:
        why.append("rollout.multi_turn.enable=true (the routing of tool turns is not collected yet)")
    if a.pipeline_parallel_size > 1 or a.tensor_parallel_size > 1:
        why.append("actor.pipeline_parallel_size / tensor_parallel_size > 1 (replay is wired for whole layer stacks "
                   "and full sequences per rank; split the experts with actor.expert_parallel_size)")
    if r.engine == "vllm" and cfg.trainer.device == "cpu":
        why.append("rollout.engine=vllm on CPU (vLLM's CPU build returns no routed experts; rollout.engine=hf does)")
    if why:
        e.append("actor.moe_routing_replay=true is not supported with " + "; ".join(why)
                 + "; set actor.moe_routing_replay=false")


def _actor(e: list, cfg) -> None:
    from rltrain.algorithms import (
        AGG_MODES,
        KL_KINDS,
        OFF_POLICY_MODES,
        POLICY_LOSS_MODES,
        TIS_MODES,
        check_off_policy_args,
    )

    a, d = cfg.actor, cfg.data
    _optimizer(e, "actor", a)
    _positive(e, "actor.ppo_epochs", a.ppo_epochs)
    _positive(e, "actor.ppo_mini_batch_size", a.ppo_mini_batch_size)
    _positive(e, "actor.max_tokens_per_micro_batch", a.max_tokens_per_micro_batch)
    if a.log_prob_max_tokens_per_micro_batch is not None:
        _positive(e, "actor.log_prob_max_tokens_per_micro_batch", a.log_prob_max_tokens_per_micro_batch)
    _choice(e, "actor.loss_mode", a.loss_mode, POLICY_LOSS_MODES)
    _choice(e, "actor.loss_agg_mode", a.loss_agg_mode, AGG_MODES)
    _range(e, "actor.clip_low", a.clip_low, 0.0, 1.0)
    _positive(e, "actor.clip_high", a.clip_high, allow_zero=True)
    if a.dual_clip is not None and not (1.0 < a.dual_clip < math.inf):
        e.append(f"actor.dual_clip={a.dual_clip} is impossible; it must be > 1 and finite (or null to disable)")
    _positive(e, "actor.entropy_coef", a.entropy_coef, allow_zero=True)
    _positive(e, "actor.kl_loss_coef", a.kl_loss_coef, allow_zero=True)
    _choice(e, "actor.kl_loss_type", a.kl_loss_type, KL_KINDS)
    _choice(e, "actor.recompute_granularity", a.recompute_granularity, RECOMPUTE_GRANULARITIES)
    for mod in a.recompute_modules:
        _choice(e, "actor.recompute_modules[]", mod, RECOMPUTE_MODULES)
    _choice(e, "actor.elementwise_fusion", a.elementwise_fusion, ELEMENTWISE_FUSIONS)
    _positive(e, "actor.grad_reduce_bucket_mb", a.grad_reduce_bucket_mb)
    _positive(e, "actor.tensor_parallel_size", a.tensor_parallel_size)
    _positive(e, "actor.pipeline_parallel_size", a.pipeline_parallel_size)
    _positive(e, "actor.expert_parallel_size", a.expert_parallel_size)
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if not 0.0 <= getattr(a, key) < math.inf:
            e.append(f"actor.{key}={getattr(a, key)} is impossible; it must be >= 0 and finite (0 = off)")
    if a.moe_routing_replay:
        _routing_replay(e, cfg)
    _choice(e, "actor.tis.mode", a.tis.mode, TIS_MODES)
    if not 1.0 <= a.tis.cap < math.inf:
        e.append(f"actor.tis.cap={a.tis.cap} is impossible; it must be >= 1 and finite (the ratio's upper truncation)")
    op = OffPolicyConfig.effective(a, async_rollout=cfg.trainer.async_rollout) if a.off_policy.mode is None \
        else a.off_policy  # null: the mode it stands for, whose arguments are checked
    _choice(e, "actor.off_policy.mode", op.mode, OFF_POLICY_MODES)
    if a.tis.enable and a.off_policy.mode not in (None, "none"):
        e.append(f"actor.tis.enable=true and actor.off_policy.mode={op.mode!r} both set an off-policy correction; "
                 "set only one (actor.tis.enable=true is actor.off_policy.mode=token_tis or seq_tis)")
    elif op.mode in OFF_POLICY_MODES:
        for key in ("cap", "low", "high"):
            _finite(e, f"actor.off_policy.{key}", getattr(op, key))
        try:  # the owner's rules for the arguments the mode uses (algorithms/off_policy.py)
            check_off_policy_args(op.mode, cap=op.cap, low=op.low, high=op.high)
        except ValueError as err:  # it names the parameter ("off-policy low=0.0 must ...")
            key = next((k for k in ("cap", "low", "high") if f"off-policy {k}=" in str(err)), None)
            e.append(f"actor.off_policy.{key}: {err}" if key else f"actor.off_policy: {err}")
    if d.train_batch_size > 0 and a.ppo_mini_batch_size > d.train_batch_size:
        e.append(f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} is larger than the batch "
                 f"(data.train_batch_size={d.train_batch_size}); it must be <= data.train_batch_size")
    _lora(e, cfg)


def _lora(e: list, cfg) -> None:
    """actor.lora.*: ranges, PEFT target names, and the rollout engines that can hold adapters."""
    from rltrain.compat.vllm import LORA_RANK_SLOTS

    lo = cfg.actor.lora
    if not isinstance(lo.rank, int) or lo.rank < 0:
        e.append(f"actor.lora.rank={lo.rank} is impossible; it must be an integer >= 0 (0 = off: full fine-tuning)")
        return
    if not lo.rank:
        return
    if not 0.0 < lo.alpha < math.inf:
        e.append(f"actor.lora.alpha={lo.alpha} is impossible; it must be > 0 and finite (the scale is alpha / rank)")
    if not 0.0 <= lo.dropout < 1.0:
        e.append(f"actor.lora.dropout={lo.dropout} is impossible; it must be in [0, 1)")
    try:
        resolve_targets(lo.target_modules)
    except ValueError as err:
        e.append(str(err))
    r = cfg.rollout
    if r.engine == "vllm" and r.engines_per_gpu > 1:
        e.append(f"actor.lora.rank={lo.rank} with rollout.engines_per_gpu={r.engines_per_gpu}: the adapters are "
                 "loaded into vLLM from the trainer's process memory, which engines in processes of their own cannot "
                 "read; set rollout.engines_per_gpu=1")
    if r.engine == "vllm" and lo.rank > LORA_RANK_SLOTS[-1]:
        e.append(f"actor.lora.rank={lo.rank} is above vLLM's largest LoRA rank ({LORA_RANK_SLOTS[-1]})")


def _critic(e: list, cfg) -> None:
    from rltrain.algorithms import AGG_MODES

    c = cfg.critic
    _optimizer(e, "critic", c)
    _positive(e, "critic.ppo_epochs", c.ppo_epochs)
    _positive(e, "critic.value_clip", c.value_clip)
    _choice(e, "critic.loss_agg_mode", c.loss_agg_mode, AGG_MODES)
    _positive(e, "critic.max_tokens_per_micro_batch", c.max_tokens_per_micro_batch)


def _algorithm(e: list, cfg) -> None:
    from rltrain.algorithms import ADV_ESTIMATORS, KL_KINDS, get_advantage_estimator

    al, r = cfg.algorithm, cfg.rollout
    _choice(e, "algorithm.adv_estimator", al.adv_estimator, ADV_ESTIMATORS, dotted_ok=True)
    if _is_dotted_path(al.adv_estimator):
        try:  # imported now, so a typo fails here and not at the first step's advantages
            get_advantage_estimator(al.adv_estimator)
        except ValueError as err:
            e.append(f"algorithm.adv_estimator={al.adv_estimator!r}: {err}")
    _range(e, "algorithm.gamma", al.gamma, 0.0, 1.0)
    _range(e, "algorithm.lam", al.lam, 0.0, 1.0)
    _choice(e, "algorithm.kl_penalty", al.kl_penalty, KL_KINDS)
    _positive(e, "algorithm.kl_coef", al.kl_coef, allow_zero=True)
    _positive(e, "algorithm.dynamic_sampling.max_tries", al.dynamic_sampling.max_tries)
    if al.overlong.enable:
        _positive(e, "algorithm.overlong.buffer_len", al.overlong.buffer_len)
        _finite(e, "algorithm.overlong.penalty_factor", al.overlong.penalty_factor)
        if al.overlong.buffer_len >= r.max_response_length:
            e.append(f"algorithm.overlong.buffer_len={al.overlong.buffer_len} must be smaller than "
                     f"rollout.max_response_length={r.max_response_length}")


def _reward(e: list, cfg) -> None:
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


def _data(e: list, cfg) -> None:
    d = cfg.data
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
        _seed(e, "data.synthetic.seed", d.synthetic.seed)


def _trainer(e: list, cfg) -> None:
    from rltrain.utils.tracking import LOGGERS

    t = cfg.trainer
    _seed(e, "trainer.seed", t.seed)
    _positive(e, "trainer.total_steps", t.total_steps)
    _positive(e, "trainer.save_freq", t.save_freq, allow_minus_one=True)
    _positive(e, "trainer.test_freq", t.test_freq, allow_minus_one=True)
    _logprob_head(e, "trainer", t)
    _choice(e, "trainer.device", t.device, TRAINER_DEVICES)
    _choice(e, "trainer.plan_check", t.plan_check, PLAN_CHECKS)
    for lg in t.logger:
        _choice(e, "trainer.logger", lg, LOGGERS)
    bad = [s for s in t.profile_steps if isinstance(s, bool) or not isinstance(s, int)
           or not 1 <= s <= (t.total_steps or 0)]
    if bad:
        e.append(f"trainer.profile_steps={list(t.profile_steps)}: each must be a step number from 1 to "
                 f"trainer.total_steps={t.total_steps} (got {', '.join(map(repr, bad))})")
    if t.resume not in ("auto", "never") and not os.path.exists(t.resume):
        e.append(f"trainer.resume={t.resume!r}: use auto, never, or an existing checkpoint directory")
    for key in ("max_ckpt_to_keep", "n_gpus_per_node", "nnodes", "max_staleness"):
        _positive(e, f"trainer.{key}", getattr(t, key))
    if t.max_staleness != 1 and not t.async_rollout:
        e.append(f"trainer.max_staleness={t.max_staleness} bounds how many batches asynchronous rollout generates "
                 "ahead; a synchronous run trains every batch fresh: set trainer.async_rollout=true (with "
                 "trainer.colocate=false) or leave trainer.max_staleness at 1")
    if t.async_rollout and t.colocate:
        e.append("trainer.async_rollout=true overlaps generation with training on separate workers; it needs "
                 "split placement: set trainer.colocate=false (or trainer.async_rollout=false)")
    if t.async_rollout and not t.use_ray:
        e.append("trainer.async_rollout=true needs Ray (trainer.use_ray=true): the in-process worker cannot "
                 "generate and train at once")
    _partial(e, cfg)
    e.extend(true_on_policy_errors(cfg))
    _step_levers(e, cfg)


def _step_levers(e: list, cfg) -> None:
    """rollout.free_cache_engine=false and actor.recompute_old_logprobs=false: where each is meaningful and exact."""
    a, t, d = cfg.actor, cfg.trainer, cfg.data
    if not cfg.rollout.free_cache_engine and not t.colocate and t.use_ray:
        e.append("rollout.free_cache_engine=false keeps a colocated rollout engine awake through the training phases; "
                 "with trainer.colocate=false the engines have GPUs of their own and never sleep: leave "
                 "rollout.free_cache_engine=true (or set trainer.colocate=true)")
    if a.recompute_old_logprobs:
        return
    why = []
    if a.ppo_epochs != 1 or a.ppo_mini_batch_size != d.train_batch_size:
        why.append(f"an update of more than one mini-batch or epoch (actor.ppo_epochs={a.ppo_epochs}, "
                   f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size}, data.train_batch_size={d.train_batch_size}; "
                   "it needs actor.ppo_epochs=1 and actor.ppo_mini_batch_size=data.train_batch_size: later mini-batches "
                   "would see weights the first one moved)")
    if cfg.algorithm.use_kl_in_reward:
        why.append("algorithm.use_kl_in_reward=true (the reward's KL penalty reads the old log-probs before the update)")
    if a.pipeline_parallel_size > 1:
        why.append(f"actor.pipeline_parallel_size={a.pipeline_parallel_size} (the update's log-probs live on the last "
                   "stage only)")
    if why:
        e.append("actor.recompute_old_logprobs=false takes the old log-probs from the update's own forward, exact only "
                 "for a strictly on-policy update; not with " + "; ".join(why)
                 + ": set actor.recompute_old_logprobs=true")


def _partial(e: list, cfg) -> None:
    """rollout.partial: where a weight push can pause generations in flight (rollout/partial.py)."""
    r, t = cfg.rollout, cfg.trainer
    _positive(e, "rollout.partial_chunk_tokens", r.partial_chunk_tokens)
    if not r.partial:
        return
    if not t.async_rollout:
        e.append("rollout.partial=true continues generations in flight across a weight push, which only asynchronous "
                 "rollout makes (a synchronous run pushes between whole generations): set trainer.async_rollout=true "
                 "(with trainer.colocate=false) or rollout.partial=false")
    if r.multi_turn.enable:
        e.append("rollout.partial=true is not supported with rollout.multi_turn.enable=true (a tool loop's turns are "
                 "not chunked): set rollout.partial=false")
    if r.tensor_parallel_size > 1 or r.engines_per_gpu > 1:
        e.append(f"rollout.partial=true pauses one engine per rollout worker between two chunks; with "
                 f"rollout.tensor_parallel_size={r.tensor_parallel_size} and rollout.engines_per_gpu="
                 f"{r.engines_per_gpu} the engine's ranks or pool would pause at different chunks: set both to 1 "
                 "or rollout.partial=false")


# one validator per section of RLConfig, in report order
RL_VALIDATORS: dict[str, Callable[[list, Any], None]] = {
    "model": lambda e, cfg: (_model(e, cfg.model), e.extend(scale_errors(cfg))), "rollout": _rollout, "actor": _actor,
    "critic": _critic,
    "algorithm": _algorithm, "reward": _reward, "data": _data, "trainer": _trainer,
    "teacher": lambda e, cfg: e.extend(distill_errors(cfg, _model)),  # its placement: workers/placement.py
}


def config_errors(cfg: RLConfig) -> list[str]:
    """Every problem the pure rules find in the typed RLConfig `cfg` (as_config made it, refusing unknown keys)."""
    e: list[str] = []
    for check in RL_VALIDATORS.values():
        check(e, cfg)
    return e


def validate_config(cfg: RLConfig) -> None:
    """Raise ConfigError listing every problem the pure rules find in the typed RLConfig `cfg`. The rooms' own
    checks follow in trainer/setup.py `check_config`."""
    raise_errors(config_errors(cfg))


def raise_errors(errors: list[str], what: str = "configuration") -> None:
    if errors:
        raise ConfigError(f"invalid {what}:\n  - " + "\n  - ".join(errors))


# ---------------------------------------------------------------------------- SFT sections (SFTConfig)

def _sft_data(e: list, cfg) -> None:
    d = cfg.data
    if not d.train_files:
        e.append("data.train_files is empty; give one or more .jsonl/.parquet files of chat rows "
                 "({\"messages\": [...]}); see rltrain/data/sft_data.py")
    _positive(e, "data.max_length", d.max_length)
    _positive(e, "data.batch_size", d.batch_size)


def _sft_trainer(e: list, cfg) -> None:
    from rltrain.utils.tracking import LOGGERS

    t = cfg.trainer
    _seed(e, "trainer.seed", t.seed)
    _positive(e, "trainer.epochs", t.epochs)
    if t.total_steps is not None:
        _positive(e, "trainer.total_steps", t.total_steps)
    _positive(e, "trainer.test_freq", t.test_freq, allow_minus_one=True)
    _positive(e, "trainer.save_freq", t.save_freq, allow_minus_one=True)
    if t.resume not in ("auto", "never") and not os.path.exists(t.resume):
        e.append(f"trainer.resume={t.resume!r}: use auto, never, or an existing checkpoint directory")
    _positive(e, "trainer.max_ckpt_to_keep", t.max_ckpt_to_keep)
    _choice(e, "trainer.device", t.device, TRAINER_DEVICES)
    _logprob_head(e, "trainer", t)
    _positive(e, "trainer.tensor_parallel_size", t.tensor_parallel_size)
    _positive(e, "trainer.max_tokens_per_micro_batch", t.max_tokens_per_micro_batch)
    for lg in t.logger:
        _choice(e, "trainer.logger", lg, LOGGERS)


SFT_VALIDATORS: dict[str, Callable[[list, Any], None]] = {
    "model": lambda e, cfg: _model(e, cfg.model), "data": _sft_data,
    "optim": lambda e, cfg: _optimizer(e, "optim", cfg.optim), "trainer": _sft_trainer,
}


def validate_sft_config(cfg: SFTConfig) -> None:
    """Raise ConfigError listing every problem found in the typed SFTConfig `cfg` (rltrain.sft)."""
    e: list[str] = []
    for check in SFT_VALIDATORS.values():
        check(e, cfg)
    raise_errors(e, "SFT configuration")
