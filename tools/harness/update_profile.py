"""A torch-profiler trace of MegatronEngine.train_step summarized into a per-category table (GEMMs, attention,
norms, elementwise, copies/casts, optimizer, communication, the LM head, idle). Must not build models or pick
cases: tools/profile_step.py update (its CLI) and tools/bench_update.py (profiled rows) hand it an engine.

How a GPU trace is read (`summarize_trace`): every kernel is charged to a category from (1) the stack of CPU
ranges open on the launching thread when it was launched (the autograd node of the backward pass, the
`Optimizer.step` range torch records, the `rltrain::lm_head` / `rltrain::optimizer` ranges this tool opens
around the head and the grad-norm/clip calls), (2) the aten op that launched it, and (3) its kernel name
(cuBLAS/CUTLASS GEMMs, flash/cuDNN attention, NCCL). Idle = the profiled steps' wall time minus the union
of kernel intervals: time the GPU waited for the host (launch gaps, host syncs). On CPU (no kernels) the
table sums each op's self time instead, and "idle" is the step time not inside any op (Python overhead).
Host syncs per step: CUDA synchronize calls inside the step (each item()/float()/bool()/tolist()/nonzero of a
device tensor makes one) less the one closing each profiled step; on CPU the `item`/`nonzero` calls.
"""

from __future__ import annotations

import gzip
import json
import os
import re
from bisect import bisect_right
from collections import defaultdict

from harness import md_table, write_report

STEP_RANGE = "rltrain::step"
HEAD_RANGE = "rltrain::lm_head"
OPT_RANGE = "rltrain::optimizer"

CATEGORIES = ("GEMM", "attention", "LM head (log-prob/entropy)", "norms", "elementwise/reduce", "copies/casts",
              "optimizer", "communication", "idle")

