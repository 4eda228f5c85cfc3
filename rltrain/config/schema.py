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
    expert_parallel_size: int = 1  # MoE: ranks the experts are split over (divides data parallel)
    grad_reduce_bucket_mb: float = 64.0  # data parallel: grads reduce-scattered in buckets of this many MiB (shards.py)
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


@dataclass
class ModelConfig:
    # HF model id or local directory (config + safetensors + tokenizer). Ignored when `builtin` is set.
    path: Optional[str] = None  # an HF model id or a local directory (config, safetensors, tokenizer)
    # Built-in architecture preset with random init and no download: "tiny" (CPU default), "small" (~55M, the
    # learning recipe's) or "qwen3-0.6b" (Qwen3-0.6B's real shapes and vocab, random weights; GPU benchmarks).
    builtin: Optional[str] = None  # a built-in shape with random weights, no download (tiny: the CPU default)
    # Tokenizer: "char" (built-in character tokenizer), an HF id/dir, or null (same as `path`).
    tokenizer: Optional[str] = None  # char (built-in), an HF id or directory, or null: model.path's
    overrides: Dict[str, Any] = field(default_factory=dict)  # set on the HF config, e.g. {num_hidden_layers: 2}
    # Parameter dtype on GPU: "bfloat16" | "float32". CPU always trains in float32.
    dtype: str = "bfloat16"  # parameter dtype on GPU (CPU always trains in float32)
    init: str = "hf"  # a preset's random weights: hf (one transformers model) | engine (made on the actor's GPUs)
    # Run the Python code a model or tokenizer directory ships (auto_map) when transformers loads it: only for code you
    # have read and trust. false refuses such a directory (never asks on stdin).
    trust_remote_code: bool = False  # run the Python code a model directory ships (only code you have read)


@dataclass
class TeacherConfig(ModelConfig):
    """On-policy distillation's frozen teacher (workers/teacher.py), served like the reference; on when `path` or
    `builtin` is set. path: an HF model directory or id, or an rltrain checkpoint (<run>/checkpoints/step_N, built from
    its run's config.json); builtin + overrides: a preset (random init, for timing); the student's vocabulary."""

    colocate: bool = True  # a role of the training workers (the actor's TP/PP); false: a Ray group of its own
    n_gpus_per_node: int = 1  # GPUs per node of its own group (teacher.colocate=false)
    tensor_parallel_size: Optional[int] = None  # null: the actor's
    pipeline_parallel_size: Optional[int] = None  # null: the actor's
    log_prob_max_tokens_per_micro_batch: Optional[int] = None  # null: the actor's forward budget

    @staticmethod
    def enabled(teacher: TeacherConfig) -> bool:
        """Whether distillation is on (teacher.path or teacher.builtin set)."""
        return teacher.path is not None or teacher.builtin is not None


@dataclass
class MultiTurnConfig:
    enable: bool = False  # multi-turn tool use: model-written code runs in the sandbox, its output is fed back
    max_turns: int = 4  # at most this many model turns per sample
    # "code_block" (```python ... ```), "code_tag" (<code>...</code>) or a regex with one group.
    tool_pattern: str = "code_block"  # how a tool call is found in a model turn
    max_total_tokens: int = 2048  # response tokens per sample, model and tool output together
    tool_timeout_s: float = 5.0  # wall-clock limit of one tool call (a call over it returns a timeout message)
    tool_memory_mb: int = 512  # memory limit of one tool call
    tool_max_workers: int = 4  # tool calls run at once


@dataclass
class SandboxConfig:
    """Where model-written tool code runs (rltrain/sandbox): behind namespaces + Landlock + seccomp."""

    # Run tool code even where the kernel cannot isolate it (no user namespaces, Landlock or seccomp): only an
    # audit hook, which is no security boundary, then stands between it and your files. Off: calls are refused.
    allow_unisolated: bool = False  # run tool code where the kernel cannot isolate it (no security boundary)
    # Let tool code run the system's programs (execve); they stay confined to its temp dir. Off: refused.
    allow_exec: bool = False  # let tool code run programs (still confined to its temp dir)


