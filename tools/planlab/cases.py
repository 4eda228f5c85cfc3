"""The measured runs the planner is calibrated on and compared with (rltrain/plan/fit.py solves and compares): each a
Case with the config overrides that reproduce it and the quantities measured, read from tools/results/ (the raw GPU
results). Must not compute predictions (fit.py does).
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def results_dir() -> str:
    path = os.path.join(ROOT, "tools", "results")
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no {path} directory with the measured GPU runs")
    return path


def load(rel: str) -> dict:
    with open(os.path.join(results_dir(), rel)) as f:
        return json.load(f)


# tools/gpu_smoke.py's GRPO run on the Qwen3-0.6B shape (GRPO_06B_OVERRIDES there), one process, no Ray
GRPO_06B = ["model=qwen3_0.6b_random", "trainer.device=cuda", "trainer.n_gpus_per_node=1",
            "trainer.fused_linear_logprob_backend=triton", "data.train_batch_size=32", "rollout.n=8",
            "rollout.max_response_length=64", "data.max_prompt_length=64", "actor.ppo_mini_batch_size=16",
            "actor.use_kl_loss=true", "actor.max_tokens_per_micro_batch=16384", "rollout.max_batch_size=256",
            "trainer.use_ray=false"]
GRPO_LENGTHS = dict(prompt_tokens=5, response_tokens=64)  # 17,664 tokens per step = 256 x 69


def compose(overrides: list[str]) -> dict:
    """grpo_tiny with `overrides`, resolved to a plain dict (a fresh copy each call)."""
    import copy

    return copy.deepcopy(_compose(tuple(overrides)))


@functools.lru_cache(maxsize=None)
def _compose(overrides: tuple[str, ...]) -> dict:
    from omegaconf import OmegaConf

    from rltrain.config.entry import compose_config

    return OmegaConf.to_container(compose_config("grpo_tiny", list(overrides)), resolve=True)  # type: ignore


def bench_overrides(row: dict) -> list[str]:
    """A tools/bench_update.py row (one sequence of `tokens` in one micro-batch, one AdamW step) as a config."""
    r = row["row"]
    T, tp = int(r["tokens"]), int(r.get("tp", 1))
    fusion = {"none": "none", "compile": "compile", "mcore": "mcore"}[r.get("fusion", "none")]
    rc = r.get("recompute", "none")
    ov = ["model=qwen3_0.6b_random", f"model.builtin={r['preset']}", "trainer.device=cuda",
          f"trainer.n_gpus_per_node={tp}", f"actor.tensor_parallel_size={tp}", "data.train_batch_size=1",
          "rollout.n=1", "actor.ppo_mini_batch_size=1", f"data.max_prompt_length={T // 2}",
          f"rollout.max_response_length={T - T // 2}", f"actor.max_tokens_per_micro_batch={T}",
          "actor.use_kl_loss=false", f"actor.elementwise_fusion={fusion}",
          f"trainer.fused_linear_logprob={'true' if r.get('head', 'fused') == 'fused' else 'false'}",
          "trainer.fused_linear_logprob_backend=triton"]
    if rc != "none":
        ov += ["actor.recompute_activations=true", f"actor.recompute_granularity={rc}"]
    return ov


def smoke_overrides(fused: bool, recompute: bool, tokens: int) -> dict[str, Any]:
    """A tools/gpu_smoke.py step8k/longctx row as a bench_update row (legacy engine)."""
    return {"row": {"tokens": tokens, "tp": 1, "preset": "qwen3-0.6b", "fusion": "none",
                    "recompute": "full" if recompute else "none", "head": "fused" if fused else "unfused"}}


@dataclass
class Case:
    name: str
    source: str  # file, date, device
    device: str  # h100 | h200
    overrides: list[str]
    role: str  # fit | held out | legacy
    measured: dict[str, float]  # quantity -> value (GiB or s); "fits": 1/0
    kind: str = "update"  # update (a bench row: the update phase alone) | step (a whole GRPO step)
    lengths: dict | None = None
    fits_constant: str = ""
    fitted: tuple[str, ...] = ()  # role "fit": the quantities a constant was solved from (None: all)
    # quantities measured through an engine path the model no longer describes (role "legacy" for them)
    legacy_q: tuple[str, ...] = ()

    def role_of(self, quantity: str) -> str:
        if quantity in self.legacy_q:
            return "legacy"
        if self.role != "fit" or not self.fitted or quantity in self.fitted:
            return self.role
        return "held out"


def _dev(device_text: str) -> str:
    return "h200" if "H200" in device_text else "h100"


def cases() -> list[Case]:
    out: list[Case] = []
    fit_rows = {"06b-8k-norms+optim": "act_none_fusion_none", "06b-8k-all": "act_none_fusion_compile",
                "06b-8k-mcore-tp2": "act_none_fusion_mcore", "06b-32k-all-rc_selective": "act_selective",
                "06b-64k-all-rc_full": "act_full_working"}
    time_rows = {"4b-8k-all": "update_rate_width_exponent", "4b-8k-all-tp2": "tp_allreduce_s",  # step time only
                 "06b-32k-all-rc_selective": "attention_tflops"}
    for rel in ("update/bench_update.json", "update/bench_update_h100_64k.json", "update/bench_update_h200_4b.json",
                "update/bench_update_h200_tp2.json", LENGTHS + "bench_update.json"):
        d = load(rel)
        for row in d["rows"]:
            if row.get("status") != "ok":
                continue
            name = row["row"]["name"]
            legacy = row["row"].get("norms") == "fp32"
            fitted = () if name in ("06b-8k-norms+optim", "06b-8k-all") else tuple(
                q for q, rows in (("peak_gib", fit_rows), ("step_s", time_rows)) if name in rows)
            out.append(Case(name, f"{rel}, {d['date']}, {d['device']}", _dev(d["device"]), bench_overrides(row),
                            "fit" if (name in fit_rows or name in time_rows) else ("legacy" if legacy else "held out"),
                            {"peak_gib": row["peak_gib"], "step_s": row["step_s"],
                             "reserved_gib": row.get("reserved_gib", 0.0)},
                            fits_constant=", ".join(r[name] for r in (fit_rows, time_rows) if name in r),
                            fitted=fitted))
    d = load("gpu_smoke_h100_steps.json")
    for sec in ("step8k", "longctx"):
        for row in d[sec]:
            if row.get("status") != "ok":
                continue
            name = f"smoke-{row['tokens'] // 1024}k-{'fused' if row['fused'] else 'unfused'}-rc{int(row['recompute'])}"
            out.append(Case(name, f"gpu_smoke_h100_steps.json, {d['date']}, {d['device']}", "h100",
                            bench_overrides(smoke_overrides(row["fused"], row["recompute"], row["tokens"])),
                            "legacy", {"peak_gib": row["peak_gib"], "step_s": row["step_s"]}))
    d = load("gpu_smoke_h100.json")
    for row in d.get("longctx", []):
        if row.get("status") == "OOM":
            name = f"smoke-{row['tokens'] // 1024}k-{'fused' if row['fused'] else 'unfused'}-rc0 (OOM)"
            out.append(Case(name, f"gpu_smoke_h100.json, {d['date']}, {d['device']}", "h100",
                            bench_overrides(smoke_overrides(row["fused"], False, row["tokens"])), "legacy",
                            {"fits": 0.0}))
    # whole GRPO steps (Qwen3-0.6B shape; tools/gpu_smoke.py and tools/gpu_placements.py)
    # grpo hf: hf_layer_step_s, fwd_mb_layer_s (its reference pass), update_step_layer_s (with two DP=2 runs, fit.py),
    # and its sleep/wake/reload (hf_offload_s_per_gb, hf_reload_s_per_tensor); grpo vllm: reload_s_per_tensor (its
    # update_weights less its wake); grpo vllm k4: ipc_reload_s_per_tensor (the same, by CUDA IPC to engines in their
    # own processes)
    fitted_q = {"grpo hf": ("generation_s", "ref_s", "update_s"),
                "grpo vllm": ("weight_sync_s",), "grpo vllm k4": ("weight_sync_s",),
                "grpo vllm, Qwen3-4B shape, one GPU": ("weight_sync_s",)}
    steps = [("grpo hf", "vllm/gpu_smoke_grpo_hf.json", [], "fit"),
             ("grpo vllm", "vllm/gpu_smoke_grpo_vllm.json", ["rollout=vllm"], "fit"),
             ("grpo hf, compile", "update/gpu_smoke_grpo_compile.json", ["actor.elementwise_fusion=compile"],
              "held out"),
             ("grpo hf", "vllm_x2/gpu_smoke_grpo_hf_h200.json", [], "held out"),
             ("grpo vllm", "vllm_x2/gpu_smoke_grpo_vllm_h200.json", ["rollout=vllm"], "held out"),
             ("grpo hf (rerun)", "vllm/pool_h100_2026-11-25/grpo_hf.json", [], "held out"),
             ("grpo vllm k1", "vllm/pool_h100_2026-11-25/grpo_vllm_k1.json", ["rollout=vllm"], "held out"),
             ("grpo vllm k2", "vllm/pool_h100_2026-11-25/grpo_vllm_k2.json",
              ["rollout=vllm", "rollout.engines_per_gpu=2", "rollout.kv_cache_memory_gb=16"], "held out"),
             ("grpo vllm k4", "vllm/pool_h100_2026-11-25/grpo_vllm_k4.json",
              ["rollout=vllm", "rollout.engines_per_gpu=4", "rollout.kv_cache_memory_gb=24"], "fit"),
             ("grpo vllm k4 (step-levers day)", "grpo_step_levers_h100_2026-11-26/base.json",
              ["rollout=vllm", "rollout.engines_per_gpu=4"], "held out"),
             ("grpo vllm k4, engines awake + old log-probs from the update",
              "grpo_step_levers_h100_2026-11-26/levers.json", LEVERS, "held out"),
             ("grpo hf (issue 17 engine)", "gpu_smoke_h100.json", [], "legacy"),
             # docs/plan.md's "runs that would calibrate it better" 2 and 3, predicted before they ran
             # (one_h200_blind_2026-11-26/predictions_before_run.md)
             ("grpo vllm, Qwen3-4B shape, one GPU", BLIND + "g4b.json",
              ["rollout=vllm", "model.builtin=qwen3-4b", "rollout.gpu_memory_utilization=0.3",
               "actor.max_tokens_per_micro_batch=8192"], "fit"),  # its weight sync: vllm_wake_s_per_gb (fit.py)
             ("grpo vllm, PPO (GAE critic)", BLIND + "ppo.json", ["rollout=vllm", "algorithm=gae"], "held out"),
             # docs/benchmarks/2026-11-26-two-h200s-evening.md section 5, one H100: the levers' config again (its
             # engines took each bucket packed in one allocation, a change tried that evening and not kept), then
             # with the forward passes in one micro-batch and the update in one (selective recompute)
             ("grpo vllm k4, levers (evening)", MICRO + "levers.json", LEVERS, "held out"),
             ("grpo vllm k4, levers, one micro-batch per pass", MICRO + "levers_microbatch.json",
              LEVERS + ["actor.log_prob_max_tokens_per_micro_batch=32768", "actor.max_tokens_per_micro_batch=32768",
                        "actor.recompute_activations=true", "actor.recompute_granularity=selective"], "held out")]
    for name, rel, extra, role in steps:
        d = load(rel)
        m = d["grpo"]["mean"]
        meas = {"allocator_peak_gib": m["perf/max_memory_allocated_gb"], "generation_s": m["timing_s/gen"],
                "old_log_prob_s": m["timing_s/old_log_prob"], "update_s": m["timing_s/update_actor"],
                "weight_sync_s": m["timing_s/update_weights"] + m.get("timing_s/rollout_sleep", 0.0)}
        meas.update({q: m[k] for q, k in (("ref_s", "timing_s/ref"), ("step_s", "timing_s/step"),
                                          ("values_s", "timing_s/values")) if k in m})
        if rel in STEP_LOGS:  # phases the tool's report of that day left out, from the run's per-step log (steps 2..)
            m = {**steady_means(STEP_LOGS[rel], first_step=2), **m}
            meas["values_s"] = m["timing_s/values"]
        meas["update_s"] += m.get("timing_s/update_critic", 0.0)  # the planner's update phase is both updates
        out.append(Case(name, f"{rel}, {d['date']}, {d['device']}", _dev(d["device"]), GRPO_06B + extra, role, meas,
                        "step", GRPO_LENGTHS, fitted=fitted_q.get(name, ()) if role == "fit" else (),
                        legacy_q=HF_PAGEABLE_SLEEP if "grpo hf" in name else ()))
    out += placement_cases()
    out += scaling_cases()
    for name, rel, role in (("vLLM alone, 256 x (128 + 1024)", "vllm/bench_rollout_1k.json", "held out"),
                            ("vLLM alone, 256 x (64 + 64)", "vllm_x2/bench_rollout_variants_h200.json", "fit")):
        d = load(rel)
        r = d["results"][0]
        ov = ["model=qwen3_0.6b_random", "trainer.device=cuda", "trainer.n_gpus_per_node=1", "rollout=vllm",
              "data.train_batch_size=256", "rollout.n=1", f"data.max_prompt_length={d['prompt_len']}",
              f"rollout.max_response_length={d['response_len']}", "actor.ppo_mini_batch_size=1",
              "trainer.use_ray=false"]
        out.append(Case(name, f"{rel}, {d['date']}, {d['device']}", _dev(d["device"]), ov, role,
                        {"generation_s": r["gen_s"], "vllm_freed_gib": r["sleep_freed_gib"]}, "rollout",
                        fitted=("vllm_freed_gib",) if role == "fit" else ()))
    return out


def placement_cases() -> list[Case]:
    """tools/gpu_placements.py runs (two GPUs, Ray): the Qwen3-0.6B shape's split and colocated TP=2 placements, the
    Qwen3-30B-A3B slice with EP=2 (vLLM, replay off/on, the hf engine) and its dense twin."""
    out: list[Case] = []
    # tools/gpu_placements.py runs: the Qwen3-0.6B shape (2026-11-23), the Qwen3-30B-A3B slice with EP=2 and its
    # dense twin (2026-11-26; docs/benchmarks/2026-11-26-moe-on-two-gpus.md); (name, file, key, role, fitted)
    moe, moe_r, moe_g = "moe_h200x2_2026-11-26/", "moe_replay_h200x2_2026-11-26/", "moe_grouped_gemm_h200x2_2026-11-26/"
    placements = [("placement split 1+1", "vllm_x2/placements_qwen06b_split_1p1.json", "split_1p1", "fit",
                   ("weight_sync_s", "generation_s")),  # split_sync_s_per_tensor, vllm_seq_step_s
                  ("placement colocated TP=2", "vllm_x2/placements_qwen06b_colocated_tp2.json", "colocated_tp2",
                   "held out", ()),
                  ("MoE slice EP=2, vLLM", moe + "moe_slice_gpu_placements.json", "colocated_dp2", "fit",
                   ("update_s", "weight_sync_s")),  # moe_expert_pass_s, reload_s_per_expert_tensor
                  ("dense twin of the MoE slice, vLLM", moe + "dense_twin_gpu_placements.json", "colocated_dp2",
                   "held out", ()),
                  ("MoE slice EP=2, vLLM, replay off", moe_r + "replay_off_gpu_placements.json", "colocated_dp2",
                   "held out", ()),
                  ("MoE slice EP=2, vLLM, replay on", moe_r + "replay_on_gpu_placements.json", "colocated_dp2",
                   "held out", ()),
                  ("MoE slice EP=2, vLLM, replay on (first run)", moe_r + "replay_on_first_run_gpu_placements.json",
                   "colocated_dp2", "held out", ()),
                  ("MoE slice EP=2, hf engine", moe_r + "hf_engine_gpu_placements.json", "colocated_dp2", "held out",
                   ()),
                  ("MoE slice EP=2, vLLM, grouped GEMM", moe_g + "grouped_true_gpu_placements.json", "colocated_dp2",
                   "fit", ("update_s",)),  # moe_grouped_layer_pass_s is solved from its update
                  ("MoE slice EP=2, vLLM, expert loop (same call)", moe_g + "grouped_false_gpu_placements.json",
                   "colocated_dp2", "held out", ()),
                  # tp_dp_layout_factor is solved from its step with every TP x DP run's (fit.py)
                  ("4B colocated TP=2 x DP=2 + vLLM TP=4 (four GPUs)",
                   "four_gpus_h200x4_2026-11-26/gpu_placements.json", "colocated_tp2dp2", "fit", ("step_s",)),
                  # 2026-11-27, two H200s, predicted before they ran (BLIND3's predictions_*.json): the 0.6B at
                  # 2,048-token responses (16 x 8) with the forward passes' micro-batches at 4,096 and 32,768 tokens
                  # (128 and 9 micro-batches; the report's means of steps 2..3)
                  ("0.6B single, 2,048-token responses, forward micro-batches of 4,096", BLIND3 + "fwd4096.json",
                   "single", "fit", ("ref_s", "old_log_prob_s")),  # fwd_row_layer_s, old_logprob_mb_s (fit.py)
                  ("0.6B single, 2,048-token responses, forward micro-batches of 32,768", BLIND3 + "fwd32768.json",
                   "single", "held out", ()),
                  # then at PP=2 (predicted before it ran, README.md there)
                  ("0.6B PP=2, 2,048-token responses, forward micro-batches of 4,096", BLIND3 + "pp2fwd4096.json",
                   "pp2", "held out", ()),
                  # the 4B on one H200 the same way (8 x 8 sequences; 64 one-row micro-batches, then 5 of 15 rows)
                  ("4B single, 2,048-token responses, forward micro-batches of 4,096",
                   BLIND4 + "g4fwd4096_gpu_placements.json", "single", "held out", ()),
                  ("4B single, 2,048-token responses, forward micro-batches of 32,768",
                   BLIND4 + "g4fwd32768_gpu_placements.json", "single", "fit",
                   ("update_s",))]  # update_rate_width_exponent_none (fit.py)
    for name, rel, key, role, fitted in placements:
        d = load(rel)
        r = d["qwen06b"][key]
        ov = [o for o in r["command"].split()[4:] if not o.startswith(("trainer.ray_address", "hydra."))]
        if "expert_parallel_size" in r["command"] and "moe_grouped_gemm" not in r["command"]:
            ov.append("actor.moe_grouped_gemm=false")  # the engine of 2026-11-26 looped over the experts
        peaks = r["peak_gib_per_gpu"]
        meas = {"allocator_peak_gib": max(v for k, v in peaks.items() if not k.startswith("rollout")),
                "old_log_prob_s": r["timing_s"]["old_log_prob"], "update_s": r["timing_s"]["update_actor"],
                "generation_s": r["timing_s"]["gen"], "weight_sync_s": r["timing_s"]["update_weights"]}
        meas.update({q: r["timing_s"][k] for q, k in (("ref_s", "ref"), ("step_s", "step")) if k in r["timing_s"]})
        meas["weight_sync_s"] += placement_sleep(rel, r["timing_s"]["update_weights"])
        if any(k.startswith("rollout") for k in peaks):
            meas["rollout_allocator_peak_gib"] = max(v for k, v in peaks.items() if k.startswith("rollout"))
        out.append(Case(name, f"{rel}, {d['date']}, {d['device']}", _dev(d["device"]), ov, role, meas, "step",
                        run_lengths(ov), fitted=fitted, legacy_q=HF_PAGEABLE_SLEEP if "hf engine" in name else ()))
    return out


def run_lengths(ov: list[str]) -> dict:
    """The tools' GRPO runs' lengths: the embedded task's 5-token prompts, every response to the run's
    rollout.max_response_length (random weights never stop early)."""
    resp = next((int(o.split("=", 1)[1]) for o in ov if o.startswith("rollout.max_response_length=")), 64)
    return {**GRPO_LENGTHS, "response_tokens": resp}


def placement_sleep(rel: str, update_weights_s: float) -> float:
    """The engine's sleep (timing_s/rollout_sleep, which the report's table leaves out and the planner's weight sync
    counts, as the other cases' weight_sync_s do) from the run's per-step log beside its report, over the report's
    steady steps (3.. when 4 or more ran, else 2..); 0 when there is no log or it is another run's (its
    update_weights mean differs from the report's)."""
    log = rel.replace("_gpu_placements.json", "_metrics.jsonl")
    if log == rel or not os.path.exists(os.path.join(results_dir(), log)):
        return 0.0
    m = steady_means(log, None)
    if abs(m.get("timing_s/update_weights", math.inf) - update_weights_s) > 1e-3:
        return 0.0
    return m.get("timing_s/rollout_sleep", 0.0)


