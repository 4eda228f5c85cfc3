"""The tiny Qwen3-architecture flavor used by tests and the embedded CPU default (`grpo_tiny`).
It must not hold weights or a tokenizer; it only returns a transformers Qwen3Config.

Shape choices: GQA (4 query heads over 2 KV groups, so TP=2 keeps one group per rank), an explicit
head_dim different from hidden/heads (catches layout bugs), q/k norm, untied embeddings by default.
"""

from __future__ import annotations

from transformers import Qwen3Config


def tiny_qwen3_config(
    vocab_size: int,
    *,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 24,
    max_position_embeddings: int = 1024,
    rope_theta: float = 10000.0,
    tie_word_embeddings: bool = False,
    rms_norm_eps: float = 1e-6,
    **overrides,
) -> Qwen3Config:
    """A small Qwen3Config; any other Qwen3Config field can be passed through `overrides`."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=rms_norm_eps,
        attention_dropout=0.0,
        **overrides,
    )
