"""tools/profile_step.py update (harness/update_profile.py): the per-category summary of a profiled update step
(synthetic GPU trace worked by hand, also through the command's --summarize; a real CPU profile of the tiny model)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

from harness.update_profile import CATEGORIES, summarize_trace, to_markdown  # noqa: E402


def _x(name, cat, ts, dur, tid=1, pid=1, corr=None):
    e = {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": pid, "tid": tid}
    if corr is not None:
        e["args"] = {"correlation": corr}
    return e


def _launch(corr, ts, tid=1):
    return _x("cudaLaunchKernel", "cuda_runtime", ts, 1, tid=tid, corr=corr)


def _kernel(name, ts, dur, corr, cat="kernel"):
    return _x(name, cat, ts, dur, pid=0, tid=7, corr=corr)


def test_gpu_trace_kernels_are_charged_by_stack_then_name_then_op(tmp_path, capsys):
    ev = [
        _x("rltrain::step", "user_annotation", 0, 1000),
        # torch's GPU-stream copy of the same range (measured on an H100: counted, it halved every per-step number)
        _x("rltrain::step", "gpu_user_annotation", 100, 820, pid=0, tid=7),
        _x("aten::mm", "cpu_op", 10, 20), _launch(1, 12), _kernel("nvjet_tst_128x256_64x4", 100, 200, 1),
        _x("aten::rms_norm", "cpu_op", 40, 10), _x("aten::_fused_rms_norm", "cpu_op", 41, 8), _launch(2, 42),
        _kernel("vectorized_layer_norm_kernel", 300, 50, 2),
        # backward on the autograd thread: the head's cuBLAS GEMM is charged to the head, not to GEMM
        _x("autograd::engine::evaluate_function: _FusedLinearLogprobBackward", "cpu_op", 200, 100, tid=2),
        _x("aten::addmm", "cpu_op", 210, 10, tid=2), _launch(3, 212, tid=2), _kernel("nvjet_tst_256x128", 400, 100, 3),
        _x("Optimizer.step#AdamW.step", "user_annotation", 500, 100), _x("aten::_fused_adamw_", "cpu_op", 510, 20),
        _launch(4, 511), _kernel("multi_tensor_apply_kernel", 600, 50, 4),
        _x("aten::mul", "cpu_op", 610, 5), _launch(5, 611), _kernel("vectorized_elementwise_kernel", 700, 20, 5),
        _x("aten::copy_", "cpu_op", 620, 5), _launch(6, 621), _kernel("Memcpy HtoD", 720, 10, 6, cat="gpu_memcpy"),
        _x("aten::scaled_dot_product_attention", "cpu_op", 630, 5), _launch(7, 631),
        _kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", 750, 100, 7),
        _x("c10d::allreduce_", "cpu_op", 640, 5), _launch(8, 641), _kernel("ncclDevKernel_AllReduce_Sum", 860, 40, 8),
        _x("cudaStreamSynchronize", "cuda_runtime", 650, 100), _x("cudaStreamSynchronize", "cuda_runtime", 950, 50),
        _x("aten::mul", "cpu_op", 1500, 5), _launch(9, 1501), _kernel("outside_the_step", 2000, 500, 9),
    ]
    s = summarize_trace({"traceEvents": ev})
    got = {r["category"]: r["ms"] for r in s["rows"]}
    want = {"GEMM": 0.2, "norms": 0.05, "LM head (log-prob/entropy)": 0.1, "optimizer": 0.05,
            "elementwise/reduce": 0.02, "copies/casts": 0.01, "attention": 0.1, "communication": 0.04,
            "idle": 0.43}
    assert set(got) == set(CATEGORIES)
    for k, v in want.items():
        assert got[k] == pytest.approx(v), k
    assert sum(r["share"] for r in s["rows"]) == pytest.approx(1.0)
    assert s["mode"] == "gpu" and s["steps"] == 1 and s["step_ms"] == pytest.approx(1.0)
    assert s["host_syncs_per_step"] == 1  # the second synchronize closes the step (the tool's own)
    assert s["top"][0]["name"] == "nvjet_tst_128x256_64x4" and s["top"][0]["category"] == "GEMM"
    with pytest.raises(ValueError, match="rltrain::step"):
        summarize_trace({"traceEvents": ev[1:]})
    # the command's --summarize prints the same table from the trace file
    import json

    import profile_step

    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    assert profile_step.main(["update", "--summarize", str(path)]) == 0
    assert capsys.readouterr().out.strip() == to_markdown(s, str(path)).strip()


def test_cpu_profile_of_the_tiny_update_gives_a_sane_table(tmp_path):
    from bench_update import Row, build_for_row
    from harness.update_profile import profile_train_step

    row = Row(name="tiny", preset="tiny", tokens=128, norms="fp32", optim="foreach")
    engine, mbs, loss_fn = build_for_row(row)
    s = profile_train_step(engine, mbs, loss_fn, out_dir=str(tmp_path), name="tiny", steps=1, warmup=1)
    got = {r["category"]: r for r in s["rows"]}
    assert s["mode"] == "cpu" and s["step_ms"] > 0
    for cat in ("GEMM", "attention", "LM head (log-prob/entropy)", "norms", "elementwise/reduce", "optimizer"):
        assert got[cat]["ms"] > 0 and got[cat]["count"] >= 1, cat
    assert got["communication"]["ms"] == 0
    assert sum(r["share"] for r in s["rows"]) == pytest.approx(1.0, abs=1e-6)
    assert s["host_syncs_per_step"] >= 1  # CPU: AdamW's step counters, the head's label checks
    md = (tmp_path / "profile_tiny.md").read_text()
    assert "| GEMM |" in md and "| idle |" in md and md == to_markdown(s | {"name": "tiny"}, "Profile: tiny")
    assert (tmp_path / "trace_tiny.json.gz").stat().st_size > 0 and (tmp_path / "profile_tiny.json").exists()


def test_rows_of_short_sequences_build_one_padded_micro_batch_like_the_grpo_update(tmp_path):
    from bench_update import Row, build_for_row
    from harness.update_profile import profile_train_step

    row = Row(name="tiny-rows", preset="tiny", tokens=130, seq_len=16)  # 8 rows of 16 (130 // 16), 2 left over
    assert row.rows_and_len == (8, 16)
    engine, mbs, loss_fn = build_for_row(row)
    assert [tuple(mb["input_ids"].shape) for mb in mbs] == [(8, 16)] and mbs[0]["seq_lens"].tolist() == [16] * 8
    s = profile_train_step(engine, mbs, loss_fn, out_dir=str(tmp_path), name="rows", steps=1, warmup=1)
    assert s["step_ms"] > 0 and {r["category"] for r in s["rows"] if r["ms"] > 0} >= {"GEMM", "attention"}
    with pytest.raises(ValueError, match="seq_len=200"):
        Row(name="bad", preset="tiny", tokens=130, seq_len=200).rows_and_len


def test_mfu_is_per_gpu_so_a_tp2_row_counts_both_gpus():
    from bench_update import mfu_per_gpu

    # the 4b-8k-mcore-tp2 row of the two-H200 run: 257.08 model TFLOP in 0.3403 s on two GPUs -> 38.2% each
    assert abs(mfu_per_gpu(257.08e12, 0.3403, 2) - 0.3819) < 1e-3
    assert mfu_per_gpu(1e12, 1.0, 1) == 2 * mfu_per_gpu(1e12, 1.0, 2)
