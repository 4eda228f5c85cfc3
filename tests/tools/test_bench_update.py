"""tools/bench_update.py end to end on CPU: the device probe and one row, each in its own process through the
harness runner, the report rewritten after the row, and the row upserted into the update table."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_cpu_row_in_a_child_process_and_its_report(tmp_path):
    out = tmp_path / "bu"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_update.py"), "--plan", "cpu", "--rows",
                           "tiny-256-norms+optim", "--reps", "1", "--no-profile", "--no-attention-probe", "--out",
                           str(out), "--results", str(tmp_path / "results")], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((out / "bench_update.json").read_text())
    (row,) = res["rows"]
    assert row["status"] == "ok" and row["row"]["name"] == "tiny-256-norms+optim" and row["reps"] == 1
    assert row["step_s"] == row["step_min_s"] == row["step_max_s"] > 0  # one timed step
    assert row["tokens_per_s"] == 256 / row["step_s"] and row["warmup_loss"] == row["warmup_loss"]  # finite
    assert res["device"].startswith("CPU (") and res["command"].startswith("python tools/bench_update.py --plan cpu")
    md = (out / "bench_update.md").read_text()
    assert "| tiny-256-norms+optim | 256 | norms+optim (bf16 norms, fused AdamW, fusion none) |" in md
    (table,) = [json.loads(line) for line in (tmp_path / "results" / "update.jsonl").read_text().splitlines()]
    assert (table["tool"], table["shape"], table["device"], table["variant"]) == (
        "bench_update", "tiny", "cpu", "tiny-256-norms+optim")
    assert table["metrics"]["step_s"] == row["step_s"] and table["scope"] == "update"
    assert "model.builtin=tiny" in table["config"] and "actor.max_tokens_per_micro_batch=256" in table["config"]


def test_plan_json_writes_the_planners_prediction_of_each_row_and_runs_nothing(tmp_path):
    # --plan-json: rltrain.plan's peak and step time of each selected row, written before a GPU run (the prediction
    # the run is compared with); nothing is run, no report is written
    path, out = tmp_path / "pred.json", tmp_path / "bu"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_update.py"), "--plan", "lengths", "--rows",
                           "06b-16k-*", "--plan-json", str(path), "--gpu", "h100", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    pred = json.loads(path.read_text())
    assert pred["gpu"] == "h100" and "--plan-json" in pred["command"]
    assert sorted(pred["rows"]) == ["06b-16k-all", "06b-16k-norms+optim"]
    for row in pred["rows"].values():
        assert row["fits"] == 1.0 and row["step_s"] > 0 and row["reserved_gib"] > row["peak_gib"] > 0
    # fusion none keeps more activations and runs slower than torch.compile's layers at the same 16,384 tokens
    assert pred["rows"]["06b-16k-norms+optim"]["peak_gib"] > pred["rows"]["06b-16k-all"]["peak_gib"]
    assert pred["rows"]["06b-16k-norms+optim"]["step_s"] > pred["rows"]["06b-16k-all"]["step_s"]
    assert not (out / "bench_update.json").exists()
