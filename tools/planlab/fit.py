"""Solve rltrain/plan/calibration.py's fitted constants from the measured runs (cases.py's FITTED: each constant
from the run, or the few runs, named there) and write them into that file. Run through tools/plan_lab.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re

from planlab import REPO
from planlab.cases import FITTED, HOST_SPREAD_RUNS, Case, by_key, cases, compose

from rltrain.plan import calibration as cal
from rltrain.plan.inputs import read
from rltrain.plan.memory import GIB, full_params, plan_gpus
from rltrain.plan.timing import host_share, phase_seconds, train_seconds, weight_tensors
from rltrain.utils import flops


constant = cal.override  # planning with one constant at another value


def case_inputs(case: Case, cfg: dict | None = None):
    """The planner's Inputs of a case: its overrides composed (or `cfg`, already composed) at its lengths, with the
    optimizer layout the runs had (all measured before the sharded optimizer of issue 59)."""
    x = dataclasses.replace(read(cfg if cfg is not None else compose(case.overrides)), legacy_engine=True)
    if case.lengths:
        x = dataclasses.replace(x, max_prompt_length=case.lengths["prompt_tokens"],
                                max_response_length=case.lengths["response_tokens"])
    return x


def predict(case: Case, cfg: dict | None = None, machine: dict[str, float] | None = None) -> dict[str, float]:
    """The planner's numbers for the quantities `case` measured (machine: per-phase factors, see machine_table)."""
    x = case_inputs(case, cfg)
    dev = cal.DEVICES[case.gpu]
    total = dev.total_gib * GIB
    gpus = plan_gpus(x, total)
    out: dict[str, float] = {}
    if case.scope == "update":
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
    out["fits"] = float(all(g.fits for g in gpus))
    roll = [g for g in gpus if g.roles == ("rollout",)]
    if roll:
        out["rollout_allocator_peak_gib"] = max(g.allocator_peak_bytes for g in roll) / GIB
    if case.scope == "rollout":
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
    dev = cal.DEVICES[c.gpu]
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
    runs = [c for c in all_cases if c.scope == "step" and "step_s" in c.measured and tp_dp_layout(c)]
    unseen = [c.name for c in runs if c.role_of("step_s") != "fit"]
    if unseen or not runs:
        raise ValueError(f"tp_dp_layout_factor: every TP x DP run's step is fitted; not so: {unseen or 'no runs'}")
    READ.update(c.key for c in runs)

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


READ: set[tuple[str, str]] = set()  # every run a solve read, since the start (tests compare it with cases.FITTED)


def fitted_run(cs: dict[tuple[str, str], Case], name: str, device: str, *quantities: str) -> Case:
    """The run (name, device) for a solve that reads `quantities` off it: only as cases.FITTED declares it, so that
    no run a constant comes from is scored as held out."""
    declared = FITTED.get((name, device), ())
    if declared is not None and not set(quantities) <= set(declared):
        raise AssertionError(f"fit.py reads {quantities} of {name!r} ({device}); cases.FITTED declares {declared}")
    READ.add((name, device))
    return cs[(name, device)]


def fit(verbose: bool = True, all_cases: list[Case] | None = None) -> dict[str, float]:
    """Solve every fitted constant from its run(s), in order (each solve holds the constants solved before it); the
    others stay as calibration.py has them while solving."""
    cs = by_key(all_cases if all_cases is not None else cases())
    fitted: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        def keep(values: dict[str, float]) -> None:
            """Record each solved constant and hold it at its value for the solves after it."""
            for k, val in values.items():
                fitted[k] = val
                stack.enter_context(constant(k, val))

        def by(name: str, device: str, *quantities: str) -> Case:
            return fitted_run(cs, name, device, *quantities)

        _fit_memory(by, keep, fitted, cs)
        _fit_update(by, keep, fitted)
        _fit_step(by, keep, fitted, cs)
    if verbose:
        for k, val in fitted.items():
            print(f"{k:32s} {val:<10.4g} (calibration.py: {cal.value(k):.4g})")
    return fitted


