"""tools/gpu_smoke.py's results rows: the GRPO section as a "step" row the planner's lab reads back, each update step
as an "update" row (fits 0 where it ran out of memory), the TP=2 section's steps. (The sections need a GPU.)"""

import argparse
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

import gpu_smoke  # noqa: E402
from planlab.cases import case_of  # noqa: E402


def test_sections_become_rows_the_planners_lab_reads():
    args = argparse.Namespace(tag="", grpo_set=["rollout.engines_per_gpu=4"])
    res = {"date": "2026-11-28", "gemm_tflops": 780.0}
    mean = {"timing_s/gen": 0.68, "timing_s/old_log_prob": 0.16, "timing_s/ref": 0.13, "timing_s/update_actor": 0.35,
            "timing_s/update_weights": 0.40, "timing_s/rollout_sleep": 0.08, "timing_s/step": 1.78,
            "perf/max_memory_allocated_gb": 23.8, "prompt_length/mean": 5.0, "response_length/mean": 64.0,
            "gen_response_tokens_per_s": 1.0}
    grpo = {"engine": "vllm", "model": "qwen3-0.6b", "overrides": ["rollout=vllm"], "mean": mean,
            "tokens_per_step": 17664.0}
    [(area, row)] = gpu_smoke.table_rows("grpo", grpo, res, args)
    assert area == "placements" and row["variant"] == "grpo vllm, rollout.engines_per_gpu=4"
    assert "gen_response_tokens_per_s" not in row["metrics"] and row["metrics"]["gemm_tflops"] == 780.0
    c = case_of(row)
    assert c.measured["weight_sync_s"] == pytest.approx(0.48) and c.measured["step_s"] == 1.78
    steps = [{"tokens": 32768, "fused": True, "recompute": True, "status": "ok", "peak_gib": 13.4, "step_s": 1.8,
              "mfu": 0.27, "tokens_per_s": 18000.0},
             {"tokens": 32768, "fused": False, "recompute": False, "status": "OOM"}]
    (a1, ok), (a2, oom) = gpu_smoke.table_rows("longctx", steps, res, args)
    assert (a1, ok["variant"], ok["scope"]) == ("update", "smoke-32k-fused-rc1", "update")
    assert "actor.recompute_granularity=full" in ok["config"] and "trainer.fused_linear_logprob=true" in ok["config"]
    assert case_of(ok).measured == {"peak_gib": 13.4, "step_s": 1.8}
    assert oom["variant"] == "smoke-32k-unfused-rc0" and case_of(oom).measured == {"fits": 0.0}
    assert gpu_smoke.table_rows("grpo", {"error": "boom"}, res, args) == []
