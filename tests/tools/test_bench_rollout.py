"""tools/bench_rollout.py on CPU with the hf engine (vLLM's rows need the vllm package and are covered by its
own tests): the table has every row and the colocated sleep(2) + wake + sync cycle gives back the same greedy
tokens and log-probs, on a tied-embedding model (the case the GPU run found broken)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_hf_rows_with_sampling_variants_and_the_colocated_cycle(tmp_path):
    out = tmp_path / "b"
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_rollout.py"), "--out", str(out), "--engines",
                           "hf", "--device", "cpu", "--batch", "8", "--prompt-len", "5", "--response-len", "6",
                           "--reps", "1", "--variants", "--profile", "--overrides", "hidden_size=32",
                           "tie_word_embeddings=true", "--results", str(tmp_path / "results")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((out / "bench_rollout.json").read_text())
    (row,) = res["results"]
    assert row["engine"] == "hf" and row["batch"] == 8
    assert row["gen_tokens_per_s"] == 8 * 6 / row["gen_s"]
    assert row["level2_same_greedy"] == 1.0 and row["level2_logprob_max_diff"] == 0.0
    assert sorted(row["variants"]) == ["seeded, log-probs", "seeded, no log-probs", "unseeded, log-probs",
                                       "unseeded, no log-probs"]
    prof = row["host_profile"]  # one more generate under cProfile: the hf engine's time is rltrain's and torch's
    assert prof["profiled_s"] > 0 and abs(sum(prof["areas"].values()) - prof["profiled_s"]) < 1e-9
    assert any(r["function"].startswith("rltrain/rollout/hf.py") for r in prof["top_cumtime"])
    assert "| area | s | share |" in (out / "profile_hf.md").read_text()
    md = (out / "bench_rollout.md").read_text()
    assert "| hf | 8 |" in md and "| hf | unseeded, no log-probs |" in md and "100% (log-prob max diff 0.0e+00)" in md
    (table,) = [json.loads(line) for line in (tmp_path / "results" / "rollout.jsonl").read_text().splitlines()]
    assert (table["variant"], table["device"]) == ("hf alone, 8 x (5 + 6)", "cpu") and "scope" not in table
    assert table["metrics"]["gen_s"] == round(row["gen_s"], 4)
    assert table["metrics"]["unseeded, no log-probs/gen_s"] == round(row["variants"]["unseeded, no log-probs"]["gen_s"], 4)


def test_host_profile_counts_calls_and_charges_areas_by_file():
    sys.path.insert(0, str(ROOT / "tools"))
    from harness.host_profile import area_of, profile_call

    def leaf(n):
        return sum(range(n))

    def outer():
        return [leaf(20_000) for _ in range(3)]

    result, prof = profile_call(outer)
    assert result == [sum(range(20_000))] * 3
    (row,) = [r for r in prof["top_cumtime"] if r["function"].endswith("(leaf)")]
    assert row["calls"] == 3 and row["area"] == "other python"
    assert 0 < prof["profiled_s"] <= prof["wall_s"] * 1.5
    assert area_of("/x/site-packages/vllm/v1/core/sched/scheduler.py") == "vllm scheduler"
    assert area_of("/x/site-packages/vllm/v1/engine/output_processor.py") == "vllm output processing (frontend)"
    assert area_of("/x/site-packages/vllm/v1/engine/core.py") == "vllm engine core / client"
    assert area_of("~") == "builtins / C calls"


def test_gpu_smoke_profiles_only_the_chosen_generate_call_and_restores_the_method(monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_smoke

    from rltrain.workers.rollout import RolloutRole

    seen = []

    def fake_generate(self, prompts, *, validate=False):
        seen.append(prompts)
        return sum(range(10_000 * prompts))

    monkeypatch.setattr(RolloutRole, "generate", fake_generate)
    into: dict = {}
    with gpu_smoke._profiled_generation(2, into):
        results = [RolloutRole.generate(None, k, validate=False) for k in (1, 2, 3)]
    assert results == [sum(range(10_000 * k)) for k in (1, 2, 3)] and seen == [1, 2, 3]
    assert RolloutRole.generate is fake_generate  # put back
    fns = {r["function"].rsplit("(", 1)[1]: r["calls"] for r in into["summary"]["top_cumtime"]}
    assert fns.get("fake_generate)") == 1  # only the second call ran under the profiler
