"""Refit calibration.py's fitted constants from the measured runs and compare the planner with every measured run.

    python -m rltrain.plan.fit            # the fitted constants (paste into calibration.py) + predicted vs measured
    python -m rltrain.plan.fit --markdown # the predicted-vs-measured table of docs/plan.md
    python -m rltrain.plan.fit --steps    # its whole-step summary (memory counters and step time per run)
    python -m rltrain.plan.fit --write    # write the refit values into calibration.py (after a new run is added)
    python -m rltrain.plan.fit --docs docs/plan.md   # then regenerate the doc's example and tables

Each fitted constant is solved from ONE run (role "fit"); every other run is "held out" and only compared. Rows of
the engine before the 2026-11-23 levers (fp32 norms, foreach AdamW: "legacy") are compared too, but the model
describes the current engine, so their error is reported apart. The runs are read from tools/results/ (the raw GPU
results).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import statistics
import sys
import textwrap
from typing import Any

from rltrain.plan import calibration as cal
from planlab.cases import (HOST_SPREAD_RUNS, Case, cases, compose, load,  # noqa: F401 (results_dir)
                                    results_dir, steady_means)
from rltrain.plan.inputs import read
from rltrain.plan.memory import GIB, full_params, ns, plan_gpus
from rltrain.plan.timing import host_share, phase_seconds, step_range, train_seconds, weight_tensors
from rltrain.utils import flops


constant = cal.override  # planning with one constant at another value


def case_inputs(case: Case, cfg: dict | None = None):
    """The planner's Inputs of a case: its overrides composed (or `cfg`, already composed) at its lengths."""
    x = read(cfg if cfg is not None else compose(case.overrides))
    if case.lengths:
        x = dataclasses.replace(x, max_prompt_length=case.lengths["prompt_tokens"],
                                max_response_length=case.lengths["response_tokens"])
    return x


def predict(case: Case, cfg: dict | None = None, machine: dict[str, float] | None = None) -> dict[str, float]:
    """The planner's numbers for the quantities `case` measured (machine: per-phase factors, see machine_table)."""
    x = case_inputs(case, cfg)
    dev = cal.DEVICES[case.device]
    total = dev.total_gib * GIB
    gpus = plan_gpus(x, total)
    out: dict[str, float] = {}
    if case.kind == "update":
        g = gpus[0]
        upd = next(p for p in g.phases if p.name.startswith("update (actor)"))
        out["peak_gib"] = upd.torch_bytes / GIB
        out["reserved_gib"] = upd.torch_bytes * (1 + cal.value("allocator_slack")) / GIB
        t = train_seconds(x, loop_overhead=False)["update_actor"]
        out["step_s"] = t
        out["fits"] = float(upd.device_bytes(cal.value("allocator_slack")) <= total)
        return out
    secs = phase_seconds(x, dev.hbm_bytes_per_s, total, factors=machine)
    out["generation_s"] = secs["generation"]
    out["old_log_prob_s"] = secs["detail/old_log_prob"]
    out["update_s"] = secs["update"]
    out["weight_sync_s"] = secs["weight sync"]
    out["ref_s"] = secs.get("detail/ref", 0.0)
    out["values_s"] = secs.get("detail/values", 0.0)
    out["step_s"] = secs["step"]
    train = [g for g in gpus if g.roles != ("rollout",)]
    out["allocator_peak_gib"] = max(g.allocator_peak_bytes for g in train) / GIB
    out["allocator_reserved_gib"] = max(g.allocator_reserved_bytes for g in train) / GIB
    out["device_peak_gib"] = max(g.peak_bytes for g in train) / GIB
    roll = [g for g in gpus if g.roles == ("rollout",)]
    if roll:
        out["rollout_allocator_peak_gib"] = max(g.allocator_peak_bytes for g in roll) / GIB
    if case.kind == "rollout":
        g = gpus[0]
        gen = next(p for p in g.phases if p.name == "generation")
        out["vllm_freed_gib"] = (gen.parts.get("vllm (weights + KV cache)", 0.0)
                                 + gen.non_torch.get("vllm CUDA graphs + workspaces", 0.0)) / GIB
    return out