# (category, regex on a kernel name); first match wins, after the stack rules
_KERNEL_RULES = [
    ("communication", re.compile(r"nccl", re.I)),
    ("LM head (log-prob/entropy)", re.compile(r"_fwd_stats_kernel|_dlogits_kernel")),
    ("attention", re.compile(r"flash|fmha|sdpa|attn|attention", re.I)),
    ("GEMM", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|splitk|matmul|wgmma", re.I)),
]
# (category, regex on any enclosing range / op / autograd node name), checked innermost-first
_STACK_RULES = [
    ("optimizer", re.compile(r"^Optimizer\.step|^" + re.escape(OPT_RANGE))),
    ("LM head (log-prob/entropy)", re.compile(r"^" + re.escape(HEAD_RANGE) + r"|FusedLinearLogprob|LogitsLogprob")),
    ("attention", re.compile(r"scaled_?dot_?product|flash_?attention|efficient_?attention|cudnn_?attention|"
                             r"varlen_attn", re.I)),
    ("norms", re.compile(r"rms_norm|layer_norm|RmsNorm|LayerNorm", re.I)),
]
# (category, regex on the innermost aten op), for what the stack did not decide
_OP_RULES = [
    ("GEMM", re.compile(r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_scaled_mm|addmm_)$")),
    ("copies/casts", re.compile(r"^aten::(copy_|to|_to_copy|cat|clone|contiguous|stack|index_select|index|"
                                r"gather|scatter|scatter_add_|index_put_|_foreach_copy_|fill_|zero_|"
                                r"masked_fill|where|embedding|embedding_dense_backward)$")),
]
_SYNC_OPS = re.compile(r"^aten::(_local_scalar_dense|nonzero)$")  # CPU mode: item()/float()/bool(), nonzero
_SYNC_RUNTIME = re.compile(r"^cuda(Stream|Device|Event)Synchronize$")  # GPU mode


def _category(stack_names: list[str], kernel_name: str | None) -> str:
    """stack_names: enclosing CPU ranges/ops, outermost first (the launching op last)."""
    for name in reversed(stack_names):
        for cat, rx in _STACK_RULES:
            if rx.search(name):
                return cat
    if kernel_name is not None:
        for cat, rx in _KERNEL_RULES:
            if rx.search(kernel_name):
                return cat
        if re.search(r"memcpy|memset", kernel_name, re.I):
            return "copies/casts"
    op = next((n for n in reversed(stack_names) if n.startswith("aten::")), "")
    for cat, rx in _OP_RULES:
        if rx.search(op):
            return cat
    return "elementwise/reduce"


def _stacks(events: list[dict]) -> list[tuple[dict, list[str], float]]:
    """(event, names of the events enclosing it on its thread (outermost first, itself last), the summed
    duration of the events directly inside it) for every CPU 'X' event, by interval nesting per thread."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[list] = []  # [event, child_us, names]
        for e in evs:
            while stack and stack[-1][0]["ts"] + stack[-1][0].get("dur", 0) <= e["ts"]:
                stack.pop()
            if stack:
                stack[-1][1] += e.get("dur", 0)
            entry = [e, 0.0, (stack[-1][2] if stack else []) + [e["name"]]]
            stack.append(entry)
            out.append(entry)
    return [(e, names, child) for e, child, names in out]


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize_trace(trace: dict, top: int = 15, range_name: str = STEP_RANGE, closing_syncs: int = 1) -> dict:
    """Per-category time of the steps marked by `range_name` ranges (default `rltrain::step`) in a chrome trace
    (torch profiler export). Returns {"mode": "gpu"|"cpu", "steps", "step_ms", "rows": [{category, ms, share,
    count}], "top": [...], "host_syncs_per_step"}; ms and counts are per step (per range). closing_syncs: the
    synchronize calls the profiling code itself makes inside each range, not counted as the step's host syncs
    (profile_train_step closes each step with one; the trainer's phase ranges have none)."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    # the host's ranges only: on CUDA the profiler also records each range on the GPU stream
    # ("gpu_user_annotation"), which would count every step twice
    steps = [e for e in evs if e.get("name") == range_name and e.get("cat") != "gpu_user_annotation"]
    if not steps:
        raise ValueError(f"no '{range_name}' range in the trace: profile the step inside record_function")
    windows = sorted((s["ts"], s["ts"] + s["dur"]) for s in steps)
    starts = [w[0] for w in windows]

    def in_steps(t0: float, t1: float) -> bool:
        i = bisect_right(starts, t0) - 1
        return i >= 0 and t1 <= windows[i][1] + 1e-3

    step_us = sum(b - a for a, b in windows)
    n = len(windows)
    kernels = [e for e in evs if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    cpu = [e for e in evs if e.get("cat") in ("cpu_op", "user_annotation", "cuda_runtime", "cuda_driver",
                                               "python_function")]
    stacked = _stacks(cpu)
    per_cat: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    per_name: dict[tuple[str, str], list] = {}
    if kernels:
        # synchronize calls inside the steps, less the profiling code's own (closing_syncs a range)
        syncs = sum(1 for e, _, _ in stacked if _SYNC_RUNTIME.search(e["name"])
                    and in_steps(e["ts"], e["ts"] + e.get("dur", 0))) - n * closing_syncs
        mode = "gpu"
        launch = {}  # correlation id -> enclosing names of the runtime call
        for e, names, _ in stacked:
            corr = (e.get("args") or {}).get("correlation")
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and corr is not None:
                launch[corr] = names[:-1]
        busy = []
        for k in kernels:
            t0, t1 = k["ts"], k["ts"] + k.get("dur", 0)
            names = launch.get((k.get("args") or {}).get("correlation"), [])
            if range_name not in names and not in_steps(t0, t1):
                continue
            cat = _category(names, k["name"])
            per_cat[cat] += k.get("dur", 0)
            count[cat] += 1
            busy.append((t0, t1))
            key = (k["name"][:90], cat)
            per_name.setdefault(key, [0.0, 0])
            per_name[key][0] += k.get("dur", 0)
            per_name[key][1] += 1
        per_cat["idle"] = max(0.0, step_us - _union_length(busy))
        total = step_us
    else:
        mode = "cpu"
        syncs = sum(1 for e, _, _ in stacked if _SYNC_OPS.search(e["name"])
                    and in_steps(e["ts"], e["ts"] + e.get("dur", 0)))
        covered = 0.0
        for e, names, child_us in stacked:
            if e.get("cat") != "cpu_op" or not in_steps(e["ts"], e["ts"] + e.get("dur", 0)):
                continue
            self_us = max(0.0, e.get("dur", 0) - child_us)
            cat = _category(names, None)
            per_cat[cat] += self_us
            count[cat] += 1
            covered += self_us
            key = (e["name"][:90], cat)
            per_name.setdefault(key, [0.0, 0])
            per_name[key][0] += self_us
            per_name[key][1] += 1
        per_cat["idle"] = max(0.0, step_us - covered)
        total = step_us
    rows = [{"category": c, "ms": per_cat.get(c, 0.0) / 1e3 / n, "share": per_cat.get(c, 0.0) / total,
             "count": count.get(c, 0) / n} for c in CATEGORIES]
    top_rows = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"mode": mode, "steps": n, "step_ms": step_us / 1e3 / n, "rows": rows,
            "busy_share": 1.0 - per_cat["idle"] / total, "host_syncs_per_step": syncs / n,
            "top": [{"name": k[0], "category": k[1], "ms": v[0] / 1e3 / n, "count": v[1] / n} for k, v in top_rows]}


RIGHT = ["---", "---:", "---:", "---:"]  # numbers right-aligned


def to_markdown(summary: dict, title: str) -> str:
    unit = "kernel time" if summary["mode"] == "gpu" else "op self time (CPU)"
    lines = [f"### {title}", "",
             f"{summary['steps']} profiled step(s), {summary['step_ms']:.1f} ms/step (under the profiler); "
             f"{unit} per category; host syncs per step: {summary['host_syncs_per_step']:.0f}", "",
             md_table(["category", "ms/step", "share", "kernels (ops)/step"],
                      [(r["category"], f"{r['ms']:.2f}", f"{100 * r['share']:.1f}%", f"{r['count']:.0f}")
                       for r in summary["rows"]], RIGHT),
             "", "Top entries:", "",
             md_table(["name", "category", "ms/step", "calls/step"],
                      [(f"`{t['name'].replace('|', '/')}`", t["category"], f"{t['ms']:.2f}", f"{t['count']:.0f}")
                       for t in summary["top"]], ["---", "---", "---:", "---:"])]
    return "\n".join(lines) + "\n"


def profile_train_step(engine, micro_batches: list[dict], loss_fn, *, out_dir: str, name: str, steps: int = 2,
                       warmup: int = 1, top: int = 15) -> dict:
    """Profile `steps` calls of engine.train_step (after `warmup` unprofiled ones); writes
    profile_<name>.md/.json and trace_<name>.json.gz under out_dir and returns the summary."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from rltrain.models.megatron import engine as engine_mod
    from rltrain.models.megatron import head as head_mod

    def ranged(fn, label):
        def wrapper(*a, **kw):
            with record_function(label):
                return fn(*a, **kw)
        return wrapper

    cuda = engine.device.type == "cuda"
    saved = (head_mod.fused_logprobs, head_mod.unfused_logprobs, engine_mod.MegatronEngine._grad_norm,
             engine_mod.MegatronEngine._clip)
    head_mod.fused_logprobs = ranged(saved[0], HEAD_RANGE)
    head_mod.unfused_logprobs = ranged(saved[1], HEAD_RANGE)
    engine_mod.MegatronEngine._grad_norm = ranged(saved[2], OPT_RANGE)
    engine_mod.MegatronEngine._clip = ranged(saved[3], OPT_RANGE)
    try:
        for _ in range(warmup):
            engine.train_step([dict(mb) for mb in micro_batches], loss_fn)
        if cuda:
            torch.cuda.synchronize()
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            for _ in range(steps):
                with record_function(STEP_RANGE):
                    engine.train_step([dict(mb) for mb in micro_batches], loss_fn)
                    if cuda:
                        torch.cuda.synchronize()  # the step's kernels end inside its range (one sync, subtracted)
    finally:
        (head_mod.fused_logprobs, head_mod.unfused_logprobs, engine_mod.MegatronEngine._grad_norm,
         engine_mod.MegatronEngine._clip) = saved
    os.makedirs(out_dir, exist_ok=True)
    raw = os.path.join(out_dir, f"trace_{name}.json")
    prof.export_chrome_trace(raw)
    with open(raw) as f:
        trace = json.load(f)
    with open(raw, "rb") as src, gzip.open(raw + ".gz", "wb") as dst:
        dst.write(src.read())
    os.remove(raw)
    summary = summarize_trace(trace, top=top)
    summary["name"] = name
    write_report(out_dir, f"profile_{name}", summary, to_markdown(summary, f"Profile: {name}"))
    return summary
