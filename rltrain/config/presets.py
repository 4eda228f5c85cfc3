"""The built-in model presets (random init, no download): their shapes as HF config fields, which `model.builtin`
names, and the rules a shape must keep to be built. Pure data: no transformers (models/presets.py turns a preset
into an HF config; the planner reads the shapes directly).

`tiny` is the CPU default's Qwen3-architecture model, `small` the learning recipe's (~55M); `qwen3-0.6b`,
`qwen3-4b` and `qwen3-8b` have Qwen3-0.6B's, Qwen3-4B's and Qwen3-8B's real shapes and vocab size for GPU
benchmarks. `tiny-moe`, `small-moe`, `qwen3-30b-a3b` and `qwen3-235b-a22b` are their Mixture-of-Experts (Qwen3-MoE)
counterparts (the last two with the published models' shapes).
"""

from __future__ import annotations

from typing import Any, Mapping

# Facts from the public Hugging Face Qwen3-0.6B config.json.
QWEN3_0_6B = dict(
    vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
    attention_bias=False,
)

# Facts from the public Hugging Face Qwen3-4B config.json.
QWEN3_4B = dict(
    vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
    attention_bias=False,
)

# Facts from the public Hugging Face Qwen3-8B config.json (untied LM head).
QWEN3_8B = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
    rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu",
    attention_bias=False,
)

# The embedded default: small enough to train for a few minutes on 2 CPU cores.
TINY = dict(
    hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=10_000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
)

# The learning recipe's model (examples/learn/): ~55M parameters with its ~300-token BPE vocab (hidden 512,
# 14 layers, MLP 2048, 8 query / 4 key-value heads of 64).
SMALL = dict(
    hidden_size=512, intermediate_size=2048, num_hidden_layers=14, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, max_position_embeddings=1024, rope_theta=10_000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
)

# Mixture-of-Experts presets (Qwen3-MoE architecture). The tiny and small ones keep their dense twin's attention and
# active FFN width (top-2 of experts half the dense MLP wide), so they compare with it at the same active size.
TINY_MOE = dict(TINY, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=96,
                norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
SMALL_MOE = dict(SMALL, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=1024,
                 norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
# Facts from the public Hugging Face Qwen3-30B-A3B config.json (48 layers, 128 experts, top-8, expert FFN 768).
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    hidden_act="silu", attention_bias=False,
)
# Facts from the public Hugging Face Qwen3-235B-A22B config.json (94 layers, 128 experts, top-8, expert FFN 1536).
QWEN3_235B_A22B = dict(
    model_type="qwen3_moe", vocab_size=151936, hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
    num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    max_position_embeddings=40960, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
    hidden_act="silu", attention_bias=False,
)

BUILTINS: dict[str, dict] = {"tiny": TINY, "small": SMALL, "qwen3-0.6b": QWEN3_0_6B, "qwen3-4b": QWEN3_4B,
                           "qwen3-8b": QWEN3_8B, "tiny-moe": TINY_MOE, "small-moe": SMALL_MOE,
                           "qwen3-30b-a3b": QWEN3_30B_A3B, "qwen3-235b-a22b": QWEN3_235B_A22B}


SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "max_position_embeddings")


def shape_errors(dims: Mapping[str, Any], *, key: str = "model.overrides") -> list[str]:
    """Why a model of these HF config `dims` (a preset with its overrides) cannot be built: sizes not positive
    integers, hidden size not divisible by the attention heads, query heads not a multiple of the key/value heads
    (grouped-query attention), an odd head_dim (rotary embeddings rotate pairs). Empty when it can."""
    e = [f"{key}.{k}={dims[k]!r} must be a positive integer" for k in SHAPE_KEYS
         if k in dims and dims[k] is not None and not (isinstance(dims[k], int) and dims[k] > 0)]
    if e:
        return e
    hidden, heads = dims.get("hidden_size"), dims.get("num_attention_heads")
    kv, hd = dims.get("num_key_value_heads") or heads, dims.get("head_dim")
    if hidden and heads and hidden % heads:
        e.append(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}: change "
                 f"{key}.hidden_size or {key}.num_attention_heads")
    if heads and kv and heads % kv:
        e.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}: change "
                 f"{key}.num_attention_heads or {key}.num_key_value_heads")
    if hd and hd % 2:
        e.append(f"head_dim={hd} is odd (rotary embeddings rotate pairs of dimensions): change {key}.head_dim")
    return e
