"""Where a profiled training step's time goes, per worker and phase: reads the traces trainer.profile_steps wrote
(<run dir>/profile/step<N>/trace_<group>_rank<r>.json.gz) and prints, for each phase range the worker ran
(rltrain::phase/<name>: old log-probs, reference, update, generation, sleep, wake-up, weight sync), its calls, wall
ms per call, the GPU's busy share (kernel time over wall time), its kernel time by category, the caching allocator's
cudaMalloc / cudaFree calls and the top kernels.
A phase the GPU is idle through most of is bound by the host (launches, Python, syncs); one the GPU is busy through
is bound by its kernels. Not a test; it changes no code.

    python -m rltrain.main ... trainer.profile_steps=[3]
    python tools/profile_step.py outputs/<run>/profile/step3            # every trace there
    python tools/profile_step.py TRACE.json.gz --phases update_actor old_log_prob --out report.md

`update`: the actor update step alone (MegatronEngine.train_step of a random model, tools/bench_update.py's rows,
harness/cases.py) under torch's profiler, summarized by category (GEMMs, attention, norms, elementwise, copies,
optimizer, communication, the LM head, idle) as markdown + json (+ the gzipped chrome trace) under --out:

    python tools/profile_step.py update --out $OUT                              # Qwen3-0.6B shape, 8k tokens
    python tools/profile_step.py update --out $OUT --preset qwen3-4b --tokens 8192 --levers legacy
    python tools/profile_step.py update --out $OUT --preset tiny --tokens 256   # CPU: op self-times, no idle
    python tools/profile_step.py update --out $OUT --tokens 8832 --seq-len 69 --levers all   # the GRPO update's shape
    python tools/profile_step.py update --summarize TRACE.json.gz               # only summarize a chrome trace

How a trace is read: tools/harness/update_profile.py (summarize_trace, over each phase's ranges or the step).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tools/, for the harness
from harness import md_table
from harness.cases import LEVER_SETS, PRESETS, Row, build_for_row
from harness.update_profile import CATEGORIES, profile_train_step, summarize_trace
from harness.update_profile import to_markdown as update_markdown

from rltrain.utils.profiling import PHASE_PREFIX


def load_trace(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def phase_names(trace: dict) -> list[str]:
    """The phases in the trace (host-side ranges), in the order they first ran."""
    seen: dict[str, float] = {}
    for e in trace.get("traceEvents", []):
        name = e.get("name", "")
        if e.get("ph") == "X" and name.startswith(PHASE_PREFIX) and e.get("cat") != "gpu_user_annotation":
            seen.setdefault(name[len(PHASE_PREFIX):], e["ts"])
    return sorted(seen, key=seen.get)


ALLOCATOR_CALLS = ("cudaMalloc", "cudaFree")  # the caching allocator growing or handing memory back to the driver


def allocator_calls(trace: dict, range_name: str) -> dict[str, tuple[float, float]]:
    """{call: (count, ms)} of the CUDA runtime's cudaMalloc / cudaFree inside the `range_name` ranges, per range. A
    phase that allocates from an emptied cache (torch.cuda.empty_cache) pays them on the host, one per block."""
    evs = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in evs
               if e.get("name") == range_name and e.get("cat") != "gpu_user_annotation"]
    out = {c: [0, 0.0] for c in ALLOCATOR_CALLS}
    for e in evs:
        if e.get("cat") == "cuda_runtime" and e.get("name") in out and any(a <= e["ts"] <= b for a, b in windows):
            out[e["name"]][0] += 1
            out[e["name"]][1] += e.get("dur", 0) / 1e3
    n = max(1, len(windows))
    return {c: (k / n, ms / n) for c, (k, ms) in out.items()}


def summarize(trace: dict, phases: list[str] | None = None, top: int = 3) -> list[dict]:
    """One row per phase: {"phase", "calls", "ms" (wall, per call), "busy" (GPU share; None on CPU), "cat": {category:
    ms per call}, "syncs" (host syncs per call), "alloc": {cudaMalloc | cudaFree: (count, ms) per call}, "top":
    [(kernel, ms per call)]}."""
    rows = []
    for name in phase_names(trace):
        if phases and name not in phases:
            continue
        s = summarize_trace(trace, top=top, range_name=PHASE_PREFIX + name, closing_syncs=0)
        rows.append({"phase": name, "calls": s["steps"], "ms": s["step_ms"],
                     "busy": s["busy_share"] if s["mode"] == "gpu" else None,
                     "cat": {r["category"]: r["ms"] for r in s["rows"]}, "syncs": s["host_syncs_per_step"],
                     "alloc": allocator_calls(trace, PHASE_PREFIX + name),
                     "top": [(t["name"], t["ms"]) for t in s["top"]]})
    return rows


def to_markdown(path: str, rows: list[dict]) -> str:
    cats = [c for c in CATEGORIES if c != "idle" and any(r["cat"].get(c, 0) > 0 for r in rows)]
    head = (["phase", "calls", "ms/call", "GPU busy"] + [f"{c} ms" for c in cats]
            + ["idle ms", "host syncs"] + [f"{c} (n, ms)" for c in ALLOCATOR_CALLS])
    table = []
    for r in rows:
        busy = "-" if r["busy"] is None else f"{100 * r['busy']:.0f}%"
        table.append([r["phase"], str(r["calls"]), f"{r['ms']:.1f}", busy]
                     + [f"{r['cat'].get(c, 0):.1f}" for c in cats] + [f"{r['cat'].get('idle', 0):.1f}",
                                                                      f"{r['syncs']:.0f}"]
                     + [f"{r['alloc'][c][0]:g}, {r['alloc'][c][1]:.1f}" for c in ALLOCATOR_CALLS])
    lines = [f"### {os.path.basename(path)}", "", md_table(head, table, ["---"] + ["---:"] * (len(head) - 1)), ""]
    for r in rows:
        if r["top"]:
            tops = "; ".join(f"`{n[:60]}` {ms:.1f} ms" for n, ms in r["top"])
            lines.append(f"- {r['phase']}: {tops}")
    return "\n".join(lines) + "\n"


def trace_paths(args: list[str]) -> list[str]:
    paths = []
    for a in args:
        if os.path.isdir(a):
            found = sorted(p for ext in ("json", "json.gz")
                           for p in glob.glob(os.path.join(a, "**", f"trace_*.{ext}"), recursive=True))
            if not found:
                raise SystemExit(f"profile_step: no trace_*.json(.gz) under {a}: profile a step with "
                                 "trainer.profile_steps=[N]")
            paths += found
        elif os.path.isfile(a):
            paths.append(a)
        else:
            raise SystemExit(f"profile_step: {a}: no such file or directory")
    return paths


def update_main(argv: list[str]) -> int:
    """`update`: profile the actor update step of each lever set, or summarize one chrome trace."""
    ap = argparse.ArgumentParser(prog="tools/profile_step.py update", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "profile_update_out"))
    ap.add_argument("--preset", default="qwen3-0.6b", choices=sorted(PRESETS))
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--levers", nargs="*", default=["legacy", "all"], choices=sorted(LEVER_SETS),
                    help="profile each of these lever sets (bench_update.py LEVER_SETS)")
    ap.add_argument("--seq-len", type=int, default=None,
                    help="rows of this many tokens in one micro-batch (the GRPO update: --tokens 8832 --seq-len 69); "
                         "default: one sequence of --tokens")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--summarize", help="only summarize this chrome trace (.json or .json.gz) and print the table")
    args = ap.parse_args(argv)
    if args.summarize:
        print(update_markdown(summarize_trace(load_trace(args.summarize)), args.summarize))
        return 0
    os.makedirs(args.out, exist_ok=True)
    md = []
    for levers in args.levers:
        name = f"{args.preset}-{args.tokens}" + (f"x{args.seq_len}" if args.seq_len else "") + f"-{levers}"
        row = Row(name=name, preset=args.preset, tokens=args.tokens, seq_len=args.seq_len, **LEVER_SETS[levers])
        t0 = time.time()
        engine, mbs, loss_fn = build_for_row(row)
        s = profile_train_step(engine, mbs, loss_fn, out_dir=args.out, name=row.name, steps=args.steps)
        md.append(update_markdown(s, f"Profile: {row.name}"))
        print(md[-1], f"({time.time() - t0:.0f} s)", flush=True)
        del engine
    with open(os.path.join(args.out, "profile_update.md"), "w") as f:
        f.write("\n".join(md))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["update"]:
        return update_main(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+", help="trace files, or directories searched for trace_*.json(.gz)")
    ap.add_argument("--phases", nargs="*", help="only these phases (default: every phase in the trace)")
    ap.add_argument("--top", type=int, default=3, help="top kernels listed per phase")
    ap.add_argument("--out", help="also write the markdown here")
    args = ap.parse_args(argv)
    parts = []
    for path in trace_paths(args.paths):
        trace = load_trace(path)
        rows = summarize(trace, args.phases, args.top)
        parts.append(to_markdown(path, rows) if rows else f"### {os.path.basename(path)}\n\nno phase ranges\n")
        print(parts[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(parts))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
