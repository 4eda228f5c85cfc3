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


AREAS = {"update": [update_extra]}


def main() -> int:
    for area, makers in AREAS.items():
        rows = [r for make in makers for r in make()]
        replaced = results.upsert(area, rows)
        print(f"{area}: {len(rows)} rows ({replaced} replaced)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
