"""One-time conversion (issue 58), second part: the summary rows of the raw results under tools/results/ that the
area documents show, as rows of the per-area tables (tools/harness/results.py). The planner's runs were converted
before (this file's first version, from rltrain/plan/fit_cases.py). Deleted after its run, with the raw files.

    python tools/convert_results_once.py
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import results  # noqa: E402

RAW = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def load(rel: str) -> dict:
    with open(os.path.join(RAW, rel)) as f:
        return json.load(f)


def _date(d: dict) -> str:
    return str(d["date"])[:10]


def update_extra() -> list[dict]:
    """tools/gpu_smoke.py's TP=2 section (two H200s): the 0.6B's 8k update step at TP=2 and TP=1, and the parity."""
    d = load("gpu_smoke_h200x2_tp2.json")
    t = d["tp2"]
    out = []
    for tp in (2, 1):
        u = t[f"update_step_tp{tp}"]
        out.append(results.row("gpu_smoke", "qwen3-0.6b", "h200x2", f"tp2: update step TP={tp}, 8k tokens",
                               {"step_s": u["step_s"], "peak_gib": u["peak_gib"], "tokens": t["update_tokens"]},
                               date=_date(d)))
    out.append(results.row("gpu_smoke", "qwen3-0.6b", "h200x2", "tp2: log-probs TP=2 vs TP=1",
                           {k: t[k] for k in ("tokens_compared", "logprob_max_abs_diff_tp2_vs_tp1",
                                              "logprob_mean_abs_diff_tp2_vs_tp1", "entropy_max_abs_diff_tp2_vs_tp1")},
                           date=_date(d)))
    return out


def update_profiles() -> list[dict]:
    """tools/profile_update.py's per-category tables (kernel ms per step; the 2026-11-23 ones rescaled as recorded)."""
    out = []
    for name, date in (("06b-8k-legacy", "2026-11-23"), ("06b-8k-all", "2026-11-23"),
                       ("qwen3-0.6b-8832x69-all", "2026-11-25")):
        d = load(f"update/profile_{name}.json")
        s = d.get("summary", d)
        m = {f"ms/{r['category']}": round(r["ms"], 2) for r in s["rows"]}
        m.update({"step_ms": round(s["step_ms"], 1), "host_syncs_per_step": s["host_syncs_per_step"]})
        out.append(results.row("profile_update", "qwen3-0.6b", "h100", name, m, date=date))
    return out


def kernel_rows() -> list[dict]:
    """tools/bench_logprob.py's GPU runs (cute and Triton alone, then with the peers: cute there at the 224 MiB
    budget), the v3 / v2 A/B with the mainloop-only probe, the slime #1951 regime, and the 2026-11-22 accuracy table
    (its raw output was not kept: transcribed from that day's report)."""
    out = []
    for prefix, note in (("t", ""), ("p", "the peers' run")):
        for T in (8192, 32768, 65536):
            d = load(f"cute_head_h100_2026-11-26/{prefix}{T}.json")
            c = d["config"]
            shape = f"{c['T']}x{c['H']}x{c['V']}"
            for prov, r in d["results"].items():
                if r.get("status") != "ok":
                    continue
                variant = prov
                if prefix == "p" and prov in ("fused_cute", "fused_triton"):  # beside the cute + Triton run
                    variant += " (224 MiB budget)" if prov == "fused_cute" and T != 65536 else " (peers' run)"
                m = {k: round(r[k], 3) for k in ("fwd_ms", "fwdbwd_ms", "peak_extra_mib") if r.get(k) is not None}
                m["gemm_ms"] = round(d["floor_ms"]["fwd"], 3)
                out.append(results.row("bench_logprob", shape, "h100", variant, m, date="2026-11-26", note=note))
    d = load("kernel/ab_h100_2026-11-25.json")
    for key, ab in d["ab"].items():
        shape = key.replace(",", "x")
        rows = ab["rows"]
        pick = {"v2": ("baseline forward", "baseline fwd+bwd"), "v3": ("new forward, flatten, 3 stages",
                                                                        "new fwd+bwd (flatten, 3 stages)")}
        for v, (f, fb) in pick.items():
            m = {"fwd_ms": round(rows[f]["ms"], 2), "fwdbwd_ms": round(rows[fb]["ms"], 2),
                 "gemm_ms": round(ab["gemm_ms"], 2)}
            if v == "v3":
                m["peak_extra_gib"] = round(ab["new_peak_extra_gib"], 3)
                m["mainloop_probe_ms"] = round(rows["mainloop only (probe var 3), flatten, 4 stages"]["ms"], 2)
            out.append(results.row("kernel_split", shape, "h100", f"fused_triton {v}", m, date="2026-11-25"))
    d = load("repro_slime_h100.json")
    for r in d["rows"]:
        m = {k: round(v, 1) for k, v in r.items() if k not in ("fraction", "rows") and isinstance(v, (int, float))}
        out.append(results.row("bench_logprob", "205280x2560x76032", "h100", f"fp32, response fraction {r['fraction']}",
                               m, date="2026-11-22", note="peak extra MiB per provider (fused_triton)"))
    acc = {"ours (triton)": (6.72e-07, 5.92e-07, 2.31e-03, 2.31e-03), "liger_flce": (1.68e-04, None, 2.32e-03, 2.44e-03),
           "cce_exact": (1.64e-04, None, 1.19e-02, 2.44e-03), "verl": (6.75e-07, 5.87e-07, 5.56e-03, 2.31e-03)}
    for prov, vals in acc.items():
        m = {k: v for k, v in zip(("logprob_rel", "entropy_rel", "dhidden_rel", "dweight_rel"), vals) if v is not None}
        out.append(results.row("gpu_logprob_check", "4096x4096x151936", "h100", f"accuracy vs fp64: {prov}", m,
                               date="2026-11-22", note="transcribed from the 2026-11-22 report (raw not kept)"))
    return out


