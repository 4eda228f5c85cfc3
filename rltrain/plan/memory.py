"""Peak memory per GPU and phase, by part. Pure arithmetic on the shape and the config (no torch).

Parts, per GPU (bytes; P = this rank's parameters of a role: its pipeline stage's layers with the matrices split
over TP, the embedding / LM head split over TP on the first / last stage, norms whole; Mixture-of-Experts: a sparse
layer's router whole and its E experts split over actor.expert_parallel_size ranks (E / EP each), each / TP):

  weights            P x dtype bytes (2 for bf16)
  fp32 master        S x 4 when the params are bf16 (models/megatron/optim.py: AdamW steps fp32 copies of this
                     rank's pieces), S = this rank's share of P: the dense parameters / DP, the experts / (DP / EP)
                     (the sharded optimizer, models/megatron/shards.py), x (1 - actor.optimizer_offload_fraction)
  optimizer          S x 8 (AdamW's two fp32 moments), x (1 - actor.optimizer_offload_fraction)
  gradients          backward: P x dtype bytes (.grad in the params' dtype; with more than one micro-batch the
                     whole set is there while the next micro-batch's activations are); optimizer step: S x 4 (the
                     fp32 grads of this rank's pieces, after the reduce-scatter)
  offload            actor.offload_while_rollout: in generation the actor's weights, master and optimizer are on
                     the host, in the weight sync its master and optimizer (the export reads the weights);
                     ref.offload: the reference keeps its embedding, head and two layers on the GPU (one running,
                     the next arriving); the host's share is listed per GPU (pinned host memory)
  activations        per token of the micro-batch (max(actor.max_tokens_per_micro_batch, the longest sequence),
                     at most the mini-batch's tokens on this DP rank), per layer of the stage, per pipeline
                     micro-batch in flight (1F1B: pp - stage):
                       no recompute    act_none_<fusion> x W,          W = h + (q + kv + ffn) / TP
                                       (sparse layer: ffn / TP -> E + k x (h + moe_intermediate_size / TP))
                       selective (mlp) act_selective x W_attn,         W_attn = h + (q + kv) / TP
                                       (sparse layers: as no recompute; megatron's "mlp" skips MoE layers)
                       full            h x dtype bytes (each layer's input) + one layer's act_full_working x W
  LM head            fused: the fp32 [V/TP, h] weight-grad accumulator + the kernel's working memory (Triton:
                     fused_head_triton_gib; torch: its chunk budget, ops/chunking.py) + the fp32 grad of the
                     hidden [T, h]; unfused: logits_bytes_per_element x T x V/TP
  forward passes     (old log-probs, reference, critic values) one layer's working memory + the head's
  reference          weights only (P x dtype bytes) when actor.use_kl_loss or algorithm.use_kl_in_reward (ref.offload:
                     the embedding, the LM head and two of the stage's layers); none with LoRA (the actor's base,
                     adapters off, is the reference)
  LoRA               actor.lora.rank > 0 (models/megatron/lora.py): the base frozen (weights only: no fp32 master, no
                     AdamW state, no gradients, no LM-head weight grad); the adapters (A_l = r x (in + out) per target
                     per layer, the split half / TP) take weights + fp32 master + AdamW + gradients as a full model's
                     parameters do (the state sharded over DP); vLLM adds one adapter slot (at its max_lora_rank)
  critic             a second trunk with a value head (algorithm.adv_estimator=gae): weights, master, optimizer,
                     and its own update at critic.max_tokens_per_micro_batch
  vLLM               awake: rollout.gpu_memory_utilization x the GPU (weights + KV cache + its activations, what
                     torch counts) + vllm_non_torch_gib (CUDA graphs, workspaces); a fixed KV cache
                     (rollout.kv_cache_memory_gb, or a small model's auto size: rollout/vllm.py auto_kv_cache_bytes)
                     replaces the fraction by weights + KV + vllm_profile_gib; asleep (colocated, during the
                     training phases): 0 (level 2 drops weights and cache, level 1 moves the weights to the host);
                     rollout.free_cache_engine=false: awake in every phase (the training phases hold it too)
  hf engine          awake: weights + KV cache of rollout.max_batch_size sequences + the sampler's logits
                     (HF_SAMPLER_BYTES per row and vocabulary entry); asleep: 0 (as vLLM,
                     awake throughout with rollout.free_cache_engine=false)
  CUDA context       cuda_context_gib per process on the GPU (engines_per_gpu > 1: one more per engine)

The peak of a GPU is the largest phase; a GPU fits when context + (torch peak less vLLM's pool) x (1 +
allocator_slack) + vLLM's pool + vLLM's non-torch part <= its memory, and vLLM's KV cache holds at least one sequence of the model's full length
(vLLM's max_model_len: max_position_embeddings; it refuses to start otherwise).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rltrain.plan import calibration as cal
from rltrain.plan.calibration import GIB
from rltrain.plan.inputs import Inputs, Shape
from rltrain.plan.lora import lora_params, vllm_adapter_slot_params
from rltrain.plan.state import (expert_params_rank, full_params, host_bytes, layer_params, ns,  # noqa: F401
                                optimizer_state, ref_resident_params, role_params, stage_layers, stage_sparse,
                                state_share)
from rltrain.utils import flops

# models/megatron/optim.py STEP_CHUNK_BYTES: the fp32 grads the bf16 step casts at a time
OPTIM_STEP_CHUNK_BYTES = 2**30
# rollout/vllm_args.py MAX_NUM_SEQS (vLLM's default max_num_seqs on a large GPU) and its auto KV-cache rule
VLLM_MAX_NUM_SEQS = 1024
# ops/chunking.py CUDA_CHUNK_BUDGET_BYTES: the torch head's scratch per chunk on CUDA
TORCH_HEAD_CHUNK_BYTES = 2 * 2**30


def widths(shape: Shape, tp: int, *, sparse: bool = False) -> tuple[float, float]:
    """(W, W_attn) of one layer on one TP rank (calibration.py's activation constants are per unit of these). A
    sparse layer's MLP term is its router's scores (E) and, per token, k routed copies of its hidden state (h: the
    dispatched expert input) each through an expert of width moe_intermediate_size / TP, in place of ffn / TP."""
    h, q, kv, ffn = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    w_attn = h + (q + kv) / tp
    if sparse:
        return w_attn + shape.num_experts + shape.num_experts_per_tok * (h + shape.moe_intermediate_size / tp), w_attn
    return h + (q + kv + ffn) / tp, w_attn


def kv_bytes_per_token(shape: Shape, tp: int, dtype_bytes: int) -> float:
    """K and V of every layer for one token on one rank (rollout/vllm.py kv_cache_need_bytes's rule: at least one
    KV head per rank)."""
    return 2 * shape.num_hidden_layers * max(1, shape.num_key_value_heads // tp) * shape.head_dim * dtype_bytes


@dataclass
class Phase:
    name: str
    parts: dict[str, float] = field(default_factory=dict)  # bytes counted by torch's allocator
    non_torch: dict[str, float] = field(default_factory=dict)  # bytes outside it (context, vLLM graphs)
    detail: str = ""

    @property
    def torch_bytes(self) -> float:
        return sum(self.parts.values())

    def device_bytes(self, slack: float) -> float:
        """On the device: the tensors with the caching allocator's slack (vLLM's pool is one block: none), plus the
        memory outside torch."""
        pool = self.parts.get("vllm (weights + KV cache)", 0.0)
        return (self.torch_bytes - pool) * (1 + slack) + pool + sum(self.non_torch.values())


@dataclass
class GPU:
    index: int
    roles: tuple[str, ...]
    stage: int | None  # pipeline stage of the training roles on it
    phases: list[Phase]
    total_bytes: float
    notes: list[str] = field(default_factory=list)
    vllm_in_process: bool = True  # rollout.engines_per_gpu > 1: the engines live in processes of their own
    engine_sleeps: bool = True  # colocated: the rollout engine sleeps through the training phases (free_cache_engine)

    @property
    def slack(self) -> float:
        return cal.value("allocator_slack")

    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.device_bytes(self.slack))

    @property
    def peak_bytes(self) -> float:
        return self.peak().device_bytes(self.slack)

    @property
    def allocator_peak_bytes(self) -> float:
        """What torch.cuda.max_memory_allocated reports on this GPU's process: the largest training phase plus, with
        vLLM in the process, its whole share (sleep frees it outside torch's counters, measured: 63.6 = 39.6 + 23.8
        GiB on one H100), or the largest phase otherwise."""
        vllm = max((p.parts.get("vllm (weights + KV cache)", 0.0) for p in self.phases), default=0.0)
        train = max((p.torch_bytes - p.parts.get("vllm (weights + KV cache)", 0.0) for p in self.phases), default=0.0)
        if not self.vllm_in_process:
            return train
        if vllm and self.roles != ("rollout",):
            return vllm + train
        return max(p.torch_bytes for p in self.phases)

    @property
    def allocator_reserved_bytes(self) -> float:
        """What torch.cuda.max_memory_reserved reports on this GPU's process: as allocator_peak_bytes, the training
        tensors with the caching allocator's slack (vLLM's pool is one block: none). With vLLM in the process this
        counter, like the allocated one, adds vLLM's share to the training peak although the card never holds both
        (sleep unmaps the pool below torch's counters): neither counter is the card's peak (peak_bytes) there."""
        vllm = max((p.parts.get("vllm (weights + KV cache)", 0.0) for p in self.phases), default=0.0)
        train = max(((p.torch_bytes - p.parts.get("vllm (weights + KV cache)", 0.0)) * (1 + self.slack)
                     for p in self.phases), default=0.0)
        if not self.vllm_in_process:
            return train
        if vllm and self.roles != ("rollout",):
            return vllm + train
        return max(p.device_bytes(self.slack) - sum(p.non_torch.values()) for p in self.phases)

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.total_bytes and not self.refusals

    @property
    def sleep_frees_bytes(self) -> float:
        """What the colocated rollout engine's sleep gives back to the training phases (0 when not colocated)."""
        if self.roles == ("rollout",) or "rollout" not in self.roles or not self.engine_sleeps:
            return 0.0
        gen = next((p for p in self.phases if p.name == "generation"), None)
        if gen is None:
            return 0.0
        keys = ("vllm (weights + KV cache)", "hf engine (weights + KV cache + logits)", "vllm CUDA graphs + workspaces")
        return sum(gen.parts.get(k, 0.0) + gen.non_torch.get(k, 0.0) for k in keys)

    @property
    def refusals(self) -> list[str]:
        return [n for n in self.notes if n.startswith("REFUSE:")]


def rows_per_micro_batch(budget: int, seq_len: int) -> int:
    """Sequences of seq_len in one micro-batch of `budget` tokens: whole rows only (models/megatron/micro_batch.py
    groups rows while rows x the longest fits the budget; a longer row gets a micro-batch of its own), so a budget
    of 16,384 holds one 8,197-token sequence, not two."""
    return max(1, budget // max(1, seq_len))


def _mini_batch_rows(x: Inputs) -> int:
    """Sequences of one update mini-batch on one DP rank."""
    return math.ceil(x.ppo_mini_batch_size * x.n / x.dp)


def step_rows(x: Inputs) -> int:
    """Sequences of one step's batch on one DP rank: what its forward passes (old log-probs, reference, values) go
    over."""
    return math.ceil(x.train_batch_size * x.n / x.dp)


def micro_batch_tokens(x: Inputs, budget: int, seq_len: int, rows: int | None = None) -> int:
    """Tokens of the largest micro-batch on one DP rank: the whole rows the budget holds (a longer sequence gets a
    micro-batch of its own), at most `rows` (default: the update's mini-batch rows on the rank)."""
    rows = _mini_batch_rows(x) if rows is None else rows
    return min(rows_per_micro_batch(budget, seq_len), rows) * seq_len


def n_micro_batches(x: Inputs, budget: int, seq_len: int, rows: int | None = None) -> int:
    """Micro-batches of `rows` sequences (default: the update's mini-batch rows on one DP rank) under `budget`."""
    rows = _mini_batch_rows(x) if rows is None else rows
    return max(1, math.ceil(rows / rows_per_micro_batch(budget, seq_len)))


def activation_bytes(x: Inputs, T: int, stage: int) -> tuple[float, str]:
    """Activations one update micro-batch of T tokens keeps on a rank of `stage` (all layers of the stage; a sparse
    layer with its width from widths(): k routed copies of each token through experts of moe_intermediate_size)."""
    shape = x.shape
    flags = stage_sparse(shape, x.pp, stage)
    ws = [widths(shape, x.tp, sparse=bool(f)) for f in flags]
    k_none = cal.value(f"act_none_fusion_{x.fusion}")
    if not x.recompute:
        return k_none * sum(w for w, _ in ws) * T, f"no recompute ({x.fusion} fusion)"
    if x.recompute_granularity == "selective":
        if "mlp" in x.recompute_modules:
            # megatron recomputes the "mlp" of dense layers only: a sparse layer keeps all it would without recompute
            kept = sum(k_none * w if f else cal.value("act_selective") * wa for f, (w, wa) in zip(flags, ws))
            return kept * T, "selective recompute" + (" (MoE layers not recomputed)" if any(flags) else "")
        return k_none * sum(w for w, _ in ws) * T, "selective recompute of core_attn only (counted as none)"
    return (x.dtype_bytes * shape.hidden_size * T * len(flags) + cal.value("act_full_working") * max(w for w, _ in ws)
            * T, "full recompute")


def head_bytes(x: Inputs, T: int, *, backward: bool) -> float:
    """The LM head's memory for T tokens on the last stage (update: with its weight-grad accumulator, which a frozen
    head under LoRA has not)."""
    V_local, h = x.shape.vocab_size / x.tp, x.shape.hidden_size
    if not x.fused_head:
        return cal.value("logits_bytes_per_element") * T * V_local * (1.0 if backward else 0.5)
    if x.logprob_backend == "torch":
        row = V_local * (8 + x.dtype_bytes)
        rows = x.chunk_size or max(1, TORCH_HEAD_CHUNK_BYTES // row)
        working = min(T, rows) * row
    else:
        working = cal.value("fused_head_triton_gib") * GIB
    return working + (((0 if x.lora_rank else 4 * V_local * h) + 4 * T * h) if backward else 0.0)


def forward_bytes(x: Inputs, T: int) -> float:
    """A forward-only pass (old log-probs, reference, values): one layer's working memory and the head's (MoE with
    the legacy engine's grouped GEMM: + one layer's stacked expert weights)."""
    W = max(widths(x.shape, x.tp, sparse=bool(f))[0] for f in set(x.shape.sparse))
    return (cal.value("act_full_working") * W * T + x.dtype_bytes * x.shape.hidden_size * T
            + (local_expert_bytes(x) if grouped_gemm(x) and x.legacy_engine else 0.0))


def grouped_gemm(x: Inputs) -> bool:
    """Whether the actor runs its experts as torch._grouped_mm (actor.moe_grouped_gemm, models/megatron/moe.py): an
    MoE whose expert widths on a rank are multiples of 16 bytes; else megatron's loop over the local experts."""
    s = x.shape
    align = 16 // x.dtype_bytes
    return bool(s.moe and x.moe_grouped_gemm and (2 * s.moe_intermediate_size // x.tp) % (2 * align) == 0
                and s.hidden_size % align == 0)


def local_expert_bytes(x: Inputs) -> float:
    """One sparse layer's local experts (E / EP, each / TP) in the params' dtype: what the grouped GEMM stacks into
    one weight tensor per projection each time the layer runs."""
    s = x.shape
    return s.num_experts / x.ep * flops.expert_params(ns(s)) / x.tp * x.dtype_bytes


def grouped_gemm_update_bytes(x: Inputs, stage: int) -> float:
    """The grouped GEMM's stacked expert weights in an update: saved for the backward by every sparse layer of the
    stage (one with full recompute: the layer being recomputed), + one layer's stacked weight gradient. The engine
    now reads the experts in place (models/megatron/moe.py stacked): 0 but for the legacy engine's runs."""
    if not grouped_gemm(x) or not x.legacy_engine:
        return 0.0
    n = sum(stage_sparse(x.shape, x.pp, stage))
    if x.recompute and x.recompute_granularity == "full":
        n = min(n, 1)
    return (n + 1) * local_expert_bytes(x) if n else 0.0


def vllm_parts(x: Inputs, total_bytes: float) -> tuple[dict[str, float], dict[str, float], list[str], float]:
    """(torch-counted parts, non-torch parts, notes, KV-cache bytes) of the awake vLLM engine(s) on one GPU."""
    shape, rtp = x.shape, x.rollout_tp
    weights = full_params(shape) * x.dtype_bytes / rtp
    if x.lora_rank:
        weights += vllm_adapter_slot_params(x) * x.dtype_bytes / rtp
    kv_tok = kv_bytes_per_token(shape, rtp, x.dtype_bytes)
    u = x.gpu_memory_utilization
    notes: list[str] = []
    fixed = None
    if x.kv_cache_memory_gb is not None:
        fixed = float(x.kv_cache_memory_gb) * GIB
    else:  # rollout/vllm.py auto_kv_cache_bytes: a small model's cache fixed at what it can ever use
        need = max(256 << 20, kv_tok * shape.max_position_embeddings * VLLM_MAX_NUM_SEQS)
        if need <= u * total_bytes / 2:
            fixed = float(need)
            notes.append(f"vLLM KV cache fixed at {need / GIB:.2f} GiB (what {VLLM_MAX_NUM_SEQS} sequences of the "
                         "model's full length need; rollout/vllm.py)")
    k = x.engines_per_gpu
    if fixed is not None:
        kv = fixed
        torch_part = weights * k + kv + cal.value("vllm_profile_gib") * GIB * k
    else:
        torch_part = u * total_bytes
        kv = torch_part - weights * k - cal.value("vllm_profile_gib") * GIB * k
    min_kv = kv_tok * shape.max_position_embeddings * k
    if kv < min_kv:
        notes.append(f"REFUSE: vLLM's KV cache ({max(kv, 0) / GIB:.2f} GiB) cannot hold one sequence of the "
                     f"model's length ({shape.max_position_embeddings} tokens: {min_kv / GIB:.2f} GiB); vLLM will "
                     "not start")
    # measured with CUDA graphs; eager engines are planned the same (not measured apart)
    non_torch = {"vllm CUDA graphs + workspaces": cal.value("vllm_non_torch_gib") * GIB}
    if k > 1:
        non_torch["vllm engine processes' CUDA contexts"] = cal.value("cuda_context_gib") * GIB * k
    return {"vllm (weights + KV cache)": torch_part}, non_torch, notes, kv


# bytes per row and vocabulary entry of the hf engine's decode step, counted from rollout/hf.py sample_next_token (the
# model's bf16 logits; fp32 copy, scaled, log-softmax, softmax): the hf split run's rollout GPU measured
# 3.80 GiB, 3.65 planned with these, 3.14 with one fp32 [rows, vocab]
HF_SAMPLER_BYTES = 2 + 4 * 4


def hf_engine_bytes(x: Inputs) -> float:
    shape = x.shape
    per_worker = math.ceil(x.train_batch_size * x.n / max(1, x.rollout_replicas))
    batch = min(x.max_batch_size, per_worker)
    kv = batch * x.seq_len * kv_bytes_per_token(shape, 1, x.dtype_bytes)
    return full_params(shape) * x.dtype_bytes + kv + batch * shape.vocab_size * HF_SAMPLER_BYTES


def train_static(x: Inputs, stage: int) -> dict[str, float]:
    """Memory the training roles hold through the whole step on a rank of `stage`."""
    shape, dt = x.shape, x.dtype_bytes
    P = role_params(shape, x.tp, x.pp, stage, ep=x.ep)
    master, moments, _ = optimizer_state(x, stage)
    parts = {"actor weights": P * dt, "actor fp32 master": master, "actor optimizer (AdamW)": moments}
    if x.lora_rank:  # the base frozen: weights only; the adapters train (models/megatron/lora.py), their state sharded
        A = lora_params(x, stage_sparse(shape, x.pp, stage))
        S = (A if x.legacy_engine else A / x.dp) * (1 - x.optimizer_offload_fraction)
        parts = {"actor weights (frozen base)": P * dt, "actor LoRA adapters": A * dt,
                 "actor LoRA fp32 master": S * 4 if dt == 2 else 0.0, "actor LoRA optimizer (AdamW)": S * 8}
    if x.use_ref and not x.lora_rank:
        parts["reference weights"] = ref_resident_params(x, stage) * dt
    if x.use_critic:
        Pc = role_params(shape, x.tp, x.pp, stage, critic=True, ep=x.ep)
        c_master, c_moments, _ = optimizer_state(x, stage, critic=True)
        parts.update({"critic weights": Pc * dt, "critic fp32 master": c_master, "critic optimizer (AdamW)": c_moments})
    return {k: v for k, v in parts.items() if v}


def while_engine_awake(x: Inputs, static: dict[str, float], phase: str) -> dict[str, float]:
    """`static` as it is while the colocated engine is awake in `phase` (generation | weight sync): with
    actor.offload_while_rollout the actor's state waits on the host (in the weight sync its weights are still read)."""
    if not x.offload_while_rollout:
        return static
    gone = ("actor fp32 master", "actor optimizer (AdamW)") + (("actor weights",) if phase == "generation" else ())
    return {k: v for k, v in static.items() if k not in gone}


def update_phase(x: Inputs, stage: int, static: dict[str, float], *, critic: bool) -> Phase:
    """The update of the actor (or critic) on a rank of `stage`: the larger of its backward and optimizer step."""
    shape, dt = x.shape, x.dtype_bytes
    P = role_params(shape, x.tp, x.pp, stage, critic=critic, ep=x.ep)
    lora = bool(x.lora_rank) and not critic
    if lora:  # only the adapters have gradients
        P = lora_params(x, stage_sparse(shape, x.pp, stage))
    budget = x.critic_mb_tokens if critic else x.mb_tokens
    T = micro_batch_tokens(x, budget, x.seq_len)
    n_mb = n_micro_batches(x, budget, x.seq_len)
    act, how = activation_bytes(x, T, stage)
    in_flight = min(x.pp - stage, n_mb) if x.pp > 1 else 1
    act *= in_flight
    last = stage == x.pp - 1
    head = head_bytes(x, T, backward=True) if (last and not critic) else 0.0
    who = "critic" if critic else "actor"
    head_grad = (shape.vocab_size * shape.hidden_size / x.tp * dt) if (last and not critic and not lora) else 0.0
    grads_bwd = P * dt if (n_mb > 1 or x.pp > 1) else max(P * dt - act, head_grad)  # grads grow as acts are freed
    backward = {**static, f"{who} activations": act,
                f"{who} gradients": grads_bwd}
    if head:
        backward["LM head (fused working + fp32 weight grad)" if x.fused_head else "LM head (logits)"] = head
    stacked = grouped_gemm_update_bytes(x, stage) * in_flight
    if stacked:
        backward["expert weights stacked for the grouped GEMM"] = stacked
    if x.dp > 1:
        backward["data-parallel grad bucket"] = 64 * 2**20
    # at the step: the grads of this rank's pieces (after the reduce-scatter); bf16 ones cast to fp32 a chunk at a time
    pieces = state_share(x, P, 0.0 if lora else expert_params_rank(shape, x.tp, x.pp, stage, x.ep))
    if dt == 2 and x.legacy_engine:  # the engine before issue 59: every fp32 grad at once
        step = {**static, f"{who} fp32 gradients at the optimizer step": P * 4}
    elif dt == 2:
        step = {**static, f"{who} gradients at the optimizer step (bf16 + one fp32 chunk)":
                pieces * 2 + min(pieces * 4, OPTIM_STEP_CHUNK_BYTES)}
    else:
        step = {**static, f"{who} gradients": pieces * 4}
    b, s = sum(backward.values()), sum(step.values())
    name = f"update ({who})"
    detail = (f"{who} update: micro-batches of {T} tokens ({n_mb} per mini-batch on each DP rank), {how}"
              + (f", {in_flight} in flight (1F1B)" if x.pp > 1 else ""))
    return Phase(name, backward, detail=detail) if b >= s else Phase(name + ", optimizer step", step, detail=detail)


def plan_gpus(x: Inputs, total_bytes: float) -> list[GPU]:
    """Every GPU of the run with its phases (colocated: one group; split: training GPUs, then rollout GPUs)."""
    ctx = {"CUDA context": cal.value("cuda_context_gib") * GIB}
    gpus: list[GPU] = []
    vllm = x.engine == "vllm" and x.device != "cpu"
    roles = ("actor",) + (("ref",) if x.use_ref else ()) + (("critic",) if x.use_critic else ())
    colocated = x.colocated
    dims = x.dims
    # forward passes go over the whole batch in micro-batches of their budget (the actor's and reference's:
    # actor.log_prob_max_tokens_per_micro_batch, else the update's; the critic's values: critic's, no LM head)
    rows = step_rows(x)
    T_fwd, T_values = (micro_batch_tokens(x, budget, x.seq_len, rows)
                       for budget in (x.fwd_mb_tokens, x.critic_mb_tokens))
    for r in range(x.world):
        stage = dims.coordinates(r)["pp"]
        static = train_static(x, stage)
        last = stage == x.pp - 1
        fwd = forward_bytes(x, T_fwd) + (head_bytes(x, T_fwd, backward=False) if last else 0.0)
        if x.use_critic:
            fwd = max(fwd, forward_bytes(x, T_values))
        phases = [Phase("log-probs (forward)", {**static, "forward working memory": fwd}, dict(ctx)),
                  update_phase(x, stage, static, critic=False)]
        phases[-1].non_torch = dict(ctx)
        if x.use_critic:
            phases.append(update_phase(x, stage, static, critic=True))
            phases[-1].non_torch = dict(ctx)
        notes: list[str] = []
        bucket = {"weight-sync bucket": x.weight_sync_bucket_mb * 2**20}
        if colocated:
            if vllm:
                eng, eng_non, vnotes, _ = vllm_parts(x, total_bytes)
                notes += vnotes
            else:
                eng, eng_non = {"hf engine (weights + KV cache + logits)": hf_engine_bytes(x)}, {}
            if not x.free_cache_engine:  # the engine stays awake: its memory beside every training phase
                notes.append("the rollout engine stays awake through the training phases (rollout.free_cache_engine="
                             "false): its weights and KV cache stay beside the log-probs and the update")
                for p in phases:
                    p.parts.update(eng)
                    p.non_torch.update(eng_non)
            phases.insert(0, Phase("generation", {**while_engine_awake(x, static, "generation"), **eng},
                                   {**ctx, **eng_non}))
            phases.append(Phase("weight sync", {**while_engine_awake(x, static, "weight sync"), **eng, **bucket},
                                {**ctx, **eng_non}))
            if host_bytes(x, stage):
                notes.append(f"host memory: {host_bytes(x, stage) / GIB:.1f} GiB pinned for this GPU's offloaded state")
            gpus.append(GPU(r, roles + ("rollout",), stage, phases, total_bytes, notes,
                            vllm_in_process=x.engines_per_gpu == 1, engine_sleeps=x.free_cache_engine))
        else:
            phases.append(Phase("weight sync", {**static, **bucket}, dict(ctx)))
            gpus.append(GPU(r, roles, stage, phases, total_bytes, notes))
    if not colocated:
        n_roll = x.rollout_replicas * x.rollout_tp
        for i in range(n_roll):
            notes = []
            if vllm:
                vparts, vnon, vnotes, _ = vllm_parts(x, total_bytes)
                notes += vnotes
                phases = [Phase("generation", dict(vparts), {**ctx, **vnon}),
                          Phase("weight sync", {**vparts, "weight-sync bucket": x.weight_sync_bucket_mb * 2**20},
                                {**ctx, **vnon})]
            else:
                phases = [Phase("generation", {"hf engine (weights + KV cache + logits)": hf_engine_bytes(x)},
                                dict(ctx))]
            gpus.append(GPU(x.world + i, ("rollout",), None, phases, total_bytes, notes))
    return gpus