@dataclass
class RolloutConfig:
    engine: str = "hf"  # the generation engine: hf (transformers, the reference; CPU and GPU) or vllm
    n: int = 8  # samples per prompt (a GRPO group)
    temperature: float = 1.0  # sampling temperature of training rollouts (the log-probs use it too)
    top_p: float = 1.0  # nucleus sampling; 1.0 = off
    top_k: int = -1  # sample among the k most likely tokens; -1 = off
    max_response_length: int = 512  # most new tokens per response (a longer one is cut, finish reason "length")
    stop: List[str] = field(default_factory=list)  # strings that end a response
    gpu_memory_utilization: float = 0.5  # vLLM: its share of each GPU (weights + KV cache)
    # GPU: a fixed KV cache (GiB) instead of vLLM's memory profiling, which assumes no other process on the GPU
    # changes its memory while the engine starts (several runs sharing one GPU); null: what the engine can ever use
    # when that is under half its share (small models; rollout/vllm.py auto_kv_cache_bytes), else by the fraction
    kv_cache_memory_gb: Optional[float] = None  # vLLM: a fixed KV cache (GiB); null: sized by gpu_memory_utilization
    tensor_parallel_size: int = 1  # vLLM: GPUs one rollout engine is split over
    enforce_eager: bool = False  # vLLM: no CUDA graphs (slower decode, faster start, less memory)
    # colocated vLLM on one GPU (tensor_parallel_size 1): engines sharing the GPU, each in its own process with
    # 1/k of gpu_memory_utilization and 1/k of the batch, weights by CUDA IPC (rollout/pool.py: vLLM's host work
    # per request bounds one engine at small models); 1: one engine in the trainer's process
    engines_per_gpu: int = 1  # colocated vLLM: engines sharing one GPU (small models decode faster)
    # HF engine: max sequences decoded together
    max_batch_size: int = 256  # hf engine: most sequences decoded together
    # split placement (trainer.colocate=false): rollout replicas of tensor_parallel_size devices each;
    # null: as many devices as the training group (workers/placement.py)
    num_replicas: Optional[int] = None  # split placement: rollout engines; null: as many GPUs as training
    # weight sync from actor to rollout, streamed in buckets of this size
    weight_sync_bucket_mb: int = 256  # weights stream from actor to rollout in buckets of this many MiB
    direct_expert_sync_after: int = 1  # MoE, vLLM on GPU: syncs by vLLM's loader before direct expert writes; -1 never
    val_temperature: float = 0.0  # sampling temperature of validation; 0 = greedy
    val_n: int = 1  # samples per validation prompt
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    # partial rollouts (trainer.async_rollout): generation in chunks of partial_chunk_tokens new tokens; a weight
    # push pauses the generations in flight between two chunks, loads the new weights, and they continue from the
    # tokens already made (log-probs and per-token versions kept; rollout/partial.py)
    partial: bool = False  # async: pause generations at a weight push and continue them
    partial_chunk_tokens: int = 64  # rollout.partial: new tokens per chunk between two possible weight pushes
    # true on-policy: the engine and the actor compute each sampled token's log-prob with the same arithmetic, so
    # rollout/logprob_diff_max is exactly 0; the log-prob is of the distribution sampled from (top_k/top_p applied)
    true_on_policy: bool = False  # engine and actor log-probs bit-identical (rollout/logprob_diff_max = 0)
    # colocated: the engine sleeps (frees its weights and KV cache) while the actor computes log-probs and trains, and
    # wakes up for the weight push; false keeps it awake through the step (no sleep, no wake-up: faster, but its
    # weights + KV cache stay on the GPU beside the training phases; the weights are still reloaded in place)
    free_cache_engine: bool = True  # colocated: the engine sleeps while the actor trains (false: stays awake)