def steady_means(rel: str, first_step: int | None = 3) -> dict[str, float]:
    """The means of a trainer's per-step jsonl log (`*_metrics.jsonl`) over steps >= `first_step` (None: the tools'
    steady steps, 3.. when 4 or more rows, else 2..), every numeric key; a step run under the profiler
    (trainer.profile_steps) is left out."""
    with open(os.path.join(results_dir(), rel)) as f:
        rows = [r for r in (json.loads(line) for line in f if line.strip()) if not r.get("perf/profiled")]
    if first_step is None:
        first_step = 3 if len(rows) >= 4 else 2
    steady = [r for r in rows if r.get("step", 0) >= first_step] or rows[-1:]
    keys = {k for r in steady for k, v in r.items() if isinstance(v, (int, float))}
    return {k: sum(r[k] for r in steady if k in r) / sum(1 for r in steady if k in r) for k in keys}


# the tools/gpu_placements.py runs of 2026-11-26 on 2 x H200 with their per-step logs (`--only qwen06b --engine vllm`:
# the Qwen3-0.6B shape, or the 4B with model.builtin=qwen3-4b, KL loss, colocated with vLLM, Ray), and the split 1+1
# run of docs/benchmarks/2026-11-26-refactor-on-two-gpus.md; (name, report, placement key, per-step log, role, fitted)
SCALING = "scaling_vllm_h200x2_2026-11-26/"
COLO_DP = "colocated_dp_h200x2_2026-11-26/"
FOUR_H100 = "four_gpus_h100x4_2026-11-26/"
WEAK = "weak_mb32_h200x2_2026-11-26/"
EVENING = "scaling_h200x2_evening_2026-11-26/"
BLIND = "one_h200_blind_2026-11-26/"
BLIND2 = "two_h200_blind_2026-11-26/"
PINNED = "hf_pinned_sleep_h200x2_2026-11-26/"
# 2026-11-26, late, one H200: bench_update's "lengths" rows (the 0.6B at 16k-128k tokens) and the GRPO step at 2,048-
# and 8,192-token responses, each predicted before it ran (predictions_*.json there)
LENGTHS = "lengths_blind_2026-11-26/"
BLIND3 = "blind_x2_2026-11-27/"
# 2026-11-27, four H200s, one machine, one run after another, each predicted before it ran (BLIND4's
# predictions_*_h200.json, BLIND4 + "README.md"; planner of 527f4c9)
BLIND4 = "blind_x4_2026-11-27/"
# then a fresh machine of the same kind: the 0.6B at DP=2 (two of its GPUs) and DP=4, one after another
DP_X4 = "dp_x4_2026-11-27/"
# 2026-11-27, later: four H200s, one machine: the 4B TP=2 x DP=2 with two vLLM TP=2 engines, then with one TP=4 engine,
# then the host's 0.6B one-GPU run, step 5 of the 4B runs under torch's profiler (left out of the means); then one
# H200: the 0.6B and the 4B one-GPU runs, step 5 profiled (PROFILE4 + "README.md", ONE_PROF + "README.md")
PROFILE4 = "profile_x4_2026-11-27/"
ONE_PROF = "one_h200_profile_2026-11-27/"
# then the 0.6B at TP=2 x DP=2 with two vLLM TP=2 engines on four H200s, step 5 profiled, predicted before it ran (by
# the planner without tp_dp_layout_factor: PROFILE4_06B + "README.md")
PROFILE4_06B = "profile_x4_06b_2026-11-27/"
# then three one-GPU machines (two H200s, an H100) with tools/host_probe.py before and after the 0.6B's one-GPU run,
# and a four-H200 machine: the 0.6B at TP=2 alone (two of its GPUs), then at TP=2 x DP=2 with two vLLM TP=2 engines,
# step 5 profiled on every rank (HOSTS + "README.md")
HOSTS = "host_spread_2026-11-27/"
# then two GPUs (asked for H100s, came as H200s), predicted before they ran (BLIND5's predictions_*_h200.json, BLIND5 +
# "README.md"; planner of 432481a): the 0.6B's vLLM DP=2 (an engine per GPU) and TP=2, the hf engine's DP=2
BLIND5 = "h100x2_blind_2026-11-27/"
# then two H200s (four asked for, not lent): the 0.6B at one GPU, DP=2 and TP=2, every phase split into the ranks'
# work, Ray's dispatch and return and the driver's rest (timing_s/{worker,dispatch,return}/<phase>); then one H200:
# the one-GPU run after three probes of the host; then another H200 the same: the run after run_split stopped copying
# a lone rank's rows. Predicted before they ran (DISPATCH + "predicted.json", README.md)
DISPATCH = "dispatch_2026-11-27/"
# then four H200s (four asked for as H100s): the 0.6B at one GPU, DP=2, DP=4 and TP=2 x DP=2 on one host, every phase
# split (the driver's rest at DP>=2 found inside its slicing of the batch); predicted before they ran (SPLIT4 +
# "predicted_139.8.json", README.md)
SPLIT4 = "split_x4_2026-11-27/"
# then, with the driver at one torch thread (its slicing 1 ms a phase, was 15-225), the same four-H200 host type: the
# 0.6B at DP=4 and DP=2, then TP=2 x DP=2 and TP=2 alone; predicted before they ran (DRIVER_THREADS +
# "predicted_139.8.json", README.md)
DRIVER_THREADS = "driver_threads_2026-11-27/"
# then two H200s, one machine, the driver at one torch thread: the 0.6B at DP=2 with 32 x 8 and 64 x 8 samples (2 and 4
# optimizer steps an update call), one GPU, the hf engine at DP=2 and TP=2, and DP=2 at 32 x 8 again; each under
# tools/thread_cpu.py, predicted before it ran (FIXED_DRIVER + "predicted_*_139.8.json", README.md); then one H100: the
# 0.6B on one GPU with vLLM, with the hf engine, and with vLLM again (FIXED_DRIVER + "predicted_*_79.18.json")
FIXED_DRIVER = "fixed_driver_2026-11-27/"
# the one config measured on the most machines (the 0.6B one-GPU GRPO step, 32 x 8, vLLM, KL loss): twenty runs,
# H100 and H200 machines, 2026-11-22..27 (name, a part of the source naming the file); fit.py solves host_speed_low /
# host_speed_high (the plan's range across machines) from their steps, which stay held out as predictions
HOST_SPREAD_RUNS = [
    ("grpo vllm", "vllm/gpu_smoke_grpo_vllm.json"), ("grpo vllm", "vllm_x2/gpu_smoke_grpo_vllm_h200.json"),
    ("grpo vllm k1", "grpo_vllm_k1.json"), ("0.6B single, 32 x 8", SCALING),
    ("0.6B single, 32 x 8 (H100)", FOUR_H100), ("0.6B single, 32 x 8 (beside another run)", COLO_DP),
    ("0.6B single, 32 x 8 (evening)", EVENING), ("0.6B single, vLLM (2026-11-27)", BLIND3),
    ("0.6B single, 32 x 8 (the four-H200 host)", BLIND4),
    ("0.6B single, 32 x 8 (the profiled four-H200 host)", PROFILE4),
    ("0.6B single, 32 x 8 (the profiled one-H200 host)", ONE_PROF),
    ("0.6B single, 32 x 8 (probed H200 host 1)", HOSTS), ("0.6B single, 32 x 8 (probed H100 host 2)", HOSTS),
    ("0.6B single, 32 x 8 (probed H200 host 3)", HOSTS),
    ("0.6B single, 32 x 8 (a two-H200 host, phases split)", DISPATCH),
    ("0.6B single, 32 x 8 (a one-H200 host, probed three times)", DISPATCH),
    ("0.6B single, 32 x 8 (another one-H200 host, probed three times)", DISPATCH),
    ("0.6B single, 32 x 8 (a four-H200 host, four ranks split)", SPLIT4),
    ("0.6B single, 32 x 8 (a two-H200 host, the driver at one torch thread)", FIXED_DRIVER),
    ("0.6B single, 32 x 8 (a one-H100 host, the driver at one torch thread)", FIXED_DRIVER)]
