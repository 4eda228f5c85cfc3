"""tools/bench_true_on_policy.py's report on a worked example: phase means after the first step, the mismatch of
every step, and the on/off cost ratios in the table."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import bench_true_on_policy as bench  # noqa: E402


def _rows(step_s, diff):
    rows = [{"step": 0, "val/accuracy": 0.1}]
    for i, s in enumerate(step_s, start=1):
        rows.append({"step": i, "timing_s/step": s, "timing_s/gen": s / 2, "timing_s/gen_engine": s / 4,
                     "timing_s/old_log_prob": 0.1, "timing_s/update_actor": 0.2, "timing_s/update_weights": 0.05,
                     "rollout/logprob_diff_max": diff, "rollout/logprob_diff_nonzero_frac": 0.5 if diff else 0.0,
                     "critic/score/mean": 0.25})
    rows[-1]["val/accuracy"] = 0.4
    return rows


def test_summary_skips_the_first_step_and_keeps_every_steps_mismatch():
    off = bench.summary_of_runs([_rows([9.0, 1.0, 3.0], 4e-7)])
    on = bench.summary_of_runs([_rows([9.0, 2.0, 2.0], 0.0)])
    assert off["mean"]["timing_s/step"] == 2.0 and off["mean"]["timing_s/gen"] == 1.0
    assert off["logprob_diff_max"] == [4e-7] * 3 and not off["all_zero"]
    assert on["all_zero"] and on["nonzero_frac"] == [0.0] * 3 and on["score_last10"] == 0.25
    assert on["val_accuracy"] == [(0, 0.1), (3, 0.4)]
    md = bench.markdown({"date": "d", "device": "cpu", "command": "c", "runs": {"off": off, "on": on}})
    assert "| timing_s/step | 2.0000 | 2.0000 | 1.00x |" in md and "exactly 0 every step: True" in md


def test_traced_steps_stay_out_of_the_means():
    overrides = ["trainer.total_steps=4", "trainer.profile_steps=[2, 3]", "rollout.true_on_policy=true"]
    assert bench.profiled_steps(overrides) == {2, 3} and bench.profiled_steps(["trainer.profile_steps=[]"]) == set()
    run = bench.summary_of_runs([_rows([9.0, 7.0, 5.0, 1.0], 0.0)], bench.profiled_steps(overrides))
    assert run["mean"]["timing_s/step"] == 1.0 and run["steps"] == 4 and run["logprob_diff_max"] == [0.0] * 4


def test_check_flow_on_cpu_is_exact_for_decode_and_chunks(tmp_path):
    """--check --cpu: the per-token check's flow with the hf engine, the partial rollouts' chunks included."""
    import json
    import subprocess

    tool = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "bench_true_on_policy.py")
    proc = subprocess.run([sys.executable, tool, "--check", "--cpu", "--out", str(tmp_path), "--prompts", "3",
                           "--n", "2", "--max-tokens", "8", "--results", str(tmp_path / "results")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads((tmp_path / "true_on_policy_check.json").read_text())
    for key in ("decode_vs_actor", "chunked_vs_actor"):
        assert got[key]["tokens"] > 0 and got[key]["max"] == 0.0, got[key]
    assert got["chunked_vs_actor"]["chunk_tokens"] == 2
    (row,) = [json.loads(line) for line in (tmp_path / "results" / "rollout.jsonl").read_text().splitlines()]
    assert (row["shape"], row["device"], row["variant"]) == ("grpo_tiny", "cpu", "check, 8 response tokens")
    assert row["metrics"] == {"decode_vs_actor_max": 0.0, "decode_vs_actor_nonzero_frac": 0.0,
                              "chunked_vs_actor_max": 0.0, "tokens": got["decode_vs_actor"]["tokens"]}


def test_rounds_alternate_and_pool_each_variants_runs():
    assert bench.run_order(["off", "on"], 3) == ["off", "on", "on", "off", "off", "on"]
    assert bench.run_order(["on"], 2) == ["on", "on"]
    slow, fast = _rows([9.0, 3.0, 3.0], 0.0), _rows([9.0, 1.0, 1.0], 0.0)
    both = bench.summary_of_runs([slow, fast])
    assert both["mean"]["timing_s/step"] == 2.0 and both["step_s_by_run"] == [3.0, 1.0] and both["steps"] == 6
    report = {"date": "d", "device": "cpu", "command": "c", "order": ["off_1", "on_1", "on_2", "off_2"],
              "runs": {"off": bench.summary_of_runs([slow, slow]), "on": both}}
    assert "runs in order (mean step s): off_1 3.000, on_1 3.000, on_2 1.000, off_2 3.000" in bench.markdown(report)
