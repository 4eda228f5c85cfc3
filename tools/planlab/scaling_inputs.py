"""The inputs of the scaling model (scaling.py): the measured numbers, read from the results tables (tools/results/,
tools/harness/results.py) or quoted from the issue that holds them, the labelled assumptions, and the measured NCCL / update numbers of --nccl-json and
--bench-update-json that replace assumptions. Must not compute a prediction: scaling.py does.
"""

from __future__ import annotations

import json

from harness import results as tables
from planlab.cases import DEFAULT_RESULTS
from planlab.scaling import Num, fit_decode

from rltrain.plan import calibration as cal
from rltrain.utils.errors import UserError
from rltrain.utils.flops import peak_flops


class InputError(UserError, ValueError):
    """A --*-json file that is missing or does not hold what the tool reads (exit code 2)."""


def _metrics(area: str, tool: str, device: str, variant: str, results_dir: str | None = None) -> dict:
    """The metrics of one results row (the table under results_dir, default tools/results/)."""
    for r in tables.read(area, results_dir or DEFAULT_RESULTS):
        if (r["tool"], r["device"], r["variant"]) == (tool, device, variant):
            return r["metrics"]
    raise InputError(f"no {tool} row {variant!r} ({device}) in the {area} table")


def measured_inputs() -> dict[str, Num]:
    """The measured numbers, read from tools/results/*.json where they are there, else quoted from the issue
    that holds them (issue 17: the 4B update on one H200; issue 21: vLLM on one H100 and two H200)."""
    g = _metrics("placements", "gpu_smoke", "h100", "grpo hf (issue 17 engine)")
    src = "placements.jsonl gpu_smoke 'grpo hf (issue 17 engine)' (2026-11-22, H100, Qwen3-0.6B, 256 seqs)"
    fused8k = _metrics("update", "gpu_smoke", "h100", "smoke-8k-fused-rc0")
    tp2 = _metrics("update", "gpu_smoke", "h200x2", "tp2: update step TP=2, 8k tokens")
    tp1 = _metrics("update", "gpu_smoke", "h200x2", "tp2: update step TP=1, 8k tokens")
    m = {f"grpo06b_{p}_s": Num(g[f"timing_s/{p}"], src, True)
         for p in ("gen", "old_log_prob", "ref", "update_actor", "update_weights", "step")}
    m.update({
        "grpo06b_tokens": Num(g["tokens_per_step"], src, True),
        "grpo06b_seqs": Num(32 * 8, src + ": data.train_batch_size=32 x rollout.n=8", True),
        "grpo06b_minibatches": Num(2, src + ": 256 samples / actor.ppo_mini_batch_size=16 prompts x 8", True),
        "gemm_tflops_h100": Num(g["gemm_tflops"] * 1e12, src + " gemm_tflops (bf16 8192^3)", True),
        "mfu_update_06b": Num(fused8k["mfu"], "update.jsonl gpu_smoke 'smoke-8k-fused-rc0' (2026-11-22, H100: 0.259 s, "
                              "8,192 tokens, fused head, no recompute)", True),
        "tp2_step_06b_s": Num(tp2["step_s"], "update.jsonl gpu_smoke 'tp2: update step TP=2, 8k tokens' (2026-11-22, "
                              "two H200s, 0.6B)", True),
        "tp1_step_06b_s": Num(tp1["step_s"], "update.jsonl gpu_smoke 'tp2: update step TP=1, 8k tokens'", True),
        # issue 21 ("vLLM on the GPUs"): vLLM 0.26.0, Qwen3-0.6B shape, random weights, token-id prompts
        "vllm_a_s": Num(0.63, "issue 21: one H100, in-process vLLM, 256 x (64 prompt + 64 response), 25,855 tok/s",
                        True),
        "vllm_b_s": Num(10.15, "issue 21: one H100, 256 x (128 + 1024), CUDA graphs, 9.8-10.5 s (midpoint)", True),
        "vllm_c_s": Num(6.0, "issue 21: two H200, vLLM TP=2 (multiprocess), 256 x (128 + 1024), 43,719 tok/s", True),
        # the weight sync's terms are rltrain.plan's (calibration.py, one place): a cost per checkpoint tensor and
        # the level-2 sleep / wake rltrain uses since 2026-11-24 (issue 21 measured level 1 and a reload per byte)
        **{k: Num(cal.value(k), cal.TIME[k].source, True)  # each read or solved off one measured run
           for k in ("reload_s_per_tensor", "reload_s_per_expert_tensor", "split_sync_s_per_tensor", "vllm_sleep_s",
                     "vllm_wake_s", "vllm_wake_s_per_gb", "vllm_rank_sync_factor")},
    })
    return m