# the hf engine's level-1 sleep before its pinned host copies (model.to("cpu"): pageable, 0.13-0.72 s for the 0.6B
# by host): its weight sync, and so its step, are a path the model no longer describes
HF_PAGEABLE_SLEEP = ("weight_sync_s", "step_s")
# tools/gpu_smoke.py reports whose mean left out a critic's phases (before it took every phase the log has)
STEP_LOGS = {BLIND + "ppo.json": BLIND + "ppo_metrics.jsonl"}
MICRO = "grpo_step_microbatch_h100_2026-11-26/"
# issue #35's step levers (docs/benchmarks/2026-11-26-grpo-step-levers.md): four engines awake, one mini-batch
LEVERS = ["rollout=vllm", "rollout.engines_per_gpu=4", "actor.ppo_mini_batch_size=32",
          "rollout.free_cache_engine=false", "actor.recompute_old_logprobs=false",
          "rollout.gpu_memory_utilization=0.4"]
SCALING_RUNS = [
    ("0.6B single, 32 x 8", SCALING + "b32.json", "single", SCALING + "b32_qwen06b_single_metrics.jsonl", "held out", ()),
    ("0.6B single, 64 x 8", SCALING + "b64.json", "single", SCALING + "b64_qwen06b_single_metrics.jsonl", "held out", ()),
    ("0.6B colocated DP=2 + vLLM TP=2, 32 x 8", SCALING + "e32.json", "colocated_dp2", SCALING + "e32_metrics.jsonl",
     "held out", ()),
    ("0.6B colocated DP=2 + vLLM TP=2, 64 x 8", SCALING + "b64.json", "colocated_dp2",
     SCALING + "b64_qwen06b_colocated_dp2_metrics.jsonl", "held out", ()),
    ("4B colocated TP=2 + vLLM TP=2, 32 x 8", SCALING + "d4b.json", "colocated_tp2", SCALING + "d4b_metrics.jsonl",
     "held out", ()),
    ("0.6B split 1+1 (refactor day)", "refactor_h200x2_2026-11-26/qwen06b_split_vllm.json", "split_1p1",
     "refactor_h200x2_2026-11-26/qwen06b_split_vllm_metrics.jsonl", "held out", ()),
    # issue #35's colocated data-parallel rollout (one vLLM TP=1 engine per GPU), 2026-11-26 afternoon; the two
    # single-GPU runs ran at the same time, one on each GPU of the machine (a shared host)
    # update_mb_layer_s and update_call_layer_s are solved from its update with the 2026-11-27 DP=2 run's and the grpo
    # hf run's, vllm_rank_sync_factor from its weight sync with the 4B's one-GPU run's (fit.py)
    ("0.6B colocated DP=2, one vLLM engine per GPU, 64 x 8", COLO_DP + "dp2_tp1_b64.json", "colocated_dp2_tp1",
     COLO_DP + "dp2_tp1_b64_metrics.jsonl", "fit", ("update_s", "weight_sync_s")),
    ("0.6B single, 32 x 8 (beside another run)", COLO_DP + "single_s32.json", "single",
     COLO_DP + "single_s32_metrics.jsonl", "held out", ()),
    ("0.6B single, 64 x 8 (beside another run)", COLO_DP + "single_s64.json", "single",
     COLO_DP + "single_s64_metrics.jsonl", "held out", ()),
    # docs/benchmarks/2026-11-26-four-h100s.md: four H100s (the 0.6B runs on two of them), then two H200s for the
    # weak-scaling run with the mini-batch grown with the GPUs
    # tp_dp_layout_factor is solved from its step with every TP x DP run's (fit.py); their phases are held out
    ("4B colocated TP=2 x DP=2, two vLLM TP=2 engines (four H100s)", FOUR_H100 + "r2.json", "colocated_tp2dp2_r2",
     FOUR_H100 + "r2_metrics.jsonl", "fit", ("step_s",)),
    ("4B split 2+2, one vLLM TP=2 engine (four H100s)", FOUR_H100 + "split_2p2.json", "split_2p2",
     FOUR_H100 + "split_2p2_metrics.jsonl", "held out", ()),
    ("0.6B colocated PP=2 + vLLM TP=2 (H100s, beside a GPU test)", FOUR_H100 + "pp2.json", "pp2",
     FOUR_H100 + "pp2_metrics.jsonl", "held out", ()),
    ("0.6B single, 32 x 8 (H100)", FOUR_H100 + "single.json", "single", FOUR_H100 + "single_metrics.jsonl",
     "held out", ()),
    ("0.6B colocated DP=2, one vLLM engine per GPU, 64 x 8, mini-batch 32", WEAK + "dp2_tp1_b64_mb32.json",
     "colocated_dp2_tp1", WEAK + "dp2_tp1_b64_mb32_metrics.jsonl", "held out", ()),
    # docs/benchmarks/2026-11-26-two-h200s-evening.md: one machine, one run after another: weak scaling's three runs,
    # the 4B colocated TP=2 again (its wake-up's parts) and the 4B split 1+1
    ("0.6B single, 32 x 8 (evening)", EVENING + "w32.json", "single", EVENING + "w32_qwen06b_single_metrics.jsonl",
     "held out", ()),
    ("0.6B colocated DP=2, one vLLM engine per GPU, 32 x 8 (evening)", EVENING + "w32.json", "colocated_dp2_tp1",
     EVENING + "w32_qwen06b_colocated_dp2_tp1_metrics.jsonl", "held out", ()),
    ("0.6B colocated DP=2, one vLLM engine per GPU, 64 x 8, mini-batch 32 (evening)", EVENING + "w64_mb32.json",
     "colocated_dp2_tp1", EVENING + "w64_mb32_metrics.jsonl", "held out", ()),
    ("4B colocated TP=2 + vLLM TP=2, 32 x 8 (evening)", EVENING + "t4b.json", "colocated_tp2",
     EVENING + "t4b_metrics.jsonl", "held out", ()),
    ("4B split 1+1, 8k-token micro-batches (H200)", EVENING + "s4b.json", "split_1p1", EVENING + "s4b_metrics.jsonl",
     "held out", ()),
    # 2026-11-26 night, two H200s, one run after another, each predicted before it ran (BLIND2's predictions_*.json):
    # the hf engine's two-GPU placements and its one-GPU baseline, vLLM's colocated TP=2 and PP=2, the 4B at DP=2
    ("hf engine, 0.6B colocated DP=2 (two H200s)", BLIND2 + "hf.json", "colocated_dp2",
     BLIND2 + "hf_qwen06b_colocated_dp2_metrics.jsonl", "held out", (), HF_PAGEABLE_SLEEP),
    ("hf engine, 0.6B split 1+1 (two H200s)", BLIND2 + "hf.json", "split_1p1",
     BLIND2 + "hf_qwen06b_split_1p1_metrics.jsonl", "held out", ()),  # split: no sleep, the NCCL path
    ("hf engine, 0.6B colocated TP=2 (two H200s)", BLIND2 + "hf.json", "colocated_tp2",
     BLIND2 + "hf_qwen06b_colocated_tp2_metrics.jsonl", "held out", (), HF_PAGEABLE_SLEEP),
    ("hf engine, 0.6B colocated PP=2 (two H200s)", BLIND2 + "hf.json", "pp2",
     BLIND2 + "hf_qwen06b_pp2_metrics.jsonl", "held out", (), HF_PAGEABLE_SLEEP),
    ("hf engine, 0.6B single (same H200 host)", BLIND2 + "hf1.json", "single",
     BLIND2 + "hf1_qwen06b_single_metrics.jsonl", "held out", (), HF_PAGEABLE_SLEEP),
    # the hf engine's pinned level-1 sleep (2026-11-26 night, two H200s, one machine): hf_offload_s_per_gb and
    # hf_reload_s_per_tensor are solved from the one-GPU run's weight sync; the DP=2 run is held out
    ("hf engine, pinned sleep, 0.6B single", PINNED + "hf.json", "single", PINNED + "hf_qwen06b_single_metrics.jsonl",
     "fit", ("weight_sync_s",)),
    ("hf engine, pinned sleep, 0.6B colocated DP=2", PINNED + "hf.json", "colocated_dp2",
     PINNED + "hf_qwen06b_colocated_dp2_metrics.jsonl", "held out", ()),
    ("0.6B colocated TP=2 + vLLM TP=2 (two H200s, night)", BLIND2 + "vl.json", "colocated_tp2",
     BLIND2 + "vl_qwen06b_colocated_tp2_metrics.jsonl", "held out", ()),
    ("0.6B colocated PP=2 + vLLM TP=2 (two H200s, night)", BLIND2 + "pp2.json", "pp2",
     BLIND2 + "pp2_qwen06b_pp2_metrics.jsonl", "held out", ()),
    ("4B colocated DP=2, one vLLM engine per GPU at 0.3 (two H200s)", BLIND2 + "t4b.json", "colocated_dp2_tp1",
     BLIND2 + "t4b_qwen06b_colocated_dp2_tp1_metrics.jsonl", "held out", ()),
    ("0.6B single, 16 x 8 at 2,048-token responses", LENGTHS + "r2k.json", "single",
     LENGTHS + "r2k_qwen06b_single_metrics.jsonl", "held out", ()),
    # decode_hbm_fraction is solved from its generation (the first run whose decode is bound by HBM, not the host)
    ("0.6B single, 4 x 8 at 8,192-token responses", LENGTHS + "r8k.json", "single",
     LENGTHS + "r8k_qwen06b_single_metrics.jsonl", "fit", ("generation_s",)),
    # then predicted with it, before they ran: the 4B at 4,096-token responses and the 0.6B at 4,096 (8 x 8)
    ("Qwen3-4B shape, 4 x 8 at 4,096-token responses", LENGTHS + "g4k.json", "single",
     LENGTHS + "g4k_qwen06b_single_metrics.jsonl", "held out", ()),
    ("0.6B single, 8 x 8 at 4,096-token responses", LENGTHS + "r4k.json", "single",
     LENGTHS + "r4k_qwen06b_single_metrics.jsonl", "held out", ()),
    # 2026-11-27, two H200s, one run after another, each predicted before it ran (BLIND3's predictions_*_h200.json,
    # BLIND3 + "README.md"): the forward passes at 65,536 tokens a micro-batch (5; step 3 alone: step 2 still warming),
    # the hf engine's one-GPU, DP=2 and TP=2 runs, vLLM's one-GPU, DP=2 (an engine per GPU) and TP=2 runs
    ("0.6B single, 2,048-token responses, forward micro-batches of 65,536", BLIND3 + "fwd65536.json", "single",
     BLIND3 + "fwd65536_qwen06b_single_metrics.jsonl", "held out", ()),
    ("hf engine, 0.6B single (2026-11-27)", BLIND3 + "hf1.json", "single", BLIND3 + "hf_qwen06b_single_metrics.jsonl",
     "held out", ()),
    ("hf engine, 0.6B colocated DP=2 (2026-11-27)", BLIND3 + "hf.json", "colocated_dp2",
     BLIND3 + "hf_qwen06b_colocated_dp2_metrics.jsonl", "held out", ()),
    ("hf engine, 0.6B colocated TP=2 (2026-11-27)", BLIND3 + "hf.json", "colocated_tp2",
     BLIND3 + "hf_qwen06b_colocated_tp2_metrics.jsonl", "held out", ()),
    ("0.6B single, vLLM (2026-11-27)", BLIND3 + "vl.json", "single", BLIND3 + "vl_qwen06b_single_metrics.jsonl",
     "held out", ()),
    ("0.6B colocated DP=2, one vLLM engine per GPU (2026-11-27)", BLIND3 + "vl.json", "colocated_dp2_tp1",
     BLIND3 + "vl_qwen06b_colocated_dp2_tp1_metrics.jsonl", "fit", ("update_s",)),  # as the 64 x 8 run above
    ("0.6B colocated TP=2 + vLLM TP=2 (2026-11-27)", BLIND3 + "vl.json", "colocated_tp2",
     BLIND3 + "vl_qwen06b_colocated_tp2_metrics.jsonl", "held out", ()),
    ("4B colocated TP=2 x DP=2, two vLLM TP=2 engines (four H200s)", BLIND4 + "r2.json", "colocated_tp2dp2_r2",
     BLIND4 + "r2_qwen06b_colocated_tp2dp2_r2_metrics.jsonl", "fit", ("step_s",)),
    ("0.6B colocated DP=4, one vLLM engine per GPU (four H200s)", BLIND4 + "dp4.json", "colocated_dp4_tp1",
     BLIND4 + "dp4_qwen06b_colocated_dp4_tp1_metrics.jsonl", "held out", ()),
    ("0.6B single, 32 x 8 (the four-H200 host)", BLIND4 + "single.json", "single",
     BLIND4 + "single_qwen06b_single_metrics.jsonl", "held out", ()),
    # vllm_step_s is solved from the two runs' generation (fit.py); their other phases and steps are held out
    ("0.6B colocated DP=2, one vLLM engine per GPU (a second four-H200 host)", DP_X4 + "dp2.json", "colocated_dp2_tp1",
     DP_X4 + "dp2_qwen06b_colocated_dp2_tp1_metrics.jsonl", "fit", ("generation_s",)),
    ("0.6B colocated DP=4, one vLLM engine per GPU (a second four-H200 host)", DP_X4 + "dp4.json", "colocated_dp4_tp1",
     DP_X4 + "dp4_qwen06b_colocated_dp4_tp1_metrics.jsonl", "fit", ("generation_s",)),
    ("4B colocated TP=2 x DP=2, two vLLM TP=2 engines (the profiled four-H200 host)", PROFILE4 + "r2.json",
     "colocated_tp2dp2_r2", PROFILE4 + "r2_metrics.jsonl", "fit", ("step_s",)),
    ("4B colocated TP=2 x DP=2 + vLLM TP=4 (the profiled four-H200 host)", PROFILE4 + "tp2dp2.json", "colocated_tp2dp2",
     PROFILE4 + "tp2dp2_metrics.jsonl", "fit", ("step_s",)),
    ("0.6B single, 32 x 8 (the profiled four-H200 host)", PROFILE4 + "single.json", "single",
     PROFILE4 + "single_metrics.jsonl", "held out", ()),
    ("0.6B single, 32 x 8 (the profiled one-H200 host)", ONE_PROF + "s06.json", "single", ONE_PROF + "s06_metrics.jsonl",
     "held out", ()),
    ("4B single, 8k-token micro-batches (the profiled one-H200 host)", ONE_PROF + "s4b.json", "single",
     ONE_PROF + "s4b_metrics.jsonl", "held out", ()),
    ("0.6B colocated TP=2 x DP=2, two vLLM TP=2 engines (four H200s, profiled)", PROFILE4_06B + "r2.json",
     "colocated_tp2dp2_r2", PROFILE4_06B + "r2_metrics.jsonl", "fit", ("step_s",)),
    ("0.6B single, 32 x 8 (probed H200 host 1)", HOSTS + "h1.json", "single", HOSTS + "h1_metrics.jsonl", "held out",
     ()),
    ("0.6B single, 32 x 8 (probed H100 host 2)", HOSTS + "h2.json", "single", HOSTS + "h2_metrics.jsonl", "held out",
     ()),
    ("0.6B single, 32 x 8 (probed H200 host 3)", HOSTS + "h3.json", "single", HOSTS + "h3_metrics.jsonl", "held out",
     ()),
    ("0.6B colocated TP=2 + vLLM TP=2 (a probed four-H200 host)", HOSTS + "x4_tp2.json", "colocated_tp2",
     HOSTS + "x4_tp2_metrics.jsonl", "held out", ()),
    ("0.6B colocated TP=2 x DP=2, two vLLM TP=2 engines (the same host, profiled)", HOSTS + "x4_r2.json",
     "colocated_tp2dp2_r2", HOSTS + "x4_r2_metrics.jsonl", "fit", ("step_s",)),
    ("0.6B colocated DP=2, one vLLM engine per GPU (two H200s, probed slow)", BLIND5 + "vl.json", "colocated_dp2_tp1",
     BLIND5 + "vl_qwen06b_colocated_dp2_tp1_metrics.jsonl", "held out", ()),
    ("0.6B colocated TP=2 + vLLM TP=2 (two H200s, probed slow)", BLIND5 + "vl.json", "colocated_tp2",
     BLIND5 + "vl_qwen06b_colocated_tp2_metrics.jsonl", "held out", ()),
    ("hf engine, 0.6B colocated DP=2 (two H200s, probed slow)", BLIND5 + "hf.json", "colocated_dp2",
     BLIND5 + "hf_qwen06b_colocated_dp2_metrics.jsonl", "held out", ()),
    ("0.6B single, 32 x 8 (a two-H200 host, phases split)", DISPATCH + "d2_single.json", "single",
     DISPATCH + "d2_single_metrics.jsonl", "held out", ()),
    ("0.6B colocated DP=2, one vLLM engine per GPU (the same two-H200 host)", DISPATCH + "d2_dp2.json",
     "colocated_dp2_tp1", DISPATCH + "d2_dp2_metrics.jsonl", "held out", ()),
    ("0.6B colocated TP=2 + vLLM TP=2 (the same two-H200 host)", DISPATCH + "d2_tp2.json", "colocated_tp2",
     DISPATCH + "d2_tp2_metrics.jsonl", "held out", ()),
    ("0.6B single, 32 x 8 (a one-H200 host, probed three times)", DISPATCH + "e1_single.json", "single",
     DISPATCH + "e1_single_metrics.jsonl", "held out", ()),
    ("0.6B single, 32 x 8 (another one-H200 host, probed three times)", DISPATCH + "f1_single.json", "single",
     DISPATCH + "f1_single_metrics.jsonl", "held out", ()),
    ("0.6B single, 32 x 8 (a four-H200 host, four ranks split)", SPLIT4 + "k4_single.json", "single",
     SPLIT4 + "k4_single_metrics.jsonl", "held out", ()),
    ("0.6B colocated DP=2, one vLLM engine per GPU (the same four-H200 host)", SPLIT4 + "k4_dp2.json",
     "colocated_dp2_tp1", SPLIT4 + "k4_dp2_metrics.jsonl", "held out", ()),
    ("0.6B colocated DP=4, one vLLM engine per GPU (the same four-H200 host)", SPLIT4 + "k4_dp4.json",
     "colocated_dp4_tp1", SPLIT4 + "k4_dp4_metrics.jsonl", "held out", ()),
    ("0.6B colocated TP=2 x DP=2, two vLLM TP=2 engines (the same four-H200 host)", SPLIT4 + "k4_tp2dp2.json",
     "colocated_tp2dp2_r2", SPLIT4 + "k4_tp2dp2_metrics.jsonl", "fit", ("step_s",)),
    ("0.6B colocated DP=4, one vLLM engine per GPU (a four-H200 host, the driver at one torch thread)",
     DRIVER_THREADS + "f_dp4.json", "colocated_dp4_tp1", DRIVER_THREADS + "f_dp4_metrics.jsonl", "held out", ()),
    ("0.6B colocated DP=2, one vLLM engine per GPU (the same host, the driver at one torch thread)",
     DRIVER_THREADS + "f_dp2.json", "colocated_dp2_tp1", DRIVER_THREADS + "f_dp2_metrics.jsonl", "held out", ()),
    ("0.6B colocated TP=2 x DP=2, two vLLM TP=2 engines (the same host, the driver at one torch thread)",
     DRIVER_THREADS + "f_tp2dp2.json", "colocated_tp2dp2_r2", DRIVER_THREADS + "f_tp2dp2_metrics.jsonl", "fit",
     ("step_s",)),
    ("0.6B colocated TP=2, one vLLM TP=2 engine (the same host, the driver at one torch thread)",
     DRIVER_THREADS + "f_tp2.json", "colocated_tp2", DRIVER_THREADS + "f_tp2_metrics.jsonl", "held out", ()),
    ("0.6B colocated DP=2, one vLLM engine per GPU (a two-H200 host, the driver at one torch thread)",
     FIXED_DRIVER + "dp2_b32.json", "colocated_dp2_tp1", FIXED_DRIVER + "dp2_b32_metrics.jsonl", "held out", ()),
    ("0.6B colocated DP=2, one vLLM engine per GPU, 64 x 8 (the same host)",
     FIXED_DRIVER + "dp2_b64.json", "colocated_dp2_tp1", FIXED_DRIVER + "dp2_b64_metrics.jsonl", "held out", ()),
    ("0.6B single, 32 x 8 (a two-H200 host, the driver at one torch thread)",
     FIXED_DRIVER + "single_b32.json", "single", FIXED_DRIVER + "single_b32_metrics.jsonl", "held out", ()),
    ("hf engine, 0.6B colocated DP=2 (the same host)",
     FIXED_DRIVER + "hf_dp2.json", "colocated_dp2", FIXED_DRIVER + "hf_dp2_metrics.jsonl", "held out", ()),
    ("hf engine, 0.6B colocated TP=2 (the same host)",
     FIXED_DRIVER + "hf_tp2.json", "colocated_tp2", FIXED_DRIVER + "hf_tp2_metrics.jsonl", "held out", ()),
    ("0.6B colocated DP=2, one vLLM engine per GPU (the same host, again)",
     FIXED_DRIVER + "dp2_b32_again.json", "colocated_dp2_tp1", FIXED_DRIVER + "dp2_b32_again_metrics.jsonl", "held out",
     ()),
    ("0.6B single, 32 x 8 (a one-H100 host, the driver at one torch thread)",
     FIXED_DRIVER + "single_h100.json", "single", FIXED_DRIVER + "single_h100_metrics.jsonl", "held out", ()),
    ("hf engine, 0.6B single (the same H100 host)",
     FIXED_DRIVER + "hf1_h100.json", "single", FIXED_DRIVER + "hf1_h100_metrics.jsonl", "held out", ()),
    ("0.6B single, 32 x 8 (the same H100 host, again)",
     FIXED_DRIVER + "single_h100_again.json", "single", FIXED_DRIVER + "single_h100_again_metrics.jsonl", "held out",
     ()),
]


