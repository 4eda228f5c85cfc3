"""tools/gpu_placements.py's pure parts: which vLLM layout each placement gets, and the log check that fails a
run using NVLink multicast (the devices' hosts are shared). The runs themselves need GPUs (docs/vllm.md)."""

import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import gpu_placements as gp  # noqa: E402


def test_vllm_tp_is_the_colocated_groups_gpus_and_one_when_split():
    assert gp.engine_overrides("hf", "colocated_tp2") == []
    assert gp.engine_overrides("vllm", "colocated_tp2") == ["rollout=vllm", "rollout.tensor_parallel_size=2"]
    # grpo_tiny's model (head_dim 16) gets the head_dim vLLM TP > 1 starts with on GPUs; TP=1 keeps its own
    assert gp.engine_overrides("vllm", "colocated_tp2", tiny=True)[-1] == "+model.overrides.head_dim=64"
    assert gp.engine_overrides("vllm", "split_1p1", tiny=True) == ["rollout=vllm", "rollout.tensor_parallel_size=1"]
    assert gp.engine_overrides("vllm", "split_2p2", tiny=True)[-1] == "+model.overrides.head_dim=64"
    assert gp.engine_overrides("vllm", "colocated_dp2")[-1] == "rollout.tensor_parallel_size=2"
    # issue 35: the same two GPUs with one TP=1 engine each (tiny: grpo_tiny's own head_dim)
    assert gp.engine_overrides("vllm", "colocated_dp2_tp1", tiny=True) == ["rollout=vllm",
                                                                          "rollout.tensor_parallel_size=1"]
    assert gp.PLACEMENTS["colocated_dp2_tp1"] == gp.PLACEMENTS["colocated_dp2"]
    assert gp.engine_overrides("vllm", "split_1p1")[-1] == "rollout.tensor_parallel_size=1"
    assert gp.engine_overrides("vllm", "colocated_tp2pp2dp2")[-1] == "rollout.tensor_parallel_size=8"
    # four GPUs: colocated, one engine over the four, or two TP=2 engines (docs/benchmarks/placements.md's layout); split, one
    # engine over the rollout group's two GPUs (workers/rollout.py builds one engine per group)
    assert gp.engine_overrides("vllm", "colocated_tp2dp2")[-1] == "rollout.tensor_parallel_size=4"
    assert gp.engine_overrides("vllm", "colocated_tp2dp2_r2") == ["rollout=vllm", "rollout.tensor_parallel_size=2"]
    assert gp.engine_overrides("vllm", "split_2p2") == ["rollout=vllm", "rollout.tensor_parallel_size=2"]


def _args(*placements: str, model: str = "qwen3-4b", overrides=(), only=("qwen06b",)):
    import argparse

    return argparse.Namespace(only=list(only), placements=list(placements), engine="vllm", model=model,
                              overrides=list(overrides), learn_steps=150, qwen_steps=4)


def test_the_four_gpu_device_call_passes_the_trainers_checks_on_h100_and_h200():
    """The runs of docs/benchmarks/placements.md's device call, through check_config and the
    trainer's plan_check (a refusal on the GPU would waste the call): accepted for 79.18 GiB (H100) and
    139.8 GiB (H200) GPUs. Without the 8k-token micro-batch and with 512-token responses, the split run's training
    GPUs are refused on an H100 (full 16k-token micro-batches of 517-token rows; at the run's own 69-token rows, the
    planned lengths of the data, its 8,832-token mini-batches fit)."""
    cap = ["actor.max_tokens_per_micro_batch=8192"]
    for gib in (79.18, 139.8):
        rows = gp.check_runs(_args("colocated_tp2dp2", "split_2p2", overrides=cap), gib)
        assert [(r["run"], r["error"]) for r in rows] == [("qwen06b/colocated_tp2dp2", None),
                                                          ("qwen06b/split_2p2", None)]
        coloc, split = (r["plan"]["layout"] for r in rows)
        assert (coloc["gpus"], coloc["tp"], coloc["dp"], coloc["rollout_tp"]) == (4, 2, 2, 4)
        assert (split["gpus"], split["tp"], split["rollout_tp"], split["rollout_replicas"]) == (2, 2, 2, 1)
    [fits] = gp.check_runs(_args("split_2p2"), 79.18)
    assert fits["error"] is None and fits["plan"]["lengths"]["prompt_tokens"] == 5
    [refused] = gp.check_runs(_args("split_2p2", overrides=["rollout.max_response_length=512"]), 79.18)
    assert refused["error"].startswith("trainer.plan_check refuses it: GPU 0 (actor, ref) does not fit")
    # a config the trainer refuses before planning: a vLLM engine of 8 GPUs on a colocated group of four
    [bad] = gp.check_runs(_args("colocated_tp2dp2", overrides=["rollout.tensor_parallel_size=8"]), 139.8)
    assert "rollout.tensor_parallel_size=8 must divide trainer.n_gpus_per_node=4" in bad["error"]
    assert bad["plan"] is None


