"""The planner against every measured run: predicted vs measured per run and quantity, the scorecard issue 58 scores
the planner by (held-out allocator peaks within 10%, no config mis-planned as fitting or not, the step time's median
|error| over the genuinely held-out runs with the plan's range across machines), the tables the docs show, and the
planner table (tools/results/planner.jsonl). Must not fit anything (fit.py does).
"""

from __future__ import annotations

import math
import statistics
import textwrap
from typing import Any

from harness import results as tables
from planlab.cases import HOST_SPREAD_RUNS, Case, by_key, cases
from planlab.fit import case_inputs, planned_step_and_share, predict

from rltrain.plan import calibration as cal
from rltrain.plan.timing import step_range

PEAK_LIMIT_PCT = 10.0  # every held-out allocator peak within this
STEP_LIMIT_PCT = 15.0  # the step's median |error| over the genuinely held-out runs at or under this


def compare(cs: list[Case] | None = None) -> list[dict[str, Any]]:
    """Predicted vs measured for every case and quantity (with calibration.py's constants)."""
    rows = []
    for c in cs if cs is not None else cases():
        try:
            p = predict(c)
        except Exception as err:  # a run the planner cannot express: reported, not hidden
            rows.append({"case": c.name, "device": c.device, "source": c.source, "role": "held out", "quantity": "-",
                         "measured": math.nan, "predicted": math.nan, "error_pct": math.nan,
                         "note": f"not planned: {err}"})
            continue
        for q, m in c.measured.items():
            if q not in p or q == "reserved_gib":
                continue
            err = 100.0 * (p[q] - m) / m if m else (0.0 if p[q] == m else math.inf)
            rows.append({"case": c.name, "device": c.device, "source": c.source, "role": c.role_of(q), "quantity": q,
                         "measured": m, "predicted": p[q], "error_pct": err, "fitted_any": c.fitted_any,
                         "scope": c.scope})
        if c.scope == "step" and c.role_of("allocator_peak_gib") != "legacy":  # it ran: the plan must say it fits
            rows.append({"case": c.name, "device": c.device, "source": c.source, "role": c.role_of("fits"),
                         "quantity": "fits", "measured": 1.0, "predicted": p["fits"],
                         "error_pct": math.nan, "fitted_any": c.fitted_any, "scope": c.scope})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | device, date | role | quantity | measured | predicted | error |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["quantity"] == "fits":
            meas, pred, err = ("fits" if r["measured"] else "OOM"), ("fits" if r["predicted"] else "OOM"), (
                "right" if r["measured"] == r["predicted"] else "WRONG")
        else:
            meas, pred, err = f"{r['measured']:.3f}", f"{r['predicted']:.3f}", f"{r['error_pct']:+.1f}%"
        lines.append(f"| {r['case']} | {r['source']} | {r['role']} | {r['quantity']} | {meas} | {pred} | {err} |")
    return "\n".join(lines)


