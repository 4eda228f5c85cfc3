"""trainer.profile_steps: a torch-profiler trace of the chosen steps per worker, each phase a range, summed by
tools/profile_step.py; bad step numbers are refused naming the key."""

import importlib.util
import os

import pytest

from rltrain.config import ConfigError
from rltrain.trainer.ppo import PPOTrainer

TOOLS = os.path.join(os.path.dirname(__file__), "..", "..", "tools")
ONE = ("data.train_batch_size=4", "actor.ppo_mini_batch_size=2", "trainer.use_ray=false", "trainer.test_freq=-1",
       "trainer.logger=[jsonl]", "trainer.plots=false", "actor.use_kl_loss=true")


def _tool():
    spec = importlib.util.spec_from_file_location("profile_step", os.path.join(TOOLS, "profile_step.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_profiled_step_writes_a_trace_whose_phases_the_tool_sums(tmp_path, cfg_for, capsys):
    trainer = PPOTrainer(cfg_for(*ONE, "trainer.total_steps=2", "trainer.profile_steps=[2]"), str(tmp_path / "run"))
    try:
        m1 = trainer.train_step(1)
        assert not os.path.exists(tmp_path / "run" / "profile")  # step 1 is not profiled
        m2 = trainer.train_step(2)
    finally:
        trainer._finish(export=False)
    assert "perf/profiled" not in m1 and m2["perf/profiled"] == 1.0
    path = tmp_path / "run" / "profile" / "step2" / "trace_local_rank0.json.gz"
    assert path.is_file()
    assert "1 trace(s)" in capsys.readouterr().out
    tool = _tool()
    trace = tool.load_trace(str(path))
    # the phases the colocated step ran in the worker, in order (the hf engine on CPU: sleep and wake-up too)
    assert tool.phase_names(trace) == ["generate", "rollout_sleep", "old_log_prob", "ref", "update_actor",
                                       "rollout_wake_up", "weight_sync_send"]
    rows = {r["phase"]: r for r in tool.summarize(trace)}
    upd = rows["update_actor"]
    assert upd["calls"] == 1 and upd["busy"] is None  # CPU: op self times, no GPU share
    # an update's time sits in its ops: the GEMMs and the rest sum to at most its wall time (the rest is idle)
    assert 0 < upd["cat"]["GEMM"] <= upd["ms"]
    assert sum(upd["cat"].values()) == pytest.approx(upd["ms"], rel=1e-6)
    # the wall time per phase is the range's own: the update outlasts the reference's forward-only pass
    assert upd["ms"] > rows["ref"]["ms"] > 0
    out = tmp_path / "report.md"
    assert tool.main([str(tmp_path / "run" / "profile"), "--out", str(out)]) == 0
    text = out.read_text()
    assert "trace_local_rank0.json.gz" in text and "| update_actor | 1 |" in text


def test_a_trace_that_cannot_be_written_is_reported_and_the_run_goes_on(tmp_path, cfg_for, capsys):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the profile directory should go")
    trainer = PPOTrainer(cfg_for(*ONE, "trainer.total_steps=2", "trainer.profile_steps=[1,2]",
                                 f"trainer.profile_dir={blocker}"), str(tmp_path / "run"))
    try:
        m1 = trainer.train_step(1)
        m2 = trainer.train_step(2)  # the profiler stopped after the failed write: step 2 profiles again
    finally:
        trainer._finish(export=False)
    err = capsys.readouterr().err
    assert err.count("profiler traces of the local workers were not written") == 2, err
    assert m1["perf/profiled"] == m2["perf/profiled"] == 1.0 and "actor/pg_loss" in m2


def test_profiling_is_off_by_default_and_leaves_no_files(tmp_path, cfg_for):
    trainer = PPOTrainer(cfg_for(*ONE, "trainer.total_steps=1"), str(tmp_path / "run"))
    try:
        m = trainer.train_step(1)
    finally:
        trainer._finish(export=False)
    assert "perf/profiled" not in m and not os.path.exists(tmp_path / "run" / "profile")


@pytest.mark.parametrize("steps", ["[0]", "[3]", "[1,5]"])
def test_profile_steps_outside_the_run_are_refused(cfg_for, steps):
    with pytest.raises(ConfigError, match=r"trainer\.profile_steps=.*from 1 to trainer\.total_steps=2"):
        cfg_for("trainer.total_steps=2", f"trainer.profile_steps={steps}")


def test_the_tool_names_a_directory_without_traces(tmp_path):
    with pytest.raises(SystemExit, match="trainer.profile_steps"):
        _tool().main([str(tmp_path)])


def test_allocator_calls_are_counted_inside_the_phase_ranges_per_call():
    """A worked trace: two update ranges, cudaMalloc / cudaFree calls inside and outside them (and the GPU-side copy
    of a range, which must not count twice)."""
    tool = _tool()

    def x(name, cat, ts, dur):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": 1}

    rng = "rltrain::phase/update_actor"
    trace = {"traceEvents": [
        x(rng, "user_annotation", 100, 100), x(rng, "gpu_user_annotation", 100, 100),
        x(rng, "user_annotation", 400, 50),
        x("cudaMalloc", "cuda_runtime", 120, 5000.0), x("cudaMalloc", "cuda_runtime", 150, 3000.0),
        x("cudaFree", "cuda_runtime", 180, 2000.0),
        x("cudaMalloc", "cuda_runtime", 410, 1000.0), x("cudaMalloc", "cuda_runtime", 420, 1000.0),
        x("cudaMalloc", "cuda_runtime", 300, 9000.0),  # between the two ranges: not the phase's
        x("cudaFree", "cuda_runtime", 90, 9000.0),  # before the first range
    ]}
    got = tool.allocator_calls(trace, rng)
    assert got["cudaMalloc"] == (2.0, pytest.approx(5.0))  # 4 calls, (5 + 3 + 1 + 1) ms, over 2 ranges
    assert got["cudaFree"] == (0.5, pytest.approx(1.0))
    assert tool.allocator_calls(trace, "rltrain::phase/ref") == {"cudaMalloc": (0, 0.0), "cudaFree": (0, 0.0)}