@dataclass
class TISConfig:
    # Truncated importance sampling (off-policy correction): each token's policy loss is weighted by
    # min(pi_old / pi_sampler, cap), the sampler's log-probs being the behaviour policy. Corrects the
    # training/inference mismatch and, with trainer.async_rollout, the rollout's staleness.
    enable: bool = False  # weight each token's loss by min(pi_old / pi_sampler, cap)
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
    mode: Optional[str] = None  # null: geo_tis with trainer.async_rollout, else none
    cap: float = 2.0  # *_tis: upper truncation C >= 1
    low: float = 0.5  # *_mask, *_mis: the kept band [low, high], 0 < low <= 1 <= high (IcePop's 0.5 and 5)
    high: float = 5.0  # *_mask, *_mis: the kept band's upper end

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
    # (optimizer keys: OptimizerConfig; parallel sizes, grad_reduce_*: ParallelConfig; recompute_*,
    # elementwise_fusion: LayerComputeConfig; moe_*: MoEConfig)

    ppo_epochs: int = 1  # passes over each step's samples
    # mini-batch size in prompts (each prompt contributes rollout.n samples); one optimizer step each
    ppo_mini_batch_size: int = 16
    max_tokens_per_micro_batch: int = 16384  # the update's token budget per micro-batch (packed rows)
    # the token budget of a micro-batch in the forward-only passes (old log-probs, the reference's); null: the
    # update's max_tokens_per_micro_batch. A forward keeps no activations for a backward, so it can take more tokens
    # at once, and each micro-batch costs a fixed host time (a small model's forward at short rows is host-bound)
    log_prob_max_tokens_per_micro_batch: Optional[int] = None  # forward-only passes' budget; null: the update's
    loss_mode: str = "ppo"  # the policy loss: ppo (clipped ratio), gspo (sequence ratio) or cispo (clipped IS weight)
    loss_agg_mode: str = "token-mean"  # how token losses average into the loss (algorithms/aggregation.py)
    clip_low: float = 0.2  # the ratio is clipped below at 1 - clip_low
    clip_high: float = 0.2  # the ratio is clipped above at 1 + clip_high (DAPO's clip-higher: > clip_low)
    dual_clip: Optional[float] = None  # dual-clip PPO's c > 1 for negative advantages; null = off
    entropy_coef: float = 0.0  # entropy bonus weight in the loss; 0 = off (no entropy gradient computed)
    use_kl_loss: bool = False  # add a KL loss to the reference model (loads a reference)
    kl_loss_coef: float = 0.001  # weight of the KL loss
    kl_loss_type: str = "low_var_kl"  # the KL estimator of the KL loss (algorithms/kl.py)
    tis: TISConfig = field(default_factory=TISConfig)
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    moe_routing_replay: Optional[bool] = None  # MoE: the actor routes as the rollout did (docs/moe.md); null: auto
    moe_routing_replay_compare: bool = False  # replay on: also log the mismatch without it (rollout/no_replay/*)
    # true: a no-grad pass computes the old log-probs before the update (timing_s/old_log_prob); false, for a strictly
    # on-policy update (ppo_epochs 1, one mini-batch of the whole step, nothing reading them before the update): the
    # update's own forward gives them, detached (same weights: ratio 1 exactly), and the pass is skipped
    recompute_old_logprobs: bool = True  # false: old log-probs from the update's forward (on-policy only)
    lora: LoraConfig = field(default_factory=LoraConfig)
    offload_while_rollout: bool = False  # colocated: the actor's state waits on the host while the engine generates


@dataclass
class RefConfig:
    """The reference model (actor.use_kl_loss, algorithm.use_kl_in_reward); its shape is the actor's."""
    offload: bool = False  # its decoder layers on the host, each streamed to the GPU for its forward


@dataclass
class CriticConfig(OptimizerConfig):
    lr: float = 1e-5  # the critic's own default (its other optimizer keys: OptimizerConfig's)
    ppo_epochs: int = 1  # the critic's passes over each step's samples
    value_clip: float = 0.5  # new values are clipped to old +- value_clip in the value loss
    loss_agg_mode: str = "token-mean"  # how token value losses average (as actor.loss_agg_mode)
    max_tokens_per_micro_batch: int = 16384  # the critic update's token budget per micro-batch


@dataclass
class DynamicSamplingConfig:
    enable: bool = False  # DAPO: drop groups whose samples all score the same and generate more until the batch fills
    max_tries: int = 4  # generation rounds per step before the step stops with an error


@dataclass
class OverlongConfig:
    enable: bool = False  # DAPO's soft overlong penalty on responses near rollout.max_response_length
    buffer_len: int = 64  # the penalty grows over the last buffer_len tokens of the allowed length
    penalty_factor: float = 1.0  # the penalty at the full length