def _fit_memory(by, keep, fitted: dict[str, float], cs: dict[tuple[str, str], Case]) -> None:
    """Activation bytes (one update row each), the unfused head's logits, the allocator's slack, vLLM's non-torch
    memory."""
    for row, device, const in (("06b-8k-norms+optim", "h100", "act_none_fusion_none"),
                               ("06b-8k-all", "h100", "act_none_fusion_compile"),
                               ("06b-8k-mcore-tp2", "h200x2", "act_none_fusion_mcore"),
                               ("06b-32k-all-rc_selective", "h100", "act_selective"),
                               ("06b-64k-all-rc_full", "h100", "act_full_working")):
        keep({const: _solve(const, by(row, device, "peak_gib"), "peak_gib")})
    # the unfused head: the difference of the fused/unfused pair at 32k tokens with full recompute
    un, fu = by("smoke-32k-unfused-rc1", "h100", "peak_gib"), by("smoke-32k-fused-rc1", "h100", "peak_gib")
    diff = un.measured["peak_gib"] - fu.measured["peak_gib"]
    with constant("logits_bytes_per_element", 0.0):
        d0 = predict(un)["peak_gib"] - predict(fu)["peak_gib"]
    with constant("logits_bytes_per_element", 1.0):
        d1 = predict(un)["peak_gib"] - predict(fu)["peak_gib"] - d0
    keep({"logits_bytes_per_element": (diff - d0) / d1})
    fit_rows = [c for c in cs.values() if c.scope == "update" and c.role_of("peak_gib") == "fit"]
    fitted["allocator_slack"] = sum(c.measured["reserved_gib"] / c.measured["peak_gib"] - 1 for c in fit_rows) / len(
        fit_rows)
    freed = by("vLLM alone, 256 x (64 + 64)", "h200", "vllm_freed_gib").measured["vllm_freed_gib"]
    keep({"vllm_non_torch_gib": freed - 0.5 * cal.DEVICES["h200"].total_gib})


def _fit_update(by, keep, fitted: dict[str, float]) -> None:
    """The update's rates (one micro-batch each) and recompute factors, then the GRPO update's fixed costs."""
    rate_rows = {"update_tflops_none_none": "06b-8k-norms+optim", "update_tflops_compile_none": "06b-8k-all"}
    keep({"recompute_full_time_factor": (by("smoke-8k-fused-rc1", "h100", "step_s").measured["step_s"]
                                         / by("smoke-8k-fused-rc0", "h100", "step_s").measured["step_s"])})
    keep({"recompute_selective_time_factor": (by("4b-32k-all-rc_selective", "h200", "step_s").measured["step_s"]
                                              / by("4b-32k-all-rc_full", "h200", "step_s").measured["step_s"]
                                              * fitted["recompute_full_time_factor"])})
    # the weight matrices' rates, their width exponent and attention's rate depend on each other (the 8k rows are 30-44%
    # attention FLOPs, the 32k row 76%): a few rounds of solving each from its row at the others' values converge
    for _ in range(6):
        for const, row in rate_rows.items():  # a benchmark step: FLOPs at the rates, no trainer loop around it
            c = by(row, "h100", "step_s")
            x = read(compose(c.overrides))
            T = x.max_prompt_length + x.max_response_length
            attn = flops.attention_flops(x.shape, T, T)
            dense_s = c.measured["step_s"] - attn / (cal.value("attention_tflops") * 1e12)
            keep({const: (flops.train_flops(x.shape, T, T) - attn) / dense_s / 1e12})
        # how the rate grows with the hidden size: the 4B's compiled 8k row against the 0.6B's (fitted above)
        keep({"update_rate_width_exponent": _solve("update_rate_width_exponent", by("4b-8k-all", "h200", "step_s"),
                                                   "step_s")})
        keep({"attention_tflops": _solve("attention_tflops", by("06b-32k-all-rc_selective", "h100", "step_s"),
                                         "step_s")})
    # the update's fixed costs (per optimizer step, the host's floor per micro-batch, per update call), together: the
    # one-GPU GRPO step (2 optimizer steps of one 8,832-token micro-batch, its FLOPs above the floor), and two DP=2 runs
    # on one host (4,416 tokens a rank and micro-batch, under the floor) with 2 and 4 optimizer steps a call
    runs = (by("grpo hf", "h100", "update_s"),
            by("0.6B colocated DP=2, one vLLM engine per GPU (2026-11-27)", "h200x2", "update_s"),
            by("0.6B colocated DP=2, one vLLM engine per GPU, 64 x 8", "h200x2", "update_s"))
    keep(_solve_many(("update_step_layer_s", "update_mb_layer_s", "update_call_layer_s"), runs, "update_s"))
    # the unfused layers' width exponent: the 4B's one-GPU GRPO update at 2,053-token sequences (its FLOPs, far above
    # the floors)
    g4 = by("4B single, 2,048-token responses, forward micro-batches of 32,768", "h200", "update_s")
    keep({"update_rate_width_exponent_none": _solve("update_rate_width_exponent_none", g4, "update_s")})
    keep({"tp_allreduce_s": _solve("tp_allreduce_s", by("4b-8k-all-tp2", "h200x2", "step_s"), "step_s")})