def test_the_one_engine_per_gpu_device_call_passes_the_trainers_checks():
    """Issue 35's two-GPU runs (docs/vllm.md): the Qwen3-0.6B steps on one GPU and on two with a TP=1 engine each
    (at the default batch and at 64 prompts), and grpo_tiny's learning run, accepted on H100 and H200 GPUs; the
    plan has two replicas of TP 1."""
    for gib in (79.18, 139.8):
        for extra in ([], ["data.train_batch_size=64"]):
            rows = gp.check_runs(_args("single", "colocated_dp2_tp1", model="qwen3-0.6b", overrides=extra), gib)
            assert [r["error"] for r in rows] == [None, None], rows
            two = rows[1]["plan"]["layout"]
            assert (two["gpus"], two["dp"], two["rollout_tp"], two["rollout_replicas"]) == (2, 2, 1, 2)
        [learn] = gp.check_runs(_args("colocated_dp2_tp1", model="qwen3-0.6b", only=["learn"]), gib)
        assert learn["error"] is None and "rollout.tensor_parallel_size=1" in learn["overrides"]


def test_a_log_naming_mnnvl_fails_the_row_and_pynccl_is_recorded():
    log = ("INFO [pynccl.py] vLLM is using nccl==2.28\n"
           "INFO [cuda_communicator.py] Using ['PYNCCL'] all-reduce backends\n")
    assert gp.log_checks(log) == {"mnnvl_lines": [], "pynccl_all_reduce": True}
    bad = log + "INFO Initialized FlashInfer Allreduce norm fusion workspace with backend=mnnvl\n"
    checks = gp.log_checks(bad)
    assert checks["mnnvl_lines"] == ["INFO Initialized FlashInfer Allreduce norm fusion workspace with backend=mnnvl"]
    run = {"rc": 0, "seconds": 1.0, "command": "c", "log_checks": checks, "log_tail": "",
           "rows": [{"step": 0, "val/accuracy": 0.0}, {"step": 10, "val/accuracy": 0.9}]}
    assert gp.learn_summary(run)["learned"] is False  # learned, but on multicast: not a pass
    assert gp.learn_summary({**run, "log_checks": gp.log_checks(log)})["learned"] is True
    res = {"date": "d", "device": "x", "torch": "t", "command": "c", "learn": {"colocated_tp2": gp.learn_summary(run)}}
    assert "learn/colocated_tp2: MNNVL FOUND, PYNCCL all-reduce" in gp.to_markdown(res)


def test_step_means_leave_out_the_warm_up_steps():
    """Worked example: steps 1 and 2 are warm-up when four or more ran (colocated TP=2's second step was 2.4x its
    third on two H200s), step 1 alone when fewer; peak memory is the max over every step."""
    def row(step, gen, mem):
        return {"step": step, "timing_s/gen": gen, "timing_s/step": 2 * gen, "perf/throughput": 100.0 * step,
                "perf/max_memory_allocated_gb/hybrid_rank0": mem, "rollout/logprob_diff_max": 0.01}

    run = {"rc": 0, "seconds": 1.0, "command": "c", "log_checks": gp.log_checks(""), "log_tail": "",
           "rows": [row(0, 0.0, 0.0), row(1, 9.0, 5.0), row(2, 4.0, 7.0), row(3, 1.0, 6.0), row(4, 2.0, 6.0)]}
    out = gp.step_summary(run)
    assert out["timing_s"]["gen"] == 1.5 and out["timing_s"]["step"] == 3.0 and out["throughput_tok_s"] == 350.0
    assert out["peak_gib_per_gpu"] == {"hybrid_rank0": 7.0} and out["steps"] == 4
    three = gp.step_summary({**run, "rows": run["rows"][:4]})  # steps 1-3: only step 1 is left out
    assert three["timing_s"]["gen"] == 2.5


def test_per_process_tails_keep_each_ray_workers_last_lines():
    text = "\n".join(["driver line 1",
                      "\x1b[36m(HybridWorker pid=11)\x1b[0m INFO rank0 a",
                      "(HybridWorker pid=12) INFO rank1 a",
                      *[f"\x1b[36m(HybridWorker pid=11)\x1b[0m capture {i}" for i in range(50)],
                      "driver line 2"])
    tails = gp.process_tails(text, lines=3)
    assert set(tails) == {"driver", "HybridWorker pid=11", "HybridWorker pid=12"}
    assert tails["HybridWorker pid=12"] == "(HybridWorker pid=12) INFO rank1 a"  # not crowded out by rank 0
    assert tails["HybridWorker pid=11"].splitlines()[-1].endswith("capture 49")
    assert tails["driver"] == "driver line 1\ndriver line 2"


