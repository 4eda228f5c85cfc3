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
                           "--reps", "1", "--variants", "--overrides", "hidden_size=32", "tie_word_embeddings=true"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads((out / "bench_rollout.json").read_text())
    (row,) = res["results"]
    assert row["engine"] == "hf" and row["batch"] == 8
    assert row["gen_tokens_per_s"] == 8 * 6 / row["gen_s"]
    assert row["level2_same_greedy"] == 1.0 and row["level2_logprob_max_diff"] == 0.0
    assert sorted(row["variants"]) == ["seeded, log-probs", "seeded, no log-probs", "unseeded, log-probs",
                                       "unseeded, no log-probs"]
    md = (out / "bench_rollout.md").read_text()
    assert "| hf | 8 |" in md and "| hf | unseeded, no log-probs |" in md and "100% (log-prob max diff 0.0e+00)" in md
