"""Scaling model of a GRPO step: per-phase seconds, tokens/s per GPU and memory of the Qwen3-4B and Qwen3-8B shapes
at 8, 64 and 512 GPUs, colocated and split, from the one- and two-GPU measurements (scaling_inputs.py). Pure
Python over the inputs it is given (must not read files: scaling_inputs.py does). scaling_report.py prints it.

How a phase is modelled (docs/benchmarks/placements.md lists every input with its source):
- actor update, old_log_prob, ref: model FLOPs (rltrain.utils.flops.train_flops; forward = 1/3) divided by a
  measured rate (MFU of a measured update step; the forward phases at the measured forward/update rate ratio
  of the GRPO run), split over TP x PP ranks at a TP efficiency, plus a 1F1B pipeline bubble, plus the bytes of
  the TP all-reduces, the PP activations and the data-parallel gradient all-reduce at NCCL bus bandwidth
  (the engine all-reduces bf16 grads in 64 MiB buckets started during the last micro-batch's backward: what
  that backward does not hide is exposed; under pipeline parallelism the buckets start after it).
- generation (vLLM): per decode step a fixed overhead + max(weight bytes / HBM bandwidth, GEMM FLOPs / GEMM
  rate) + KV-cache bytes / HBM bandwidth + 2 all-reduces per layer at TP > 1; per generate call a fixed cost;
  the overheads fitted to the measured vLLM points (issue 21), the HBM bandwidth an assumption.
- weight sync: bf16 weights gathered over the actor's TP/PP groups, sent to every replica (split: one NCCL
  broadcast from train rank 0), loaded at rltrain.plan's measured cost per checkpoint tensor; colocated adds
  vLLM's level-2 sleep + wake (rltrain.plan's constants: one rule for both models).
- the two step levers (Recipe): actor.recompute_old_logprobs=false drops the old-log-prob forward (the update's
  first forward gives them, on-policy), rollout.free_cache_engine=false the colocated sleep + wake (the engine's
  share then stays beside the update: the memory rows below do not count the update's activations either way).
"""

from __future__ import annotations

import dataclasses
import math

from rltrain.config.schema import ActorConfig, ModelConfig
from rltrain.plan.inputs import Shape, model_shape
from rltrain.plan.memory import kv_bytes_per_token
from rltrain.plan.timing import inplace_reload_seconds, vllm_sleep_wake_seconds, weight_tensors
from rltrain.utils.flops import matmul_params, num_params, train_flops

GB = 1e9
DP_BUCKET_BYTES = int(ActorConfig.grad_reduce_bucket_mb * 2**20)  # the engine's default bucket


@dataclasses.dataclass(frozen=True)
class Num:
    """One input: its value, where it comes from, and whether it was measured (else: a labelled assumption)."""
    value: float
    source: str
    measured: bool


def shape(name: str) -> Shape:
    """A Qwen3 preset's shape (qwen3-0.6b, qwen3-4b, qwen3-8b) as utils/flops.py reads it."""
    return model_shape(ModelConfig(builtin=name))


# --------------------------------------------------------------------------- calibration
@dataclasses.dataclass(frozen=True)
class DecodeCal:
    call_s: float  # per generate call (scheduling, first prefill launch, outputs)
    step_s: float  # per decode step on top of bytes and FLOPs (scheduler, sampler over V=151,936)
    lat_ar_s: float  # per TP all-reduce in a decode step


def decode_step_terms(cfg, batch: int, ctx: float, tp: int, hbm_bw: float, gemm: float) -> dict:
    """One decode step of `batch` sequences at mean context `ctx`, per GPU of a TP group (bytes and seconds)."""
    w_bytes = 2 * matmul_params(cfg) / tp
    kv_bytes = batch * ctx * kv_bytes_per_token(cfg, tp, 2)  # bf16, per rank (the planner's rule)
    flops = 2 * matmul_params(cfg) * batch / tp
    return {"weight_bytes": w_bytes, "kv_bytes": kv_bytes,
            "mem_s": max(w_bytes / hbm_bw, flops / gemm) + kv_bytes / hbm_bw}


