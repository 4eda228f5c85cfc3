"""The tools' trainer runs go through the harness's child runner: a run that fails reports its exit code and log
tail, a run past its time is stopped with the run's process group (a tool's deadline), on CPU with grpo_tiny's
command line."""

import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import gpu_placements  # noqa: E402
import harness  # noqa: E402

STOP = ((signal.SIGTERM, 20), (signal.SIGKILL, 10))  # what bench_offpolicy asks of a run at its deadline


def test_harness_run_fails_with_its_log_and_is_stopped_at_the_deadline(tmp_path):
    bad = harness.run_trainer("grpo_tiny", ["trainer.no_such_key=1"], str(tmp_path / "bad"), timeout_s=300, stop=STOP)
    assert bad["rc"] not in (0, None) and not bad["timed_out"] and bad["rows"] == []
    assert "no_such_key" in bad["tail"] and bad["command"][-1] == f"hydra.run.dir={tmp_path / 'bad'}"
    slow = harness.run_trainer("grpo_tiny", ["trainer.device=cpu"], str(tmp_path / "slow"), timeout_s=2, stop=STOP)
    assert slow["timed_out"] and slow["wall_s"] < 60


def test_gpu_placements_run_reports_a_failed_run(tmp_path):
    run = gpu_placements.run_trainer("bad", ["trainer.no_such_key=1"], str(tmp_path), "127.0.0.1:1", timeout_s=300,
                                     device="cpu")
    assert run["rc"] not in (0, None) and run["rows"] == [] and "no_such_key" in run["log_tail"]
    assert run["process_tails"] is not None and run["log_checks"]["mnnvl_lines"] == []
    summary = gpu_placements.step_summary(run)
    assert summary["rc"] == run["rc"] and "no_such_key" in summary["log_tail"] and "timing_s" not in summary
