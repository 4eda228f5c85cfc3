"""The structured config schema: one small typed dataclass per component, registered in Hydra's ConfigStore.

Types are checked by OmegaConf when YAML and command-line overrides are merged (unknown key or wrong type
fails at composition); value rules (ranges, allowed names, cross-field rules) live in `validate.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, TypeVar

from hydra.core.config_store import ConfigStore


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

    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    grad_clip: float = 1.0
    lr_warmup_steps: int = 0
    lr_schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0


@dataclass
class ParallelConfig(Section):
    """Model parallelism of the trained engines (actor.*; the critic and reference share the actor's)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Mixture-of-Experts models: experts split over this many ranks (it divides the data-parallel size; each
    # expert's matrices are split over the tensor-parallel ranks as the dense MLP's)
    expert_parallel_size: int = 1
    # data parallel > 1: grads averaged in buckets of this many MiB (one all-reduce each), started during the
    # last micro-batch's backward when overlap_grad_reduce (models/megatron/grad_reduce.py)
    grad_reduce_bucket_mb: float = 64.0
    overlap_grad_reduce: bool = True


@dataclass
class MoEConfig(Section):
    """The router of a Mixture-of-Experts actor (actor.*; ignored by dense models)."""

    # load-balancing loss (Switch/GShard, per micro-batch) and router z-loss added to the actor's loss; 0 = off.
    # RL starts from a trained router: the peers' RL recipes keep both off or tiny
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    # the experts' GEMMs as one torch._grouped_mm per projection over all local experts (megatron's SequentialMLP,
    # used without Transformer Engine, loops over them); false: megatron's loop
    moe_grouped_gemm: bool = True


# The allowed values of LayerComputeConfig's keys, named once here (validate.py checks them; models/megatron implements
# each: build.py the recompute options, fusion.py one function per fusion).
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_MODULES = ("mlp", "core_attn")  # megatron's "layernorm" too where Transformer Engine is installed
ELEMENTWISE_FUSIONS = ("none", "mcore", "compile")


@dataclass
class LayerComputeConfig(Section):
    """How a trained engine's layers run forward/backward (actor.*; the critic and SFT keep these defaults)."""

    # full activation recomputation (one layer at a time): long-context updates need it on GPU
    recompute_activations: bool = False
    # full: whole layers; selective: only recompute_modules (mlp, core_attn) of each layer (less memory
    # saved, much less recomputed; docs/benchmarks/update.md)
    recompute_granularity: str = "full"
    recompute_modules: List[str] = field(default_factory=lambda: ["mlp"])
    # none | mcore (megatron's fused SwiGLU + bias-dropout-add) | compile (torch.compile of each layer)
    elementwise_fusion: str = "none"


@dataclass
class LogprobHeadConfig(Section):
    """The loss path's LM head (trainer.* of RL and SFT): fused log-probs from the hidden states (ops/logprob.py)."""

    fused_linear_logprob: bool = True
    fused_linear_logprob_backend: str = "auto"  # auto | ops.logprob.BACKENDS
    logprobs_chunk_size: Optional[int] = None  # tokens; null picks from a memory budget


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
    target_modules: List[str] = field(default_factory=lambda: ["all"])


@dataclass
class ModelConfig:
    # HF model id or local directory (config + safetensors + tokenizer). Ignored when `builtin` is set.
    path: Optional[str] = None
    # Built-in architecture preset with random init and no download: "tiny" (CPU default), "small" (~55M, the
    # learning recipe's) or "qwen3-0.6b" (Qwen3-0.6B's real shapes and vocab, random weights; GPU benchmarks).
    builtin: Optional[str] = None
    # Tokenizer: "char" (built-in character tokenizer), an HF id/dir, or null (same as `path`).
    tokenizer: Optional[str] = None
    # Overrides applied to the HF config (e.g. {num_hidden_layers: 2}).
    overrides: Dict[str, Any] = field(default_factory=dict)
    # Parameter dtype on GPU: "bfloat16" | "float32". CPU always trains in float32.
    dtype: str = "bfloat16"
    # Run the Python code a model or tokenizer directory ships (auto_map) when transformers loads it: only for code you
    # have read and trust. false refuses such a directory (never asks on stdin).
    trust_remote_code: bool = False


@dataclass
class TeacherConfig(ModelConfig):
    """On-policy distillation's frozen teacher (workers/teacher.py), served like the reference; on when `path` or
    `builtin` is set. path: an HF model directory or id, or an rltrain checkpoint (<run>/checkpoints/step_N, built from
    its run's config.json); builtin + overrides: a preset (random init, for timing); the student's vocabulary."""

    colocate: bool = True  # a role of the training workers (the actor's TP/PP); false: a Ray group of its own
    n_gpus_per_node: int = 1
    tensor_parallel_size: Optional[int] = None  # null: the actor's
    pipeline_parallel_size: Optional[int] = None  # null: the actor's
    log_prob_max_tokens_per_micro_batch: Optional[int] = None  # null: the actor's forward budget

    @staticmethod
    def enabled(teacher: TeacherConfig) -> bool:
        """Whether distillation is on (teacher.path or teacher.builtin set)."""
        return teacher.path is not None or teacher.builtin is not None


@dataclass
class MultiTurnConfig:
    enable: bool = False
    max_turns: int = 4
    # "code_block" (```python ... ```), "code_tag" (<code>...</code>) or a regex with one group.
    tool_pattern: str = "code_block"
    max_total_tokens: int = 2048
    tool_timeout_s: float = 5.0
    tool_memory_mb: int = 512
    tool_max_workers: int = 4


@dataclass
class SandboxConfig:
    """Where model-written tool code runs (rltrain/sandbox): behind namespaces + Landlock + seccomp."""

    # Run tool code even where the kernel cannot isolate it (no user namespaces, Landlock or seccomp): only an
    # audit hook, which is no security boundary, then stands between it and your files. Off: calls are refused.
    allow_unisolated: bool = False
    # Let tool code run the system's programs (execve); they stay confined to its temp dir. Off: refused.
    allow_exec: bool = False


@dataclass
class RolloutConfig:
    engine: str = "hf"  # hf | vllm
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_response_length: int = 512
    stop: List[str] = field(default_factory=list)
    # vLLM-only knobs
    gpu_memory_utilization: float = 0.5
    # GPU: a fixed KV cache (GiB) instead of vLLM's memory profiling, which assumes no other process on the GPU
    # changes its memory while the engine starts (several runs sharing one GPU); null: what the engine can ever use
    # when that is under half its share (small models; rollout/vllm.py auto_kv_cache_bytes), else by the fraction
    kv_cache_memory_gb: Optional[float] = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    # colocated vLLM on one GPU (tensor_parallel_size 1): engines sharing the GPU, each in its own process with
    # 1/k of gpu_memory_utilization and 1/k of the batch, weights by CUDA IPC (rollout/pool.py: vLLM's host work
    # per request bounds one engine at small models); 1: one engine in the trainer's process
    engines_per_gpu: int = 1
    # HF engine: max sequences decoded together
    max_batch_size: int = 256
    # split placement (trainer.colocate=false): rollout replicas of tensor_parallel_size devices each;
    # null: as many devices as the training group (workers/placement.py)
    num_replicas: Optional[int] = None
    # weight sync from actor to rollout, streamed in buckets of this size
    weight_sync_bucket_mb: int = 256
    # validation sampling
    val_temperature: float = 0.0
    val_n: int = 1
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    # partial rollouts (trainer.async_rollout): generation in chunks of partial_chunk_tokens new tokens; a weight
    # push pauses the generations in flight between two chunks, loads the new weights, and they continue from the
    # tokens already made (log-probs and per-token versions kept; rollout/partial.py)
    partial: bool = False
    partial_chunk_tokens: int = 64
    # true on-policy: the engine and the actor compute each sampled token's log-prob with the same arithmetic, so
    # rollout/logprob_diff_max is exactly 0; the log-prob is of the distribution sampled from (top_k/top_p applied)
    true_on_policy: bool = False
    # colocated: the engine sleeps (frees its weights and KV cache) while the actor computes log-probs and trains, and
    # wakes up for the weight push; false keeps it awake through the step (no sleep, no wake-up: faster, but its
    # weights + KV cache stay on the GPU beside the training phases; the weights are still reloaded in place)
    free_cache_engine: bool = True


@dataclass
class TISConfig:
    # Truncated importance sampling (off-policy correction): each token's policy loss is weighted by
    # min(pi_old / pi_sampler, cap), the sampler's log-probs being the behaviour policy. Corrects the
    # training/inference mismatch and, with trainer.async_rollout, the rollout's staleness.
    enable: bool = False
    cap: float = 2.0  # upper truncation C >= 1 (2.0 as in verl / slime)
    mode: str = "token"  # token (one ratio per token) | sequence (the product over the response)


@dataclass
class OffPolicyConfig:
    # Off-policy correction of the policy loss against the sampler's log-probs: one of
    # algorithms/off_policy.py's OFF_POLICY_MODES, `none` or <unit>_<correction> with unit token | seq | geo
    # (the ratio pi_old/pi_sampler of each token, of the row's product, of the row's geometric mean) and
    # correction tis (weight min(ratio, cap)) | mask (weight 1 inside [low, high], the unit dropped outside) |
    # mis (weight ratio inside [low, high], dropped outside). Dropped tokens keep their place in the loss's
    # denominator. actor.tis.enable=true stands for token_tis / seq_tis with actor.tis.cap (`effective`).
    # null: ASYNC_DEFAULT with trainer.async_rollout=true, none otherwise (the choice and its measurements:
    # docs/benchmarks/offpolicy.md)
    mode: Optional[str] = None
    cap: float = 2.0  # *_tis: upper truncation C >= 1
    low: float = 0.5  # *_mask, *_mis: the kept band [low, high], 0 < low <= 1 <= high (IcePop's 0.5 and 5)
    high: float = 5.0

    # the correction of an asynchronous run that names none: of the ten modes at 4 batches in flight (grpo_tiny,
    # vLLM, split 1+1, two seeds) the geometric-mean ratio ones kept their accuracy, the token and sequence ones fell
    ASYNC_DEFAULT = "geo_tis"

    @staticmethod
    def effective(actor: ActorConfig, *, async_rollout: bool) -> OffPolicyConfig:
        """The off-policy correction a run applies: actor.off_policy (null mode: ASYNC_DEFAULT when the rollout is
        asynchronous, else none), or what actor.tis stands for when actor.tis.enable (validate.py refuses a config
        that sets both). The one place actor.tis and the null mode are mapped."""
        tis, op = actor.tis, actor.off_policy
        if not tis.enable:
            if op.mode is None:
                return OffPolicyConfig(mode=OffPolicyConfig.ASYNC_DEFAULT if async_rollout else "none", cap=op.cap,
                                       low=op.low, high=op.high)
            return op
        modes = {"token": "token_tis", "sequence": "seq_tis"}  # actor.tis.mode -> off-policy mode
        if tis.mode not in modes:
            raise ValueError(f"actor.tis.mode={tis.mode!r} is not allowed; choose one of {', '.join(modes)}")
        return OffPolicyConfig(mode=modes[tis.mode], cap=tis.cap, low=op.low, high=op.high)


@dataclass
class ActorConfig(OptimizerConfig, ParallelConfig, LayerComputeConfig, MoEConfig):
    # optimizer keys: OptimizerConfig; tensor/pipeline/expert_parallel_size, grad_reduce_bucket_mb,
    # overlap_grad_reduce: ParallelConfig; recompute_*, elementwise_fusion: LayerComputeConfig; moe_*: MoEConfig
    ppo_epochs: int = 1
    # mini-batch size in prompts (each prompt contributes rollout.n samples); one optimizer step each
    ppo_mini_batch_size: int = 16
    max_tokens_per_micro_batch: int = 16384
    # the token budget of a micro-batch in the forward-only passes (old log-probs, the reference's); null: the
    # update's max_tokens_per_micro_batch. A forward keeps no activations for a backward, so it can take more tokens
    # at once, and each micro-batch costs a fixed host time (a small model's forward at short rows is host-bound)
    log_prob_max_tokens_per_micro_batch: Optional[int] = None
    loss_mode: str = "ppo"  # ppo | gspo | cispo
    loss_agg_mode: str = "token-mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None
    entropy_coef: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    tis: TISConfig = field(default_factory=TISConfig)
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    # rollout routing replay (MoE actors, docs/moe.md): the rollout engine returns the experts it routed each token
    # to, and the actor's old-log-prob and update forwards route through them; null: on where it was measured to
    # help (MoE with rollout.engine=vllm on GPU), off elsewhere
    moe_routing_replay: Optional[bool] = None
    # true: a no-grad pass computes the old log-probs before the update (timing_s/old_log_prob); false, for a strictly
    # on-policy update (ppo_epochs 1, one mini-batch of the whole step, nothing reading them before the update): the
    # update's own forward gives them, detached (same weights: ratio 1 exactly), and the pass is skipped
    recompute_old_logprobs: bool = True
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class CriticConfig(OptimizerConfig):
    lr: float = 1e-5  # the other optimizer keys: OptimizerConfig's
    ppo_epochs: int = 1
    value_clip: float = 0.5
    loss_agg_mode: str = "token-mean"
    max_tokens_per_micro_batch: int = 16384


@dataclass
class DynamicSamplingConfig:
    enable: bool = False
    max_tries: int = 4


@dataclass
class OverlongConfig:
    enable: bool = False
    buffer_len: int = 64
    penalty_factor: float = 1.0


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "k1"
    kl_coef: float = 0.001
    mask_truncated_responses: bool = False
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    # with teacher.*: advantage += distill_coef * (log pi_teacher - log pi_old), trained tokens (algorithms/distill.py)
    distill_coef: float = 1.0
    distill_baseline: bool = True  # subtract that term's mean over the batch's trained tokens (variance reduction)


@dataclass
class RewardConfig:
    # a built-in name (gsm8k | math | math_dapo | retool | synthetic) or "path/to/file.py:function"
    fn: str = "math"
    timeout_s: float = 10.0
    max_workers: int = 4


@dataclass
class SyntheticDataConfig:
    task: str = "copy_last"
    train_size: int = 4096
    val_size: int = 128
    seed: int = 0


@dataclass
class DataConfig:
    source: str = "file"  # file | synthetic
    train_files: List[str] = field(default_factory=list)
    val_files: List[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    data_source_key: str = "data_source"
    train_batch_size: int = 32  # prompts per step
    val_batch_size: int = 128
    max_prompt_length: int = 512
    apply_chat_template: bool = True
    system_prompt: Optional[str] = None
    shuffle: bool = True
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)


@dataclass
class TrainerConfig(LogprobHeadConfig):
    project_name: str = "rltrain"
    experiment_name: str = "run"
    total_steps: int = 100
    save_freq: int = -1  # -1: never
    test_freq: int = -1  # -1: never
    val_before_train: bool = True
    seed: int = 1
    logger: List[str] = field(default_factory=lambda: ["console", "jsonl"])
    device: str = "auto"  # auto | cpu | cuda
    # on GPUs, before any worker starts: error | warn | off when rltrain.plan predicts a GPU will not fit
    plan_check: str = "error"
    # the loss path: fused_linear_logprob, fused_linear_logprob_backend, logprobs_chunk_size (LogprobHeadConfig)
    logprobs_response_only: bool = True
    logprobs_loss_mask_only: bool = False
    # orchestration
    use_ray: bool = True  # false: one in-process worker (single device, debugging, no Ray installed)
    ray_address: Optional[str] = None  # null: start a local Ray; "auto" or host:port: connect
    colocate: bool = True
    n_gpus_per_node: int = 1  # devices per node, one worker process each (on CPU: processes per node)
    nnodes: int = 1  # > 1: join a Ray cluster (ray_address) and place one bundle per node
    num_cpus: Optional[int] = None
    # asynchronous rollout (split placement only): the rollout group generates the next batches while the
    # train group updates on this one, up to max_staleness batches ahead; generation is paced so that no sample
    # is trained more than max_staleness policy versions after the weights that sampled it (docs/architecture.md)
    async_rollout: bool = False
    max_staleness: int = 1
    # checkpoints
    ckpt_dir: Optional[str] = None  # null: <run dir>/checkpoints
    resume: str = "auto"  # auto | never | PATH
    max_ckpt_to_keep: int = 2
    export_hf_on_end: bool = False
    plots: bool = True
    progress_bar: bool = True
    # torch-profiler traces of these steps (1-based), one per training worker (and rollout worker under split
    # placement), each phase a range (rltrain::phase/<name>): <profile_dir>/step<N>/trace_<group>_rank<r>.json.gz;
    # tools/profile_step.py reads them. [] = off
    profile_steps: List[int] = field(default_factory=list)
    profile_dir: Optional[str] = None  # null: <run dir>/profile


@dataclass
class RLConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)