def learn_rows(rel: str, tool_variant: str, device: str = "h100") -> list[dict]:
    """tools/learn_gpu.py's summary: each GRPO (and ReTool GRPO) run's held-out accuracy before, at steps 10, 50 and
    100 and after, its mean s/step; the SFT stages' before / after."""
    d = load(rel)
    out = []
    for stage in ("sft", "retool_sft"):
        if stage in d:
            st = d[stage]
            m = {"acc_before": st["before"]["accuracy"], "acc_after": st["after"]["accuracy"], "wall_s": st["wall_s"]}
            out.append(results.row("learn_gpu", "small (55.4M)", device, f"{tool_variant}{stage}", m,
                                   date=str(d["date"])[:10]))
    for stage in ("grpo", "retool_grpo"):
        for run, r in (d.get(stage) or {}).get("runs", {}).items():
            curve = dict(r["curve"]["val/accuracy"])
            m = {"acc_before": r["before"]["accuracy"],
                 "acc_after": r["after"]["accuracy"] if "after" in r else r["curve"]["val/accuracy"][-1][1],
                 "steps": r["steps_done"]}
            m.update({f"acc@{k}": curve[k] for k in (10, 50, 100) if k in curve})
            t = r.get("timing", {})
            if "step_s" in t:
                m["step_s"] = round(t["step_s"], 3)
            out.append(results.row("learn_gpu", "small (55.4M)", device, f"{tool_variant}{stage} {run}", m,
                                   date=str(d["date"])[:10]))
    return out


def kernel_learn() -> list[dict]:
    out = learn_rows("cute_head_h100_2026-11-26/learn_recipe/cute_summary.json", "cute head: ")
    out += learn_rows("cute_head_h100_2026-11-26/learn_recipe/triton_summary.json", "triton head: ")
    curves = load("cute_head_h100_2026-11-26/learn_curves.json")
    for run, c in curves.items():
        acc = dict(c["val_accuracy"])
        m = {f"acc@{k}": acc[k] for k in (0, 100, 200, 300) if k in acc}
        out.append(results.row("rltrain.main", "tiny", "h100", f"grpo_tiny bf16, {run}", m, date="2026-11-26"))
    return out


def rollout_rows() -> list[dict]:
    """tools/bench_rollout.py's runs: every number of each engine row (the planner's two rows keep their config and
    scope), and the learning recipe's hf against vLLM runs."""
    old = {r["variant"]: r for r in results.read("rollout") if "scope" in r}  # the planner's two rows
    out = []
    for rel, variant in (("vllm/bench_rollout_1k.json", "vLLM alone, 256 x (128 + 1024)"),
                         ("vllm_x2/bench_rollout_variants_h200.json", "vLLM alone, 256 x (64 + 64)"),
                         ("vllm/bench_rollout_own_process_h100.json", "vLLM alone, 256 x (64 + 64), engine core in its "
                                                                       "own process"),
                         ("hf_pinned_sleep_h200x2_2026-11-26/bench_rollout.json", "hf alone, 256 x (64 + 64), pinned "
                                                                                 "sleep")):
        d = load(rel)
        r = d["results"][0]
        m = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
             if isinstance(v, (int, float)) and k != "batch"}
        if "gen_tokens_per_s" in m:
            m["tokens_per_s"] = m["gen_tokens_per_s"]
        if isinstance(r.get("variants"), dict):
            for name, v in r["variants"].items():
                for k in ("gen_s", "ms_per_decode_step"):
                    if isinstance(v, dict) and k in v:
                        m[f"{name}/{k}"] = round(v[k], 4)
        device = results.device_kind(d["device"])
        row = results.row("bench_rollout", d["shape"], device, variant, m, date=str(d["date"])[:10],
                          config=old[variant].get("config") if variant in old else None)
        if variant in old:
            row["scope"] = old[variant]["scope"]
            row["metrics"]["gen_s"] = old[variant]["metrics"]["gen_s"]
            row["metrics"]["sleep_freed_gib"] = old[variant]["metrics"]["sleep_freed_gib"]
        out.append(row)
    out += learn_rows("vllm/learn_summary.json", "engines: ")
    return out