def _fit_step(by, keep, fitted: dict[str, float], cs: dict[tuple[str, str], Case]) -> None:
    """The forward passes' floors, MoE experts, generation, the weight sync, the TP x DP layout and the range across
    machines."""
    # the forward's host floor per layer, and per row and layer of a micro-batch: the reference's pass of the one-GPU
    # GRPO step (micro-batches of 128 rows of 69 tokens) and of the 2,048-token responses in one-row micro-batches, both
    # under the floor; then the old log-probs' entropy, per micro-batch: the second run's old log-probs (128 of them)
    hf = by("grpo hf", "h100", "ref_s", "generation_s")
    one_row = by("0.6B single, 2,048-token responses, forward micro-batches of 4,096", "h200", "ref_s",
                 "old_log_prob_s")
    keep(_solve_many(("fwd_mb_layer_s", "fwd_row_layer_s"), (hf, one_row), "ref_s"))
    keep({"old_logprob_mb_s": _solve("old_logprob_mb_s", one_row, "old_log_prob_s")})
    moe = by("MoE slice EP=2, vLLM", "h200x2", "update_s", "weight_sync_s")
    fitted["moe_expert_pass_s"] = _solve("moe_expert_pass_s", moe, "update_s")
    grouped = by("MoE slice EP=2, vLLM, grouped GEMM", "h200x2", "update_s")
    fitted["moe_grouped_layer_pass_s"] = _solve("moe_grouped_layer_pass_s", grouped, "update_s")
    fitted["hf_layer_step_s"] = _solve("hf_layer_step_s", hf, "generation_s")
    split = by("placement split 1+1", "h200", "generation_s", "weight_sync_s")
    # vLLM's host work per decode step: its fixed part from one host's DP=2 and DP=4 runs in one call (128 and 64
    # sequences an engine; the part per sequence solved with it there is that host's, not kept), then the part per
    # sequence from the reference run's 256 at that fixed part
    dp2 = by("0.6B colocated DP=2, one vLLM engine per GPU (a second four-H200 host)", "h200x2", "generation_s")
    dp4 = by("0.6B colocated DP=4, one vLLM engine per GPU (a second four-H200 host)", "h200x4", "generation_s")
    keep({"vllm_step_s": _solve_many(("vllm_step_s", "vllm_seq_step_s"), (dp2, dp4), "generation_s")["vllm_step_s"]})
    keep({"vllm_seq_step_s": _solve("vllm_seq_step_s", split, "generation_s")})
    fitted["decode_hbm_fraction"] = _solve(
        "decode_hbm_fraction", by("0.6B single, 4 x 8 at 8,192-token responses", "h200", "generation_s"),
        "generation_s")
    _fit_weight_sync(by, keep, fitted, moe, split)
    # the TP x DP layout's factor on the host's floors and the weight sync, after every constant above: the value that
    # plans the layout's runs (each a "fit" case for its step) at their measured steps in the geometric mean. Until
    # 2026-11-27 it took every phase, from the first run alone (four H100s: 1.77); nine runs on eight hosts took
    # 1.20-1.81x
    keep({"tp_dp_layout_factor": _solve_layout_factor(list(cs.values()))})
    # the host's speed across machines of one kind (the plan's range, not its step): the one config measured on
    # twenty machines, each run's measured / planned step as a multiple of its planned host time; the runs' steps
    # stay held out (the planned step does not use these)
    speeds = [host_speed(cs[k]) for k in HOST_SPREAD_RUNS]
    fitted["host_speed_low"], fitted["host_speed_high"] = min(speeds), max(speeds)