def gen_seconds(cfg, batch: int, prompt: int, response: int, tp: int, hbm_bw: float, gemm: float,
                cal: DecodeCal) -> dict:
    """A generate call of `batch` sequences on one replica: prefill at the GEMM rate, `response` decode steps at
    the mean context prompt + (response + 1) / 2 (the KV bytes grow linearly, so the mean is exact)."""
    prefill_s = 2 * matmul_params(cfg) * batch * prompt / (tp * gemm)
    t = decode_step_terms(cfg, batch, prompt + (response + 1) / 2, tp, hbm_bw, gemm)
    ar_s = 2 * cfg.num_hidden_layers * cal.lat_ar_s if tp > 1 else 0.0
    step = cal.step_s + t["mem_s"] + ar_s
    return {"s": cal.call_s + prefill_s + response * step, "step_s": step, "kv_bytes_step": t["kv_bytes"],
            "weight_bytes_step": t["weight_bytes"], "ar_s": response * ar_s, "overhead_s": response * cal.step_s,
            "steps": response}


def fit_decode(inp: dict[str, Num]) -> DecodeCal:
    """Per-call and per-step overheads from the two one-H100 points (A: 64+64, B: 128+1024; HBM bandwidth
    assumed), then the TP all-reduce latency from the two-H200 TP=2 point (C) with those overheads."""
    cfg, gemm = shape("qwen3-0.6b"), inp["gemm_tflops_h100"].value
    zero = DecodeCal(0.0, 0.0, 0.0)
    pts = [(inp["vllm_a_s"].value, 64, 64), (inp["vllm_b_s"].value, 128, 1024)]
    # measured = call + R * step + rest(R)  ->  two linear equations in (call, step)
    rest = [(t - gen_seconds(cfg, 256, p, r, 1, inp["hbm_bw_h100"].value, gemm, zero)["s"], r) for t, p, r in pts]
    (ya, ra), (yb, rb) = rest
    step = (yb - ya) / (rb - ra)
    call = ya - ra * step
    base = gen_seconds(cfg, 256, 128, 1024, 2, inp["hbm_bw_h200"].value, gemm, DecodeCal(call, step, 0.0))["s"]
    lat = (inp["vllm_c_s"].value - base) / (1024 * 2 * cfg.num_hidden_layers)
    return DecodeCal(call, step, lat)


# --------------------------------------------------------------------------- layouts and the step
@dataclasses.dataclass(frozen=True)
class Recipe:
    """The weak-scaling workload: the same sequences per GPU at every scale (global batch grows with GPUs)."""
    seqs_per_gpu: int = 64  # e.g. 8 prompts x 8 samples per GPU: 512 sequences on one node
    prompt_len: int = 512
    response_len: int = 2048  # every response this long (vLLM without EOS): gen waits for the longest anyway
    minibatches: int = 2  # optimizer steps per GRPO step (ppo_mini_batch_size = half the batch)
    mb_tokens: int = 8192  # actor.max_tokens_per_micro_batch: the measured update shape (4B at TP=1: 114.7 GiB)
    kl_ref: bool = True  # a reference forward (KL loss), as the measured GRPO run
    recompute_old_logprobs: bool = True  # actor.recompute_old_logprobs=false: the update's forward gives them (on-policy)
    free_cache_engine: bool = True  # rollout.free_cache_engine=false: colocated vLLM stays awake (no sleep, no wake)

    @property
    def seq_len(self) -> int:
        return self.prompt_len + self.response_len


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    n_gpus: int
    placement: str  # "colocated" | "split"
    tp: int
    pp: int
    rollout_tp: int
    train_gpus: int
    rollout_gpus: int

    @property
    def dp(self) -> int:
        return self.train_gpus // (self.tp * self.pp)

    @property
    def replicas(self) -> int:
        return self.rollout_gpus // self.rollout_tp

    def describe(self) -> str:
        if self.placement == "colocated":
            return (f"TP{self.tp} PP{self.pp} DP{self.dp}; {self.replicas} x vLLM TP{self.rollout_tp} on the same "
                    f"{self.n_gpus} GPUs")
        return (f"train {self.train_gpus} GPUs TP{self.tp} PP{self.pp} DP{self.dp}; rollout {self.rollout_gpus} GPUs "
                f"= {self.replicas} x vLLM TP{self.rollout_tp}")


def colocated(n: int, tp: int, pp: int, rtp: int) -> Layout:
    return Layout(f"{n} GPUs colocated", n, "colocated", tp, pp, rtp, n, n)