def step_table(rows: list[dict[str, Any]]) -> str:
    """One line per whole GRPO step run: max_memory_allocated and max_memory_reserved of its training GPU(s) and the
    step's seconds, each measured, predicted, error, and the run's role for them."""
    by: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["quantity"] in ("allocator_peak_gib", "allocator_reserved_gib", "step_s"):
            by.setdefault((r["case"], r["source"]), {})[r["quantity"]] = r
    lines = ["| run | device, date | role (memory / step) | allocated GiB: measured | predicted | error | reserved "
             "GiB: measured | predicted | error | step s: measured | predicted | error |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (name, src), q in by.items():
        if "step_s" not in q or "allocator_peak_gib" not in q:  # whole steps only (not the update benchmarks)
            continue
        cells = []
        for k in ("allocator_peak_gib", "allocator_reserved_gib", "step_s"):
            r = q.get(k)
            cells += ([f"{r['measured']:.2f}", f"{r['predicted']:.2f}", f"{r['error_pct']:+.1f}%"] if r else ["-"] * 3)
        mem = q.get("allocator_peak_gib", {}).get("role", "-")
        lines.append(f"| {name} | {src} | {mem} / {q['step_s']['role']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def placement_label(c: Case) -> tuple[str, str, str, str]:
    """(model, engine, placement, GPU) of a whole-step case, from its composed config: what placement_table groups
    its runs by."""
    x = case_inputs(c)
    gpus = x.n_gpus_per_node * x.nnodes
    parts = [f"TP={x.tp}"] * (x.tp > 1) + [f"PP={x.pp}"] * (x.pp > 1)
    dp = gpus // max(1, x.tp * x.pp)
    parts += [f"DP={dp}"] * (dp > 1) + [f"EP={x.ep}"] * (x.ep > 1)
    if not x.colocate:
        where = f"split, training on {gpus} GPU{'s' * (gpus > 1)}" + (f" ({' x '.join(parts)})" if parts else "")
    elif gpus == 1:
        where = "one GPU"
    else:
        where = "colocated " + " x ".join(parts)
    if x.engine == "vllm":
        where += f", vLLM TP={x.rollout_tp}" if x.rollout_tp > 1 else (
            f", {x.engines_per_gpu} engines a GPU" if x.engines_per_gpu > 1 else
            (", an engine per GPU" if gpus > 1 and x.colocate else ""))
    if x.max_response_length != 64:
        where += f", {x.max_response_length:,}-token responses"
    return x.shape.name, x.engine, where, c.gpu.upper()


def placement_table(rows: list[dict[str, Any]], cs: list[Case] | None = None) -> str:
    """The whole steps (not legacy) grouped by model, engine, placement and GPU: how many runs (how many of them
    fitted any constant), how many within 25% of plan, their errors' range and median |error|."""
    by = by_key(cs if cs is not None else cases())
    groups: dict[tuple[str, str, str, str], list[tuple[float, bool]]] = {}
    for r in rows:
        if r["quantity"] != "step_s" or r["role"] == "legacy" or not math.isfinite(r["error_pct"]):
            continue
        c = by[(r["case"], r["device"])]
        if c.scope != "step" or "allocator_peak_gib" not in c.measured:  # whole GRPO steps only
            continue
        groups.setdefault(placement_label(c), []).append((r["error_pct"], c.fitted_any))
    lines = ["| model | engine | placement | GPU | runs (fitted) | within 25% | errors | median abs. error |",
             "|---|---|---|---|---:|---:|---|---:|"]
    for key in sorted(groups):
        errs = sorted(e for e, _ in groups[key])
        fitted = sum(f for _, f in groups[key])
        absolute = sorted(abs(e) for e in errs)
        span = f"{errs[0]:+.1f}%" + (f" .. {errs[-1]:+.1f}%" if len(errs) > 1 else "")
        lines.append(f"| {' | '.join(key)} | {len(errs)}{f' ({fitted})' if fitted else ''} | "
                     f"{sum(a <= 25 for a in absolute)} | {span} | {statistics.median(absolute):.1f}% |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    """Per role and kind (memory, time): the comparisons' count, median and max |error|."""
    out = []
    for role in ("fit", "held out", "legacy"):
        for kind, test in (("memory", lambda q: q.endswith("gib")), ("time", lambda q: q.endswith("_s"))):
            errs = sorted(abs(r["error_pct"]) for r in rows if r["role"] == role and test(r["quantity"])
                          and math.isfinite(r["error_pct"]))
            if errs:
                out.append(f"{role}, {kind}: {len(errs)} comparisons, median |error| {errs[len(errs) // 2]:.1f}%, "
                           f"max {errs[-1]:.1f}%")
    return "\n".join(out)


def scorecard(rows: list[dict[str, Any]], ranges: list[dict[str, Any]]) -> dict[str, Any]:
    """Issue 58's score: held-out allocator peaks (max |error|, how many within PEAK_LIMIT_PCT), the fit verdicts
    (every run that ran planned as fitting, every OOM as not), and the step time over the genuinely held-out runs (no
    quantity of the run fitted a constant): their count, median |error|, the errors' range, the median per GPU kind,
    and how many steps the plan's range across machines held."""
    peaks = [r for r in rows if r["quantity"] in ("allocator_peak_gib", "peak_gib") and r["role"] == "held out"
             and math.isfinite(r["error_pct"])]
    verdicts = [r for r in rows if r["quantity"] == "fits" and r["role"] != "legacy"]
    steps = [r for r in rows if r["quantity"] == "step_s" and r["scope"] == "step" and r["role"] == "held out"
             and not r["fitted_any"] and math.isfinite(r["error_pct"])]
    errs = sorted(r["error_pct"] for r in steps)
    by_gpu = {}
    for gpu in sorted({r["device"].split("x")[0] for r in steps}):
        e = [abs(r["error_pct"]) for r in steps if r["device"].split("x")[0] == gpu]
        by_gpu[gpu] = (len(e), statistics.median(e))
    held = [r for r in ranges if not r["fitted_any"]]
    return {"peaks": len(peaks), "peak_max_pct": max(abs(r["error_pct"]) for r in peaks),
            "peaks_within": sum(abs(r["error_pct"]) <= PEAK_LIMIT_PCT for r in peaks),
            "verdicts": len(verdicts), "verdicts_wrong": [r["case"] for r in verdicts if r["measured"] != r["predicted"]],
            "steps": len(steps), "step_median_pct": statistics.median(abs(e) for e in errs),
            "step_low_pct": errs[0], "step_high_pct": errs[-1],
            "step_p10_pct": errs[len(errs) // 10], "step_p90_pct": errs[(9 * len(errs)) // 10],
            "step_within_25": sum(abs(e) <= 25 for e in errs), "step_by_gpu": by_gpu,
            "range_held": sum(r["inside"] for r in held), "range_runs": len(held)}


def scorecard_text(s: dict[str, Any]) -> str:
    gpus = ", ".join(f"{g.upper()} {n} runs {m:.1f}%" for g, (n, m) in s["step_by_gpu"].items())
    lines = [
        f"held-out allocator peaks: {s['peaks_within']} of {s['peaks']} within {PEAK_LIMIT_PCT:.0f}% "
        f"(max |error| {s['peak_max_pct']:.1f}%)",
        f"fit verdicts: {s['verdicts'] - len(s['verdicts_wrong'])} of {s['verdicts']} right"
        + (f" (wrong: {'; '.join(s['verdicts_wrong'])})" if s["verdicts_wrong"] else ""),
        f"step time over the {s['steps']} genuinely held-out runs (no quantity of the run fitted): median |error| "
        f"{s['step_median_pct']:.1f}% (limit {STEP_LIMIT_PCT:.0f}%), errors {s['step_low_pct']:+.1f}% .. "
        f"{s['step_high_pct']:+.1f}% (10th-90th percentile {s['step_p10_pct']:+.1f}% .. {s['step_p90_pct']:+.1f}%), "
        f"{s['step_within_25']} within 25%; by GPU: {gpus}",
        f"the plan's range across machines held {s['range_held']} of those {s['range_runs']} steps (the {len(HOST_SPREAD_RUNS)} "
        "runs it is solved from left out)"]
    return "\n".join(textwrap.fill(ln, width=120, subsequent_indent="  ") for ln in lines)


def range_rows(cs: list[Case] | None = None) -> list[dict[str, Any]]:
    """Every whole step (not legacy) outside HOST_SPREAD_RUNS (the runs host_speed_low / _high come from): measured,
    the plan's step and its range across machines (timing.step_range), and whether the range held it."""
    spread = set(HOST_SPREAD_RUNS)
    rows = []
    for c in cs if cs is not None else cases():
        if c.scope != "step" or "step_s" not in c.measured or c.role_of("step_s") == "legacy" or c.key in spread:
            continue
        planned, share = planned_step_and_share(c)
        lo, hi = step_range(planned, share)
        m = c.measured["step_s"]
        rows.append({"case": c.name, "device": c.device, "source": c.source, "measured": m, "predicted": planned,
                     "low": lo, "high": hi, "inside": lo <= m <= hi, "fitted_any": c.fitted_any})
    return rows


def range_summary(rows: list[dict[str, Any]]) -> str:
    """One paragraph: how many whole steps the plan's range held, and those it did not."""
    out = [r for r in rows if not r["inside"]]
    text = (f"The plan's range across machines (host_speed_low .. host_speed_high of its host time, solved from the "
            f"0.6B one-GPU step's {len(HOST_SPREAD_RUNS)} runs) held {len(rows) - len(out)} of the {len(rows)} whole "
            "steps of the other runs")
    if out:
        text += "; outside: " + "; ".join(f"{r['case']} {r['measured']:.3f} s ({r['low']:.3f}-{r['high']:.3f})"
                                          for r in out)
    return textwrap.fill(text + ".", width=120, break_long_words=False, break_on_hyphens=False)


def planner_rows(rows: list[dict[str, Any]], cs: list[Case]) -> list[dict]:
    """The planner table's rows: one per run, its measured, planned and error per quantity and its role."""
    by = by_key(cs)
    out: dict[tuple[str, str], dict] = {}
    for r in rows:
        if r["quantity"] == "-":
            continue
        c = by[(r["case"], r["device"])]
        row = out.setdefault(c.key, tables.row(
            "plan_lab", c.shape, c.device, c.name, {}, date=c.date,
            note="fitted: " + ", ".join(sorted({q for q in c.measured if c.role_of(q) == "fit"})) if c.fitted_any
            else ""))
        q = r["quantity"]
        row["metrics"][f"{q}/measured"] = r["measured"]
        row["metrics"][f"{q}/planned"] = r["predicted"]
        if math.isfinite(r["error_pct"]):
            row["metrics"][f"{q}/error_pct"] = round(r["error_pct"], 2)
    return list(out.values())


def constants_markdown() -> str:
    lines = ["| constant | value | unit | kind | source (the results row, date, device; what) |", "|---|---|---|---|---|"]
    for name, c in cal.all_constants().items():
        lines.append(f"| `{name}` | {c.value:g} | {c.unit} | {c.kind} | {c.source} |")
    for key, d in cal.DEVICES.items():
        lines.append(f"| device `{key}` | {d.total_gib:g} GiB, {d.hbm_bytes_per_s / 1e12:g} TB/s | memory, HBM | "
                     f"measured / datasheet | {d.source} |")
    return "\n".join(lines)
