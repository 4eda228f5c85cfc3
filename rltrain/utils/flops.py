"""Model FLOPs and parameter counts from a transformer's shape (an HF config or any object with its fields).
Pure arithmetic: must not import torch or build a model (tools/gpu_smoke.py, bench_update.py and
scaling_model.py use it on machines with and without a GPU).

Counting rule (the one every MFU number in docs/benchmarks.md uses): 2 FLOPs per multiply-add over every
weight matrix (q, k, v, o, gate, up, down, and the LM head), causal attention (QK^T and PV over the average
context seq_len / 2), backward = 2x forward; norms, RoPE and softmax are not counted.
"""

from __future__ import annotations


def head_dim(cfg) -> int:
    """Width of one attention head: the config's head_dim, else hidden_size / num_attention_heads."""
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def layer_matmul_params(cfg) -> int:
    """Weights of one decoder layer's matrices: q, k, v, o projections and the SwiGLU MLP (gate, up, down)."""
    h, hd = cfg.hidden_size, head_dim(cfg)
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size


def matmul_params(cfg) -> int:
    """Weights that take part in a matrix product per token: every layer's matrices plus the LM head."""
    return cfg.num_hidden_layers * layer_matmul_params(cfg) + cfg.vocab_size * cfg.hidden_size


def num_params(cfg) -> int:
    """Every parameter of the HF checkpoint: matrices, the input embedding (shared with the LM head when
    `tie_word_embeddings`), the RMSNorm weights (two per layer, the q/k norms of Qwen3, the final norm)."""
    h, hd, L = cfg.hidden_size, head_dim(cfg), cfg.num_hidden_layers
    embed = 0 if getattr(cfg, "tie_word_embeddings", False) else cfg.vocab_size * h
    qk_norm = 2 * hd if getattr(cfg, "model_type", "qwen3") == "qwen3" else 0
    return matmul_params(cfg) + embed + L * (2 * h + qk_norm) + h


def train_flops(cfg, tokens: float, seq_len: float) -> float:
    """Model FLOPs of forward+backward (3x forward) for `tokens` tokens in sequences of `seq_len`:
    2 FLOPs per multiply-add over every weight matrix (incl. the LM head) + causal attention (QK^T and PV)."""
    q = cfg.num_attention_heads * head_dim(cfg)
    attn = 2 * 2 * cfg.num_hidden_layers * q * (seq_len / 2)  # per token, causal average context
    return 3 * tokens * (2 * matmul_params(cfg) + attn)


# Dense bf16 peak of one GPU, FLOP/s, by a fragment of its torch.cuda.get_device_name() (vendor datasheets, SXM
# parts): the MFU denominator of every number in docs/. H200 is an H100 die with more, faster memory: same peak.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}
DEFAULT_PEAK = "H100"  # a device not in the table (a CPU run, another GPU) is measured against the H100


def peak_flops(device_name: str | None = None) -> float:
    """Dense bf16 FLOP/s of one GPU named `device_name` (a torch.cuda.get_device_name() string); the H100's
    for None or a name the table does not know."""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if device_name and k in device_name),
                PEAK_BF16_FLOPS[DEFAULT_PEAK])
