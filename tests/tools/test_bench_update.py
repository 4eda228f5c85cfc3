"""tools/bench_update.py end to end on CPU: the device probe and one row, each in its own process through the
harness runner, and the report rewritten after the row."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_one_cpu_row_in_a_child_process_and_its_report(tmp_path):
    out = tmp_path / "bu"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_update.py"), "--plan", "cpu", "--rows",
                           "tiny-256-norms+optim", "--reps", "1", "--no-profile", "--no-attention-probe", "--out",
                           str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((out / "bench_update.json").read_text())
    (row,) = res["rows"]
    assert row["status"] == "ok" and row["row"]["name"] == "tiny-256-norms+optim" and row["reps"] == 1
    assert row["step_s"] == row["step_min_s"] == row["step_max_s"] > 0  # one timed step
    assert row["tokens_per_s"] == 256 / row["step_s"] and row["warmup_loss"] == row["warmup_loss"]  # finite
    assert res["device"].startswith("CPU (") and res["command"].startswith("python tools/bench_update.py --plan cpu")
    md = (out / "bench_update.md").read_text()
    assert "| tiny-256-norms+optim | 256 | norms+optim (bf16 norms, fused AdamW, fusion none) |" in md
