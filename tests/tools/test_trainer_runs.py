"""The tools' trainer runs go through the harness's child runner: a run that fails reports its exit code and log
tail, a run past its time is stopped (bench_async's deadline), on CPU with grpo_tiny's command line."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import bench_async  # noqa: E402
import gpu_placements  # noqa: E402


def test_bench_async_run_fails_with_its_log_and_is_stopped_at_the_deadline(tmp_path):
    bad = bench_async.run_trainer(str(tmp_path / "bad"), "grpo_tiny", ["trainer.no_such_key=1"], timeout_s=300)
    assert bad["returncode"] not in (0, "stopped at the deadline") and bad["rows"] == []
    assert "no_such_key" in bad["log_tail"] and bad["command"].endswith(f"hydra.run.dir={tmp_path / 'bad'}")
    slow = bench_async.run_trainer(str(tmp_path / "slow"), "grpo_tiny", ["trainer.device=cpu"], timeout_s=2)
    assert slow["returncode"] == "stopped at the deadline" and slow["wall_s"] < 60


def test_gpu_placements_run_reports_a_failed_run(tmp_path):
    run = gpu_placements.run_trainer("bad", ["trainer.no_such_key=1"], str(tmp_path), "127.0.0.1:1", timeout_s=300,
                                     device="cpu")
    assert run["rc"] not in (0, None) and run["rows"] == [] and "no_such_key" in run["log_tail"]
    assert run["process_tails"] is not None and run["log_checks"]["mnnvl_lines"] == []
    summary = gpu_placements.step_summary(run)
    assert summary["rc"] == run["rc"] and "no_such_key" in summary["log_tail"] and "timing_s" not in summary
