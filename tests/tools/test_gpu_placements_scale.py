"""tools/gpu_placements.py's scale runs (--runs, --plan) without a GPU: its prompts are what the runs claim (256 of 511 digits), every run's config is
valid and planned to fit four H200s (the keys docs/plan.md gives for Qwen3-30B-A3B included), the plan's row holds the
plan's numbers, the summary turns metric rows into the step table, tokens/s/GPU and the update's MFU by its formula,
and a run in progress leaves its steps on disk after each one (the report, the metrics, its row beside the plan)."""

from __future__ import annotations

import json
import os
import sys

from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import gpu_placements as gp  # noqa: E402


def test_prompts_are_256_of_511_digits(tmp_path):
    path = tmp_path / "p.jsonl"
    gp.write_prompts(str(path))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 256 and {len(r["prompt"]) for r in rows} == {511} and all(r["prompt"].isdigit() for r in rows)


@pytest.mark.parametrize("name", list(gp.RUNS))
def test_every_run_is_valid_and_planned_to_fit_four_h200s(name, tmp_path):
    from rltrain.config.entry import compose_config
    from rltrain.config.validate import validate_config
    from rltrain.plan import make_plan

    data = str(tmp_path / "p.jsonl")
    gp.write_prompts(data)
    cfg = compose_config("grpo_tiny", gp.scale_overrides(name, data))
    validate_config(cfg)
    plan = make_plan(cfg, gpu_memory_gib=139.8, prompt_tokens=512, response_tokens=1024)
    assert plan.fits and plan.peak_gib < 139.8 and plan.inputs.world == 4
    from rltrain.plan.report import to_json

    row = gp.plan_row(name, to_json(plan), "2026-11-28")
    assert row["variant"] == f"{name} plan" and row["metrics"]["plan/fits"] == 1.0
    assert gp.committed_plan(name)["plan/fits"] == 1.0  # its row is committed
    assert row["metrics"]["plan/step_s"] == pytest.approx(plan.seconds["step"], abs=1e-4)
    assert row["metrics"]["plan/peak_gib"] == pytest.approx(plan.peak_gib, abs=1e-3)


def test_summary_by_hand():
    rows = [{"step": s, "timing_s/step": 10.0, "timing_s/update_actor": 4.0, "timing_s/update_weights": 1.0,
             "perf/total_num_tokens": 393216, "rollout/mismatch_abs_mean": 0.01,
             "perf/max_memory_allocated_gb/train_rank0": 100.0 + s} for s in (1, 2, 3)]
    out = gp.scale_summary("qwen3_8b", rows, None)
    assert len(out["steps"]) == 3 and out["peak_gib_per_gpu"] == {"train_rank0": 103.0}
    assert out["tokens_per_s_per_gpu"] == pytest.approx(393216 / 10 / 4)
    from rltrain.config.presets import BUILTINS
    from rltrain.utils import flops

    model_flops = flops.train_flops(SimpleNamespace(**BUILTINS["qwen3-8b"]), 393216, 1536)
    assert out["update_mfu"] == pytest.approx(model_flops / (4.0 * 4 * 989e12))


def test_a_run_in_progress_leaves_its_steps_and_its_row_beside_the_plan(tmp_path):
    out, results, run_dir = tmp_path / "out", tmp_path / "results", tmp_path / "run"
    out.mkdir()
    run_dir.mkdir()
    args = SimpleNamespace(out=str(out), results=str(results))
    res = {"date": "2026-11-28", "device": "4 x NVIDIA H200", "torch": "x", "command": "c", "runs": {}}
    predicted = {"phase_seconds": {"generation": 6.0, "update": 3.0, "step": 12.0, "step/x": 1.0}, "peak_gib": 120.0,
                 "gpus": [{"allocator_peak_gib": 100.0}, {"allocator_peak_gib": 110.0}], "fits": True}
    prog = gp.Progress("qwen3_30b_a3b", str(run_dir), args, res, gp.plan_metrics(predicted))
    prog.poll()  # nothing logged yet: a report, no row
    assert json.loads((out / "scale_runs.json").read_text())["runs"]["qwen3_30b_a3b"]["rc"] is None
    assert not (results / "moe.jsonl").exists()
    step_s = [20.0, 15.0, 17.0]
    with open(run_dir / "metrics.jsonl", "w") as f:
        for i, s in enumerate(step_s, 1):
            f.write(json.dumps({"step": i, "timing_s/step": s, "timing_s/update_actor": 5.0, "timing_s/gen": s - 8,
                                "timing_s/update_weights": 9.0 - i, "perf/total_num_tokens": 300000,
                                "rollout/mismatch_abs_mean": 0.004, "rollout/no_replay/mismatch_abs_mean": 0.01,
                                "perf/max_memory_allocated_gb/train_rank0": 90.0 + i}) + "\n")
            f.flush()
            prog.poll()
            row = json.loads((results / "moe.jsonl").read_text())
            assert (out / "qwen3_30b_a3b_metrics.jsonl").read_text().count("\n") == i
    m = row["metrics"]
    assert row["variant"] == "qwen3_30b_a3b" and row["note"].startswith("partial: written at step 3")
    assert m["step_s"] == pytest.approx(16.0) and m["timing_s/gen"] == pytest.approx(8.0)  # steps 2-3
    assert m["step_s/error_pct"] == pytest.approx(100 * (16 / 12 - 1), abs=0.01)
    assert m["allocator_peak_gib"] == 93.0 and m["plan/allocator_peak_gib"] == 110.0
    assert m["allocator_peak_gib/error_pct"] == pytest.approx(100 * (110 / 93 - 1), abs=0.01)
    assert m["mismatch"] == pytest.approx(0.004) and m["mismatch_no_replay"] == pytest.approx(0.01)
    assert m["weight_sync_s/last"] == 6.0 and m["steps"] == 3 and "plan/step/x_s" not in m
    assert "| 3 |" in (out / "scale_runs.md").read_text()