@dataclass
class AlgorithmConfig:
    adv_estimator: str = "grpo"  # the advantage estimator (gae trains a critic), or your own 'module:function'
    gamma: float = 1.0  # discount (gae, reinforce++)
    lam: float = 1.0  # GAE's lambda
    norm_adv_by_std_in_grpo: bool = True  # grpo: divide by the group's std (false: Dr. GRPO's plain mean removal)
    use_kl_in_reward: bool = False  # subtract kl_coef * KL(actor || reference) from the token rewards
    kl_penalty: str = "k1"  # the KL estimator of the in-reward penalty
    kl_coef: float = 0.001  # weight of the in-reward KL penalty
    mask_truncated_responses: bool = False  # leave responses cut at max_response_length out of the loss
    dynamic_sampling: DynamicSamplingConfig = field(default_factory=DynamicSamplingConfig)
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    # with teacher.*: advantage += distill_coef * (log pi_teacher - log pi_old), trained tokens (algorithms/distill.py)
    distill_coef: float = 1.0
    distill_baseline: bool = True  # subtract that term's mean over the batch's trained tokens (variance reduction)


@dataclass
class RewardConfig:
    # a built-in name (gsm8k | math | math_dapo | retool | synthetic) or "path/to/file.py:function"
    fn: str = "math"  # a built-in reward by name, or your own "path/to/file.py:function"
    timeout_s: float = 10.0  # one call's limit; a call over it scores 0 (reward/timeouts)
    max_workers: int = 4  # reward processes; 0 = calls in the trainer's process (no timeout for sync functions)


@dataclass
class SyntheticDataConfig:
    task: str = "copy_last"  # copy_last ("482=" -> "2"), successor (last digit + 1) or sum_mod10
    train_size: int = 4096  # training prompts generated
    val_size: int = 128  # held-out prompts generated
    seed: int = 0  # seed of the generated prompts


@dataclass
class DataConfig:
    source: str = "file"  # file: data.train_files; synthetic: the built-in task (data.synthetic)
    train_files: List[str] = field(default_factory=list)  # .jsonl / .parquet files of prompt rows (docs/guide/data.md)
    val_files: List[str] = field(default_factory=list)  # held-out rows, scored every trainer.test_freq steps
    prompt_key: str = "prompt"  # the row's prompt: a string or a list of chat messages (dotted path for nesting)
    answer_key: str = "answer"  # the row's ground truth, passed to the reward (dotted path for nesting)
    data_source_key: str = "data_source"  # the row's source name: val/<source>/accuracy (missing: the file's name)
    train_batch_size: int = 32  # prompts per step
    val_batch_size: int = 128  # prompts per validation generation call
    max_prompt_length: int = 512  # tokens; longer prompts are dropped (and counted)
    apply_chat_template: bool = True  # render prompts with the tokenizer's chat template
    system_prompt: Optional[str] = None  # prepended as a system message when a prompt has none
    shuffle: bool = True  # a new order each epoch (seeded)
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)