def assumed_inputs() -> dict[str, Num]:
    """Everything not measured yet, each with its public or in-repo source. Replaced by measurements through
    --nccl-json / --bench-update-json where those runs exist."""
    return {
        "peak_flops": Num(peak_flops("H100"), "H100/H200 SXM dense bf16 datasheet peak (the MFU denominator of "
                          "docs/benchmarks.md)", False),
        "hbm_bw_h100": Num(2.7e12, "achieved HBM3 bandwidth on H100 (3.35 TB/s peak), docs/benchmarks/kernel.md "
                           "'The two numbers'", False),
        "hbm_bw_h200": Num(4.0e12, "achieved HBM3e bandwidth on H200 (4.8 TB/s peak), docs/benchmarks/kernel.md", False),
        "hbm_bytes_h200": Num(141e9, "H200 memory (the kinds the issue's x4/x8 runs use)", False),
        "busbw_intra": Num(370e9, "NCCL ring all-reduce bus bandwidth on 8x H100 NVLink 4 with NVLS off: 450 GB/s "
                           "line rate per direction (900 GB/s bidirectional) less ~20% protocol overhead, "
                           "NVIDIA/nccl-tests#212 (NVLS, which rltrain keeps off, reaches ~480)", False),
        "busbw_inter": Num(220e9, "NCCL all-reduce bus bandwidth across nodes of 8x H100 with 8x 400 Gb/s NICs: "
                           "216-231 GB/s measured on 2 nodes in NVIDIA/nccl#2409 (its reporter expected ~470 "
                           "from nccl-tests#309); the lower, measured figure is used", False),
        "lat_hop_inter_s": Num(8.5e-6, "latency per network hop of an NCCL tree all-reduce (NVIDIA/nccl "
                               "src/graph/tuning.cc hwLat, NET/Tree/LL128); a collective over k nodes adds "
                               "2 log2(k) hops (the same file's tree latency formula)", False),
        "p2p_inter": Num(45e9, "one 400 Gb/s NIC per GPU at ~90% line rate (PP activations across nodes)", False),
        "mfu_update_8b": Num(0.466, "Qwen3-8B update MFU taken equal to the 4B's measured 46.6% (update.jsonl "
                             "4b-8k-all; larger GEMMs usually run faster: conservative)", False),
        "static_bytes_per_param": Num(18, "actor memory per parameter: bf16 param + bf16 grad + fp32 master + fp32 "
                                      "grad + 2 fp32 Adam moments (MegatronEngine, no distributed optimizer)", False),
        "gpus_per_node": Num(8, "8-GPU nodes (HGX H100/H200)", False),
    }


def load_nccl_json(path: str) -> dict[str, Num]:
    """Intra-node all-reduce bus bandwidth and latency from tools/gpu_placements.py's JSON (the whole
    gpu_placements.json or its "nccl" section): the largest message's bus bandwidth, and the 1 MiB time less
    its bandwidth share as the latency. "isolated" (each process sees its own GPU, as Ray workers) is used."""
    try:
        with open(path) as f:
            res = json.load(f)
    except OSError as err:
        raise InputError(f"--nccl-json {path}: cannot read it ({err.strerror}); give the gpu_placements.json that "
                         "`tools/gpu_placements.py --only nccl` wrote") from err
    except json.JSONDecodeError as err:
        raise InputError(f"--nccl-json {path}: not JSON ({err})") from err
    sec = res.get("nccl", res) if isinstance(res, dict) else None
    rows = (sec or {}).get("isolated", {}).get("results") if isinstance(sec, dict) else None
    ar = sorted((r for r in rows or [] if r.get("op") == "all_reduce"), key=lambda r: r["mib"])
    if not ar:
        raise InputError(f"--nccl-json {path}: no nccl.isolated.results all_reduce rows; rerun "
                         "`tools/gpu_placements.py --only nccl` (errors: "
                         f"{res.get('errors', {}).get('nccl', 'none') if isinstance(res, dict) else 'n/a'})")
    big, small = ar[-1], ar[0]
    bw = big["busbw_gbps"] * 1e9
    lat = max(small["ms"] / 1e3 - small["mib"] * 2**20 / bw, 1e-6)
    where = f"measured: {path} (tools/gpu_placements.py --only nccl, {res.get('device', '2 GPUs')}, " \
            f"{res.get('date', '?')}, all-reduce between 2 GPUs, isolated visibility)"
    return {"busbw_intra": Num(bw, f"{where}, {big['mib']} MiB", True),
            "lat_intra_s": Num(lat, f"{where}, {small['mib']} MiB time less its bandwidth share", True)}