HANGS = """
import sys, threading, time
sys.path.insert(0, sys.argv[1])
from rltrain.utils.stacks import enable_stack_dumps
enable_stack_dumps()
def wait_for_a_peer_that_never_comes():
    time.sleep(60)
threading.Thread(target=wait_for_a_peer_that_never_comes, daemon=True).start()
print("ready", flush=True)
time.sleep(60)
"""


def test_a_hung_process_prints_every_threads_stack_on_the_dump_signal_and_keeps_running():
    import subprocess
    import time

    proc = subprocess.Popen([sys.executable, "-c", HANGS, ROOT], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert gp.dump_stacks([proc.pid, 2**22 + 12345]) == 1  # a pid that does not exist is skipped
        time.sleep(1.0)
        assert proc.poll() is None  # still running after the dump
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert "in wait_for_a_peer_that_never_comes" in err and "Current thread" in err  # both threads


def test_stack_dumps_set_up_when_stderr_has_no_file_descriptor(monkeypatch):
    import io

    from rltrain.utils.stacks import enable_stack_dumps

    monkeypatch.setattr(sys, "stderr", io.StringIO())  # as pytest's capture and some notebooks replace it
    assert enable_stack_dumps() is True
    monkeypatch.setattr(sys, "__stderr__", None)  # pythonw-like: no stderr at all
    assert enable_stack_dumps() is False


def test_run_timeout_defaults_by_the_runs_model_and_an_explicit_one_wins():
    import argparse

    ns = lambda **kw: argparse.Namespace(**{"run_timeout": None, "model": "qwen3-0.6b", **kw})  # noqa: E731
    assert gp.run_timeout_s(ns(), "qwen06b") == 240.0
    # a 4B run on a fresh machine spent 166-244 s before vLLM's first line (2026-11-26)
    assert gp.run_timeout_s(ns(model="qwen3-4b"), "qwen06b") == 480.0
    assert gp.run_timeout_s(ns(model="qwen3-4b"), "learn") == 240.0  # grpo_tiny's own model
    assert gp.run_timeout_s(ns(model="qwen3-4b", run_timeout=90.0), "qwen06b") == 90.0


def test_a_finished_run_is_a_results_row_the_planner_reads():
    """table_row: the qwen06b section's GRPO steps as a "step" row of the placements table (the means of the steps
    after the two warm-up ones, the memory counters' maxima: training GPUs apart from the rollout's), an MoE run's in
    the moe table, a learning run's accuracy; tools/planlab reads the step row back as the planner's quantities."""
    import argparse

    from planlab.cases import case_of

    rows = [{"step": s, "timing_s/gen": 0.5 + s, "timing_s/old_log_prob": 0.2, "timing_s/ref": 0.1,
             "timing_s/update_actor": 0.3, "timing_s/update_weights": 0.2, "timing_s/rollout_sleep": 0.05,
             "timing_s/step": 1.5 + s, "prompt_length/mean": 5.0, "response_length/mean": 64.0,
             "perf/max_memory_allocated_gb/actor0": 20.0 + s, "perf/max_memory_allocated_gb/rollout0": 60.0,
             "perf/max_memory_reserved_gb/actor0": 25.0} for s in range(1, 6)]
    run = {"rc": 0, "rows": rows, "seconds": 90.0}
    over = ["model=qwen3_0.6b_random", "trainer.n_gpus_per_node=2", "trainer.colocate=false", "rollout=vllm"]
    args = argparse.Namespace(device="cpu", tag="probed host", model="qwen3-0.6b")
    area, row = gp.table_row("qwen06b", "split_1p1", run, over, args)
    assert area == "placements" and row["variant"] == "split_1p1 (probed host)" and row["scope"] == "step"
    m = row["metrics"]
    assert m["timing_s/gen"] == (3.5 + 4.5 + 5.5) / 3  # steps 3..5: the first two warm up
    assert (m["perf/max_memory_allocated_gb"], m["perf/max_memory_allocated_gb/rollout"]) == (25.0, 60.0)
    c = case_of(row)
    assert c.measured["weight_sync_s"] == pytest.approx(0.25) and c.measured["rollout_allocator_peak_gib"] == 60.0
    assert c.lengths == {"prompt_tokens": 5, "response_tokens": 64} and c.overrides == over
    assert gp.table_row("qwen06b", "colocated_dp2", run, [*over, "actor.expert_parallel_size=2"], args)[0] == "moe"
    learn = [{"step": 0, "val/accuracy": 0.1}, {"step": 50, "val/accuracy": 0.6}]
    area, row = gp.table_row("learn", "split_1p1", {"rc": 0, "rows": learn, "seconds": 30.0}, over, args)
    assert area == "placements" and row["metrics"]["gain"] == 0.5 and "scope" not in row
    assert gp.table_row("qwen06b", "split_1p1", {"rc": 1, "rows": rows, "seconds": 1.0}, over, args) is None
