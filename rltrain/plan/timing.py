"""Seconds per step by phase, from FLOPs (utils/flops.py) and bytes at the measured rates of calibration.py.

generation (per rollout replica, in waves: each decode step the larger of the engine's host work and the GPU's reads
of the weights and the wave's KV cache; + prefill), log-probs (the old log-probs, the reference, the critic's values:
per micro-batch the larger of its forward FLOPs and the host's floor), update (the FLOPs at the update's rates with
recompute, the 1F1B bubble, MoE's and TP's per-pass costs, the host's floors per micro-batch, optimizer step and call)
and weight sync (sleep, wake and reload, or split's broadcast). The step is their sum (asynchronous rollout:
max(generation, log-probs + update) + weight sync); a colocated TP x DP actor has its host's floors and weight sync x
tp_dp_factor; offload adds its copies at host_copy_gb_s. step_range: the step's host share (host_share) at
host_speed_low .. host_speed_high. Steps are timed at the data's mean prompt length when the plan has the data's
lengths; the GPU kind picks the HBM bandwidth, compute rates are the H100's on both. Each formula and its sources:
docs/plan.md, "The model".
"""

from __future__ import annotations

import dataclasses
import math

from rltrain.plan import calibration as cal
from rltrain.plan.inputs import Inputs
from rltrain.plan.memory import (VLLM_MAX_NUM_SEQS, full_params, grouped_gemm, kv_bytes_per_token, n_micro_batches,
                                 step_rows, vllm_parts)
from rltrain.plan.state import optimizer_state, ref_resident_params, role_params
from rltrain.utils import flops


def recompute_factor(x: Inputs, recompute: bool | None = None) -> float:
    """The update's time with activation recompute over its time without (1 without recompute)."""
    if not (x.recompute if recompute is None else recompute):
        return 1.0
    selective = x.recompute_granularity == "selective" and "mlp" in x.recompute_modules
    return cal.value("recompute_selective_time_factor" if selective else "recompute_full_time_factor")


def update_rate(x: Inputs, *, recompute: bool | None = None) -> float:
    """Achieved FLOP/s of one GPU on the weight matrices' FLOPs of the update (a TP group of x.tp GPUs runs x.tp times
    this); with recompute, divided by its time factor (the extra forward is not counted as model FLOPs)."""
    rate = cal.value("update_tflops_none_none" if x.fusion == "none" else "update_tflops_compile_none")
    exponent = "update_rate_width_exponent_none" if x.fusion == "none" else "update_rate_width_exponent"
    rate *= (x.shape.hidden_size / cal.RATE_HIDDEN) ** cal.value(exponent)
    return rate * 1e12 / recompute_factor(x, recompute)


def flop_seconds(x: Inputs, tokens: float, seq: float, *, recompute: bool | None = None,
                 skip_flops: float = 0.0) -> float:
    """Seconds of utils/flops.train_flops of `tokens` tokens in sequences of `seq` on one TP x PP group: the weight
    matrices' FLOPs (less skip_flops: a critic's LM head) at update_rate, causal attention's at attention_tflops."""
    attn = flops.attention_flops(x.shape, tokens, seq)
    dense = flops.train_flops(x.shape, tokens, seq) - attn - skip_flops
    attn_rate = cal.value("attention_tflops") * 1e12 / recompute_factor(x, recompute)
    return (dense / update_rate(x, recompute=recompute) + attn / attn_rate) / (x.tp * x.pp)


def tp_pass_seconds(x: Inputs, all_reduces: int) -> float:
    """TP's fixed cost in one micro-batch pass of a stage's layers doing `all_reduces` activation all-reduces each (2
    a forward, 4 a forward + backward); only with torch.compile's layers, where it was measured (fusion none: 0)."""
    if x.tp == 1 or x.fusion == "none":
        return 0.0
    layers = x.shape.num_hidden_layers / x.pp
    return layers * all_reduces * math.log2(x.tp) * cal.value("tp_allreduce_s")


def step_seqs(x: Inputs) -> int:
    return x.train_batch_size * x.n


def decode_weight_bytes(x: Inputs, wave: int) -> float:
    """Weight bytes a decode step of `wave` sequences reads on a rollout GPU (experts: E (1 - (1 - k/E)^wave))."""
    shape = x.shape
    total = full_params(shape)
    if shape.moe:
        E, k = shape.num_experts, shape.num_experts_per_tok
        experts = sum(shape.sparse) * E * flops.expert_params(shape)
        total -= experts * (1 - k / E) ** wave  # the experts no token of the wave routes to are not read
    return total * x.dtype_bytes / x.rollout_tp