def _collective_s(nbytes: float, ranks: int, busbw: float, lat: float, kind: str = "all_reduce") -> float:
    """nccl-tests' bus-bandwidth convention: all-reduce moves 2(n-1)/n of the buffer per rank, all-gather and
    reduce-scatter (n-1)/n, broadcast 1x."""
    if ranks <= 1:
        return 0.0
    factor = {"all_reduce": 2 * (ranks - 1) / ranks, "all_gather": (ranks - 1) / ranks, "broadcast": 1.0}[kind]
    return nbytes * factor / busbw + lat


def _net(inp: dict[str, Num], gpus: int) -> tuple[float, float]:
    """Bus bandwidth and per-collective latency of a group spread over `gpus` consecutive GPUs (8 per node):
    NVLink inside a node; across k nodes the network bandwidth and 2 log2(k) network hops more."""
    nodes = math.ceil(gpus / inp["gpus_per_node"].value)
    if nodes <= 1:
        return inp["busbw_intra"].value, inp["lat_intra_s"].value
    return inp["busbw_inter"].value, inp["lat_intra_s"].value + 2 * math.log2(nodes) * inp["lat_hop_inter_s"].value


@dataclasses.dataclass(frozen=True)
class Eff:
    """Compute rates: update MFU, forward phases relative to it, and TP=2 efficiency."""
    mfu_update: float
    ratio_old: float
    ratio_ref: float
    tp_eff: float


def efficiencies(inp: dict[str, Num], name: str, grpo06b: bool = False) -> Eff:
    """Forward/update rate ratios from the measured GRPO run (FLOPs per second of old_log_prob and ref against
    the update's); update MFU from the measured long-sequence update step of that shape."""
    upd, old, ref = (inp[f"grpo06b_{p}_s"].value for p in ("update_actor", "old_log_prob", "ref"))
    ratio_old, ratio_ref = upd / (3 * old), upd / (3 * ref)
    if grpo06b:
        cfg = shape("qwen3-0.6b")
        tok = inp["grpo06b_tokens"].value
        mfu = train_flops(cfg, tok, tok / inp["grpo06b_seqs"].value) / upd / inp["peak_flops"].value
        return Eff(mfu, ratio_old, ratio_ref, 1.0)
    key = {"qwen3-0.6b": "mfu_update_06b", "qwen3-4b": "mfu_update_4b", "qwen3-8b": "mfu_update_8b"}[name]
    if name == "qwen3-0.6b":
        tp_eff = inp["tp1_step_06b_s"].value / (2 * inp["tp2_step_06b_s"].value)
    else:
        tp_eff = inp["tp_eff_big"].value
    return Eff(inp[key].value, ratio_old, ratio_ref, tp_eff)


