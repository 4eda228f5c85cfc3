"""Tests for the vllm engine adapter: the missing-vllm message, the translation of params/outputs,
weight bucketing; end-to-end checks against the hf engine run only where vllm and a GPU exist."""

from __future__ import annotations

import importlib.util
import sys
from types import SimpleNamespace

import pytest
import torch

from rltrain.rollout import SamplingParams, build_engine
from rltrain.rollout.vllm import VLLMEngine, response_from_completion, vllm_sampling_kwargs, weight_buckets


def test_missing_vllm_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"pip install 'rltrain\[vllm\]'"):
        VLLMEngine("Qwen/Qwen3-0.6B")
    with pytest.raises(ImportError, match=r"pip install 'rltrain\[vllm\]'"):
        build_engine("vllm", model="Qwen/Qwen3-0.6B")


def test_sampling_params_translate_to_vllm_names():
    sp = SamplingParams(n=4, temperature=0.8, top_p=0.95, top_k=0, max_tokens=33, stop=["</code>"],
                        stop_token_ids=[7], seed=9)
    assert vllm_sampling_kwargs(sp) == {
        "n": 4, "temperature": 0.8, "top_p": 0.95, "top_k": -1, "max_tokens": 33, "stop": ["</code>"],
        "stop_token_ids": [7], "include_stop_str_in_output": True, "seed": 9, "logprobs": 0}
    assert vllm_sampling_kwargs(SamplingParams(top_k=5, logprobs=False))["top_k"] == 5
    assert vllm_sampling_kwargs(SamplingParams(logprobs=False))["logprobs"] is None


def test_completion_output_becomes_a_rollout_response():
    lp = lambda v: SimpleNamespace(logprob=v)  # noqa: E731  (vLLM's Logprob has .logprob)
    completion = SimpleNamespace(index=0, token_ids=(5, 9, 2), finish_reason="stop", stop_reason=None,
                                 logprobs=[{5: lp(-0.5)}, {9: lp(-1.25), 3: lp(-0.1)}, {2: lp(-2.0)}])
    r = response_from_completion(3, completion)
    assert (r.prompt_index, r.token_ids, r.logprobs, r.finish_reason, r.stop_reason) == (
        3, [5, 9, 2], [-0.5, -1.25, -2.0], "stop", None)
    assert r.loss_mask == [1, 1, 1]
    aborted = SimpleNamespace(index=1, token_ids=[4], finish_reason=None, stop_reason=None, logprobs=None)
    r = response_from_completion(0, aborted)
    assert r.finish_reason == "abort" and r.logprobs == [0.0]


def test_weight_buckets_stream_by_size_and_keep_every_tensor():
    tensors = [(f"w{i}", torch.randn(n)) for i, n in enumerate([10, 10, 30, 5, 5, 5, 100])]  # fp32: 4 bytes each
    taken = []

    def stream():
        for item in tensors:
            taken.append(item[0])
            yield item

    buckets = weight_buckets(stream(), bucket_bytes=80)
    first = next(buckets)
    assert [n for n, _ in first] == ["w0", "w1"] and taken == ["w0", "w1", "w2"]  # lazy: one tensor ahead
    rest = list(buckets)
    assert [[n for n, _ in b] for b in rest] == [["w2"], ["w3", "w4", "w5"], ["w6"]]
    flat = [t for b in [first, *rest] for t in b]
    for (name, got), (_, want) in zip(flat, tensors):
        assert got.device.type == "cpu" and torch.equal(got, want)


needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None or not torch.cuda.is_available(),
                                reason="needs vllm and a CUDA GPU")


@pytest.mark.gpu
@needs_vllm
def test_vllm_engine_end_to_end_against_hf(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from rltrain.rollout.hf import HFEngine

    config = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                         tie_word_embeddings=False, initializer_range=0.3)
    torch.manual_seed(0)
    old, new = Qwen3ForCausalLM(config).eval(), Qwen3ForCausalLM(config).eval()
    old.save_pretrained(tmp_path)
    engine = VLLMEngine(str(tmp_path), dtype="float32", skip_tokenizer_init=True, eos_token_id=[],
                        gpu_memory_utilization=0.3, enforce_eager=True)
    prompts = [[5, 6, 7], [9], [10, 11, 12, 13, 14]]
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=8)
    hf_old = [r.token_ids for r in HFEngine(old, eos_token_id=[]).generate(prompts, greedy)]
    assert [r.token_ids for r in engine.generate(prompts, greedy)] == hf_old

    sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1))
    for r in sampled:  # processed log-probs == temperature-1 log-probs without filters
        full = torch.tensor([prompts[r.prompt_index] + r.token_ids])
        with torch.no_grad():
            ref = torch.log_softmax(old(full).logits[0, len(prompts[r.prompt_index]) - 1:-1].double(), -1)
        ref = ref.gather(-1, torch.tensor(r.token_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(r.logprobs, dtype=torch.float64), ref, atol=1e-3, rtol=0)

    engine.sleep(level=1)
    engine.wake_up()
    assert [r.token_ids for r in engine.generate(prompts, greedy)] == hf_old
    engine.update_weights((n, t) for n, t in new.state_dict().items())
    hf_new = [r.token_ids for r in HFEngine(new, eos_token_id=[]).generate(prompts, greedy)]
    assert [r.token_ids for r in engine.generate(prompts, greedy)] == hf_new
