"""Every measured constant of the planner, each with the run it comes from: what the formulas of memory.py and
timing.py cannot know (bytes the layers keep per token, each phase's rates, what vLLM and CUDA take beside the
tensors). A FITTED constant is solved from the run(s) its source names (a results table's row, date, device) by
`python tools/plan_lab.py fit`, which `--write`s them here; every other run is held out and scores the planner
(docs/benchmarks/planner.md). MEASURED constants are read off one run, ASSUMED ones are datasheet or code values.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Iterator

GIB = float(2**30)
RATE_HIDDEN = 1024  # hidden size of the Qwen3-0.6B shape on which the update rates were measured


@dataclass(frozen=True)
class Const:
    value: float
    unit: str
    source: str  # file, date, device, and which row
    kind: str = "fitted"  # fitted | measured (read directly off a run) | assumed (datasheet / code)


@dataclass(frozen=True)
class Device:
    name: str
    total_gib: float  # what torch reports as the GPU's total memory
    hbm_bytes_per_s: float
    source: str


DEVICES: dict[str, Device] = {
    "h100": Device("H100 80GB HBM3", 79.18, 3.35e12,
                   "total: tools/gpu_smoke.py's OOM message (2026-11-22, H100: 'total capacity of 79.18 GiB'); "
                   "HBM: datasheet 3.35 TB/s"),
    "h200": Device("H200", 139.80, 4.8e12,
                   "total: tools/gpu_placements.py's OOM message (2026-11-23, H200: 'total capacity "
                   "of 139.80 GiB'); HBM: datasheet 4.8 TB/s"),
}

# ------------------------------------------------------------------------------------------------ memory
# Activation bytes per token per layer per unit of "width" W = h + (q + kv + ffn) / TP (memory.py), one constant
# per elementwise-fusion mode (how many tensors of each width a Qwen3 layer keeps for its backward).
MEMORY: dict[str, Const] = {
    "act_none_fusion_none": Const(
        8.3114, "B/token/layer/W",
        "update.jsonl, 2026-11-23, H100: row 06b-8k-norms+optim (0.6B, 8,192 tokens, no recompute, "
        "fusion none, engine defaults) peak 21.78 GiB"),
    "act_none_fusion_compile": Const(
        6.4542, "B/token/layer/W",
        "update.jsonl, 2026-11-23, H100: row 06b-8k-all (0.6B, 8,192 tokens, no recompute, "
        "torch.compile of each layer) peak 18.93 GiB"),
    "act_none_fusion_mcore": Const(
        6.8572, "B/token/layer/W",
        "update.jsonl, 2026-11-23, H200: row 06b-8k-mcore-tp2 (0.6B, TP=2, 8,192 tokens, "
        "megatron's fused SwiGLU) peak 10.73 GiB"),
    "act_selective": Const(
        7.5604, "B/token/layer/W_attn",
        "update.jsonl, 2026-11-23, H100: row 06b-32k-all-rc_selective (0.6B, 32,768 tokens, the MLP "
        "recomputed) peak 35.60 GiB; W_attn = h + (q + kv) / TP"),
    "act_full_working": Const(
        6.3931, "B/token/W",
        "update.jsonl, 2026-11-25, H100: row 06b-64k-all-rc_full (0.6B, 65,536 tokens, full "
        "recompute) peak 15.56 GiB; the one layer being recomputed (the kept layer inputs are h x dtype bytes, exact)"),
    "logits_bytes_per_element": Const(
        3.9996, "B/(token x vocab/TP)",
        "update.jsonl, 2026-11-22, H100: rows smoke-32k-unfused-rc1 / smoke-32k-fused-rc1, 32,768 tokens with "
        "full recompute, unfused head 30.87 GiB vs fused 13.40 GiB (trainer.fused_linear_logprob=false keeps the "
        "logits and their gradient)"),
    "fused_head_triton_gib": Const(
        0.376, "GiB", "kernel.jsonl, 2026-11-25, H100: peak extra of the fused head v3 at "
                      "32,768 x 4,096 x 151,936 (0.31-0.38 GiB over the three shapes), the head of the calibration "
                      "runs; the blocking of 2026-11-29 holds 0.249 (rows probe_head_blocking): 0.13 GiB to spare "
                      "until those runs are re-measured", "measured"),
    "allocator_slack": Const(
        0.0769, "fraction of the peak",
        "update.jsonl, 2026-11-23/25, H100/H200: mean of reserved_gib / peak_gib - 1 over the fit rows "
        "(torch's caching allocator holds this much more than the tensors)"),
    "cuda_context_gib": Const(
        0.60, "GiB per process", "tools/gpu_smoke.py, 2026-11-22, H100: its OOM message 'Process 405 has 618.00 MiB "
                                 "memory in use' (a CUDA context with cuBLAS/NCCL workspaces)", "measured"),
    "vllm_non_torch_gib": Const(
        1.4340, "GiB", "rollout.jsonl 'vLLM alone, 256 x (64 + 64)', 2026-11-23, H200: sleep(level 1) freed 71.33 GiB "
                       "at gpu_memory_utilization 0.5 = 69.90 GiB counted by torch + this (CUDA graphs, workspaces)"),
    "vllm_profile_gib": Const(
        1.0, "GiB", "vLLM's peak activation of its profiling run, subtracted from its share before the KV cache "
                    "(an allowance; not measured separately here)", "assumed"),
}

# ------------------------------------------------------------------------------------------------ time
TIME: dict[str, Const] = {
    # achieved TFLOP/s of an update micro-batch on its weight matrices' FLOPs (flops.train_flops less attention_flops)
    "update_tflops_none_none": Const(
        194.5633, "TFLOP/s", "update.jsonl, 2026-11-23, H100: row 06b-8k-norms+optim 0.1896 s for 29.29 "
                          "TFLOP of weight matrices and 23.09 of attention (0.6B, one 8,192-token sequence)"),
    "update_tflops_compile_none": Const(
        276.8382, "TFLOP/s", "update.jsonl, 2026-11-23, H100: row 06b-8k-all 0.1448 s, the same FLOPs"),
    # the 0.6B's rates (h = 1,024); a wider model runs its GEMMs nearer the peak: x (h / 1024)^this
    "update_rate_width_exponent": Const(
        0.4872, "exponent", "update.jsonl, 2026-11-23, H200: row 4b-8k-all (Qwen3-4B shape, h "
                            "2,560, one 8,192-token sequence, torch.compile) 0.5574 s for 197.7 TFLOP of weight "
                            "matrices and 59.4 of attention, against the 0.6B's 06b-8k-all"),
    # the same for the unfused layers (actor.elementwise_fusion=none), whose rate grows faster with the width
    "update_rate_width_exponent_none": Const(
        0.7579, "exponent",
        "placements.jsonl '4B single, 2,048-token responses, forward micro-batches of 32,768', 2026-11-27, H200: "
        "update_actor 8.705 s of the Qwen3-4B shape's GRPO step on one GPU (64 sequences of 2,053 tokens, 8,192-token "
        "micro-batches, 2 optimizer steps; fusion none), against the 0.6B's 06b-8k-norms+optim"),
    # causal attention's FLOPs (flops.attention_flops) in flash attention's kernels, at one rate for every width
    "attention_tflops": Const(
        591.6964, "TFLOP/s", "update.jsonl, 2026-11-23, H100: row 06b-32k-all-rc_selective 1.121 s (0.6B, "
                          "one 32,768-token sequence, selective recompute: 117.2 TFLOP of weight matrices, 369.4 of "
                          "attention)"),
    # activation recompute: one more forward of the recomputed part, as a factor on the update's time
    "recompute_full_time_factor": Const(
        1.2602, "x update time", "update.jsonl, 2026-11-22, H100: rows smoke-8k-fused-rc1 / -rc0, 0.3268 s with full "
                                 "recompute / 0.2593 s without (same engine, same 8,192 tokens)"),
    "recompute_selective_time_factor": Const(
        1.0703, "x update time", "update.jsonl, 2026-11-23, H200: 4b-32k-all-rc_selective 3.807 s "
                                 "/ 4b-32k-all-rc_full 4.483 s x recompute_full_time_factor"),
    # TP with torch.compile's layers: a fixed cost per activation all-reduce of a layer in a micro-batch pass and per
    # doubling of TP, not a fraction of the FLOPs (the 0.6B loses as many seconds per layer as the 4B)
    "tp_allreduce_s": Const(
        0.0008297, "s per TP all-reduce x layer x micro-batch pass",
        "update.jsonl, 2026-11-23, H200: 4b-8k-all 0.5574 s at "
        "TP=1 vs 4b-8k-all-tp2 0.3982 s at TP=2: the TP=2 step less half the TP=1 step, over 36 layers x 4 "
        "all-reduces; torch.compile's layers only: the fusion-none 4B TP=2 GRPO steps of 2026-11-26 show no such "
        "loss"),
    # the update's fixed costs beyond its FLOPs, per layer of a stage, solved together from three runs: per optimizer
    # step, a floor per micro-batch (the host's launches, overlapping the GPU's work) and per update call
    "update_step_layer_s": Const(
        0.0007535, "s per mini-batch x layer",
        "placements.jsonl 'grpo hf', 2026-11-23, H100: update_actor 0.452 s of the Qwen3-0.6B GRPO step (2 "
        "mini-batches of one 8,832-token micro-batch, 28 layers), with the two runs below"),
    "update_mb_layer_s": Const(
        0.004192, "s per update micro-batch x layer (the host's floor)",
        "placements.jsonl '0.6B colocated DP=2, one vLLM engine per GPU (2026-11-27)', 2 x H200: update_actor 0.361 s "
        "(DP=2, 2 optimizer steps of one 4,416-token micro-batch a rank), with the runs above and below"),
    "update_call_layer_s": Const(
        0.003012, "s per update call x layer",
        "placements.jsonl '0.6B colocated DP=2, one vLLM engine per GPU, 64 x 8', 2026-11-26, 2 x H200: "
        "update_actor 0.638 s (DP=2, 4 optimizer steps of one 4,416-token micro-batch a rank), with the two runs "
        "above"),
    # a forward-only micro-batch costs the larger of its FLOPs' time and the host's floor: per layer, a cost and one
    # per row (the 0.6B's short-row passes sit on the floor)
    "fwd_mb_layer_s": Const(
        0.001397, "s per forward micro-batch x layer (the host's floor)",
        "placements.jsonl '0.6B single, 2,048-token responses, forward micro-batches of 4,096', 2026-11-27, "
        "H200: ref 5.01 s of the 0.6B's 128 sequences of 2,053 tokens, one a micro-batch (the 4,096-token "
        "budget), with the run below"),
    "fwd_row_layer_s": Const(
        1.099e-05, "s per row of a forward micro-batch x layer (the host's floor)",
        "placements.jsonl 'grpo hf', 2026-11-23, H100: ref 0.157 s (17,664 tokens in 2 micro-batches of 128 "
        "rows, forward only, 28 layers; their FLOPs' 0.054 s a micro-batch are under the floor), with the run above"),
    # the old log-probs' pass (the actor's engine, with the entropy) over the reference's, per micro-batch
    "old_logprob_mb_s": Const(
        0.009129, "s per old-log-prob micro-batch beyond the reference's (the host's floor)",
        "placements.jsonl '0.6B single, 2,048-token responses, forward micro-batches of 4,096', 2026-11-27, "
        "H200: old_log_prob 6.21 s against ref 5.01 s, 128 one-row micro-batches of 2,053 tokens (the floors "
        "above solved from the reference's pass)"),
    # MoE without the grouped GEMM: megatron-core's SequentialMLP loops over the local experts in Python, a
    # launch-bound cost per expert, layer and forward pass
    "moe_expert_pass_s": Const(
        0.000421, "s per local expert x sparse layer x forward pass",
        "moe.jsonl 'MoE slice EP=2, vLLM', 2026-11-26, 2 x H200: update_actor 1.453 s of the "
        "Qwen3-30B-A3B slice (8 sparse layers, 64 local experts at EP=2, 2 micro-batches of forward + backward = 3 "
        "passes) less its active FLOPs at the update rate and the update's fixed costs"),
    # the grouped GEMM (actor.moe_grouped_gemm): a sparse layer's pass beyond its active FLOPs (permutation, all-to-all)
    "moe_grouped_layer_pass_s": Const(
        0.004167, "s per sparse layer x forward pass",
        "moe.jsonl 'MoE slice EP=2, vLLM, grouped GEMM', 2026-11-26, 2 x H200: update_actor "
        "0.36 s of the Qwen3-30B-A3B slice with the grouped expert GEMM (8 sparse layers, 64 local experts at EP=2, "
        "3 passes) less its active FLOPs at the update rate and the update's fixed costs"),
    # vLLM's host work per decode step: a fixed part (its loop, launches) and a part per sequence of the wave
    "vllm_step_s": Const(
        0.001754, "s per decode step (the engine's fixed host work)",
        "placements.jsonl '0.6B colocated DP=2 / DP=4, one vLLM engine per GPU (a second four-H200 host)', "
        "2026-11-27, 4 x H200, one call: gen 0.359 s (DP=2, 128 sequences an engine) and 0.235 s (DP=4, 64) for "
        "64 decode steps, with vllm_seq_step_s solved at the same time (not kept)"),
    "vllm_seq_step_s": Const(
        3.89e-05, "s per sequence x decode step",
        "placements.jsonl 'placement split 1+1', 2026-11-23, H200: gen 0.757 s for 64 decode steps of 256 "
        "sequences at vllm_step_s (the engine's host work per sequence and step: scheduling, sampling, "
        "detokenizing; 512 sequences took 2.0-2.8x as long as 256 on 2026-11-26)"),
    # a memory-bound decode step (the wave's KV cache outweighs the weights) reads at this share of the datasheet HBM
    "decode_hbm_fraction": Const(
        0.6218, "x datasheet HBM bandwidth",
        "placements.jsonl '0.6B single, 4 x 8 at 8,192-token responses', 2026-11-26, H200: gen 44.59 s for 8,192 "
        "decode steps of 32 sequences (1.2 GB of weights + 15.0 GB of KV cache at the mean context a step)"),
    # the hf engine decodes in eager mode, one Python call per layer a token: launch-bound, per layer and decode step
    "hf_layer_step_s": Const(
        0.00138, "s per layer x decode step",
        "placements.jsonl 'grpo hf', 2026-11-23, H100: gen 2.473 s for 64 decode steps of 256 sequences through "
        "28 layers (rltrain's own decoder, one Python loop per token; the head and the sampler, a few kernels, "
        "are inside the per-layer cost)"),
    "vllm_wake_s": Const(
        0.127, "s", "placements.jsonl 'grpo vllm', 2026-11-23, H100: rollout_wake (level 2)", "measured"),
    "vllm_sleep_s": Const(
        0.041, "s", "placements.jsonl 'grpo vllm', 2026-11-23, H100: rollout_sleep (level 2)", "measured"),
    # the level-2 wake grows with the model (its weights' memory mapped again): per GB of its bf16 weights on a GPU
    "vllm_wake_s_per_gb": Const(
        0.01737, "s per GB of the engine's weights on a GPU",
        "placements.jsonl 'grpo vllm, Qwen3-4B shape, one GPU', 2026-11-26, H200: rollout_sleep + update_weights "
        "of the Qwen3-4B shape's one-GPU step (8.0 GB), with the run below"),
    # a host's GPUs sleep and wake their engines at once; the step waits for the slowest
    "vllm_rank_sync_factor": Const(
        0.3882, "x (GPUs on the host - 1), on the sleep and wake",
        "placements.jsonl '0.6B colocated DP=2, one vLLM engine per GPU, 64 x 8', 2026-11-26, 2 x H200: "
        "rollout_sleep 0.10 + rollout_wake 0.18 s (DP=2, an engine per GPU), with the run above"),
    # the hf engine's level-1 sleep copies its weights into pinned host copies and its wake back: per byte
    "hf_offload_s_per_gb": Const(
        0.08459, "s/GB", "placements.jsonl 'hf engine, pinned sleep, 0.6B single', 2026-11-26, H200: "
                        "rollout_sleep 0.035 + rollout_wake 0.066 s for the 0.6B's 1.19 GB of bf16 weights (level 1: "
                        "to the pinned host copies and back; steps 3..)"),
    "hf_reload_s_per_tensor": Const(
        8.085e-05, "s per checkpoint tensor", "placements.jsonl 'hf engine, pinned sleep, 0.6B single', "
                                            "2026-11-26, H200: update_weights 0.091 - wake 0.066 s for the 0.6B's "
                                            "310 tensors (the hf engine's copy_ of each)"),
    "reload_s_per_tensor": Const(
        0.0005198, "s per checkpoint tensor", "placements.jsonl 'grpo vllm', 2026-11-23, H100: update_weights 0.288 "
                                            "- wake 0.127 s for the 0.6B's 310 tensors (colocated in-place reload)"),
    # an MoE checkpoint's expert tensors, each copied by vLLM's expert loader into its layer's stacked weight
    "reload_s_per_expert_tensor": Const(
        0.0003371, "s per expert tensor",
        "moe.jsonl 'MoE slice EP=2, vLLM', 2026-11-26, 2 x H200: rollout_sleep + update_weights of the "
        "Qwen3-30B-A3B slice (8 layers x 128 experts x 3 tensors + 75 others; EP=2, vLLM TP=2)"),
    # rollout.engines_per_gpu > 1: engines in their own processes take each bucket by CUDA IPC (rollout/sync/ipc.py)
    "ipc_reload_s_per_tensor": Const(
        0.001049, "s per checkpoint tensor",
        "placements.jsonl 'grpo vllm k4', 2026-11-25, H100: update_weights 0.500 - wake 0.175 s for the "
        "0.6B's 310 tensors sent by CUDA IPC to 4 engines in their own processes"),
    # colocated actor TP > 1 with DP > 1: the host's floors and the weight sync at this factor (measured, not
    # derived: one rank of each TP pair waits in the all-reduce for its peer's host, docs/benchmarks/planner.md)
    "tp_dp_layout_factor": Const(
        1.5587, "x the host's floors and the weight sync of a TP x DP step",
        "the value that plans the layout's nine runs (placements.jsonl, the colocated TP x DP rows of 2026-11-26..27 "
        "on four H100s and four H200s, eight hosts) at their measured steps in the geometric mean"),
    # the host's speed across machines, x the planned host time: only the plan's range (timing.step_range) uses them
    "host_speed_low": Const(
        0.5884, "x the planned host time",
        "the fastest of the 0.6B one-GPU step's twenty runs (placements.jsonl '0.6B single, 32 x 8', 2026-11-26, "
        "H200: 1.360 s)"),
    "host_speed_high": Const(
        1.7216, "x the planned host time",
        "the slowest of the 0.6B one-GPU step's twenty runs (placements.jsonl '0.6B single, 32 x 8 (the "
        "four-H200 host)', 2026-11-27, H200: 2.824 s)"),
    # split: each checkpoint tensor by NCCL broadcast, loaded as it comes: a cost per tensor + the bytes at NCCL's
    "split_sync_s_per_tensor": Const(
        0.0006096, "s per checkpoint tensor",
        "placements.jsonl 'placement split 1+1', 2026-11-23, H200: update_weights 0.192 s - 1.19 GB at "
        "nccl_broadcast_gb_s, for the 0.6B's 310 tensors"),
    "nccl_broadcast_gb_s": Const(
        368.0, "GB/s", "issue #35's NCCL measurement, 2026-11-25, 2 x H100: broadcast bus bandwidth at 1 GiB",
        "measured"),
    # offload (models/megatron/offload.py): pinned host copies, a host's GPUs at once, and a CPU AdamW
    "host_copy_gb_s": Const(
        20.0, "GB/s per GPU, each direction",
        "assumed: PCIe Gen5 x16 (about 50 GB/s a direction nominal), halved for four GPUs copying at once; not "
        "measured yet (the offload runs of issue 59 will)", "assumed"),
    # rollout.direct_expert_sync_after: expert tensors written into vLLM's fused blocks (rollout/vllm_experts.py)
    "direct_expert_s_per_tensor": Const(
        2e-5, "s per expert tensor",
        "assumed: a dict insert and a regex match per tensor, two copies of the layer's bytes at HBM speed; not "
        "measured yet (the Qwen3-30B-A3B run of issue 59 will)", "assumed"),
    "host_adam_params_per_s": Const(
        2.0e8, "parameters per second per rank",
        "assumed: torch's CPU AdamW reads and writes 28 bytes a parameter, a few threads of a rank at about 6 GB/s; "
        "not measured", "assumed"),
}


def value(name: str) -> float:
    """A constant by name (MEMORY or TIME)."""
    return (MEMORY.get(name) or TIME[name]).value


def all_constants() -> dict[str, Const]:
    return {**MEMORY, **TIME}


@contextlib.contextmanager
def override(name: str, new_value: float) -> Iterator[None]:
    """Plan with constant `name` at `new_value` inside the block (a what-if, or the lab's solve for its value)."""
    table = MEMORY if name in MEMORY else TIME
    old = table[name]
    table[name] = dataclasses.replace(old, value=new_value)
    try:
        yield
    finally:
        table[name] = old
