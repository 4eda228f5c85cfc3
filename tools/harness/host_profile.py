"""Where a call's host (Python) time goes: cProfile of one call, summarized by function and by package area.
Its seconds are not a benchmark (see below). Used by tools/bench_rollout.py --profile and tools/gpu_smoke.py
--profile-gen to find the host work that keeps a rollout engine's decode steps from running at the GPU's speed.

cProfile slows Python-heavy code (often ~1.5-2x), so a profiled call's wall time is not a benchmark: read the
shares, not the seconds. Time a thread spends blocked on the GPU shows up as the tottime of the blocking call
(a `.tolist()` / `.item()` / `synchronize` of a CUDA tensor or event): that is GPU time the host did not hide.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import time

from harness import md_table

# (area, path fragment) in order: a function's file is charged to the first area whose fragment it contains
AREAS = [
    ("vllm scheduler", "vllm/v1/core/"),
    ("vllm output processing (frontend)", "vllm/v1/engine/output_processor"),
    ("vllm log-probs (frontend)", "vllm/v1/engine/logprobs"),
    ("vllm detokenizer (frontend)", "vllm/v1/engine/detokenizer"),
    ("vllm engine core / client", "vllm/v1/engine/"),
    ("vllm model runner / worker", "vllm/v1/worker/"),
    ("vllm sampler", "vllm/v1/sample/"),
    ("vllm other", "vllm/"),
    ("rltrain", "rltrain/"),
    ("torch (python)", "torch/"),
]


def area_of(filename: str) -> str:
    path = filename.replace(os.sep, "/")
    for area, fragment in AREAS:
        if fragment in path:
            return area
    return "builtins / C calls" if filename.startswith("~") or filename == "" else "other python"


def profile_call(fn, *args, top: int = 30, **kwargs):
    """Run fn(*args, **kwargs) under cProfile. Returns (result, summary): summary has the wall seconds, the
    tottime per area (sums to the profiled time), and the `top` functions by tottime and by cumulative time."""
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    try:
        result = fn(*args, **kwargs)
    finally:
        prof.disable()
    wall = time.perf_counter() - start
    return result, summarize(pstats.Stats(prof), wall, top=top)


def summarize(stats: pstats.Stats, wall_s: float, *, top: int = 30) -> dict:
    rows = []
    for (filename, line, name), (cc, nc, tt, ct, _callers) in stats.stats.items():
        rows.append({"function": f"{_short(filename)}:{line}({name})", "area": area_of(filename), "calls": nc,
                     "tottime_s": tt, "cumtime_s": ct})
    total = sum(r["tottime_s"] for r in rows)
    areas: dict[str, float] = {}
    for r in rows:
        areas[r["area"]] = areas.get(r["area"], 0.0) + r["tottime_s"]
    return {"wall_s": wall_s, "profiled_s": total,
            "areas": dict(sorted(areas.items(), key=lambda kv: -kv[1])),
            "top_tottime": sorted(rows, key=lambda r: -r["tottime_s"])[:top],
            "top_cumtime": sorted(rows, key=lambda r: -r["cumtime_s"])[:top]}


def _short(filename: str) -> str:
    path = filename.replace(os.sep, "/")
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    for root in ("/rltrain/", "/tools/"):
        if root in path:
            return root.strip("/") + "/" + path.split(root, 1)[1]
    return path


def to_markdown(summary: dict, title: str, *, top: int = 20) -> str:
    total = max(summary["profiled_s"], 1e-12)
    return "\n".join([
        f"#### {title}", "", f"Wall {summary['wall_s']:.3f} s under cProfile (inflated by it; read the shares), "
        f"{summary['profiled_s']:.3f} s of function time.", "",
        md_table(["area", "s", "share"], [(a, f"{s:.3f}", f"{100 * s / total:.1f}%") for a, s in summary["areas"].items()]),
        "", md_table(["function (top by own time)", "area", "calls", "own s", "cumulative s"],
                     [(f"`{r['function']}`", r["area"], r["calls"], f"{r['tottime_s']:.3f}", f"{r['cumtime_s']:.3f}")
                      for r in summary["top_tottime"][:top]])]) + "\n"
