"""tools/gpu_placements.py's pure parts: which vLLM layout each placement gets, and the log check that fails a
run using NVLink multicast (the devices' hosts are shared). The runs themselves need GPUs (docs/vllm.md)."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import gpu_placements as gp  # noqa: E402


def test_vllm_tp_is_the_colocated_groups_gpus_and_one_when_split():
    assert gp.engine_overrides("hf", "colocated_tp2") == []
    assert gp.engine_overrides("vllm", "colocated_tp2") == ["rollout=vllm", "rollout.tensor_parallel_size=2"]
    assert gp.engine_overrides("vllm", "colocated_dp2")[-1] == "rollout.tensor_parallel_size=2"
    assert gp.engine_overrides("vllm", "split_1p1")[-1] == "rollout.tensor_parallel_size=1"
    assert gp.engine_overrides("vllm", "colocated_tp2pp2dp2")[-1] == "rollout.tensor_parallel_size=8"


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