def load_bench_update_json(paths: list[str]) -> dict[str, Num]:
    """The 4B update MFU (TP=1) and the TP=2 efficiency from tools/bench_update.py rows (8k tokens, fused head,
    no recompute): efficiency = TP=1 step / (2 x TP=2 step) for the same lever set."""
    rows = []
    for path in paths:
        try:
            with open(path) as f:
                rows += [r for r in json.load(f).get("rows", []) if r.get("status") == "ok"]
        except (OSError, json.JSONDecodeError, AttributeError) as err:
            raise InputError(f"--bench-update-json {path}: cannot read its rows ({err}); give the "
                             "bench_update.json that tools/bench_update.py wrote") from err
    pick = {}
    for r in rows:
        row = r["row"]
        if row["preset"] == "qwen3-4b" and row["tokens"] == 8192 and row["head"] == "fused" \
                and row["recompute"] == "none":
            pick[(row["tp"], row["norms"], row["optim"], row["fusion"])] = r
    out: dict[str, Num] = {}
    tp1 = [k for k in pick if k[0] == 1]
    if tp1:
        best = min(tp1, key=lambda k: pick[k]["step_s"])
        out["mfu_update_4b"] = Num(pick[best]["mfu"], f"measured: {', '.join(paths)} row {pick[best]['row']['name']}",
                                   True)
    both = [k for k in tp1 if (2, *k[1:]) in pick]
    if both:
        k = min(both, key=lambda k: pick[(2, *k[1:])]["step_s"])
        eff = pick[k]["step_s"] / (2 * pick[(2, *k[1:])]["step_s"])
        out["tp_eff_big"] = Num(eff, f"measured: {', '.join(paths)} rows {pick[k]['row']['name']} / "
                                f"{pick[(2, *k[1:])]['row']['name']} (TP comm included: an upper bound on its cost)",
                                True)
    if not out:
        raise InputError(f"--bench-update-json: no ok qwen3-4b 8k fused no-recompute row in {', '.join(paths)}; run "
                         "`tools/bench_update.py --plan h200-4b` (and `--plan tp2` on two GPUs)")
    return out


def table_update_inputs() -> dict[str, Num]:
    """The 4B update's MFU (TP=1) and TP=2 efficiency from the update table's tools/bench_update.py rows (8k tokens,
    fused head, no recompute; the same lever set at TP=1 and TP=2): the measured values of the two assumptions."""
    one = _metrics("update", "bench_update", "h200", "4b-8k-all")
    two = _metrics("update", "bench_update", "h200x2", "4b-8k-all-tp2")
    src = "update.jsonl bench_update 4b-8k-all (2026-11-23, one H200)"
    return {"mfu_update_4b": Num(one["mfu"], f"measured: {src}", True),
            "tp_eff_big": Num(one["step_s"] / (2 * two["step_s"]), f"measured: {src} / 4b-8k-all-tp2 (two H200s): the "
                              "TP=1 step over twice the TP=2 step, TP communication included", True)}


def all_inputs(nccl_json: str | None = None, bench_update_json: list[str] | None = None) -> dict[str, Num]:
    inp = {**assumed_inputs(), **measured_inputs(), **table_update_inputs()}
    # until NCCL is measured: the per-all-reduce time that the vLLM TP=2 point leaves in its decode steps
    inp["lat_intra_s"] = Num(fit_decode(inp).lat_ar_s, "derived: per decode all-reduce time of issue 21's vLLM "
                             "TP=2 point after the one-GPU overheads and the assumed HBM bandwidth (fit_decode)", False)
    if nccl_json:
        inp.update(load_nccl_json(nccl_json))
    if bench_update_json:
        inp.update(load_bench_update_json(bench_update_json))
    return inp
