"""tools/driver_threads.py: an arm's summary on a worked record (selects' means, torch's OpenMP pool counted, the
steps kept), the e2e A/B of the tiny default under Ray at DP=2 (the arms' driver threads are what they name, every
select is timed, the phase split has the slicing), and bad input exits 2."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import driver_threads  # noqa: E402


def test_summary_of_a_worked_record():
    rec = {"device": "CPU", "torch_threads": 4, "frames": [["worker.py:1:wait", 9]],
           "selects": [[0.010, 0.009, 0, 3], [0.002, 0.002, 1, 0]],  # wall, CPU, voluntary, involuntary
           "threads": [{"tid": 1, "comm": "python", "py": "MainThread", "cpu_s": 5.0},
                       {"tid": 2, "comm": "python", "py": None, "cpu_s": 0.5},
                       {"tid": 3, "comm": "python", "py": None, "cpu_s": 0.25},
                       {"tid": 4, "comm": "gcs_client_io_s", "py": None, "cpu_s": 1.0}]}
    rows = [{"step": s, "timing_s/step": t} for s, t in ((1, 9.0), (2, 1.0), (3, 2.0))]
    s = driver_threads.summarize(rec, rows, skip=1)
    assert s["selects"] == 2 and s["torch_threads"] == 4
    assert s["select_wall_ms"] == pytest.approx(6.0) and s["select_cpu_ms"] == pytest.approx(5.5)
    assert s["select_ivcsw"] == pytest.approx(1.5) and s["select_vcsw"] == pytest.approx(0.5)
    assert s["select_wall_ms_max"] == pytest.approx(10.0)
    assert (s["pool_threads"], s["pool_cpu_s"], s["main_cpu_s"]) == (2, pytest.approx(0.75), 5.0)
    assert s["step_s"] == pytest.approx(1.5) and s["steps"] == 2 and s["split"] == {}
    empty = driver_threads.summarize({**rec, "selects": []}, [], skip=0)  # a run that never sliced (one rank)
    assert empty["selects"] == 0 and empty["select_wall_ms"] == 0.0 and empty["step_s"] is None


def test_ab_of_the_tiny_default_under_ray(tmp_path, capsys):
    out = tmp_path / "ab"
    rc = driver_threads.main(["--out", str(out), "--timeout", "240", "--", "trainer.use_ray=true",
                              "trainer.n_gpus_per_node=2", "trainer.total_steps=2", "trainer.progress_bar=false",
                              "trainer.plots=false", "trainer.logger=[console,jsonl]", "trainer.num_cpus=2"])
    assert rc == 0, capsys.readouterr()
    res = json.loads((out / "driver_threads.json").read_text())
    one, per_core = res["arms"]["one"], res["arms"]["per-core"]
    default = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                             capture_output=True, text=True, check=True).stdout
    assert one["torch_threads"] == 1 and per_core["torch_threads"] == int(default)  # torch's own, untouched
    for arm in (one, per_core):
        # DP=2: each batch phase (old log-probs, update) slices the batch once a step, over two ranks
        assert arm["selects"] >= 2 * 2 and arm["select_wall_ms"] > 0 and arm["select_cpu_ms"] >= 0
        assert arm["steps"] == 1 and arm["step_s"] > 0
        assert {"old_log_prob", "update_actor"} <= set(arm["split"])
        assert arm["split"]["update_actor"]["slice"] >= 0 and "slice_cpu" in arm["split"]["update_actor"]
    md = (out / "driver_threads.md").read_text()
    assert "| one | 1 |" in md and "| update_actor |" in md


def test_bad_input_exits_2(tmp_path, capsys):
    assert driver_threads.main(["--out", str(tmp_path), "--arms", "two"]) == 2
    assert "--arms takes one and/or per-core, got two" in capsys.readouterr().err
    assert driver_threads.main(["--out", str(tmp_path), "--skip", "-1"]) == 2
    assert "--skip must be >= 0" in capsys.readouterr().err
    assert driver_threads.main(["--out", str(tmp_path), "--arms", "one", "--", "trainer.no_such_key=1"]) == 2
    assert "arm one's run failed (rc 2" in capsys.readouterr().err
    assert driver_threads.main(["--child", "one"]) == 2