def _solve(name: str, case: Case, quantity: str) -> float:
    """The value of constant `name` at which the planner reproduces `case`'s `quantity`: secant steps from the current
    value (the model is linear in each constant within one branch of its max()es: host or GPU, per phase), then, where
    the secant stalls on a flat branch (the constant is not the larger there), bisection between values on either side
    of the measurement (found by halving and doubling the current value)."""
    cfg = compose(case.overrides)
    target = case.measured[quantity]

    def f(v: float) -> float:
        with constant(name, v):
            return predict(case, cfg)[quantity] - target

    k0 = cal.value(name) or 1.0
    k1 = k0 * 1.05
    f0, f1 = f(k0), f(k1)
    for _ in range(30):
        if f1 == f0:
            break
        k0, k1, f0 = k1, k1 - f1 * (k1 - k0) / (f1 - f0), f1
        f1 = f(k1)
        if abs(f1) < 1e-9:
            return k1
    if abs(f1) < 1e-6 * max(1.0, abs(target)):
        return k1
    # bracket a sign change geometrically around the current value (every constant here is positive), then bisect
    k = cal.value(name) or 1.0
    lo, hi, f_lo, f_hi = k, k, f(k), f(k)
    for _ in range(60):
        if (f_lo < 0) != (f_hi < 0):
            break
        lo, hi = lo / 2, hi * 2
        f_lo, f_hi = f(lo), f(hi)
    else:
        raise ValueError(f"{name}: no value reproduces {case.name}'s {quantity}")
    for _ in range(100):
        mid = (lo + hi) / 2
        f_mid = f(mid)
        lo, hi, f_lo = (mid, hi, f_mid) if (f_mid < 0) == (f_lo < 0) else (lo, mid, f_lo)
    return (lo + hi) / 2


def _solve_many(names: tuple[str, ...], cs: tuple[Case, ...], quantity: str) -> dict[str, float]:
    """As many constants as runs, at which the planner reproduces `quantity` of every run at once: Newton steps with a
    numerical Jacobian (the model is linear in each constant within one branch of its max()es, where a step lands)."""
    n = len(names)
    cfgs = [compose(c.overrides) for c in cs]
    v = [cal.value(k) for k in names]

    def resid(vals: list[float]) -> list[float]:
        with contextlib.ExitStack() as st:
            for k, val in zip(names, vals):
                st.enter_context(constant(k, val))
            return [predict(c, cfg)[quantity] - c.measured[quantity] for c, cfg in zip(cs, cfgs)]

    for _ in range(8):
        r = resid(v)
        if max(abs(e) for e in r) < 1e-9:
            break
        cols = []
        for i in range(n):
            dv = list(v)
            dv[i] = v[i] * 1.01 if v[i] else 1e-6
            ri = resid(dv)
            cols.append([(ri[k] - r[k]) / (dv[i] - v[i]) for k in range(n)])
        # J[k][i] = d resid_k / d v_i; solve J d = -r by Gaussian elimination with partial pivoting
        a = [[cols[i][k] for i in range(n)] + [-r[k]] for k in range(n)]
        for c in range(n):
            p = max(range(c, n), key=lambda k: abs(a[k][c]))
            if abs(a[p][c]) < 1e-300:
                raise ValueError(f"{names}: the runs {[x.name for x in cs]} do not determine them all")
            a[c], a[p] = a[p], a[c]
            for k in range(c + 1, n):
                m = a[k][c] / a[c][c]
                a[k] = [a[k][j] - m * a[c][j] for j in range(n + 1)]
        d = [0.0] * n
        for c in reversed(range(n)):
            d[c] = (a[c][n] - sum(a[c][j] * d[j] for j in range(c + 1, n))) / a[c][c]
        v = [v[i] + d[i] for i in range(n)]
    return dict(zip(names, v))


def host_speed(c: Case) -> float:
    """A run's host time over its planned host time: 1 + (measured / planned step - 1) / the plan's host share (the
    GPU's share taken as planned)."""
    planned, share = planned_step_and_share(c)
    return 1 + (c.measured["step_s"] / planned - 1) / share


def planned_step_and_share(c: Case) -> tuple[float, float]:
    """A step case's planned step and the host's share of it (timing.host_share)."""
    cfg = compose(c.overrides)
    x = case_inputs(c, cfg)
    dev = cal.DEVICES[c.device]
    planned = predict(c, cfg)["step_s"]
    return planned, host_share(x, dev.hbm_bytes_per_s, dev.total_gib * GIB, planned)


