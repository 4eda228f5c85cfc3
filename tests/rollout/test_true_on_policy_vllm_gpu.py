"""rollout.true_on_policy with the vLLM engine on a GPU: one forward of the Megatron actor gives every token vLLM
sampled the very log-prob vLLM reported (tools/bench_true_on_policy.py --check, in a process of its own: vLLM's
batch-invariant mode is process-wide). Skips without CUDA or vLLM."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.gpu
@pytest.mark.timeout(900)
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
                    reason="needs a CUDA GPU and vLLM")
def test_actor_forward_equals_vllm_sampler_logprobs(tmp_path):
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench_true_on_policy.py"), "--check",
                           "--out", str(tmp_path),
                           "--prompts", "16", "--n", "4", "--max-tokens", "48"],
                          cwd=REPO, capture_output=True, text=True, timeout=850)
    path = tmp_path / "true_on_policy_check.json"
    assert path.exists(), proc.stderr[-4000:]
    got = json.loads(path.read_text())
    assert got["decode_vs_actor"]["tokens"] > 0
    assert got["decode_vs_actor"]["max"] == 0.0, {k: got.get(k) for k in ("decode_vs_actor", "prefill_vs_actor",
                                                                      "decode_vs_prefill")}
    assert got["chunked_vs_actor"]["tokens"] > 0 and got["chunked_vs_actor"]["max"] == 0.0, got["chunked_vs_actor"]
