"""Peak memory per GPU and phase, by part. Pure arithmetic on the shape and the config (no torch).

Each GPU (colocated: every role on each; split: the training GPUs, then the rollout GPUs) has its phases (generation,
log-probs, update, weight sync), each a dict of parts in bytes: the training roles' weights, fp32 masters, AdamW
moments and gradients (plan/state.py: a rank's parameters and its share of the sharded state; LoRA: plan/lora.py),
activations by recompute mode, the LM head, the forward passes' working memory, the rollout engine awake or asleep,
the CUDA contexts. A GPU's peak is its largest phase on the device: the tensors less vLLM's pool x (1 +
allocator_slack), plus the pool and what lies outside torch; it fits when that is at most its memory and nothing is
refused (vLLM's KV cache must hold one sequence of max_position_embeddings). Each part's formula and its sources:
docs/plan.md, "The model".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rltrain.plan import calibration as cal
from rltrain.plan.calibration import GIB
from rltrain.plan.inputs import Inputs, Shape
from rltrain.plan.lora import lora_params, vllm_adapter_slot_params
from rltrain.plan.state import (expert_params_rank, full_params, host_bytes, layer_params,  # noqa: F401
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
    """(W, W_attn) of one layer on one TP rank, the units of calibration.py's activation constants (a sparse layer: its
    router's scores and k routed copies of each token through experts of moe_intermediate_size / TP)."""
    h, q, kv, ffn = shape.hidden_size, shape.q_dim, shape.kv_dim, shape.intermediate_size
    w_attn = h + (q + kv) / tp
    if sparse:
        return w_attn + shape.num_experts + shape.num_experts_per_tok * (h + shape.moe_intermediate_size / tp), w_attn
    return h + (q + kv + ffn) / tp, w_attn


