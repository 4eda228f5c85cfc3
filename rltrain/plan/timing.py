"""Seconds per step by phase, from FLOPs (utils/flops.py) and bytes at the measured rates of calibration.py.

  generation   per rollout replica, its share of train_batch_size x n sequences in waves of at most vLLM's
               1,024 (rollout/vllm.py MAX_NUM_SEQS) or as many as its KV cache holds at full length (hf:
               rollout.max_batch_size); each of max_response_length decode steps costs vllm_step_s + vllm_seq_step_s
               per sequence of the wave (the engine's host work: its loop and launches, then scheduling, sampling and
               detokenizing each sequence) or (weights + the wave's KV cache at its mean context) / (HBM bandwidth x
               decode_hbm_fraction), the larger
               (they overlap; hf: hf_layer_step_s per layer, eager transformers being launch-bound; MoE: of the
               experts, those the wave routes to); prefill at the forward rate.
  log-probs    old log-probs (not with actor.recompute_old_logprobs=false: the update's forward gives them; + reference,
               + critic values, without the LM head's FLOPs: the critic's head is h -> 1): forward FLOPs (1/3 of
               utils/flops.train_flops, on the ACTIVE parameters for MoE) of the step's tokens on one data-parallel
               rank at the update's rates (weight matrices, attention) without recompute (+ MoE: moe_pass_seconds
               per micro-batch; + TP with torch.compile's layers: tp_pass_seconds of 2 all-reduces a layer, per
               micro-batch), per micro-batch (of actor.log_prob_max_tokens_per_micro_batch tokens, else the update's;
               values: the critic's; whole rows, plan/memory.py's rule) the larger of that and the host's floor,
               fwd_mb_layer_s + fwd_row_layer_s per row, per layer (+ old_logprob_mb_s a micro-batch of the old
               log-probs: the actor's pass, with the entropy, over the reference's) (the two overlap); PP: x (m + pp -
               1) / m for m micro-batches, the pipeline's fill and drain.
  update       actor (+ critic, without the LM head's FLOPs): train_flops x ppo_epochs, its weight matrices' FLOPs at
               update_tflops_<none|compile>_none x (h / 1024) ^ update_rate_width_exponent[_none] (the 0.6B's rates;
               a wider model's GEMMs dominate its elementwise work) and its causal attention's at attention_tflops
               (flash attention's kernels, whatever the width), times recompute_<full|selective>_time_factor
               with recompute (PP: + the 1F1B bubble (pp - 1) / micro-batches)
               (+ MoE: 3 x moe_pass_seconds per micro-batch, 4 x with full recompute; + TP > 1 with torch.compile's
               layers: tp_allreduce_s per all-reduce, 4 a layer and micro-batch, per doubling; fusion none: none),
               per micro-batch the larger of that and the host's floor, update_mb_layer_s per layer; + per mini-batch
               (optimizer step) update_step_layer_s per layer; + once a call update_call_layer_s per layer.
  weight sync  colocated vLLM: (sleep + wake + the engine's bf16 GB on a GPU x vllm_wake_s_per_gb) x (1 +
               vllm_rank_sync_factor x (the host's GPUs - 1): they sleep and wake at once, the step waits for the
               slowest) + the checkpoint's tensors x reload_s_per_tensor (the in-place reload
               is a fixed cost per tensor: the 4B's 8 GB took as long as the 0.6B's 1.2 GB; an expert's tensor at
               reload_s_per_expert_tensor); engines in their own
               processes (rollout.engines_per_gpu > 1): x ipc_reload_s_per_tensor (CUDA IPC); hf: its level-1 sleep
               + wake (the weights to their pinned host copies and back, hf_offload_s_per_gb) + hf_reload_s_per_tensor;
               rollout.free_cache_engine=false (the engine stays awake): the reload alone;
               split: the checkpoint's tensors x split_sync_s_per_tensor + its bf16 bytes at
               nccl_broadcast_gb_s (a fixed cost per tensor, as the in-place reload).
Offload (each at host_copy_gb_s, assumed): actor.offload_while_rollout adds the actor's state to the host and back
to the weight sync; actor.optimizer_offload_fraction adds the host's AdamW and its copies to each optimizer step;
ref.offload makes each reference micro-batch at least its streamed layers' copy.
A colocated step whose actor is both tensor- and data-parallel: the host's floors and fixed costs above (the forward
and update floors, per optimizer step and call, vllm_step_s, vllm_seq_step_s, hf_layer_step_s) and the weight sync x
tp_dp_layout_factor (tp_dp_factor; measured): the layout's runs sat on those floors in every phase.
The range across machines (step_range): the step's host share (host_share: all but the training passes' FLOPs and
the generation's reads and prefill) at host_speed_low .. host_speed_high of its planned time, the rest as planned.
Sequences are planned at the data's mean prompt length when the plan has the data's lengths
(Inputs.mean_prompt_length; memory takes the longest), else at data.max_prompt_length. The GPU kind (h100 | h200)
picks the HBM bandwidth; compute rates are the H100's on both (same GH100 compute).
"""