@dataclass
class TrainerConfig(LogprobHeadConfig):
    project_name: str = "rltrain"  # wandb project
    experiment_name: str = "run"  # the run's name: wandb's, and outputs/<experiment_name>/ in the recipes
    total_steps: int = 100  # training steps (one batch of prompts each)
    save_freq: int = -1  # write a checkpoint every N steps; -1: never
    test_freq: int = -1  # validate on data.val_files every N steps and at the end; -1: never
    val_before_train: bool = True  # validate once before the first step (with test_freq > 0)
    seed: int = 1  # seeds data order, sampling and initialization
    logger: List[str] = field(default_factory=lambda: ["console", "jsonl"])  # where metrics go
    device: str = "auto"  # auto: cuda when a GPU is visible, else cpu
    plan_check: str = "error"  # on GPUs: stop (error) or warn when rltrain.plan says a GPU will not fit
    # the loss path: fused_linear_logprob, fused_linear_logprob_backend, logprobs_chunk_size (LogprobHeadConfig)
    logprobs_response_only: bool = True  # compute log-probs of response tokens only
    logprobs_loss_mask_only: bool = False  # the policy loss's log-probs of loss_mask == 1 tokens only (no tool output)
    use_ray: bool = True  # false: one in-process worker (one device, debugging, no Ray needed)
    ray_address: Optional[str] = None  # null: start a local Ray; "auto" or host:port: connect
    colocate: bool = True  # every role on the same GPUs (false: split training and rollout groups)
    n_gpus_per_node: int = 1  # devices per node, one worker process each (on CPU: processes per node)
    nnodes: int = 1  # > 1: join a Ray cluster (ray_address) and place one bundle per node
    num_cpus: Optional[int] = None  # CPUs a local Ray may use; null: Ray's default (all)
    # asynchronous rollout (split placement only): the rollout group generates the next batches while the
    # train group updates on this one, up to max_staleness batches ahead; generation is paced so that no sample
    # is trained more than max_staleness policy versions after the weights that sampled it (docs/architecture.md)
    async_rollout: bool = False  # split placement: generate the next batch while this one trains
    max_staleness: int = 1  # async: the most policy versions a sample may lag the weights it trains
    ckpt_dir: Optional[str] = None  # where checkpoints go; null: <run dir>/checkpoints
    resume: str = "auto"  # auto: the newest intact checkpoint (docs/guide/runs.md), never, or a checkpoint PATH
    resume_in_place: bool = True  # resume=auto continues a stopped run in its own directory; false: in a new one
    max_ckpt_to_keep: int = 2  # older checkpoints are deleted
    export_hf_on_end: bool = False  # write the actor in transformers format to <run dir>/hf at the end
    plots: bool = True  # PNG plots of the run's curves in the run directory at the end
    progress_bar: bool = True  # a progress bar on a terminal (never in a piped log)
    # torch-profiler traces of these steps (1-based), one per training worker (and rollout worker under split
    # placement), each phase a range (rltrain::phase/<name>): <profile_dir>/step<N>/trace_<group>_rank<r>.json.gz;
    # tools/profile_step.py reads them. [] = off
    profile_steps: List[int] = field(default_factory=list)  # steps (1-based) traced by torch.profiler
    profile_dir: Optional[str] = None  # where profiler traces go; null: <run dir>/profile


@dataclass
class RLConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    ref: RefConfig = field(default_factory=RefConfig)
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
    val_files: List[str] = field(default_factory=list)  # held-out chat rows: the validation loss
    messages_key: str = "messages"  # the row's list of messages
    max_length: int = 2048  # tokens (prompt + response); longer rows are dropped and counted
    batch_size: int = 32  # sequences per optimizer step (global, over data-parallel ranks)
    shuffle: bool = True  # a new order each epoch (seeded)
    system_prompt: Optional[str] = None  # prepended when a row has no system message


@dataclass
class SFTOptimConfig(OptimizerConfig):
    lr: float = 1e-5  # SFT's own defaults of these OptimizerConfig keys
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    lr_schedule: str = "cosine"
    min_lr_ratio: float = 0.1


@dataclass
class SFTTrainerConfig(LogprobHeadConfig):
    project_name: str = "rltrain"  # wandb project
    experiment_name: str = "sft"  # the run's name: wandb's, and outputs/<experiment_name>/ in the recipes
    epochs: int = 1  # passes over data.train_files
    total_steps: Optional[int] = None  # optimizer steps; null: epochs x (rows // data.batch_size)
    seed: int = 1  # seeds data order and initialization
    logger: List[str] = field(default_factory=lambda: ["console", "jsonl"])  # where metrics go
    device: str = "auto"  # auto: cuda when a GPU is visible, else cpu
    tensor_parallel_size: int = 1  # GPUs each layer's matrices are split over (the rest is data parallel)
    max_tokens_per_micro_batch: int = 16384  # token budget per micro-batch (packed rows)
    test_freq: int = -1  # validation loss every N steps (needs data.val_files); -1: only at the end
    # where the HF-format model (config + safetensors + tokenizer) is written; null: <run dir>/hf
    output_dir: Optional[str] = None  # where the trained HF model goes; null: <run dir>/hf
    progress_bar: bool = True  # a progress bar on a terminal (never in a piped log)
    # checkpoints, as the RL trainer's (utils/checkpoint.py): every save_freq steps, resumed from the latest
    save_freq: int = -1  # write a checkpoint every N steps; -1: never
    ckpt_dir: Optional[str] = None  # where checkpoints go; null: <run dir>/checkpoints
    resume: str = "auto"  # auto: the newest intact checkpoint in ckpt_dir, never, or a checkpoint PATH
    max_ckpt_to_keep: int = 2  # older checkpoints are deleted


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
