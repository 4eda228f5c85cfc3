"""The plan for people (a plain table) and for programs (one JSON object)."""

from __future__ import annotations

from typing import Any

from rltrain.plan import calibration as cal
from rltrain.plan.calibration import GIB
from rltrain.plan.memory import GPU
from rltrain.plan.planner import Plan, _fmt

PHASES = ("generation", "log-probs", "update", "weight sync")


def _groups(plan: Plan) -> list[list[GPU]]:
    """GPUs with the same roles, stage and phases, together (a DP group's GPUs are alike)."""
    out: dict[tuple, list[GPU]] = {}
    for g in plan.gpus:
        key = (g.roles, g.stage, tuple((p.name, round(p.torch_bytes)) for p in g.phases))
        out.setdefault(key, []).append(g)
    return list(out.values())


def _span(gs: list[GPU]) -> str:
    idx = [g.index for g in gs]
    if len(idx) == 1:
        return f"GPU {idx[0]}"
    if idx == list(range(idx[0], idx[-1] + 1)):
        return f"GPUs {idx[0]}-{idx[-1]}"
    return "GPUs " + ",".join(map(str, idx))


def table(plan: Plan) -> str:
    x = plan.inputs
    dev = cal.DEVICES[plan.device]
    moe = (f"; MoE: {x.shape.num_experts} experts, top-{x.shape.num_experts_per_tok}, {sum(x.shape.sparse)} of "
           f"{x.shape.num_hidden_layers} layers sparse, EP {x.ep}") if x.shape.moe else ""
    lines = [f"rltrain.plan: {x.shape.name}, {x.world} training GPU(s) (TP {x.tp} x PP {x.pp} x DP {x.dp}{moe}), "
             f"{'colocated' if x.colocated else 'split'}, rollout {x.engine} "
             f"(TP {x.rollout_tp}, {x.rollout_replicas} replica(s)); {plan.gpu_memory_gib:.1f} GiB per GPU, rates of "
             f"{dev.name}; sequences of {plan.lengths_note()}", ""]
    for gs in _groups(plan):
        g = gs[0]
        peak = g.peak()
        status = "fits" if g.fits else "DOES NOT FIT"
        lines.append(f"{_span(gs)} ({', '.join(g.roles)}"
                     + (f", pipeline stage {g.stage}" if x.pp > 1 and g.stage is not None else "")
                     + f"): peak {g.peak_bytes / GIB:.1f} GiB in '{peak.name}' -> {status}")
        names = list(dict.fromkeys(k for p in g.phases for k in [*p.parts, *p.non_torch]))
        w = max(len(n) for n in names + ["total on the device (x allocator slack)"]) + 2
        cols = [p.name[:22] for p in g.phases]
        lines.append("  " + "part (GiB)".ljust(w) + "".join(c.rjust(24) for c in cols))
        for n in names:
            vals = [(p.parts.get(n, p.non_torch.get(n))) for p in g.phases]
            lines.append("  " + n.ljust(w) + "".join(("-" if v is None else f"{v / GIB:.2f}").rjust(24) for v in vals))
        lines.append("  " + "total on the device (x allocator slack)".ljust(w)
                     + "".join(f"{p.device_bytes(g.slack) / GIB:.2f}".rjust(24) for p in g.phases))
        lines += ["  " + p.detail for p in g.phases if p.detail]
        if g.sleep_frees_bytes:
            lines.append(f"  the rollout engine's sleep frees {g.sleep_frees_bytes / GIB:.2f} GiB for the training "
                         "phases")
        lines += ["  note: " + n.removeprefix("REFUSE: ") for n in g.notes]
        lines.append("")
    s = plan.seconds
    lo, hi = plan.step_range
    lines.append("seconds per step: " + ", ".join(f"{k} {s[k]:.2f}" for k in PHASES) + f"; step {s['step']:.2f}")
    lines.append(f"across machines of one kind: {lo:.2f}-{hi:.2f} s a step ({100 * plan.host_share:.0f}% of it is the "
                 f"host's time, which ran {cal.value('host_speed_low'):.2f}-{cal.value('host_speed_high'):.2f}x the "
                 "planned on the machines measured; docs/benchmarks/planner.md)")
    lines += ["warning: " + msg for msg in plan.warnings]
    lines.append(plan.verdict())
    if not plan.fits:
        lines.append(plan.refusal())
    return "\n".join(lines)


def to_json(plan: Plan) -> dict[str, Any]:
    x = plan.inputs
    gpus = []
    for g in plan.gpus:
        peak = g.peak()
        gpus.append({
            "gpu": g.index, "roles": list(g.roles), "pipeline_stage": g.stage,
            "peak_gib": round(g.peak_bytes / GIB, 3), "peak_phase": peak.name, "fits": g.fits,
            "allocator_peak_gib": round(g.allocator_peak_bytes / GIB, 3),
            "allocator_reserved_gib": round(g.allocator_reserved_bytes / GIB, 3),
            "sleep_frees_gib": round(g.sleep_frees_bytes / GIB, 3),
            "phases": {p.name: {"device_gib": round(p.device_bytes(g.slack) / GIB, 3),
                                "parts_gib": {k: round(v / GIB, 3) for k, v in {**p.parts, **p.non_torch}.items()}}
                       for p in g.phases},
            "notes": [n.removeprefix("REFUSE: ") for n in g.notes],
        })
    return {
        "model": x.shape.name, "device": plan.device, "gpu_memory_gib": round(plan.gpu_memory_gib, 3),
        "fits": plan.fits, "peak_gib": round(plan.peak_gib, 3),
        "layout": {"gpus": x.world, "tp": x.tp, "pp": x.pp, "dp": x.dp, "ep": x.ep,
                   "colocated": x.colocated, "rollout_engine": x.engine,
                   "rollout_tp": x.rollout_tp, "rollout_replicas": x.rollout_replicas},
        "lengths": {"prompt_tokens": x.max_prompt_length, "response_tokens": x.max_response_length,
                    "time_prompt_tokens": round(x.mean_prompt_length if x.mean_prompt_length is not None
                                                else x.max_prompt_length, 2),
                    "from": x.lengths_from,
                    "data": None if plan.prompts is None else {
                        "longest": plan.prompts.longest, "mean": round(plan.prompts.mean, 2),
                        "count": plan.prompts.count, "where": plan.prompts.where}},
        "phase_seconds": {k: round(plan.seconds[k], 4) for k in (*PHASES, "step")},
        "step_s_range": [round(v, 4) for v in plan.step_range],
        "host_share": round(plan.host_share, 4),
        "phase_seconds_detail": {k.removeprefix("detail/"): round(v, 4) for k, v in plan.seconds.items()
                                 if k.startswith("detail/")},
        "gpus": gpus,
        "suggestions": [{"overrides": [f"{k}={_fmt(v)}" for k, v in s.overrides.items()],
                         "peak_gib": round(s.peak_gib, 3), "step_s": round(s.step_s, 3), "fits": s.fits}
                        for s in plan.suggestions],
        "more_gpus": None if plan.more_gpus is None else {
            "gpus": plan.more_gpus.gpus, "overrides": [f"{k}={_fmt(v)}" for k, v in plan.more_gpus.overrides.items()],
            "peak_gib": round(plan.more_gpus.peak_gib, 3), "step_s": round(plan.more_gpus.step_s, 3)},
        "searched_gpus": plan.searched_gpus,
        "warnings": plan.warnings,
        "message": plan.refusal(),
        "summary": plan.summary(),
    }