def placement_learning() -> list[dict]:
    """tools/gpu_placements.py --only learn: grpo_tiny to the end in each placement (held-out accuracy)."""
    out = []
    for rel, tag in (("vllm_x2/placements_learn_150steps.json", "2026-11-23"),
                     ("vllm_x2/placements_learn_split_1p1_150steps_rerun.json", "2026-11-23, rerun"),
                     ("vllm_x2/placements_learn_colocated_tp2_hd64_h100x2_2026-11-25.json", "head_dim 64"),
                     ("refactor_h200x2_2026-11-26/learn_vllm_split_dp2_tp2.json", "after #32"),
                     ("refactor_h200x2_2026-11-26/learn_vllm_tp2_final.json", "after #32, again"),
                     ("refactor_h200x2_2026-11-26/learn_vllm_pp2.json", "after #32"),
                     ("refactor_h200x2_2026-11-26/learn_vllm_async_split.json", "after #32, async"),
                     ("colocated_dp_h200x2_2026-11-26/learn_dp2_tp1.json", "an engine per GPU")):
        d = load(rel)
        for place, r in d["learn"].items():
            steps = next((int(o.split("=")[1]) for o in r["command"].split() if o.startswith("trainer.total_steps=")),
                         0)
            m = {"steps": steps, "seconds": r.get("seconds", 0.0), "rc": r["rc"]}
            if "acc_after" in r:
                m.update(acc_before=r["acc_before"], acc_after=r["acc_after"], gain=round(r["gain"], 4))
            gpus = 1 if place in ("single",) else 2
            out.append(results.row("gpu_placements", "tiny", results.device_kind(d["device"]),
                                   f"learn {place} ({tag})", m, date=str(d["date"])[:10],
                                   note="" if r["rc"] == 0 else "hung in vLLM's start (head_dim 16, TP=2)"))
            del gpus
    return out


def moe_learning() -> list[dict]:
    return learn_rows("moe_h200x2_2026-11-26/learn_moe_summary.json", "small-moe: ", "h200")


def offpolicy_rows() -> list[dict]:
    """tools/bench_offpolicy.py, two seeds (grpo_tiny, split 1+1, vLLM, two H200s), and the async speed of the
    Qwen3-0.6B shape with the hf engine (tools/bench_async.py, 2026-11-26), and the learning recipe (one H100)."""
    out = []
    for seed in ("seed2", "seed3"):
        d = load(f"offpolicy_h200x2_2026-11-26/{seed}/bench_offpolicy.json")
        for name, r in d["runs"].items():
            if "speed" not in r:
                continue
            acc = [a for _, a in r["curve"]["by_step"]]
            m = {"best": max(acc), "final3": round(sum(acc[-3:]) / len(acc[-3:]), 4),
                 "tokens_per_s": round(r["speed"]["tokens_per_s"], 1), "staleness_mean": r["staleness_mean"],
                 "staleness_max": r["speed"]["max_staleness_seen"], "dropped_samples": r["dropped_samples"],
                 "wave": r["wave"]}
            for k in ("rollout/is_weight_mean", "rollout/is_ratio_max", "rollout/is_clipfrac",
                      "rollout/is_masked_frac", "rollout/mismatch_kl", "rollout/partial_samples_frac"):
                if k in r:
                    m[k] = round(r[k], 5)
            out.append(results.row("bench_offpolicy", "tiny", "h200x2", f"{name}, {seed.replace('seed', 'seed ')}", m,
                                   date="2026-11-26", config=r["overrides"]))
    d = load("refactor_h200x2_2026-11-26/bench_async_speed_hf.json")
    for mode in ("sync", "async"):
        s = d["speed"][mode]
        m = {k.split("/")[1] + "_s": round(v, 4) for k, v in s["mean"].items()}
        m.update(tokens_per_s=round(s["tokens_per_s"], 1), median_step_s=round(s["median_step_s"], 4))
        out.append(results.row("bench_async", "qwen3-0.6b", "h200x2", f"split 1+1, hf engine, {mode}", m,
                               date="2026-11-26", note="the async step's gen excluded the wait for the next batch "
                               "(a timing error fixed that day; not re-timed)" if mode == "async" else ""))
    out += learn_rows("learn/summary.json", "recipe: ")
    return out


AREAS = {"update": [update_extra, update_profiles], "kernel": [kernel_rows, kernel_learn], "rollout": [rollout_rows],
         "placements": [placement_learning], "moe": [moe_learning], "offpolicy": [offpolicy_rows]}



def main() -> int:
    for area, makers in AREAS.items():
        rows = [r for make in makers for r in make()]
        replaced = results.upsert(area, rows)
        print(f"{area}: {len(rows)} rows ({replaced} replaced)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
