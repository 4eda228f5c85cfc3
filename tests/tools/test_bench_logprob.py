"""tools/bench_logprob.py on CPU: providers in their own processes, the rows-fraction sweep (the slime #1951
memory regime at toy size) and the peers' report of what does not import here."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

import bench_logprob as bl  # noqa: E402


def test_memory_sweep_over_row_fractions(tmp_path, capsys):
    out = tmp_path / "r.json"
    bl.main(["--T", "512", "--H", "32", "--V", "2000", "--reps", "0", "--device", "cpu", "--providers",
             "naive,naive_rows,fused_torch", "--rows-fraction", "0.1", "1.0", "--json", str(out), "--results",
             str(tmp_path)])
    res = json.loads(out.read_text())
    assert [s["rows_fraction"] for s in res["sweep"]] == [0.1, 1.0] and res["floor_ms"]["fwd"] is None
    for s in res["sweep"]:
        assert {k: v["status"] for k, v in s["results"].items()} == dict.fromkeys(
            ["naive", "naive_rows", "fused_torch"], "ok")
        assert "fwd_ms" not in s["results"]["naive"]  # --reps 0: memory only
    small, full = (s["results"] for s in res["sweep"])
    # gathering 10% of the rows first needs less than the logits of all 512 rows (4 MiB of fp32)
    assert small["naive_rows"]["peak_extra_mib"] < small["naive"]["peak_extra_mib"]
    assert "rows fraction 0.1: 51 rows" in capsys.readouterr().out
    # the kernel table: a row per provider and fraction, its peak as the report's
    table = {r["variant"]: r for r in map(json.loads, (tmp_path / "kernel.jsonl").read_text().splitlines())}
    assert len(table) == 6 and table["fused_torch, fp32, response fraction 1.0"]["metrics"]["peak_extra_mib"] == round(
        full["fused_torch"]["peak_extra_mib"], 4)
    assert {(r["shape"], r["device"]) for r in table.values()} == {("512x32x2000", "cpu")}


def test_timed_run_and_the_peer_report(tmp_path, capsys):
    out = tmp_path / "t.json"
    bl.main(["--T", "256", "--H", "32", "--V", "500", "--reps", "1", "--device", "cpu", "--providers", "naive,fused_torch",
             "--json", str(out), "--results", str(tmp_path)])
    res = json.loads(out.read_text())
    assert res["floor_ms"]["fwd"] > 0 and res["floor_ms"]["fwdbwd"] == 3 * res["floor_ms"]["fwd"]
    assert res["floor_ms"]["fwdbwd_4gemm"] > 0  # the four GEMMs back to back, timed as one unit
    # each provider is divided by the floors its own process timed right before it: those are its row's
    rows = {r["variant"]: r for r in map(json.loads, (tmp_path / "kernel.jsonl").read_text().splitlines())}
    for name, r in res["results"].items():
        assert r["fwd_ms"] > 0 and r["fwdbwd_ms"] > 0 and r["gemm_ms"] > 0 and r["gemm4_ms"] > 0
        m = rows[f"{name}, fp32"]["metrics"]
        assert (m["gemm_ms"], m["gemm4_ms"]) == (round(r["gemm_ms"], 4), round(r["gemm4_ms"], 4))
    assert bl.floors_of({"gemm_ms": 2.0}, 5.0, 7.0) == (2.0, 7.0)  # the shape's where a provider has none
    assert "x 4 GEMMs" in capsys.readouterr().out
    peers, unavailable = bl.load_peers()
    assert set(unavailable) | {p.split("_")[0] for p in peers} == {"liger", "cce", "verl"}  # each: in, or why not
    bl.main(["--list-peers"])
    assert "available:" in capsys.readouterr().out


def test_several_shapes_in_one_call_each_beside_its_floor_and_a_bad_shape_exits_2(tmp_path, capsys):
    out = tmp_path / "s.json"
    bl.main(["--shapes", "64x16", "96x8x300", "--V", "257", "--reps", "1", "--device", "cpu", "--providers",
             "fused_torch", "--json", str(out), "--results", str(tmp_path)])
    res = json.loads(out.read_text())["shapes"]
    assert [(r["config"]["T"], r["config"]["H"], r["config"]["V"]) for r in res] == [(64, 16, 257), (96, 8, 300)]
    assert all(r["floor_ms"]["fwd"] > 0 and r["results"]["fused_torch"]["status"] == "ok" for r in res)
    shapes = {json.loads(line)["shape"] for line in (tmp_path / "kernel.jsonl").read_text().splitlines()}
    assert shapes == {"64x16x257", "96x8x300"}
    try:
        bl.main(["--shapes", "64x0", "--device", "cpu"])
    except SystemExit as err:
        assert err.code == 2 and "--shapes '64x0'" in capsys.readouterr().err
    else:
        raise AssertionError("a bad --shapes entry must exit 2")