def kv_bytes_per_token(shape: Shape, tp: int, dtype_bytes: int) -> float:
    """K and V of every layer for one token on one rank (at least one KV head a rank, as rollout/vllm.py counts)."""
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
        """On the device: the tensors x (1 + slack) (vLLM's pool is one block: none), plus the memory outside torch."""
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

    def _allocator_bytes(self, slack: float) -> float:
        """torch's counters on this GPU's process: the largest training phase (tensors x (1 + slack); vLLM's pool is
        one block) plus, with vLLM in the process, its whole share: sleep frees it below torch's counters, so neither
        counter is the card's peak there (measured: 63.6 = 39.6 + 23.8 GiB on one H100); else the largest phase."""
        vllm = max((p.parts.get("vllm (weights + KV cache)", 0.0) for p in self.phases), default=0.0)
        train = max(((p.torch_bytes - p.parts.get("vllm (weights + KV cache)", 0.0)) * (1 + slack)
                     for p in self.phases), default=0.0)
        if not self.vllm_in_process:
            return train
        if vllm and self.roles != ("rollout",):
            return vllm + train
        return max(p.device_bytes(slack) - sum(p.non_torch.values()) if slack else p.torch_bytes for p in self.phases)

    @property
    def allocator_peak_bytes(self) -> float:
        """What torch.cuda.max_memory_allocated reports on this GPU's process."""
        return self._allocator_bytes(0.0)

    @property
    def allocator_reserved_bytes(self) -> float:
        """What torch.cuda.max_memory_reserved reports on this GPU's process (the caching allocator's slack)."""
        return self._allocator_bytes(self.slack)

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
    """Sequences of seq_len in one micro-batch of `budget` tokens: whole rows only, a longer row alone (as
    models/megatron/micro_batch.py groups them: 16,384 tokens hold one 8,197-token sequence, not two)."""
    return max(1, budget // max(1, seq_len))


def step_rows(x: Inputs) -> int:
    """Sequences of one step's batch on one DP rank (what the forward passes go over)."""
    return math.ceil(x.train_batch_size * x.n / x.dp)


def micro_batch_tokens(x: Inputs, budget: int, seq_len: int, rows: int | None = None) -> int:
    """Tokens of the largest micro-batch on one DP rank, of at most `rows` (default: the update's mini-batch's)."""
    rows = math.ceil(x.ppo_mini_batch_size * x.n / x.dp) if rows is None else rows
    return min(rows_per_micro_batch(budget, seq_len), rows) * seq_len


def n_micro_batches(x: Inputs, budget: int, seq_len: int, rows: int | None = None) -> int:
    """Micro-batches of `rows` sequences (default: the update's mini-batch's on one DP rank) under `budget`."""
    rows = math.ceil(x.ppo_mini_batch_size * x.n / x.dp) if rows is None else rows
    return max(1, math.ceil(rows / rows_per_micro_batch(budget, seq_len)))


def activation_bytes(x: Inputs, T: int, stage: int) -> tuple[float, str]:
    """Activations one update micro-batch of T tokens keeps on a rank of `stage` (all layers of the stage)."""
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
    """The LM head's memory for T tokens on the last stage (backward: + its weight-grad accumulator, not LoRA's)."""
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
    """A forward-only pass: one layer's working memory (the legacy engine's grouped GEMM: + its stacked experts)."""
    W = max(widths(x.shape, x.tp, sparse=bool(f))[0] for f in set(x.shape.sparse))
    return (cal.value("act_full_working") * W * T + x.dtype_bytes * x.shape.hidden_size * T
            + (local_expert_bytes(x) if grouped_gemm(x) and x.legacy_engine else 0.0))


def grouped_gemm(x: Inputs) -> bool:
    """Whether the actor runs its experts as torch._grouped_mm (actor.moe_grouped_gemm; expert widths on a rank a
    multiple of 16 bytes), else megatron's loop over the local experts."""
    s = x.shape
    align = 16 // x.dtype_bytes
    return bool(s.moe and x.moe_grouped_gemm and (2 * s.moe_intermediate_size // x.tp) % (2 * align) == 0
                and s.hidden_size % align == 0)


def local_expert_bytes(x: Inputs) -> float:
    """One sparse layer's local experts (E / EP, each / TP) in bytes: what the legacy grouped GEMM stacked per call."""
    s = x.shape
    return s.num_experts / x.ep * flops.expert_params(s) / x.tp * x.dtype_bytes


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


# bytes per row and vocabulary entry of the hf engine's decode step (rollout/hf.py sample_next_token: the bf16 logits
# and four fp32 copies)
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
    """`static` while the colocated engine is awake in `phase`: actor.offload_while_rollout's state on the host."""
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


def _engine(x: Inputs, total_bytes: float, vllm: bool) -> tuple[dict[str, float], dict[str, float], list[str]]:
    """(torch-counted parts, non-torch parts, notes) of the awake rollout engine on one GPU."""
    if vllm:
        eng, eng_non, notes, _ = vllm_parts(x, total_bytes)
        return eng, eng_non, notes
    return {"hf engine (weights + KV cache + logits)": hf_engine_bytes(x)}, {}, []


def plan_gpus(x: Inputs, total_bytes: float) -> list[GPU]:
    """Every GPU of the run with its phases (colocated: one group; split: training GPUs, then rollout GPUs)."""
    ctx = {"CUDA context": cal.value("cuda_context_gib") * GIB}
    bucket = {"weight-sync bucket": x.weight_sync_bucket_mb * 2**20}
    gpus: list[GPU] = []
    vllm = x.engine == "vllm" and x.device != "cpu"
    roles = ("actor",) + (("ref",) if x.use_ref else ()) + (("critic",) if x.use_critic else ())
    # forward passes go over the whole batch in micro-batches of their budget (the actor's and reference's:
    # actor.log_prob_max_tokens_per_micro_batch, else the update's; the critic's values: critic's, no LM head)
    rows = step_rows(x)
    T_fwd, T_values = (micro_batch_tokens(x, budget, x.seq_len, rows)
                       for budget in (x.fwd_mb_tokens, x.critic_mb_tokens))
    for r in range(x.world):
        stage = x.dims.coordinates(r)["pp"]
        static = train_static(x, stage)
        last = stage == x.pp - 1
        fwd = forward_bytes(x, T_fwd) + (head_bytes(x, T_fwd, backward=False) if last else 0.0)
        if x.use_critic:
            fwd = max(fwd, forward_bytes(x, T_values))
        phases = [Phase("log-probs (forward)", {**static, "forward working memory": fwd}),
                  update_phase(x, stage, static, critic=False)]
        if x.use_critic:
            phases.append(update_phase(x, stage, static, critic=True))
        for p in phases:
            p.non_torch = dict(ctx)
        if not x.colocated:
            phases.append(Phase("weight sync", {**static, **bucket}, dict(ctx)))
            gpus.append(GPU(r, roles, stage, phases, total_bytes, []))
            continue
        eng, eng_non, notes = _engine(x, total_bytes, vllm)
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
    for i in range(0 if x.colocated else x.rollout_replicas * x.rollout_tp):
        eng, eng_non, notes = _engine(x, total_bytes, vllm)
        phases = [Phase("generation", dict(eng), {**ctx, **eng_non})]
        if vllm:
            phases.append(Phase("weight sync", {**eng, **bucket}, {**ctx, **eng_non}))
        gpus.append(GPU(x.world + i, ("rollout",), None, phases, total_bytes, notes))
    return gpus