def tp_dp_layout(c: Case) -> bool:
    """Whether a case's actor is tensor- and data-parallel on a colocated host (timing.tp_dp_factor's layout)."""
    x = case_inputs(c)
    return x.colocated and x.tp > 1 and x.dp > 1


def _solve_layout_factor(all_cases) -> float:
    """tp_dp_layout_factor: the value at which the layout's fitted runs' steps are planned at their measured ones in the
    geometric mean (mean log(measured / planned) = 0; bisection, the plan growing with the factor); refuses a layout
    run left held out (it would be fitted on, yet scored as unseen)."""
    runs = [c for c in all_cases if c.kind == "step" and "step_s" in c.measured and tp_dp_layout(c)]
    unseen = [c.name for c in runs if c.role_of("step_s") != "fit"]
    if unseen or not runs:
        raise ValueError(f"tp_dp_layout_factor: every TP x DP run's step is fitted; not so: {unseen or 'no runs'}")

    def mean_log(f: float) -> float:
        with constant("tp_dp_layout_factor", f):
            return sum(math.log(c.measured["step_s"] / predict(c)["step_s"]) for c in runs) / len(runs)

    lo, hi = 1.0, 8.0
    if mean_log(lo) <= 0:  # the runs are no slower than planned without the factor
        return lo
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_log(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def fit(verbose: bool = True) -> dict[str, float]:
    """Solve every fitted constant from its run; the others stay as calibration.py has them while solving."""
    cs = {c.name + "|" + c.source: c for c in cases()}
    by = lambda n, src: next(c for c in cs.values() if c.name == n and src in c.source)  # noqa: E731
    fitted: dict[str, float] = {}
    stack = contextlib.ExitStack()

    def keep(values: dict[str, float]) -> None:
        """Record each solved constant and hold it at its value for the solves after it."""
        for k, val in values.items():
            fitted[k] = val
            stack.enter_context(constant(k, val))

    # memory: activations, one row each
    for row, const in (("06b-8k-norms+optim", "act_none_fusion_none"), ("06b-8k-all", "act_none_fusion_compile"),
                       ("06b-8k-mcore-tp2", "act_none_fusion_mcore"), ("06b-32k-all-rc_selective", "act_selective"),
                       ("06b-64k-all-rc_full", "act_full_working")):
        keep({const: _solve(const, by(row, "update/"), "peak_gib")})
    # the unfused head: the difference of the fused/unfused pair at 32k tokens with full recompute
    un, fu = by("smoke-32k-unfused-rc1", "steps"), by("smoke-32k-fused-rc1", "steps")
    diff = un.measured["peak_gib"] - fu.measured["peak_gib"]
    with constant("logits_bytes_per_element", 0.0):
        d0 = predict(un)["peak_gib"] - predict(fu)["peak_gib"]
    with constant("logits_bytes_per_element", 1.0):
        d1 = predict(un)["peak_gib"] - predict(fu)["peak_gib"] - d0
    keep({"logits_bytes_per_element": (diff - d0) / d1})
    fit_rows = [c for c in cs.values() if c.kind == "update" and c.role_of("peak_gib") == "fit"]
    fitted["allocator_slack"] = sum(c.measured["reserved_gib"] / c.measured["peak_gib"] - 1 for c in fit_rows) / len(
        fit_rows)
    v = load("vllm_x2/bench_rollout_variants_h200.json")
    keep({"vllm_non_torch_gib": v["results"][0]["sleep_freed_gib"] - 0.5 * cal.DEVICES["h200"].total_gib})
    # time: the update rates (one micro-batch each) and the GRPO step's fixed costs (per optimizer step, per forward
    # micro-batch), solved together
    rate_rows = {"update_tflops_none_none": "06b-8k-norms+optim", "update_tflops_compile_none": "06b-8k-all"}
    hf, vl = by("grpo hf", "vllm/gpu_smoke_grpo_hf"), by("grpo vllm", "vllm/gpu_smoke_grpo_vllm")
    sm = {(r["fused"], r["recompute"]): r["step_s"] for r in load("gpu_smoke_h100_steps.json")["step8k"]}
    keep({"recompute_full_time_factor": sm[(True, True)] / sm[(True, False)]})
    keep({"recompute_selective_time_factor": (by("4b-32k-all-rc_selective", "update/").measured["step_s"]
                                              / by("4b-32k-all-rc_full", "update/").measured["step_s"]
                                              * fitted["recompute_full_time_factor"])})
    # the weight matrices' rates, their width exponent and attention's rate depend on each other (the 8k rows are 30-44%
    # attention FLOPs, the 32k row 76%): a few rounds of solving each from its row at the others' values converge
    for _ in range(6):
        for const, row in rate_rows.items():  # a benchmark step: FLOPs at the rates, no trainer loop around it
            c = by(row, "update/")
            x = read(compose(c.overrides))
            T = x.max_prompt_length + x.max_response_length
            attn = flops.attention_flops(ns(x.shape), T, T)
            dense_s = c.measured["step_s"] - attn / (cal.value("attention_tflops") * 1e12)
            keep({const: (flops.train_flops(ns(x.shape), T, T) - attn) / dense_s / 1e12})
        # how the rate grows with the hidden size: the 4B's compiled 8k row against the 0.6B's (fitted above)
        keep({"update_rate_width_exponent": _solve("update_rate_width_exponent", by("4b-8k-all", "update/"),
                                                   "step_s")})
        keep({"attention_tflops": _solve("attention_tflops", by("06b-32k-all-rc_selective", "update/"), "step_s")})
    # the update's fixed costs (per optimizer step, the host's floor per micro-batch, per update call), together: the
    # one-GPU GRPO step (2 optimizer steps of one 8,832-token micro-batch, its FLOPs above the floor), and two DP=2 runs
    # on one host (4,416 tokens a rank and micro-batch, under the floor) with 2 and 4 optimizer steps a call
    dp2_two = by("0.6B colocated DP=2, one vLLM engine per GPU (2026-11-27)", "blind_x2")
    dp2_four = by("0.6B colocated DP=2, one vLLM engine per GPU, 64 x 8", "colocated_dp_h200x2")
    keep(_solve_many(("update_step_layer_s", "update_mb_layer_s", "update_call_layer_s"), (hf, dp2_two, dp2_four),
                     "update_s"))
    # the unfused layers' width exponent: the 4B's one-GPU GRPO update at 2,053-token sequences (its FLOPs, far above
    # the floors)
    g4 = by("4B single, 2,048-token responses, forward micro-batches of 32,768", "blind_x4")
    keep({"update_rate_width_exponent_none": _solve("update_rate_width_exponent_none", g4, "update_s")})
    keep({"tp_allreduce_s": _solve("tp_allreduce_s", by("4b-8k-all-tp2", "update/"), "step_s")})
    # the forward's host floor per layer, and per row and layer of a micro-batch: the reference's pass of the one-GPU
    # GRPO step (micro-batches of 128 rows of 69 tokens) and of the 2,048-token responses in one-row micro-batches, both
    # under the floor; then the old log-probs' entropy, per micro-batch: the second run's old log-probs (128 of them)
    one_row = by("0.6B single, 2,048-token responses, forward micro-batches of 4,096", "blind_x2")
    keep(_solve_many(("fwd_mb_layer_s", "fwd_row_layer_s"), (hf, one_row), "ref_s"))
    keep({"old_logprob_mb_s": _solve("old_logprob_mb_s", one_row, "old_log_prob_s")})
    moe = by("MoE slice EP=2, vLLM", "moe_h200x2_2026-11-26/")
    fitted["moe_expert_pass_s"] = _solve("moe_expert_pass_s", moe, "update_s")
    grouped = by("MoE slice EP=2, vLLM, grouped GEMM", "moe_grouped_gemm_h200x2_2026-11-26/")
    fitted["moe_grouped_layer_pass_s"] = _solve("moe_grouped_layer_pass_s", grouped, "update_s")
    fitted["hf_layer_step_s"] = _solve("hf_layer_step_s", hf, "generation_s")
    split = by("placement split 1+1", "vllm_x2/placements_qwen06b_split_1p1")
    # vLLM's host work per decode step: its fixed part from one host's DP=2 and DP=4 runs in one call (128 and 64
    # sequences an engine; the part per sequence solved with it there is that host's, not kept), then the part per
    # sequence from the reference run's 256 at that fixed part
    dp2 = by("0.6B colocated DP=2, one vLLM engine per GPU (a second four-H200 host)", "dp_x4_2026-11-27")
    dp4 = by("0.6B colocated DP=4, one vLLM engine per GPU (a second four-H200 host)", "dp_x4_2026-11-27")
    keep({"vllm_step_s": _solve_many(("vllm_step_s", "vllm_seq_step_s"), (dp2, dp4), "generation_s")["vllm_step_s"]})
    keep({"vllm_seq_step_s": _solve("vllm_seq_step_s", split, "generation_s")})
    fitted["decode_hbm_fraction"] = _solve("decode_hbm_fraction", by("0.6B single, 4 x 8 at 8,192-token responses",
                                                                      "lengths_blind"), "generation_s")
    vm = load("vllm/gpu_smoke_grpo_vllm.json")["grpo"]["mean"]
    shape06 = read(compose(vl.overrides)).shape  # the Qwen3-0.6B shape of every run below
    tensors = weight_tensors(shape06)
    keep({"reload_s_per_tensor": (vm["timing_s/update_weights"] - vm.get("timing_s/rollout_wake", 0.0)) / tensors})
    # the level-2 sleep and wake beyond the 0.6B's one GPU: the 4B's one-GPU step (per GB of weights) and the 0.6B's
    # DP=2 step (an engine per GPU, both at once), together
    g4b = by("grpo vllm, Qwen3-4B shape, one GPU", "one_h200_blind")
    keep(_solve_many(("vllm_wake_s_per_gb", "vllm_rank_sync_factor"), (g4b, dp2_four), "weight_sync_s"))
    # an MoE checkpoint's expert tensors: the slice's weight sync at the two above
    keep({"reload_s_per_expert_tensor": _solve("reload_s_per_expert_tensor", moe, "weight_sync_s")})
    # the hf engine's pinned level-1 sleep: its one-GPU trainer run (steps 3..)
    hm = steady_means("hf_pinned_sleep_h200x2_2026-11-26/hf_qwen06b_single_metrics.jsonl")
    fitted["hf_reload_s_per_tensor"] = (hm["timing_s/update_weights"] - hm["timing_s/rollout_wake"]) / tensors
    gb = 2 * full_params(shape06) / 1e9  # its bf16 checkpoint
    fitted["hf_offload_s_per_gb"] = (hm["timing_s/rollout_sleep"] + hm["timing_s/rollout_wake"]) / gb
    # the TP x DP layout's factor on the host's floors and the weight sync, after every constant above: the value that
    # plans the layout's runs (each a "fit" case for its step) at their measured steps in the geometric mean. Until
    # 2026-11-27 it took every phase, from the first run alone (four H100s: 1.77); nine runs on eight hosts took
    # 1.20-1.81x
    keep({"tp_dp_layout_factor": _solve_layout_factor(cs.values())})
    # the host's speed across machines of one kind (the plan's range, not its step): the one config measured on
    # twenty machines, each run's measured / planned step as a multiple of its planned host time; the runs' steps
    # stay held out (the planned step does not use these)
    speeds = [host_speed(by(name, src)) for name, src in HOST_SPREAD_RUNS]
    fitted["host_speed_low"], fitted["host_speed_high"] = min(speeds), max(speeds)
    k4 = load("vllm/pool_h100_2026-11-25/grpo_vllm_k4.json")["grpo"]["mean"]
    fitted["ipc_reload_s_per_tensor"] = (k4["timing_s/update_weights"] - k4["timing_s/rollout_wake"]) / tensors
    sp = load("vllm_x2/placements_qwen06b_split_1p1.json")["qwen06b"]["split_1p1"]["timing_s"]
    fitted["split_sync_s_per_tensor"] = (sp["update_weights"] - gb / cal.value("nccl_broadcast_gb_s")) / tensors
    stack.close()
    if verbose:
        for k, val in fitted.items():
            print(f"{k:32s} {val:.4f}   (calibration.py: {cal.value(k):.4f})")
    return fitted


def _digits(v: float) -> str:
    """4 decimals, or 4 significant digits below 0.1 (per-layer and per-expert seconds)."""
    return f"{v:.4f}" if abs(v) >= 0.1 else f"{v:.4g}"


def write_calibration(values: dict[str, float]) -> None:
    """Replace each fitted constant's value in calibration.py by `values` (_digits)."""
    import re

    path = cal.__file__
    with open(path) as f:
        text = f.read()
    for k, v in values.items():
        pat = re.compile(r'("%s": Const\(\s*)([-0-9.e]+)' % re.escape(k))
        if not pat.search(text):
            raise KeyError(f"{k} not found in {path}")
        text = pat.sub(lambda m: m.group(1) + _digits(v), text, count=1)
    with open(path, "w") as f:
        f.write(text)
    for k, v in values.items():
        table = cal.MEMORY if k in cal.MEMORY else cal.TIME
        table[k] = dataclasses.replace(table[k], value=float(_digits(v)))


def constants_markdown() -> str:
    lines = ["| constant | value | unit | kind | source (file under tools/results, date, device; what) |",
             "|---|---|---|---|---|"]
    for name, c in cal.all_constants().items():
        lines.append(f"| `{name}` | {c.value:g} | {c.unit} | {c.kind} | {c.source} |")
    for key, d in cal.DEVICES.items():
        lines.append(f"| device `{key}` | {d.total_gib:g} GiB, {d.hbm_bytes_per_s / 1e12:g} TB/s | memory, HBM | "
                     f"measured / datasheet | {d.source} |")
    return "\n".join(lines)


def write_docs(path: str) -> None:
    """Rewrite docs/plan.md's generated blocks: the example (its first code block), the constants table, the
    predicted-vs-measured table with its summary, the whole steps' table, the by-placement table and the machine
    factors' table."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from rltrain.plan.__main__ import main as plan_main

    buf = io.StringIO()
    with redirect_stdout(buf), redirect_stderr(io.StringIO()):
        plan_main(["--config-name", "grpo_qwen3", "model=qwen3_4b", "actor.max_tokens_per_micro_batch=16384",
                   "actor.recompute_activations=false", "--gpu-memory-gib", "80", "--worst-case"])
    rows = compare()
    with open(path) as f:
        s = f.read()
    a = s.index("```\n")
    b = s.index("```\n", a + 4)
    s = s[:a] + "```\n" + buf.getvalue().rstrip("\n") + "\n" + s[b:]
    a = s.index("| constant | value |")
    b = s.index("\n\n", a)
    s = s[:a] + constants_markdown() + s[b:]
    a = s.index("| run | source")
    b = s.index("\n\nIn short")
    s = s[:a] + markdown(rows) + "\n\n" + summary(rows) + "\n\n" + range_summary(range_rows()) + s[b:]
    a = s.index("| run | file | role (memory / step)")
    b = s.index("\n\n", a)
    s = s[:a] + step_table(rows) + s[b:]
    a = s.index("| model | engine | placement | device |")
    b = s.index("\n\n", a)
    s = s[:a] + placement_table(rows) + s[b:]
    a = s.index("| run | machine's factors from")
    b = s.index("\n\n", a)
    s = s[:a] + machine_table() + s[b:]
    with open(path, "w") as f:
        f.write(s)


def compare() -> list[dict[str, Any]]:
    """Predicted vs measured for every case and quantity (with calibration.py's constants)."""
    rows = []
    for c in cases():
        try:
            p = predict(c)
        except Exception as err:  # a run the planner cannot express: reported, not hidden
            rows.append({"case": c.name, "source": c.source, "role": c.role, "quantity": "-", "measured": math.nan,
                         "predicted": math.nan, "error_pct": math.nan, "note": f"not planned: {err}"})
            continue
        for q, m in c.measured.items():
            if q not in p or q == "reserved_gib":
                continue
            err = 100.0 * (p[q] - m) / m if m else (0.0 if p[q] == m else math.inf)
            rows.append({"case": c.name, "source": c.source, "role": c.role_of(q), "quantity": q, "measured": m,
                         "predicted": p[q], "error_pct": err})
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | source (file, date, device) | role | quantity | measured | predicted | error |",
             "|---|---|---|---|---|---|---|"]
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
    by: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        if r["quantity"] in ("allocator_peak_gib", "allocator_reserved_gib", "step_s"):
            by.setdefault(r["case"] + " | " + r["source"].split(",")[0], {})[r["quantity"]] = r
    lines = ["| run | file | role (memory / step) | allocated GiB: measured | predicted | error | reserved GiB: measured "
             "| predicted | error | step s: measured | predicted | error |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, q in by.items():
        if "step_s" not in q or "allocator_peak_gib" not in q:  # whole steps only (not the update benchmarks)
            continue
        name, src = key.split(" | ")
        cells = []
        for k in ("allocator_peak_gib", "allocator_reserved_gib", "step_s"):
            r = q.get(k)
            cells += ([f"{r['measured']:.2f}", f"{r['predicted']:.2f}", f"{r['error_pct']:+.1f}%"] if r else ["-"] * 3)
        mem = q.get("allocator_peak_gib", {}).get("role", "-")
        lines.append(f"| {name} | {src} | {mem} / {q['step_s']['role']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def placement_label(c: Case) -> tuple[str, str, str, str]:
    """(model, engine, placement, device) of a whole-step case, from its composed config: what placement_table groups
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
    return x.shape.name, x.engine, where, c.device.upper()


def placement_table(rows: list[dict[str, Any]]) -> str:
    """The whole steps (held out or fit, not legacy) grouped by model, engine, placement and device: how many runs,
    how many within 25% of plan, their errors' range and median |error|."""
    by_name = {(c.name, c.source): c for c in cases()}
    groups: dict[tuple[str, str, str, str], list[tuple[float, str]]] = {}
    for r in rows:
        if r["quantity"] != "step_s" or r["role"] == "legacy" or not math.isfinite(r["error_pct"]):
            continue
        c = by_name[(r["case"], r["source"])]
        if c.kind != "step" or "allocator_peak_gib" not in c.measured:  # whole GRPO steps only
            continue
        groups.setdefault(placement_label(c), []).append((r["error_pct"], r["role"]))
    lines = ["| model | engine | placement | device | runs (fitted) | within 25% | errors | median abs. error |",
             "|---|---|---|---|---:|---:|---|---:|"]
    for key in sorted(groups):
        errs = sorted(e for e, _ in groups[key])
        fitted = sum(role == "fit" for _, role in groups[key])
        absolute = sorted(abs(e) for e in errs)
        lines.append(f"| {' | '.join(key)} | {len(errs)}{f' ({fitted})' if fitted else ''} | "
                     f"{sum(a <= 25 for a in absolute)} | {errs[0]:+.1f}%" + (f" .. {errs[-1]:+.1f}%" if len(errs) > 1
                                                                                else "")
                     + f" | {statistics.median(absolute):.1f}% |")
    return "\n".join(lines)


# A per-machine correction, tried and not adopted: on runs made one after another on one machine, the first run's
# per-phase factors (measured / planned) scale the plan of the others. (the calibration run, [the runs planned with
# its factors]) by case name; each group is one machine on one day.
MACHINE_GROUPS = [
    ("0.6B single, 32 x 8", ["0.6B single, 64 x 8", "0.6B colocated DP=2 + vLLM TP=2, 32 x 8",
                             "0.6B colocated DP=2 + vLLM TP=2, 64 x 8", "4B colocated TP=2 + vLLM TP=2, 32 x 8"]),
    ("0.6B single, 32 x 8 (evening)", ["0.6B colocated DP=2, one vLLM engine per GPU, 32 x 8 (evening)",
                                       "0.6B colocated DP=2, one vLLM engine per GPU, 64 x 8, mini-batch 32 (evening)",
                                       "4B colocated TP=2 + vLLM TP=2, 32 x 8 (evening)",
                                       "4B split 1+1, 8k-token micro-batches (H200)"]),
    ("grpo vllm, PPO (GAE critic)", ["grpo vllm, Qwen3-4B shape, one GPU"]),
    ("grpo vllm k4, levers (evening)", ["grpo vllm k4, levers, one micro-batch per pass"]),
    ("0.6B single, 32 x 8 (H100)", ["4B colocated TP=2 x DP=2, two vLLM TP=2 engines (four H100s)",
                                    "4B split 2+2, one vLLM TP=2 engine (four H100s)",
                                    "0.6B colocated PP=2 + vLLM TP=2 (H100s, beside a GPU test)"]),
    ("0.6B single, 32 x 8 (a two-H200 host, the driver at one torch thread)",
     ["0.6B colocated DP=2, one vLLM engine per GPU (a two-H200 host, the driver at one torch thread)",
      "0.6B colocated DP=2, one vLLM engine per GPU, 64 x 8 (the same host)",
      "hf engine, 0.6B colocated DP=2 (the same host)", "hf engine, 0.6B colocated TP=2 (the same host)",
      "0.6B colocated DP=2, one vLLM engine per GPU (the same host, again)"]),
    ("0.6B single, 32 x 8 (a one-H100 host, the driver at one torch thread)",
     ["hf engine, 0.6B single (the same H100 host)", "0.6B single, 32 x 8 (the same H100 host, again)"]),
]
MACHINE_PHASES = {"generation": ("generation_s",), "log-probs": ("old_log_prob_s", "ref_s", "values_s"),
                  "update": ("update_s",), "weight sync": ("weight_sync_s",)}


def case_factors(case: Case) -> dict[str, float]:
    """{phase: measured / planned} of a case's run."""
    pred = predict(case)
    out = {}
    for phase, qs in MACHINE_PHASES.items():
        m = sum(case.measured.get(q, 0.0) for q in qs)
        p = sum(pred.get(q, 0.0) for q in qs if q in case.measured)
        if m > 0 and p > 0:
            out[phase] = m / p
    return out


def machine_table() -> str:
    """Each MACHINE_GROUPS run's step: measured, planned, and planned with the factors of the group's first run."""
    by = {c.name: c for c in cases()}
    lines = ["| run | machine's factors from | step s: measured | planned | error | with the factors | error |",
             "|---|---|---|---|---|---|---|"]
    for calib, targets in MACHINE_GROUPS:
        f = case_factors(by[calib])
        for t in targets:
            c = by[t]
            m, p, q = c.measured["step_s"], predict(c)["step_s"], predict(c, machine=f)["step_s"]
            lines.append(f"| {t} | {calib} (x{f.get('generation', 1):.2f} / {f.get('log-probs', 1):.2f} / "
                         f"{f.get('update', 1):.2f} / {f.get('weight sync', 1):.2f}) | {m:.3f} | {p:.3f} | "
                         f"{100 * (p / m - 1):+.1f}% | {q:.3f} | {100 * (q / m - 1):+.1f}% |")
    return "\n".join(lines)


def summary(rows: list[dict[str, Any]]) -> str:
    out = []
    for role in ("fit", "held out", "legacy"):
        for kind, test in (("memory", lambda q: q.endswith("gib")), ("time", lambda q: q.endswith("_s"))):
            errs = [abs(r["error_pct"]) for r in rows if r["role"] == role and test(r["quantity"])
                    and math.isfinite(r["error_pct"])]
            if errs:
                errs.sort()
                out.append(f"{role}, {kind}: {len(errs)} comparisons, median |error| {errs[len(errs) // 2]:.1f}%, "
                           f"max {errs[-1]:.1f}%")
    return "\n".join(out)


def range_rows() -> list[dict[str, Any]]:
    """Every whole step (held out or fit, not legacy) outside HOST_SPREAD_RUNS (the runs host_speed_low / _high come
    from): measured, the plan's step and its range across machines (timing.step_range), and whether the range held
    it."""
    spread = {(name, src) for name, src in HOST_SPREAD_RUNS}
    rows = []
    for c in cases():
        if c.kind != "step" or "step_s" not in c.measured or c.role_of("step_s") == "legacy":
            continue
        if any(c.name == name and src in c.source for name, src in spread):
            continue
        planned, share = planned_step_and_share(c)
        lo, hi = step_range(planned, share)
        m = c.measured["step_s"]
        rows.append({"case": c.name, "source": c.source, "measured": m, "predicted": planned, "low": lo, "high": hi,
                     "inside": lo <= m <= hi})
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rltrain.plan.fit")
    ap.add_argument("--markdown", action="store_true", help="print the predicted-vs-measured table only")
    ap.add_argument("--write", action="store_true", help="write the refit values into calibration.py")
    ap.add_argument("--constants", action="store_true", help="print the constants table of docs/plan.md")
    ap.add_argument("--steps", action="store_true", help="print the whole-step table of docs/plan.md")
    ap.add_argument("--docs", metavar="PATH", help="rewrite the generated blocks of docs/plan.md at PATH")
    ap.add_argument("--machine", action="store_true", help="print the machine-factor table of docs/plan.md")
    ap.add_argument("--placements", action="store_true", help="print the by-placement table of docs/plan.md")
    args = ap.parse_args(argv)
    if args.placements:
        print(placement_table(compare()))
        return 0
    if args.machine:
        print(machine_table())
        return 0
    if args.docs:
        write_docs(args.docs)
        return 0
    if args.constants:
        print(constants_markdown())
        return 0
    if args.steps:
        print(step_table(compare()))
        return 0
    if args.write:
        write_calibration(fit(verbose=False))
    if not args.markdown:
        print("fitted constants (each from one run):")
        fit()
        print()
    rows = compare()
    print(markdown(rows))
    print()
    print(summary(rows))
    print(range_summary(range_rows()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
