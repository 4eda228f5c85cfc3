"""LoRA in the rollout engines against real vLLM (CPU build in CI): only the adapter's PEFT-named tensors reach the
engines; vLLM swaps them in from memory and generates what the hf engine with the same adapters does (greedy tokens,
log-probs), and both equal the transformers model with the merged weights W + (alpha / r) B A. A second adapter
replaces the first (no stale KV from the prefix cache)."""

from __future__ import annotations

import pytest
import torch

from rltrain.models.lora import LoraSpec, adapter_name, merged_weights
from rltrain.rollout import SamplingParams
from rltrain.rollout.hf import HFEngine
from test_rollout_vllm import EOS, TOK, tiny_model

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("one_torch_thread")]
SPEC = LoraSpec(rank=8, alpha=16.0, dropout=0.0, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                          "up_proj", "down_proj"))
PROMPTS = [[1, 5, 20, 31, 12], [1], [9, 10, 11]]
GREEDY = SamplingParams(n=1, temperature=0.0, max_tokens=8)


def _adapter(model, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    out = {}
    for i in range(model.config.num_hidden_layers):
        for t in SPEC.targets:
            w = modules[adapter_name(i, t, "A").removeprefix("base_model.model.").rsplit(".lora_A", 1)[0]].weight
            out[adapter_name(i, t, "A")] = torch.randn(SPEC.rank, w.shape[1], generator=g) * 0.3
            out[adapter_name(i, t, "B")] = torch.randn(w.shape[0], SPEC.rank, generator=g) * 0.3
    return out


@pytest.fixture(scope="module")
def lora_engines(tmp_path_factory):
    from rltrain.rollout.vllm import VLLMEngine

    base = tiny_model(0)
    path = tmp_path_factory.mktemp("vllm_lora_base")
    base.save_pretrained(path)
    vllm = VLLMEngine(str(path), tokenizer=TOK, device="cpu", dtype="float32", seed=0, eos_token_id=EOS, lora=SPEC)
    hf = HFEngine(tiny_model(0), tokenizer=TOK, eos_token_id=EOS, lora=SPEC)
    yield base, hf, vllm
    vllm.close()


def _merged_logprobs(base, adapter, responses):
    """Teacher-forced log-probs of each (prompt, response) under the merged transformers model."""
    model = tiny_model(0)
    model.load_state_dict(dict(merged_weights(base.state_dict(), adapter, SPEC)))
    out = []
    with torch.no_grad():
        for r in responses:
            ids = torch.tensor([PROMPTS[r.prompt_index] + r.token_ids])
            logp = torch.log_softmax(model(ids).logits[0].float(), -1)
            p = len(PROMPTS[r.prompt_index])
            out.append(logp[p - 1:-1].gather(-1, ids[0, p:, None]).squeeze(-1))
    return out


def test_adapter_only_sync_into_vllm_matches_hf_and_the_merged_model(lora_engines):
    base, hf, vllm = lora_engines
    before = vllm.generate(PROMPTS, GREEDY)  # no adapter yet: the base (B = 0 in the actor)
    assert [r.token_ids for r in before] == [r.token_ids for r in hf.generate(PROMPTS, GREEDY)]
    seen = []
    for seed in (1, 2):  # the second adapter replaces the first
        adapter = _adapter(base, seed)
        n = len(adapter)
        assert n == 2 * base.config.num_hidden_layers * len(SPEC.targets)
        assert vllm.update_weights(iter(adapter.items())) == n  # only adapter tensors cross
        assert hf.update_weights(iter(adapter.items())) == n
        got, want = vllm.generate(PROMPTS, GREEDY), hf.generate(PROMPTS, GREEDY)
        assert [r.token_ids for r in got] == [r.token_ids for r in want]
        for g, w, m in zip(got, want, _merged_logprobs(base, adapter, got)):
            torch.testing.assert_close(torch.tensor(g.logprobs), m.float(), atol=1e-4, rtol=0)
            torch.testing.assert_close(torch.tensor(w.logprobs), m.float(), atol=1e-4, rtol=0)
        seen.append([r.token_ids for r in got])
    assert seen[0] != seen[1] and seen[0] != [r.token_ids for r in before]  # each adapter changed the model
    with pytest.raises(ValueError, match="not a LoRA adapter tensor"):
        vllm.update_weights(iter([("model.norm.weight", torch.ones(64))]))
