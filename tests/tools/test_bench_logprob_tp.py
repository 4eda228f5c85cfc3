"""tools/bench_logprob_tp.py on CPU: two gloo ranks of the torch backend, the vocabulary split in two, timed beside
the whole-vocabulary run on rank 0 and compared value for value; its row in the kernel table; bad arguments exit 2."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import bench_logprob_tp as tp  # noqa: E402


def test_two_gloo_ranks_match_one_device_and_write_their_row(tmp_path, capsys):
    out = tmp_path / "tp.json"
    # V = 2 x 301 (odd shards), fp32: the shards' log-sum-exp combine differs from one device by rounding only
    rc = tp.main(["--T", "37", "--H", "16", "--V", "602", "--tp", "2", "--dtype", "fp32", "--device", "cpu",
                  "--providers", "fused_torch", "--reps", "1", "--json", str(out), "--results", str(tmp_path)])
    assert rc == 0, capsys.readouterr()
    r = json.loads(out.read_text())["results"]["fused_torch"]
    assert r["status"] == "ok" and all(r[k] > 0 for k in ("fwd_ms", "fwdbwd_ms", "gemm_ms", "gemm4_ms",
                                                           "tp1_fwd_ms", "tp1_fwdbwd_ms"))
    assert r["lp_max_abs_diff"] < 1e-5 and r["ent_max_abs_diff"] < 1e-5 and r["dweight_rel_l2"] < 1e-5, r
    (row,) = [json.loads(line) for line in (tmp_path / "kernel.jsonl").read_text().splitlines()]
    assert (row["tool"], row["shape"], row["device"], row["variant"]) == (
        "bench_logprob_tp", "37x16x602", "cpu", "fused_torch, TP=2, fp32")
    assert row["metrics"]["lp_max_abs_diff"] == round(r["lp_max_abs_diff"], 6)
    assert "max |diff| against TP=1" in capsys.readouterr().out


@pytest.mark.parametrize("argv, says", [
    (["--providers", "liger_flce"], "--providers liger_flce"),
    (["--tp", "1"], "--tp 1: at least 2"),
    (["--V", "601"], "not a multiple of --tp 2"),
])
def test_bad_arguments_exit_2_naming_them(argv, says, capsys):
    assert tp.main(["--device", "cpu", *argv]) == 2
    assert says in capsys.readouterr().err
