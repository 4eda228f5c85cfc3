"""One-time conversion (issue 58): the planner's measured runs, read from the raw files under tools/results/ by
rltrain/plan/fit_cases.py, as rows of the per-area results tables (tools/harness/results.py). Each row keeps the raw
trainer metrics the calibration reads (steady-step means, as fit_cases computed them); the check at the end rebuilds
every Case's measured quantities from its row and compares them with fit_cases'. Deleted after its run.

    python tools/convert_results_once.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import results  # noqa: E402

from rltrain.plan import fit_cases as fc  # noqa: E402
from rltrain.plan.inputs import read  # noqa: E402

STEP_KEYS = ("timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/values", "timing_s/update_actor",
             "timing_s/update_critic", "timing_s/update_weights", "timing_s/rollout_sleep", "timing_s/rollout_wake",
             "timing_s/step")


def _date(d: dict) -> str:
    return str(d["date"])[:10]


def _kind(c: fc.Case) -> tuple[str, int]:
    x = read(fc.compose(c.overrides))
    return x.shape.name, x.n_gpus_per_node * x.nnodes


def _base(c: fc.Case, tool: str, date: str, metrics: dict) -> dict:
    shape, gpus = _kind(c)
    r = results.row(tool, shape, results.device_kind(c.device.upper(), gpus), c.name, metrics, date=date,
                    config=c.overrides)
    r["_case"] = c
    if c.legacy_q or c.role == "legacy":
        r["legacy"] = list(c.legacy_q) if c.role != "legacy" else ["all"]
    return r


def update_rows(by: dict) -> list[dict]:
    out = []
    for rel in ("update/bench_update.json", "update/bench_update_h100_64k.json", "update/bench_update_h200_4b.json",
                "update/bench_update_h200_tp2.json", fc.LENGTHS + "bench_update.json"):
        d = fc.load(rel)
        for row in d["rows"]:
            if row.get("status") != "ok":
                continue
            c = by[row["row"]["name"], rel]
            m = {k: row[k] for k in ("peak_gib", "reserved_gib", "step_s", "mfu", "tokens_per_s") if k in row}
            r = _base(c, "bench_update", _date(d), m)
            r["scope"] = "update"
            out.append(r)
    d = fc.load("gpu_smoke_h100_steps.json")
    for sec in ("step8k", "longctx"):
        for row in d[sec]:
            if row.get("status") != "ok":
                continue
            name = f"smoke-{row['tokens'] // 1024}k-{'fused' if row['fused'] else 'unfused'}-rc{int(row['recompute'])}"
            c = by[name, "gpu_smoke_h100_steps.json"]
            r = _base(c, "gpu_smoke", _date(d), {k: row[k] for k in ("peak_gib", "step_s", "mfu") if k in row})
            r["scope"] = "update"
            out.append(r)
    d = fc.load("gpu_smoke_h100.json")
    for row in d.get("longctx", []):
        if row.get("status") == "OOM":
            name = f"smoke-{row['tokens'] // 1024}k-{'fused' if row['fused'] else 'unfused'}-rc0 (OOM)"
            r = _base(by[name, "gpu_smoke_h100.json"], "gpu_smoke", _date(d), {"fits": 0.0})
            r["scope"] = "update"
            out.append(r)
    return out


def step_rows(by: dict) -> list[dict]:
    """fit_cases.cases()'s whole GRPO steps of tools/gpu_smoke.py: the report's means (a critic's phases from the
    run's log where the report left them out)."""
    out = []
    for c in [c for c in by.values() if c.kind == "step" and "gpu_placements" not in c.source]:
        rel = c.source.split(",")[0]
        if rel.endswith(("_gpu_placements.json",)) or any(rel == r[1] for r in fc.SCALING_RUNS):
            continue
        d = fc.load(rel)
        if "grpo" not in d:
            continue
        m = dict(d["grpo"]["mean"])
        raw = {k: m[k] for k in STEP_KEYS if k in m}
        if rel in fc.STEP_LOGS:
            logm = {**fc.steady_means(fc.STEP_LOGS[rel], first_step=2), **m}
            raw["timing_s/values"] = logm["timing_s/values"]
            if "timing_s/update_critic" in logm:
                raw["timing_s/update_critic"] = logm["timing_s/update_critic"]
        raw["perf/max_memory_allocated_gb"] = m["perf/max_memory_allocated_gb"]
        for k in ("tokens_per_step",):
            if k in d["grpo"]:
                raw[k] = d["grpo"][k]
        if "gemm_tflops" in d:
            raw["gemm_tflops"] = d["gemm_tflops"]
        raw["prompt_length/mean"], raw["response_length/mean"] = 5.0, 64.0
        r = _base(c, "gpu_smoke", _date(d), raw)
        r["scope"] = "step"
        out.append(r)
    return out


def placement_rows(by: dict) -> list[dict]:
    out = []
    plain = [(n, rel, key, None) for n, rel, key, _, _ in _placements()]
    scaling = [(n, rel, key, log) for n, rel, key, log, *_ in fc.SCALING_RUNS]
    for name, rel, key, log in plain + scaling:
        d = fc.load(rel)
        c = by[name, rel]
        r = d["qwen06b"][key]
        if log is None:  # tools/gpu_placements.py's report: its means and per-GPU peaks, the sleep from the log
            t = r["timing_s"]
            raw = {f"timing_s/{k}": t[k] for k in ("gen", "old_log_prob", "update_actor", "update_weights")}
            raw.update({f"timing_s/{k}": t[k] for k in ("ref", "step") if k in t})
            sleep = fc.placement_sleep(rel, t["update_weights"])
            if sleep:
                raw["timing_s/rollout_sleep"] = sleep
            peaks = r["peak_gib_per_gpu"]
            raw["perf/max_memory_allocated_gb"] = max(v for k, v in peaks.items() if not k.startswith("rollout"))
            if any(k.startswith("rollout") for k in peaks):
                raw["perf/max_memory_allocated_gb/rollout"] = max(v for k, v in peaks.items()
                                                                  if k.startswith("rollout"))
        else:  # the steady-step means of its per-step log (steps 3..)
            m = fc.steady_means(log)
            raw = {k: m[k] for k in ("timing_s/gen", "timing_s/old_log_prob", "timing_s/ref", "timing_s/update_actor",
                                     "timing_s/update_weights", "timing_s/step")}
            if "timing_s/rollout_sleep" in m:
                raw["timing_s/rollout_sleep"] = m["timing_s/rollout_sleep"]
            if "timing_s/rollout_wake" in m:
                raw["timing_s/rollout_wake"] = m["timing_s/rollout_wake"]
            alloc = {k.rsplit("/", 1)[1]: v for k, v in m.items() if k.startswith("perf/max_memory_allocated_gb/")}
            res = {k.rsplit("/", 1)[1]: v for k, v in m.items() if k.startswith("perf/max_memory_reserved_gb/")}
            raw["perf/max_memory_allocated_gb"] = max(v for k, v in alloc.items() if not k.startswith("rollout"))
            raw["perf/max_memory_reserved_gb"] = max(v for k, v in res.items() if not k.startswith("rollout"))
            if any(k.startswith("rollout") for k in alloc):
                raw["perf/max_memory_allocated_gb/rollout"] = max(v for k, v in alloc.items()
                                                                  if k.startswith("rollout"))
        lengths = fc.run_lengths(c.overrides)
        raw["prompt_length/mean"] = float(lengths["prompt_tokens"])
        raw["response_length/mean"] = float(lengths["response_tokens"])
        row = _base(c, "gpu_placements", _date(d), raw)
        row["scope"] = "step"
        out.append(row)
    return out


def _placements():
    """placement_cases() as (name, report, placement key, role, fitted)."""
    return [(c.name, c.source.split(",")[0], _placement_key(c, c.source.split(",")[0]), c.role, c.fitted)
            for c in fc.placement_cases()]


def _placement_key(c: fc.Case, rel: str) -> str:
    d = fc.load(rel)
    keys = list(d["qwen06b"])
    if len(keys) == 1:
        return keys[0]
    for k in keys:  # the run whose command gave these overrides
        ov = [o for o in d["qwen06b"][k]["command"].split()[4:] if not o.startswith(("trainer.ray_address", "hydra."))]
        if ov in (c.overrides, [o for o in c.overrides if o != "actor.moe_grouped_gemm=false"]):
            return k
    raise KeyError(f"{c.name}: no placement of {rel} matches")


def rollout_rows(by: dict) -> list[dict]:
    out = []
    for name, rel in (("vLLM alone, 256 x (128 + 1024)", "vllm/bench_rollout_1k.json"),
                      ("vLLM alone, 256 x (64 + 64)", "vllm_x2/bench_rollout_variants_h200.json")):
        d = fc.load(rel)
        r = d["results"][0]
        m = {k: r[k] for k in ("gen_s", "sleep_freed_gib", "tokens_per_s") if k in r and r[k] is not None}
        row = _base(by[name, rel], "bench_rollout", _date(d), m)
        row["scope"] = "rollout"
        out.append(row)
    return out


def measured_from_row(r: dict) -> dict:
    """What the planlab reader will compute from a row (a copy of its rule, checked here)."""
    m = r["metrics"]
    if r["scope"] == "update":
        return {k: m[k] for k in ("peak_gib", "step_s", "reserved_gib", "fits") if k in m}
    if r["scope"] == "rollout":
        return {"generation_s": m["gen_s"], "vllm_freed_gib": m["sleep_freed_gib"]}
    out = {"allocator_peak_gib": m["perf/max_memory_allocated_gb"], "generation_s": m["timing_s/gen"],
           "old_log_prob_s": m["timing_s/old_log_prob"],
           "update_s": m["timing_s/update_actor"] + m.get("timing_s/update_critic", 0.0),
           "weight_sync_s": m["timing_s/update_weights"] + m.get("timing_s/rollout_sleep", 0.0)}
    for q, k in (("allocator_reserved_gib", "perf/max_memory_reserved_gb"), ("ref_s", "timing_s/ref"),
                 ("step_s", "timing_s/step"), ("values_s", "timing_s/values"),
                 ("rollout_allocator_peak_gib", "perf/max_memory_allocated_gb/rollout")):
        if k in m:
            out[q] = m[k]
    return out


def main() -> int:
    by = {(c.name, c.source.split(",")[0]): c for c in fc.cases()}
    rows = update_rows(by) + step_rows(by) + placement_rows(by) + rollout_rows(by)
    names = {(r["variant"], r["device"]) for r in rows}
    assert len(names) == len(rows) == len(by), (len(names), len(rows), len(by))
    bad = 0
    for r in rows:
        c = r.pop("_case")
        got = measured_from_row(r)
        if set(got) != set(c.measured) or any(abs(got[k] - c.measured[k]) > 1e-12 * max(1, abs(c.measured[k]))
                                               for k in got):
            bad += 1
            print("MISMATCH", c.name, c.source, sorted(set(got) ^ set(c.measured)),
                  {k: (got.get(k), c.measured.get(k)) for k in got if got.get(k) != c.measured.get(k)})
    areas: dict[str, list[dict]] = {}
    for r in rows:
        area = ("update" if r["scope"] == "update" else "rollout" if r["scope"] == "rollout" else
                "moe" if r["shape"].startswith("qwen3-30b") else "placements")
        areas.setdefault(area, []).append(r)
    for area, rs in areas.items():
        results.upsert(area, rs)
        print(area, len(rs))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