def train_phases(cfg, layout: Layout, recipe: Recipe, eff: Eff, inp: dict[str, Num], n_seqs: int) -> dict:
    """old_log_prob, ref and update_actor on the training GPUs: seconds and the bytes each rank moves."""
    gpn = int(inp["gpus_per_node"].value)
    tp, pp, dp = layout.tp, layout.pp, layout.dp
    peak = inp["peak_flops"].value
    tokens_dp = n_seqs * recipe.seq_len / dp  # per data-parallel rank
    n_mb = max(1, math.ceil(tokens_dp / recipe.mb_tokens))
    mb_tok = min(recipe.mb_tokens, tokens_dp)
    tp_eff = eff.tp_eff if tp > 1 else 1.0
    flops = train_flops(cfg, tokens_dp, recipe.seq_len) / (tp * pp)  # per GPU
    # TP: 2 all-reduces of the [tokens, hidden] bf16 activations per layer forward, 2 more backward (no SP, no
    # recompute); inside a node (TP divides the node)
    ar_bytes = mb_tok * cfg.hidden_size * 2
    bw_in, lat_in = _net(inp, tp)
    tp_ar_s = _collective_s(ar_bytes, tp, bw_in, lat_in)
    layers = cfg.num_hidden_layers / pp
    # PP: one [tokens, hidden] bf16 activation forward and its grad backward per micro-batch per stage boundary
    pp_bytes = mb_tok * cfg.hidden_size * 2
    pp_bw = inp["p2p_inter"].value if tp * pp > gpn else inp["busbw_intra"].value
    # DP: bf16 grads of this rank's parameters in DP_BUCKET_BYTES buckets (models/megatron/shards.py), one
    # all-reduce each, started as the last micro-batch's backward completes them (not under PP)
    grad_bytes = 2 * num_params(cfg) / (tp * pp)
    n_buckets = max(1, math.ceil(grad_bytes / DP_BUCKET_BYTES))
    bw_dp, lat_dp = _net(inp, layout.train_gpus)
    dp_s = _collective_s(grad_bytes, dp, bw_dp, 0.0) + (n_buckets * lat_dp if dp > 1 else 0.0)

    def phase(compute_s: float, n_ar_per_layer: int, backward: bool, m: int) -> dict:
        bubble = compute_s * (pp - 1) / m if pp > 1 else 0.0
        tp_s = n_mb * layers * n_ar_per_layer * tp_ar_s
        pp_s = n_mb * (2 if backward else 1) * pp_bytes / pp_bw if pp > 1 else 0.0
        return {"compute_s": compute_s, "bubble_s": bubble, "tp_comm_s": tp_s, "pp_comm_s": pp_s,
                "tp_bytes": n_mb * layers * n_ar_per_layer * ar_bytes * (2 * (tp - 1) / tp if tp > 1 else 0.0),
                "pp_bytes": n_mb * (2 if backward else 1) * pp_bytes if pp > 1 else 0.0}

    fwd = flops / 3 / (peak * eff.mfu_update * tp_eff)
    out = {"old_log_prob": phase(fwd / eff.ratio_old, 2, False, n_mb) if recipe.recompute_old_logprobs else None}
    out["ref"] = phase(fwd / eff.ratio_ref, 2, False, n_mb) if recipe.kl_ref else None
    m_upd = max(1, n_mb // recipe.minibatches)
    upd = phase(flops / (peak * eff.mfu_update * tp_eff), 4, True, m_upd)
    if pp == 1:  # hidden behind the last micro-batch's backward (2/3 of its compute), except the last bucket:
        # the input embedding's (registered first, its grad completes last), alone or with other tensors
        last_bwd_s = upd["compute_s"] / recipe.minibatches / m_upd * 2 / 3
        emb_bytes = 2 * cfg.vocab_size * cfg.hidden_size / tp
        last_s = _collective_s(max(emb_bytes, min(grad_bytes, DP_BUCKET_BYTES)), dp, bw_dp, 0.0) + lat_dp
        dp_exposed = min(dp_s, max(last_s, dp_s - last_bwd_s))
    else:
        dp_exposed = dp_s
    upd["dp_comm_s"] = recipe.minibatches * dp_exposed
    upd["dp_comm_total_s"] = recipe.minibatches * dp_s
    upd["dp_bytes"] = recipe.minibatches * grad_bytes * (2 * (dp - 1) / dp if dp > 1 else 0.0)
    out["update_actor"] = upd
    for v in out.values():
        if v is not None:
            v["s"] = v["compute_s"] + v["bubble_s"] + v["tp_comm_s"] + v["pp_comm_s"] + v.get("dp_comm_s", 0.0)
    out["micro_batches_per_rank"] = n_mb
    return out


def sync_phase(cfg, layout: Layout, inp: dict[str, Num], *, free_cache_engine: bool = True) -> dict:
    """Weight sync: every training rank assembles the bf16 HF model (TP all-gather, PP stage broadcasts),
    the bytes reach each rollout replica (colocated: inside each process; split: one NCCL broadcast from train
    rank 0), and each replica rank loads the checkpoint's tensors one by one at rltrain.plan's cost per tensor
    (colocated: the in-place reload, after the engine's level-2 wake-up; split: as it receives them)."""
    s_bytes = 2 * num_params(cfg)
    bw_in, lat_in = _net(inp, layout.tp)
    gather_s = _collective_s(s_bytes / layout.pp, layout.tp, bw_in, lat_in, "all_gather")
    pp_bw, pp_lat = _net(inp, layout.tp * layout.pp)
    merge_s = _collective_s(s_bytes, layout.pp, pp_bw, pp_lat, "all_gather")
    tensors = weight_tensors(cfg)
    if layout.placement == "split":
        bw, lat = _net(inp, layout.n_gpus)
        send_s = _collective_s(s_bytes, layout.rollout_gpus + 1, bw, lat, "broadcast")
        sleep_wake = 0.0
        load_s = tensors * inp["split_sync_s_per_tensor"].value
    else:
        send_s = 0.0
        awake = not free_cache_engine  # rollout.free_cache_engine=false: the engine never sleeps
        value = lambda k: inp[k].value  # noqa: E731
        gpus_on_host = min(layout.n_gpus, int(inp["gpus_per_node"].value))
        sleep_wake = 0.0 if awake else vllm_sleep_wake_seconds(s_bytes / 1e9 / layout.rollout_tp, gpus_on_host, value)
        load_s = inplace_reload_seconds(cfg, value)
    return {"s": gather_s + merge_s + send_s + load_s, "gather_s": gather_s + merge_s, "send_s": send_s,
            "load_s": load_s, "sleep_wake_s": sleep_wake, "bytes_per_replica": s_bytes, "tensors": tensors,
            "bytes_total": s_bytes * layout.replicas}


def step(name: str, layout: Layout, recipe: Recipe, inp: dict[str, Num], cal: DecodeCal) -> dict:
    """Every phase of one GRPO step for `layout`, the step time, tokens/s per GPU, memory and the limiter."""
    cfg = shape(name)
    n_seqs = recipe.seqs_per_gpu * layout.n_gpus
    eff = efficiencies(inp, name)
    batch = n_seqs // layout.replicas
    gen = gen_seconds(cfg, batch, recipe.prompt_len, recipe.response_len, layout.rollout_tp,
                      inp["hbm_bw_h200"].value, inp["gemm_tflops_h100"].value, cal)
    tr = train_phases(cfg, layout, recipe, eff, inp, n_seqs)
    sync = sync_phase(cfg, layout, inp, free_cache_engine=recipe.free_cache_engine)
    train_s = sum(tr[p]["s"] for p in ("old_log_prob", "ref", "update_actor") if tr[p] is not None)
    phases = {"gen": gen["s"], "old_log_prob": tr["old_log_prob"]["s"] if tr["old_log_prob"] else 0.0,
              "ref": tr["ref"]["s"] if tr["ref"] else 0.0,
              "update_actor": tr["update_actor"]["s"], "update_weights": sync["s"], "sleep_wake": sync["sleep_wake_s"]}
    step_s = sum(phases.values())  # synchronous in both placements (split: the groups take turns)
    tokens = n_seqs * recipe.seq_len
    out = {"shape": name, "layout": dataclasses.asdict(layout), "describe": layout.describe(), "phases": phases,
           "step_s": step_s, "tokens_per_step": tokens, "tok_s_per_gpu": tokens / step_s / layout.n_gpus,
           "gen": gen, "train": tr, "sync": sync, "batch_per_replica": batch, "eff": dataclasses.asdict(eff)}
    if layout.placement == "split":  # one batch in flight (trainer.async_rollout): gen overlaps train + sync
        pipelined = max(gen["s"], train_s + sync["s"])
        out["async_step_s"] = pipelined
        out["async_tok_s_per_gpu"] = tokens / pipelined / layout.n_gpus
    out["memory"] = memory(cfg, layout, recipe, batch, inp)
    out["limits"] = limiter(out)
    return out


def memory(cfg, layout: Layout, recipe: Recipe, batch: int, inp: dict[str, Num]) -> dict:
    """Resident GB per GPU while vLLM generates (actor state stays on the GPU): actor static state, vLLM weights
    and the KV cache of its batch at full length, and the rollout.gpu_memory_utilization range that holds them
    (at most 0.9 of the GPU in all). Activations are not counted: vLLM sleeps during the update, and the
    8k-token micro-batch is the measured one (4B at TP=1: 114.7 GiB peak on one H200, issue 17)."""
    actor = inp["static_bytes_per_param"].value * num_params(cfg) / (layout.tp * layout.pp) / GB
    vllm_w = 2 * num_params(cfg) / layout.rollout_tp / GB
    kv = batch * recipe.seq_len * kv_bytes_per_token(cfg, layout.rollout_tp, 2) / GB
    hbm = inp["hbm_bytes_h200"].value / GB
    if layout.placement == "colocated":  # rollout.gpu_memory_utilization must leave the actor's state room
        resident = actor + vllm_w + kv
        util = ((vllm_w + kv) / hbm, 0.9 - actor / hbm)
    else:  # separate GPUs
        resident = max(actor, vllm_w + kv)
        util = ((vllm_w + kv) / hbm, 0.9) if actor <= 0.9 * hbm else (1.0, 0.0)
    return {"actor_gb": actor, "vllm_weights_gb": vllm_w, "kv_gb": kv, "resident_gb": resident,
            "fits": util[0] <= util[1], "gpu_memory_utilization": util, "hbm_gb": hbm}


def limiter(res: dict) -> str:
    """The largest phase, and the communication term that costs most, in words with its bytes."""
    ph = res["phases"]
    top = max(ph, key=ph.get)
    g, u, s = res["gen"], res["train"]["update_actor"], res["sync"]
    comm = {"DP grad all-reduce": (u.get("dp_comm_s", 0.0), u.get("dp_bytes", 0.0)),
            "TP all-reduces (update)": (u["tp_comm_s"], u["tp_bytes"]),
            "PP bubble (update)": (u["bubble_s"], 0.0),
            "PP activations": (u["pp_comm_s"], u["pp_bytes"]),
            "weight sync load": (s["load_s"], s["bytes_per_replica"]),
            "weight sync send/gather": (s["send_s"] + s["gather_s"], s["bytes_per_replica"]),
            "vLLM TP all-reduces (decode)": (g["ar_s"], 0.0)}
    worst = max(comm, key=lambda k: comm[k][0])
    t, b = comm[worst]
    mem_ms = 1e3 * (g["step_s"] - g["overhead_s"] / g["steps"] - g["ar_s"] / g["steps"])
    words = {"gen": f"gen: decode step {1e3 * g['step_s']:.1f} ms = {mem_ms:.1f} ms reading "
                    f"{g['kv_bytes_step'] / GB:.1f} GB KV + {g['weight_bytes_step'] / GB:.1f} GB weights per GPU, "
                    f"{1e3 * g['overhead_s'] / g['steps']:.1f} ms fixed"
                    + (f", {1e3 * g['ar_s'] / g['steps']:.1f} ms TP all-reduces" if g["ar_s"] else ""),
             "update_actor": "update_actor: compute", "old_log_prob": "old_log_prob: compute", "ref": "ref: compute",
             "update_weights": "weight sync", "sleep_wake": "vLLM sleep/wake"}[top]
    return (f"{words} ({100 * ph[top] / res['step_s']:.0f}%); top overhead: {worst} {t:.2f} s"
            + (f" ({b / GB:.1f} GB)" if b else ""))



# --------------------------------------------------------------------------- what is predicted
# Actor TP x PP and vLLM replica TP per shape, as issue 22 lays them out (4B: actor TP=2 with vLLM TP=2
# replicas; 8B: actor TP=2 x PP=2); smaller machines take the smallest layout that fits.
BASE_LAYOUT = {"qwen3-4b": (2, 1, 2), "qwen3-8b": (2, 2, 2)}
SCALES = (8, 64, 512)
WEAK = (1, 2, 4, 8)


def layout_for(name: str, n: int) -> Layout:
    tp, pp, rtp = BASE_LAYOUT[name]
    while tp * pp > n:  # fewer GPUs than one model instance: drop PP first, then TP
        pp, tp = (1, tp) if pp > 1 else (pp, tp // 2)
    return colocated(n, tp, pp, min(rtp, n))


def best_split(name: str, n: int, recipe: Recipe, inp: dict[str, Num], cal: DecodeCal) -> dict | None:
    """The split layout (rollout GPUs in whole replicas, training GPUs in whole TP x PP instances) with the
    shortest synchronous step."""
    tp, pp, rtp = BASE_LAYOUT[name]
    best = None
    for r in range(rtp, n, rtp):
        if (n - r) % (tp * pp):
            continue
        lay = Layout(f"{n} GPUs split", n, "split", tp, pp, rtp, n - r, r)
        res = step(name, lay, recipe, inp, cal)
        if best is None or res["step_s"] < best["step_s"]:
            best = res
    return best


def calibration(inp: dict[str, Num], cal: DecodeCal) -> list[dict]:
    """The model run on the measured configurations: each row's model value next to the measurement."""
    cfg = shape("qwen3-0.6b")
    tok, seqs = inp["grpo06b_tokens"].value, int(inp["grpo06b_seqs"].value)
    seq_len = tok / seqs
    rec = Recipe(seqs_per_gpu=seqs, prompt_len=0, response_len=seq_len, minibatches=int(inp["grpo06b_minibatches"].value))
    tr = train_phases(cfg, colocated(1, 1, 1, 1), rec, efficiencies(inp, "qwen3-0.6b", grpo06b=True), inp, seqs)
    # (the weight sync is rltrain.plan's, whose constants docs/plan.md checks against every run; the hf-engine
    # update_weights of this GRPO run is not a vLLM sync and is left out)
    rows = [{"what": f"GRPO 0.6B H100: {p}", "model_s": tr[p]["s"], "measured": inp[f"grpo06b_{p}_s"]}
            for p in ("old_log_prob", "ref", "update_actor")]
    gemm = inp["gemm_tflops_h100"].value
    for key, (p, r, tp, bw) in {"vllm_a_s": (64, 64, 1, "hbm_bw_h100"), "vllm_b_s": (128, 1024, 1, "hbm_bw_h100"),
                                "vllm_c_s": (128, 1024, 2, "hbm_bw_h200")}.items():
        g = gen_seconds(cfg, 256, p, r, tp, inp[bw].value, gemm, cal)
        rows.append({"what": f"vLLM 0.6B 256 x ({p} + {r}) TP={tp}", "model_s": g["s"], "measured": inp[key]})
    # one 8k-token sequence at TP=2, at the TP=1 step's own MFU and the TP efficiency the two steps measure
    mfu_tp1 = train_flops(cfg, 8192, 8192) / inp["tp1_step_06b_s"].value / inp["peak_flops"].value
    t2 = train_phases(cfg, colocated(2, 2, 1, 1), Recipe(seqs_per_gpu=1, prompt_len=0, response_len=8192,
                                                         minibatches=1, kl_ref=False),
                      Eff(mfu_tp1, 1.0, 1.0, efficiencies(inp, "qwen3-0.6b").tp_eff), inp, 1)
    rows.append({"what": "update 0.6B 8k tokens TP=2 (H200)", "model_s": t2["update_actor"]["s"],
                 "measured": inp["tp2_step_06b_s"]})
    return rows


def predict(inp: dict[str, Num], recipe: Recipe) -> dict:
    cal = fit_decode(inp)
    eff06, eff4 = efficiencies(inp, "qwen3-0.6b"), efficiencies(inp, "qwen3-4b")
    res = {"decode_cal": dataclasses.asdict(cal), "recipe": dataclasses.asdict(recipe),
           "derived": {"ratio_old": eff4.ratio_old, "ratio_ref": eff4.ratio_ref, "tp_eff_06b": eff06.tp_eff,
                       "tp_eff_big": eff4.tp_eff},
           "calibration": [{**r, "measured": r["measured"].value, "source": r["measured"].source}
                           for r in calibration(inp, cal)],
           "inputs": {k: dataclasses.asdict(v) for k, v in inp.items()}, "predictions": [], "weak": []}
    for name in BASE_LAYOUT:
        for n in SCALES:
            res["predictions"].append(step(name, layout_for(name, n), recipe, inp, cal))
            split = best_split(name, n, recipe, inp, cal)
            if split is not None:
                res["predictions"].append(split)
        base = None
        for n in WEAK:
            r = step(name, layout_for(name, n), recipe, inp, cal)
            if base is None and r["memory"]["fits"]:
                base = r
            r["weak_eff"] = r["tok_s_per_gpu"] / base["tok_s_per_gpu"] if base and r["memory"]["fits"] else None
            r["weak_base_gpus"] = base["layout"]["n_gpus"] if base else None
            res["weak"].append(r)
        eight = next(p for p in res["predictions"] if p["shape"] == name and p["layout"]["n_gpus"] == 8
                     and p["layout"]["placement"] == "colocated")
        for p in res["predictions"]:
            if p["shape"] == name and p["layout"]["placement"] == "colocated":
                p["eff_vs_8"] = p["tok_s_per_gpu"] / eight["tok_s_per_gpu"]
    return res