def scaling_cases() -> list[Case]:
    """SCALING_RUNS as Cases: the overrides of the run's command, the steady-step means of its per-step log (steps 3..,
    as the tool's report): max_memory_allocated of the training ranks (and the rollout ranks), every phase, and the
    whole step."""
    out: list[Case] = []
    for name, rel, key, log, role, fitted, *legacy in SCALING_RUNS:
        d = load(rel)
        r = d["qwen06b"][key]
        ov = [o for o in r["command"].split()[4:] if not o.startswith(("trainer.ray_address", "hydra."))]
        m = steady_means(log)
        alloc = {k.rsplit("/", 1)[1]: v for k, v in m.items() if k.startswith("perf/max_memory_allocated_gb/")}
        res = {k.rsplit("/", 1)[1]: v for k, v in m.items() if k.startswith("perf/max_memory_reserved_gb/")}
        meas = {"allocator_peak_gib": max(v for k, v in alloc.items() if not k.startswith("rollout")),
                "allocator_reserved_gib": max(v for k, v in res.items() if not k.startswith("rollout")),
                "generation_s": m["timing_s/gen"], "old_log_prob_s": m["timing_s/old_log_prob"],
                "ref_s": m["timing_s/ref"], "update_s": m["timing_s/update_actor"],
                "weight_sync_s": m["timing_s/update_weights"] + m.get("timing_s/rollout_sleep", 0.0),
                "step_s": m["timing_s/step"]}
        if any(k.startswith("rollout") for k in alloc):
            meas["rollout_allocator_peak_gib"] = max(v for k, v in alloc.items() if k.startswith("rollout"))
        out.append(Case(name, f"{rel}, {d['date']}, {d['device']}", _dev(d["device"]), ov, role, meas, "step",
                        run_lengths(ov), fitted=fitted, legacy_q=legacy[0] if legacy else ()))
    return out
