"""tools/phase_split.py: each phase's driver seconds split into the ranks' work, Ray's dispatch and return and the
driver's rest, on a worked example; warm-up and profiled steps left out; bad input exits 2."""

import json
import os
import random
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import phase_split  # noqa: E402
from harness.runs import split_phases  # noqa: E402


def _row(step, old, worker, dispatch, ret, **extra):
    return {"step": step, "timing_s/step": 2.0, "timing_s/old_log_prob": old, "timing_s/worker/old_log_prob": worker,
            "timing_s/dispatch/old_log_prob": dispatch, "timing_s/return/old_log_prob": ret,
            "timing_s/update_weights": 0.30, "timing_s/worker/rollout_wake_up": 0.12,
            "timing_s/worker/weight_sync_send": 0.14, "timing_s/dispatch/rollout_wake_up": 0.001,
            "timing_s/dispatch/weight_sync_send": 0.002, "timing_s/return/rollout_wake_up": 0.001,
            "timing_s/return/weight_sync_send": 0.001, **extra}


def _write(tmp_path, rows):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_worked_example(tmp_path, capsys):
    rows = [{"step": 0, "val/accuracy": 0.1},  # validation before training: no step time
            _row(1, 3.0, 2.9, 0.05, 0.01),  # compilation: --skip 1 leaves it out
            _row(2, 0.20, 0.14, 0.010, 0.004),
            _row(3, 0.30, 0.16, 0.012, 0.004, **{"timing_s/slice/old_log_prob": 0.06,  # slicing: a newer run's
                                                  "timing_s/slice_cpu/old_log_prob": 0.002}),
            _row(4, 9.0, 8.0, 0.5, 0.1, **{"perf/profiled": 1.0})]  # under the profiler: left out
    t = split_phases(phase_split.read_rows(_write(tmp_path, rows)), skip=1)
    old = t["old_log_prob"]
    assert old["steps"] == 2
    assert old == pytest.approx({"steps": 2, "driver": 0.25, "slice": 0.03, "slice_cpu": 0.001, "worker": 0.15,
                                 "dispatch": 0.011, "return": 0.004, "rest": 0.25 - 0.03 - 0.15 - 0.011 - 0.004})
    # a phase of two worker methods sums them
    assert t["update_weights"] == pytest.approx({"steps": 2, "driver": 0.30, "slice": 0.0,  # no slicing's CPU noted
                                                 "worker": 0.26, "dispatch": 0.003,
                                                 "return": 0.002, "rest": 0.30 - 0.265})
    assert "ref" not in t  # never ran
    assert phase_split.main([_write(tmp_path, rows), "--json", str(tmp_path / "o.json")]) == 0
    assert "| old_log_prob | 0.250 | 0.030 | 0.001 | 0.150 | 0.011 | 0.004 | 0.055 |" in capsys.readouterr().out
    assert json.load(open(tmp_path / "o.json"))[str(tmp_path / "metrics.jsonl")]["old_log_prob"]["steps"] == 2


def test_random_rows_rest_is_what_the_parts_leave(tmp_path):
    rng = random.Random()
    rows = []
    for s in range(1, 6):
        w, d, r, sl, rest = (rng.uniform(0.01, 0.5) for _ in range(5))
        rows.append(_row(s, sl + w + d + r + rest, w, d, r, rest=rest, **{"timing_s/slice/old_log_prob": sl}))
    t = split_phases(rows, skip=0)["old_log_prob"]
    assert t["rest"] == pytest.approx(sum(r["rest"] for r in rows) / 5)


def test_bad_input_exits_2(tmp_path, capsys):
    assert phase_split.main([str(tmp_path / "missing.jsonl")]) == 2
    assert "no such metrics file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1}\nnot json\n')
    assert phase_split.main([str(bad)]) == 2
    assert "line 2 is not JSON" in capsys.readouterr().err
    local = _write(tmp_path, [{"step": 1, "timing_s/step": 1.0, "timing_s/old_log_prob": 0.2}])  # trainer.use_ray=false
    assert phase_split.main([local, "--skip", "0"]) == 2
    assert "no step with the phase split" in capsys.readouterr().err
    assert phase_split.main([local, "--skip", "-1"]) == 2