from __future__ import annotations

import dataclasses
import math

from rltrain.plan import calibration as cal
from rltrain.plan.inputs import Inputs
from rltrain.plan.memory import (VLLM_MAX_NUM_SEQS, full_params, grouped_gemm, kv_bytes_per_token, n_micro_batches, ns,
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
    """Seconds of utils/flops.train_flops (forward + backward) of `tokens` tokens in sequences of `seq` on one TP x PP
    group: the weight matrices' FLOPs (less skip_flops, e.g. a critic's LM head) at update_rate, the causal
    attention's at attention_tflops (FlashAttention's kernels: their own rate, whatever the width; the 0.6B's 32k and
    64k sequences are 76-86% attention FLOPs); with recompute, both over its time factor."""
    shape = ns(x.shape)
    attn = flops.attention_flops(shape, tokens, seq)
    dense = flops.train_flops(shape, tokens, seq) - attn - skip_flops
    attn_rate = cal.value("attention_tflops") * 1e12 / recompute_factor(x, recompute)
    return (dense / update_rate(x, recompute=recompute) + attn / attn_rate) / (x.tp * x.pp)


def tp_pass_seconds(x: Inputs, all_reduces: int) -> float:
    """TP's cost in one micro-batch pass of a stage's layers doing `all_reduces` activation all-reduces each (2 a
    forward, 4 a forward + backward): tp_allreduce_s per all-reduce and doubling of TP, a fixed cost per pass
    (measured the same at 8k and 32k tokens), so a narrow model loses a larger share of its time. Only with
    torch.compile's layers (elementwise_fusion compile or mcore), where it was measured; 0 at TP=1 and fusion none
    (the fusion-none 4B TP=2 GRPO steps ran at the TP=1 rates)."""
    if x.tp == 1 or x.fusion == "none":
        return 0.0
    layers = x.shape.num_hidden_layers / x.pp
    return layers * all_reduces * math.log2(x.tp) * cal.value("tp_allreduce_s")


def step_seqs(x: Inputs) -> int:
    return x.train_batch_size * x.n


def decode_weight_bytes(x: Inputs, wave: int) -> float:
    """Weight bytes one decode step of `wave` sequences reads on one rollout GPU: every dense matrix, and of a sparse
    layer's E experts those the wave's tokens route to (each token picks k: E x (1 - (1 - k/E)^wave) expected)."""
    shape = x.shape
    total = full_params(shape)
    if shape.moe:
        E, k = shape.num_experts, shape.num_experts_per_tok
        experts = sum(shape.sparse) * E * flops.expert_params(ns(shape))
        total -= experts * (1 - k / E) ** wave  # the experts no token of the wave routes to are not read
    return total * x.dtype_bytes / x.rollout_tp


def moe_pass_seconds(x: Inputs) -> float:
    """One forward pass of one micro-batch through this rank's experts beyond their FLOPs at the update rate: with
    megatron-core's loop (actor.moe_grouped_gemm=false, or widths the grouped GEMM cannot take: one small GEMM set
    per local expert and sparse layer, launch-bound) sparse layers / PP x E / EP local experts x moe_expert_pass_s;
    with the grouped GEMM sparse layers / PP x moe_grouped_layer_pass_s (fitted on one run: a per-layer cost, not
    split into its token and weight-copy parts); 0 for a dense model."""
    shape = x.shape
    if not shape.moe:
        return 0.0
    if grouped_gemm(x):
        return sum(shape.sparse) / x.pp * cal.value("moe_grouped_layer_pass_s")
    return sum(shape.sparse) / x.pp * shape.num_experts / x.ep * cal.value("moe_expert_pass_s")


def gen_seconds(x: Inputs, hbm: float, total_bytes: float, *, host: bool = True) -> float:
    """host=False: the GPU's part alone (the weight and KV-cache reads and the prefill; no engine host work per
    sequence, and none of the hf engine's launch-bound decode)."""
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
        # the engine's host work per step (its loop and launches, then scheduling, sampling and detokenizing each
        # sequence of the wave) and the GPU's reads overlap (CUDA launches are asynchronous): the larger
        host_step = cal.value("vllm_step_s") + cal.value("vllm_seq_step_s") * wave
        step = max(host_step * tp_dp_factor(x) if host else 0.0,
                   (weights + wave * ctx * kv_tok) / (hbm * cal.value("decode_hbm_fraction")))
        prefill = 2 * flops.matmul_params(ns(shape)) * seqs * prompt / (
            cal.value("update_tflops_none_none") * 1e12 * x.rollout_tp)
        return waves * resp * step + prefill
    if not host:
        return 0.0
    waves = math.ceil(seqs / max(1, x.max_batch_size))
    return waves * resp * shape.num_hidden_layers * cal.value("hf_layer_step_s") * tp_dp_factor(x)


def train_seconds(x: Inputs, *, loop_overhead: bool = True) -> dict[str, float]:
    """loop_overhead=False: the FLOPs alone (a benchmark's bare step, as the update rates were measured)."""
    shape = ns(x.shape)
    seq = x.seq_len
    tokens_rank = step_seqs(x) * seq / x.dp
    n_mini = max(1, math.ceil(x.train_batch_size / x.ppo_mini_batch_size))
    out: dict[str, float] = {}
    over = tp_dp_factor(x) if loop_overhead else 0.0  # the host's floors and fixed costs (TP x DP: x the factor)
    moe = moe_pass_seconds(x)
    layers = x.shape.num_hidden_layers / x.pp  # of one rank's stage
    # the critic has a value head (h -> 1) where the actor has the LM head: its passes skip the head's FLOPs
    head = 3 * tokens_rank * 2 * shape.vocab_size * shape.hidden_size  # forward + backward of the LM head

    def forward(budget: int, head_flops: float, old: bool = False, stream: float = 0.0) -> float:
        """A forward-only pass over the step's tokens of this rank in micro-batches of `budget` tokens. Each micro-batch
        costs the larger of its GPU time (its FLOPs, + MoE's and TP's per-pass costs) and the host's time to run its
        layers (fwd_mb_layer_s + fwd_row_layer_s per row, each; + old_logprob_mb_s for the old log-probs: the actor's
        pass, which also gives the entropy, took longer than the reference's): launches are asynchronous, so the two
        overlap. PP: it runs the same pipeline schedule as the update (megatron's, forward_only): m micro-batches
        through pp stages take m + pp - 1 stage slots, not m. stream: a micro-batch's copy of the reference's
        layers from the host (ref.offload), overlapped with its compute."""
        seqs_rank = step_rows(x)
        n_fwd_mb = n_micro_batches(x, budget, seq, seqs_rank)
        bubble = 1 + (x.pp - 1) / n_fwd_mb if x.pp > 1 else 1.0
        gpu_mb = max(flop_seconds(x, tokens_rank, seq, recompute=False, skip_flops=head_flops) / 3 / n_fwd_mb
                     + moe + tp_pass_seconds(x, 2), stream)
        floor = layers * (cal.value("fwd_mb_layer_s") + seqs_rank / n_fwd_mb * cal.value("fwd_row_layer_s"))
        if old:
            floor += cal.value("old_logprob_mb_s")
        return n_fwd_mb * max(gpu_mb, over * floor) * bubble

    # false: the update's forward gives them
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
    # per micro-batch: the experts' loop forward + backward (2x; one more forward with full recompute) and TP's
    # all-reduces (4 a layer; + 2 for a recomputed layer, + 1 for a recomputed MLP); per mini-batch (one optimizer
    # step: the step, the grad norm's host sync, zeroing): the fixed cost of the stage's layers (the pipeline's bubble
    # as for the FLOPs). A fixed cost added per micro-batch alone (an earlier model) planned the 8,192-token
    # responses' 32 micro-batches +24% and the 2,048's 19 +47%; per step -6% and +21%
    full = x.recompute and x.recompute_granularity == "full"
    selective = x.recompute and not full and "mlp" in x.recompute_modules
    per_mb = (moe * (4 if full else 3)
              + tp_pass_seconds(x, 4 + (2 if full else 1 if selective else 0)))
    per_mini = over * layers * cal.value("update_step_layer_s") * bubble
    # per micro-batch the GPU's work (FLOPs + the costs above) overlaps the host's launches of the stage's layers
    # (update_mb_layer_s each): the larger; per update call (each role's, once a step) a fixed cost of its layers
    # (update_call_layer_s: the call's setup, the batch to the ranks, the metrics back)
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
    """One optimizer step's cost of actor.optimizer_offload_fraction on a rank: the host's AdamW over its share
    (host_adam_params_per_s) and the copies around it (the share's fp32 grads to the host, its params back in the
    params' dtype, at host_copy_gb_s), after the device's step is queued (offload.HostOptimizer): not hidden."""
    if not x.optimizer_offload_fraction:
        return 0.0
    _, _, host = optimizer_state(x, 0)
    params = host / ((4 if x.dtype_bytes == 2 else 0) + 8)
    return params / cal.value("host_adam_params_per_s") + params * (4 + x.dtype_bytes) / (
        cal.value("host_copy_gb_s") * 1e9)


def offload_seconds(x: Inputs) -> float:
    """actor.offload_while_rollout, each step: the actor's weights, fp32 master and moments to the host before the
    engine wakes and back after it sleeps (offload.StateOffload), at host_copy_gb_s each way."""
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


def weight_tensors(shape) -> int:
    """The checkpoint's named tensors (what a colocated reload hands the engine one by one): per dense layer q, k, v,
    o, gate, up, down and the two RMSNorms (+ Qwen3's q/k norms); a sparse layer's router and 3 per expert in place of
    the MLP's three; the embedding, the final norm and an untied LM head."""
    s = ns(shape)
    norms = 2 + (2 if s.model_type in ("qwen3", "qwen3_moe") else 0)
    n = 0
    for sparse in flops.sparse_layers(s):
        n += 4 + norms + ((1 + 3 * s.num_experts) if sparse else 3)
    return n + 2 + (0 if s.tie_word_embeddings else 1)


def expert_tensors(shape) -> int:
    """Of weight_tensors, the experts' (3 per expert and sparse layer)."""
    s = ns(shape)
    return sum(3 * s.num_experts for sparse in flops.sparse_layers(s) if sparse)


def inplace_reload_seconds(shape, value=cal.value, direct_experts: bool = False) -> float:
    """A colocated vLLM engine's in-place reload: the checkpoint's tensors one at a time (a fixed cost per tensor: the
    4B's 8 GB reloaded in 0.16 s, the 0.6B's 1.2 GB in 0.09-0.16 s on the same H200s), an expert's tensor at its own
    cost (vLLM's expert loader copies each into its slice of the layer's stacked weight; direct_experts: written
    into the layer's fused tensors by rollout/vllm_experts.py). value: a constant by name."""
    experts = expert_tensors(shape)
    per_expert = value("direct_expert_s_per_tensor" if direct_experts else "reload_s_per_expert_tensor")
    return (weight_tensors(shape) - experts) * value("reload_s_per_tensor") + experts * per_expert


def vllm_sleep_wake_seconds(engine_gb: float, gpus_on_host: int, value=cal.value) -> float:
    """vLLM's level-2 sleep and wake-up of a colocated engine: a fixed cost + per GB of the engine's bf16 weights on a
    GPU (engine_gb), x (1 + vllm_rank_sync_factor x (gpus_on_host - 1)): the host's GPUs do it at once and the step
    waits for the slowest. value: a constant by name."""
    one = value("vllm_sleep_s") + value("vllm_wake_s") + engine_gb * value("vllm_wake_s_per_gb")
    return one * (1 + value("vllm_rank_sync_factor") * (gpus_on_host - 1))


def sync_seconds(x: Inputs) -> float:
    gb = full_params(x.shape) * x.dtype_bytes / 1e9
    if not x.colocated:  # each tensor broadcast, then loaded by the engine as it comes
        return weight_tensors(x.shape) * cal.value("split_sync_s_per_tensor") + gb / cal.value("nccl_broadcast_gb_s")
    vllm = x.engine == "vllm" and x.device != "cpu"
    # in place (inplace_reload_seconds); engines in their own processes take each tensor by CUDA IPC; the hf engine
    # copies each into its module
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
    """The factor on the host's floors and fixed costs (train_seconds, gen_seconds) and the weight sync of a colocated
    step whose actor is tensor- AND data-parallel (actor TP > 1 with DP > 1: TP groups side by side on the host):
    tp_dp_layout_factor, measured, not derived. Nine runs of that layout on eight hosts (the 0.6B and the 4B at
    64-token responses, either rollout layout, every phase on its host's floor) took 1.20-1.81x their step planned
    without it; the factor centres them (tools/planlab/fit.py). Under torch's profiler one rank of each TP pair waits in
    the all-reduce for its peer's host (docs/benchmarks/placements.md), so a step bound by its FLOPs (long sequences)
    is planned to lose little.
    1 for any other layout, and for a split placement (no TP x DP split run was measured)."""
    return cal.value("tp_dp_layout_factor") if x.colocated and x.tp > 1 and x.dp > 1 else 1.0


def phase_seconds(x: Inputs, hbm: float, total_bytes: float,
                  factors: dict[str, float] | None = None) -> dict[str, float]:
    """{generation, log-probs, update, weight sync} seconds of one step, and their detail; a TP x DP layout's with its
    host floors and weight sync at tp_dp_factor. factors: {phase: measured / predicted} of another run on the same
    machine, multiplying each phase and its detail (tried as a per-machine correction, it did not help, docs/benchmarks/
    planner.md; the planner does not use it)."""
    f = {"generation": 1.0, "log-probs": 1.0, "update": 1.0, "weight sync": 1.0, **(factors or {})}
    x = _timed_lengths(x)  # the data's prompts: a typical step's at their mean, not the longest
    t = train_seconds(x)
    t = {k: v * f["update" if k.startswith("update") else "log-probs"] for k, v in t.items()}
    gen = gen_seconds(x, hbm, total_bytes) * f["generation"]
    logp = sum(v for k, v in t.items() if k in ("old_log_prob", "old_log_prob_no_replay", "ref", "values"))
    upd = sum(v for k, v in t.items() if k.startswith("update"))
    # the weight sync is all the host's: x the TP x DP factor here (train_seconds and gen_seconds scale their floors)
    sync = sync_seconds(x) * tp_dp_factor(x) * f["weight sync"]
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
    """The share of a planned step (step_s) that is the host's: all of it but the GPU's own work, which is the
    training passes' FLOPs (train_seconds without the host's floors and fixed costs) and the generation's reads and
    prefill (gen_seconds(host=False)). The weight sync (sleep, wake, reload: copies and driver calls) counts as the
    host's. With rollout.async (generation beside training on its own GPUs) the GPU's work is the larger of the two,
    as the step is. 0..1."""
    if step_s <= 0:
        return 0.0
    x = _timed_lengths(x)
    train = sum(train_seconds(x, loop_overhead=False).values())
    gen = gen_seconds(x, hbm, total_bytes, host=False)
    gpu = max(gen, train) if x.async_rollout else gen + train
    return 1.0 - min(gpu, step_s) / step_s


def step_range(step_s: float, share: float, value=cal.value) -> tuple[float, float]:
    """The step time the same config took across machines of one kind: its host share at host_speed_low ..
    host_speed_high of the planned host time, its GPU share as planned (docs/benchmarks/planner.md: the
    guests' vCPUs run at half speed in spells, which the config does not predict). value: a constant by name."""
    return (step_s * (1 - share * (1 - value("host_speed_low"))),
            step_s * (1 + share * (value("host_speed_high") - 1)))
