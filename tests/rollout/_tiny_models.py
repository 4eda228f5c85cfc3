"""Shared helpers of the rollout tests: a tiny random Qwen3 and a decode-able stand-in tokenizer. Not a test module."""

from __future__ import annotations

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB = 80


def tiny_qwen3(seed: int) -> Qwen3ForCausalLM:
    """hidden 32, 2 layers, vocab 80; weights scaled up so logits are peaked (greedy has clear winners)."""
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         tie_word_embeddings=True, initializer_range=0.3)
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()


class UnicodeTokenizer:
    """Decode-able stand-in: id i is the single character chr(0x4E00 + i)."""

    eos_token_id = None
    pad_token_id = 0

    def decode(self, ids) -> str:
        return "".join(chr(0x4E00 + int(i)) for i in ids)

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 0x4E00 for c in text]
