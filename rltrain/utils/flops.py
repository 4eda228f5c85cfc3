"""Model FLOPs and parameter counts from a transformer's shape (an HF config or any object with its fields).
Pure arithmetic: must not import torch or build a model (tools/gpu_smoke.py, bench_update.py and
the planner's lab use it on machines with and without a GPU).

Counting rule (the one every MFU number in docs/benchmarks.md uses): 2 FLOPs per multiply-add over every
weight matrix a token goes through (q, k, v, o, gate, up, down, and the LM head), causal attention (QK^T and PV
over the average context seq_len / 2), backward = 2x forward; norms, RoPE and softmax are not counted.
Mixture-of-Experts (Qwen3-MoE: `num_experts` E, `num_experts_per_tok` k, `moe_intermediate_size` I): a token goes
through its sparse layers' router (h x E) and k of the E experts (3 x h x I each), so FLOPs and MFU are counted on
these ACTIVE parameters; the parameter count (memory, weight sync) holds all E experts.
"""

from __future__ import annotations


def head_dim(cfg) -> int:
    """Width of one attention head: the config's head_dim, else hidden_size / num_attention_heads."""
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _get(cfg, key: str, default=None):
    return cfg.get(key, default) if isinstance(cfg, dict) else getattr(cfg, key, default)


def sparse_layers(cfg) -> list[int]:
    """Per layer, 1 where the model has a sparse MoE block and 0 where a dense MLP: Qwen3-MoE's rule (not in
    `mlp_only_layers`, and `(i + 1) % decoder_sparse_step == 0`); all 0 without `num_experts`. The one copy of the rule:
    the Megatron builder, the vLLM engine's routing rows and the planner read it here."""
    n = int(_get(cfg, "num_hidden_layers"))
    if not int(_get(cfg, "num_experts", 0) or 0):
        return [0] * n
    step, dense = int(_get(cfg, "decoder_sparse_step", 1) or 1), set(_get(cfg, "mlp_only_layers", None) or [])
    return [int(i not in dense and (i + 1) % step == 0) for i in range(n)]


def attention_params(cfg) -> int:
    """The q, k, v and o projections of one decoder layer."""
    h, hd = cfg.hidden_size, head_dim(cfg)
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    return h * (q + 2 * kv) + q * h


def expert_params(cfg) -> int:
    """One expert's SwiGLU matrices (gate, up, down of width moe_intermediate_size)."""
    return 3 * cfg.hidden_size * int(cfg.moe_intermediate_size)


def mlp_params(cfg, *, sparse: bool = False, active: bool = True) -> int:
    """One layer's MLP matrices: dense, 3 x h x intermediate_size; sparse, the router (h x E) + k experts (active)
    or all E experts (active=False)."""
    if not sparse:
        return 3 * cfg.hidden_size * cfg.intermediate_size
    experts = int(cfg.num_experts_per_tok) if active else int(cfg.num_experts)
    return cfg.hidden_size * int(cfg.num_experts) + experts * expert_params(cfg)


def layer_matmul_params(cfg, *, sparse: bool = False, active: bool = True) -> int:
    """Weights of one decoder layer's matrices: q, k, v, o projections and the MLP (dense, or a sparse layer's
    router and its k active / all E experts)."""
    return attention_params(cfg) + mlp_params(cfg, sparse=sparse, active=active)


def matmul_params(cfg, *, active: bool = True) -> int:
    """Weights that take part in a matrix product per token (active=True: a sparse layer's k experts; False: all
    of them): every layer's matrices plus the LM head."""
    return (sum(layer_matmul_params(cfg, sparse=bool(s), active=active) for s in sparse_layers(cfg))
            + cfg.vocab_size * cfg.hidden_size)


def _other_params(cfg) -> int:
    """The input embedding (shared with the LM head when `tie_word_embeddings`) and the RMSNorm weights (two per
    layer, Qwen3's q/k norms, the final norm)."""
    h, hd, L = cfg.hidden_size, head_dim(cfg), cfg.num_hidden_layers
    embed = 0 if getattr(cfg, "tie_word_embeddings", False) else cfg.vocab_size * h
    qk_norm = 2 * hd if getattr(cfg, "model_type", "qwen3") in ("qwen3", "qwen3_moe") else 0
    return embed + L * (2 * h + qk_norm) + h


def num_params(cfg) -> int:
    """Every parameter of the HF checkpoint: matrices (all experts), the input embedding (shared with the LM head
    when `tie_word_embeddings`), the RMSNorm weights (two per layer, the q/k norms of Qwen3, the final norm)."""
    return matmul_params(cfg, active=False) + _other_params(cfg)


def active_params(cfg) -> int:
    """num_params with each sparse layer's k active experts in place of all E (= num_params for a dense model)."""
    return matmul_params(cfg) + _other_params(cfg)


def train_flops(cfg, tokens: float, seq_len: float) -> float:
    """Model FLOPs of forward+backward (3x forward) for `tokens` tokens in sequences of `seq_len`:
    2 FLOPs per multiply-add over every active weight matrix (incl. the LM head) + causal attention (QK^T and PV)."""
    return 3 * tokens * 2 * matmul_params(cfg) + attention_flops(cfg, tokens, seq_len)


def attention_flops(cfg, tokens: float, seq_len: float) -> float:
    """The causal attention's part of train_flops (QK^T and PV, forward + backward = 3x forward): it grows with the
    sequence, the weight matrices' part does not."""
    q = cfg.num_attention_heads * head_dim(cfg)
    return 3 * tokens * 2 * 2 * cfg.num_hidden_layers * q * (seq_len / 2)  # per token, causal average context


# Dense bf16 peak of one GPU, FLOP/s, by a fragment of its torch.cuda.get_device_name() (vendor datasheets, SXM
# parts): the MFU denominator of every number in docs/. H200 is an H100 die with more, faster memory: same peak.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12}
DEFAULT_PEAK = "H100"  # a device not in the table (a CPU run, another GPU) is measured against the H100


def peak_flops(device_name: str | None = None) -> float:
    """Dense bf16 FLOP/s of one GPU named `device_name` (a torch.cuda.get_device_name() string); the H100's
    for None or a name the table does not know."""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if device_name and k in device_name),
                PEAK_BF16_FLOPS[DEFAULT_PEAK])
