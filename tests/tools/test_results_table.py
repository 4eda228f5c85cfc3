"""tools/harness/results.py: the per-area results tables. A rerun replaces its row (same tool, shape, device and
variant) and leaves the others; the file stays sorted by key; the merge command upserts a run's files."""

import json
import os
import subprocess
import sys

import pytest

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools")
sys.path.insert(0, TOOLS)

from harness import results  # noqa: E402


def _row(variant: str, step_s: float, device: str = "h200") -> dict:
    return results.row("bench_update", "qwen3-0.6b", device, variant, {"step_s": step_s}, date="2026-11-28",
                       config=["actor.max_tokens_per_micro_batch=8192"])


def test_a_rerun_replaces_its_row_and_keeps_the_others(tmp_path):
    d = str(tmp_path)
    assert results.upsert("update", [_row("8k", 0.20), _row("32k", 1.10), _row("8k", 0.25, "h100")], d) == 0
    assert results.upsert("update", [_row("8k", 0.18)], d) == 1  # the H200 8k row again
    rows = results.read("update", d)
    assert [(r["device"], r["variant"], r["metrics"]["step_s"]) for r in rows] == [
        ("h100", "8k", 0.25), ("h200", "32k", 1.10), ("h200", "8k", 0.18)]  # sorted by key, the rerun's value
    lines = (tmp_path / "update.jsonl").read_text().splitlines()
    assert list(json.loads(lines[0])) == ["tool", "shape", "device", "variant", "date", "config", "metrics"]
    assert not list(tmp_path.glob("*.tmp"))


def test_rows_without_a_key_or_of_an_unknown_area_are_refused(tmp_path):
    with pytest.raises(ValueError, match="missing variant"):
        results.upsert("update", [{"tool": "t", "shape": "s", "device": "cpu", "metrics": {}}], str(tmp_path))
    with pytest.raises(ValueError, match="unknown results area 'speed'"):
        results.table_path("speed")
    (tmp_path / "kernel.jsonl").write_text('{"tool": "x"}\nnot json\n')
    with pytest.raises(ValueError, match=r"kernel.jsonl:2: not a JSON row"):
        results.read("kernel", str(tmp_path))


def test_device_kind():
    assert results.device_kind("NVIDIA H200", 2) == "h200x2" == results.device_kind("2 x NVIDIA H200")
    assert results.device_kind("NVIDIA H100 80GB HBM3") == "h100"
    assert results.device_kind("CPU (AMD EPYC 9654, 2 cores)") == "cpu"


def test_merge_upserts_a_runs_files_into_the_tables(tmp_path):
    out = tmp_path / "out"
    results.upsert("moe", [_row("ep2", 4.2)], str(out))
    repo = tmp_path / "repo"
    results.upsert("moe", [_row("ep2", 5.0), _row("ep1", 9.0)], str(repo))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from harness import results; "
            "results.DEFAULT_DIR = sys.argv[2]; sys.exit(results.main(sys.argv[3:]))")
    r = subprocess.run([sys.executable, "-c", code, TOOLS, str(repo), "merge", str(out / "moe.jsonl")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "1 rows" in r.stdout and "(1 replaced)" in r.stdout
    assert {r["variant"]: r["metrics"]["step_s"] for r in results.read("moe", str(repo))} == {"ep1": 9.0, "ep2": 4.2}
    bad = subprocess.run([sys.executable, "-c", code, TOOLS, str(repo), "merge", str(tmp_path / "speed.jsonl")],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown results area 'speed'" in bad.stderr


def test_markdown_lists_the_rows_by_key_with_the_chosen_metrics():
    rows = [_row("8k", 0.145), _row("32k", 1.121)]
    rows[1]["metrics"]["mfu"] = 0.439
    assert results.markdown(rows, ["step_s", "mfu"]).splitlines() == [
        "| tool | shape | device | variant | date | step_s | mfu |", "|---|---|---|---|---|---|---|",
        "| bench_update | qwen3-0.6b | h200 | 32k | 2026-11-28 | 1.121 | 0.439 |",
        "| bench_update | qwen3-0.6b | h200 | 8k | 2026-11-28 | 0.145 |  |"]