# ---------------------------------------------------------------------------- SFT (rltrain.sft)
@dataclass
class SFTDataConfig:
    # jsonl/parquet files of chat rows: {"messages": [{"role": "system|user|assistant|tool", "content": ...}]}
    train_files: List[str] = field(default_factory=list)
    val_files: List[str] = field(default_factory=list)
    messages_key: str = "messages"
    max_length: int = 2048  # tokens (prompt + response); longer rows are dropped and counted
    batch_size: int = 32  # sequences per optimizer step (global, over data-parallel ranks)
    shuffle: bool = True
    system_prompt: Optional[str] = None  # prepended when a row has no system message


@dataclass
class SFTOptimConfig(OptimizerConfig):
    lr: float = 1e-5  # SFT's own defaults of these OptimizerConfig keys
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    lr_schedule: str = "cosine"
    min_lr_ratio: float = 0.1


@dataclass
class SFTTrainerConfig(LogprobHeadConfig):
    project_name: str = "rltrain"
    experiment_name: str = "sft"
    epochs: int = 1
    total_steps: Optional[int] = None  # null: epochs x (rows // data.batch_size)
    seed: int = 1
    logger: List[str] = field(default_factory=lambda: ["console", "jsonl"])
    device: str = "auto"  # auto | cpu | cuda
    # fused_linear_logprob, fused_linear_logprob_backend, logprobs_chunk_size: LogprobHeadConfig
    tensor_parallel_size: int = 1
    max_tokens_per_micro_batch: int = 16384
    test_freq: int = -1  # validation loss every N steps (needs data.val_files); -1: only at the end
    # where the HF-format model (config + safetensors + tokenizer) is written; null: <run dir>/hf
    output_dir: Optional[str] = None
    progress_bar: bool = True
    # checkpoints, as the RL trainer's (utils/checkpoint.py): every save_freq steps, resumed from the latest
    save_freq: int = -1  # -1: never
    ckpt_dir: Optional[str] = None  # null: <run dir>/checkpoints
    resume: str = "auto"  # auto | never | PATH
    max_ckpt_to_keep: int = 2


@dataclass
class SFTConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    optim: SFTOptimConfig = field(default_factory=SFTOptimConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)


def register_configs() -> None:
    """Register the schema so YAML recipes can start their defaults list with `rltrain_schema`."""
    cs = ConfigStore.instance()
    cs.store(name="rltrain_schema", node=RLConfig)
    cs.store(name="rltrain_sft_schema", node=SFTConfig)  # supervised fine-tuning (rltrain.sft)