def _fit_weight_sync(by, keep, fitted: dict[str, float], moe: Case, split: Case) -> None:
    """Each engine's reload per checkpoint tensor (in place, by CUDA IPC, over NCCL, the hf engine's copy), vLLM's
    level-2 sleep and wake beyond one GPU, the hf engine's pinned level-1 sleep."""
    vl = by("grpo vllm", "h100", "weight_sync_s")
    shape06 = read(compose(vl.overrides)).shape  # the Qwen3-0.6B shape of every run below
    tensors = weight_tensors(shape06)
    vm = vl.metrics
    keep({"reload_s_per_tensor": (vm["timing_s/update_weights"] - vm.get("timing_s/rollout_wake", 0.0)) / tensors})
    # the level-2 sleep and wake beyond the 0.6B's one GPU: the 4B's one-GPU step (per GB of weights) and the 0.6B's
    # DP=2 step (an engine per GPU, both at once), together
    g4b = by("grpo vllm, Qwen3-4B shape, one GPU", "h200", "weight_sync_s")
    dp2_four = by("0.6B colocated DP=2, one vLLM engine per GPU, 64 x 8", "h200x2", "weight_sync_s")
    keep(_solve_many(("vllm_wake_s_per_gb", "vllm_rank_sync_factor"), (g4b, dp2_four), "weight_sync_s"))
    # an MoE checkpoint's expert tensors: the slice's weight sync at the two above
    keep({"reload_s_per_expert_tensor": _solve("reload_s_per_expert_tensor", moe, "weight_sync_s")})
    # the hf engine's pinned level-1 sleep: its one-GPU trainer run (steps 3..)
    hm = by("hf engine, pinned sleep, 0.6B single", "h200", "weight_sync_s").metrics
    fitted["hf_reload_s_per_tensor"] = (hm["timing_s/update_weights"] - hm["timing_s/rollout_wake"]) / tensors
    gb = 2 * full_params(shape06) / 1e9  # its bf16 checkpoint
    fitted["hf_offload_s_per_gb"] = (hm["timing_s/rollout_sleep"] + hm["timing_s/rollout_wake"]) / gb
    k4 = by("grpo vllm k4", "h100", "weight_sync_s").metrics
    fitted["ipc_reload_s_per_tensor"] = (k4["timing_s/update_weights"] - k4["timing_s/rollout_wake"]) / tensors
    sp = split.metrics["timing_s/update_weights"]
    fitted["split_sync_s_per_tensor"] = (sp - gb / cal.value("nccl_broadcast_gb_s")) / tensors


def _digits(v: float) -> str:
    """4 decimals, or 4 significant digits below 0.1 (per-layer and per-expert seconds)."""
    return f"{v:.4f}" if abs(v) >= 0.1 else f"{v:.4g}"


CALIBRATION = os.path.join(REPO, "rltrain", "plan", "calibration.py")


def write_calibration(values: dict[str, float], path: str = CALIBRATION) -> None:
    """Replace each fitted constant's value in the constants file at `path` (rltrain/plan/calibration.py) by `values`
    (_digits), and in the loaded module."""
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