def moe_pass_seconds(x: Inputs) -> float:
    """One forward pass of one micro-batch through this rank's experts beyond their FLOPs: megatron-core's loop, a
    launch-bound cost per local expert and sparse layer, or the grouped GEMM's per sparse layer; 0 for a dense model."""
    shape = x.shape
    if not shape.moe:
        return 0.0
    if grouped_gemm(x):
        return sum(shape.sparse) / x.pp * cal.value("moe_grouped_layer_pass_s")
    return sum(shape.sparse) / x.pp * shape.num_experts / x.ep * cal.value("moe_expert_pass_s")


def gen_seconds(x: Inputs, hbm: float, total_bytes: float, *, host: bool = True) -> float:
    """host=False: the GPU's part alone (the reads and the prefill; none of the engines' host work)."""
    shape = x.shape
    replicas = x.rollout_replicas
    seqs = math.ceil(step_seqs(x) / replicas)
    prompt, resp = x.max_prompt_length, x.max_response_length
    if x.engine == "vllm" and x.device != "cpu":
        _, _, _, kv = vllm_parts(x, total_bytes)
        kv_tok = kv_bytes_per_token(shape, x.rollout_tp, x.dtype_bytes)
        fit = max(1, int(max(kv, 0) // (kv_tok * x.seq_len))) if kv > 0 else 1
        wave = max(1, min(seqs, VLLM_MAX_NUM_SEQS * x.engines_per_gpu, fit))
        waves = math.ceil(seqs / wave)
        ctx = prompt + (resp + 1) / 2
        weights = decode_weight_bytes(x, wave)
        host_step = cal.value("vllm_step_s") + cal.value("vllm_seq_step_s") * wave
        step = max(host_step * tp_dp_factor(x) if host else 0.0,
                   (weights + wave * ctx * kv_tok) / (hbm * cal.value("decode_hbm_fraction")))
        prefill = 2 * flops.matmul_params(shape) * seqs * prompt / (
            cal.value("update_tflops_none_none") * 1e12 * x.rollout_tp)
        return waves * resp * step + prefill
    if not host:
        return 0.0
    waves = math.ceil(seqs / max(1, x.max_batch_size))
    return waves * resp * shape.num_hidden_layers * cal.value("hf_layer_step_s") * tp_dp_factor(x)


def train_seconds(x: Inputs, *, loop_overhead: bool = True) -> dict[str, float]:
    """loop_overhead=False: the FLOPs alone (a benchmark's bare step, as the update rates were measured)."""
    shape = x.shape
    seq = x.seq_len
    tokens_rank = step_seqs(x) * seq / x.dp
    n_mini = max(1, math.ceil(x.train_batch_size / x.ppo_mini_batch_size))
    out: dict[str, float] = {}
    over = tp_dp_factor(x) if loop_overhead else 0.0  # the host's floors and fixed costs (TP x DP: x the factor)
    moe = moe_pass_seconds(x)
    layers = x.shape.num_hidden_layers / x.pp  # of one rank's stage
    head = 3 * tokens_rank * 2 * shape.vocab_size * shape.hidden_size  # the LM head's FLOPs, which the critic skips

    def forward(budget: int, head_flops: float, old: bool = False, stream: float = 0.0) -> float:
        """A forward-only pass over this rank's tokens in micro-batches of `budget`: each the larger of its GPU time
        and the host's floor, x the pipeline's fill and drain; stream: ref.offload's copy of a micro-batch's layers."""
        seqs_rank = step_rows(x)
        n_fwd_mb = n_micro_batches(x, budget, seq, seqs_rank)
        bubble = 1 + (x.pp - 1) / n_fwd_mb if x.pp > 1 else 1.0
        gpu_mb = max(flop_seconds(x, tokens_rank, seq, recompute=False, skip_flops=head_flops) / 3 / n_fwd_mb
                     + moe + tp_pass_seconds(x, 2), stream)
        floor = layers * (cal.value("fwd_mb_layer_s") + seqs_rank / n_fwd_mb * cal.value("fwd_row_layer_s"))
        if old:
            floor += cal.value("old_logprob_mb_s")
        return n_fwd_mb * max(gpu_mb, over * floor) * bubble

    out["old_log_prob"] = forward(x.fwd_mb_tokens, 0.0, old=True) if x.recompute_old_logprobs else 0.0
    if x.replay_compare and x.recompute_old_logprobs:  # the same pass without routing replay
        out["old_log_prob_no_replay"] = out["old_log_prob"]
    if x.use_ref:
        out["ref"] = forward(x.fwd_mb_tokens, 0.0, stream=ref_stream_seconds(x))
    if x.use_critic:
        out["values"] = forward(x.critic_mb_tokens, head)
    n_mb = n_mini * n_micro_batches(x, x.mb_tokens, seq)
    bubble = 1 + (x.pp - 1) / max(1, n_mb / n_mini) if x.pp > 1 else 1.0
    upd = flop_seconds(x, tokens_rank, seq) * bubble
    # per micro-batch: MoE's passes and TP's all-reduces; per mini-batch (optimizer step) and per call: fixed costs
    full = x.recompute and x.recompute_granularity == "full"
    selective = x.recompute and not full and "mlp" in x.recompute_modules
    per_mb = moe * (4 if full else 3) + tp_pass_seconds(x, 4 + (2 if full else 1 if selective else 0))
    per_mini = over * layers * cal.value("update_step_layer_s") * bubble
    host_mb = over * layers * cal.value("update_mb_layer_s") * bubble
    per_call = over * layers * cal.value("update_call_layer_s")

    def passes(flop_s: float, n: int) -> float:
        return n * max(flop_s / n + per_mb, host_mb)

    out["update_actor"] = per_call + x.ppo_epochs * (passes(upd, n_mb) + n_mini * (per_mini + host_adam_seconds(x)))
    if x.use_critic:
        n_mbc = n_mini * n_micro_batches(x, x.critic_mb_tokens, seq)
        upd_critic = upd - head / (x.tp * x.pp * update_rate(x)) * bubble
        out["update_critic"] = per_call + x.critic_ppo_epochs * (passes(upd_critic, n_mbc) + n_mini * per_mini)
    return out


def host_adam_seconds(x: Inputs) -> float:
    """One optimizer step's cost of actor.optimizer_offload_fraction on a rank: the host's AdamW over its share and
    the copies around it (fp32 grads out, params back), after the device's step is queued: not hidden."""
    if not x.optimizer_offload_fraction:
        return 0.0
    _, _, host = optimizer_state(x, 0)
    params = host / ((4 if x.dtype_bytes == 2 else 0) + 8)
    return params / cal.value("host_adam_params_per_s") + params * (4 + x.dtype_bytes) / (
        cal.value("host_copy_gb_s") * 1e9)


def offload_seconds(x: Inputs) -> float:
    """actor.offload_while_rollout: the actor's weights, master and moments to the host and back each step."""
    if not (x.offload_while_rollout and x.colocated):
        return 0.0
    master, moments, _ = optimizer_state(x, 0)
    moved = role_params(x.shape, x.tp, x.pp, 0, ep=x.ep) * x.dtype_bytes + master + moments
    return 2 * moved / (cal.value("host_copy_gb_s") * 1e9)


def ref_stream_seconds(x: Inputs) -> float:
    """ref.offload: one forward micro-batch's copy of the reference's streamed layers from the host."""
    if not x.ref_offload:
        return 0.0
    streamed = role_params(x.shape, x.tp, x.pp, 0, ep=x.ep) - ref_resident_params(x, 0)
    return streamed * x.dtype_bytes / (cal.value("host_copy_gb_s") * 1e9)


def weight_tensors(s) -> int:
    """The checkpoint's named tensors (what a reload hands the engine one by one): per layer its matrices and norms (a
    sparse layer: the router and 3 per expert), the embedding, the final norm and an untied LM head."""
    norms = 2 + (2 if s.model_type in ("qwen3", "qwen3_moe") else 0)
    n = 0
    for sparse in flops.sparse_layers(s):
        n += 4 + norms + ((1 + 3 * s.num_experts) if sparse else 3)
    return n + 2 + (0 if s.tie_word_embeddings else 1)


def expert_tensors(s) -> int:
    """Of weight_tensors, the experts' (3 per expert and sparse layer)."""
    return sum(3 * s.num_experts for sparse in flops.sparse_layers(s) if sparse)


def inplace_reload_seconds(shape, value=cal.value, direct_experts: bool = False) -> float:
    """A colocated vLLM engine's in-place reload: a fixed cost per checkpoint tensor, an expert's at its own (through
    vLLM's expert loader, or direct_experts: written into the fused tensors). value: a constant by name."""
    experts = expert_tensors(shape)
    per_expert = value("direct_expert_s_per_tensor" if direct_experts else "reload_s_per_expert_tensor")
    return (weight_tensors(shape) - experts) * value("reload_s_per_tensor") + experts * per_expert


def vllm_sleep_wake_seconds(engine_gb: float, gpus_on_host: int, value=cal.value) -> float:
    """vLLM's level-2 sleep and wake-up of a colocated engine with `engine_gb` of weights on a GPU, the host's GPUs at
    once (the step waits for the slowest). value: a constant by name."""
    one = value("vllm_sleep_s") + value("vllm_wake_s") + engine_gb * value("vllm_wake_s_per_gb")
    return one * (1 + value("vllm_rank_sync_factor") * (gpus_on_host - 1))


def sync_seconds(x: Inputs) -> float:
    gb = full_params(x.shape) * x.dtype_bytes / 1e9
    if not x.colocated:  # each tensor broadcast, then loaded by the engine as it comes
        return weight_tensors(x.shape) * cal.value("split_sync_s_per_tensor") + gb / cal.value("nccl_broadcast_gb_s")
    vllm = x.engine == "vllm" and x.device != "cpu"
    if vllm and x.engines_per_gpu == 1:  # the steady state: the experts written directly once the switch is on
        reload = inplace_reload_seconds(x.shape, direct_experts=x.direct_expert_sync_after >= 0 and not x.legacy_engine)
    else:
        reload = weight_tensors(x.shape) * cal.value("ipc_reload_s_per_tensor" if vllm else "hf_reload_s_per_tensor")
    if not x.free_cache_engine:  # the engine stayed awake: no sleep, no wake-up
        return reload
    if vllm:
        return vllm_sleep_wake_seconds(gb / x.rollout_tp, x.n_gpus_per_node) + reload
    return gb * cal.value("hf_offload_s_per_gb") + reload  # level 1: the weights to the host and back


def tp_dp_factor(x: Inputs) -> float:
    """The factor on the host's floors and fixed costs and the weight sync of a colocated step whose actor is tensor-
    AND data-parallel: tp_dp_layout_factor, measured, not derived; 1 for any other layout and for split placement."""
    return cal.value("tp_dp_layout_factor") if x.colocated and x.tp > 1 and x.dp > 1 else 1.0


def phase_seconds(x: Inputs, hbm: float, total_bytes: float,
                  factors: dict[str, float] | None = None) -> dict[str, float]:
    """{generation, log-probs, update, weight sync, step} seconds and their detail. factors: {phase: multiplier} (the
    lab's per-machine correction, tools/planlab/fit.py; the planner does not use it)."""
    f = {"generation": 1.0, "log-probs": 1.0, "update": 1.0, "weight sync": 1.0, **(factors or {})}
    x = _timed_lengths(x)
    t = train_seconds(x)
    t = {k: v * f["update" if k.startswith("update") else "log-probs"] for k, v in t.items()}
    gen = gen_seconds(x, hbm, total_bytes) * f["generation"]
    logp = sum(v for k, v in t.items() if k in ("old_log_prob", "old_log_prob_no_replay", "ref", "values"))
    upd = sum(v for k, v in t.items() if k.startswith("update"))
    sync = sync_seconds(x) * tp_dp_factor(x) * f["weight sync"]  # all the host's
    offload = offload_seconds(x)  # timed in the trainer with the wake-up and the sleep: planned with the sync
    sync += offload
    out = {"generation": gen, "log-probs": logp, "update": upd, "weight sync": sync}
    out["step"] = (max(gen, logp + upd) + sync) if x.async_rollout else (gen + logp + upd + sync)
    out.update({f"detail/{k}": v for k, v in t.items()})
    if offload:
        out["detail/offload"] = offload
    return out


def _timed_lengths(x: Inputs) -> Inputs:
    """The inputs a step is timed at: the data's mean prompt length when the plan has the data's lengths."""
    if x.mean_prompt_length is not None:
        return dataclasses.replace(x, max_prompt_length=max(1, round(x.mean_prompt_length)), mean_prompt_length=None)
    return x


def host_share(x: Inputs, hbm: float, total_bytes: float, step_s: float) -> float:
    """The share (0..1) of a planned step that is the host's: all but the GPU's own work, the training passes' FLOPs
    and the generation's reads and prefill (with rollout.async the larger of the two, as the step is)."""
    if step_s <= 0:
        return 0.0
    x = _timed_lengths(x)
    train = sum(train_seconds(x, loop_overhead=False).values())
    gen = gen_seconds(x, hbm, total_bytes, host=False)
    gpu = max(gen, train) if x.async_rollout else gen + train
    return 1.0 - min(gpu, step_s) / step_s


def step_range(step_s: float, share: float, value=cal.value) -> tuple[float, float]:
    """The step time across machines of one kind: its host share at host_speed_low .. host_speed_high, its GPU share
    as planned (docs/benchmarks/planner.md). value: a constant by name."""
    return (step_s * (1 - share * (1 - value("host_speed_low"))),
            step_s * (1 + share * (value("host_speed_high") - 1)))
