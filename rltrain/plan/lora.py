"""LoRA's parameters for the memory plan: the adapters on one rank of a stage, and the slot a vLLM engine allocates."""

from __future__ import annotations

from dataclasses import replace

from rltrain.plan.inputs import Inputs


def lora_params(x: Inputs, sparse_flags) -> float:
    """LoRA adapter parameters on one rank holding the layers of `sparse_flags` (1: a sparse layer; 0 without LoRA):
    per layer and target r x (in + out), the half the base layer splits (column-parallel: B's rows; row-parallel: A's
    columns) / TP; a sparse layer's MLP takes none (adapters on experts are refused)."""
    if not x.lora_rank:
        return 0.0
    s = x.shape
    h, q, kv, ffn = s.hidden_size, s.q_dim, s.kv_dim, s.intermediate_size
    dims = {"q_proj": (h, q, True), "k_proj": (h, kv, True), "v_proj": (h, kv, True), "o_proj": (q, h, False),
            "gate_proj": (h, ffn, True), "up_proj": (h, ffn, True), "down_proj": (ffn, h, False)}
    total = 0.0
    for sparse in sparse_flags:
        for t in x.lora_targets:
            d_in, d_out, column = dims[t]
            if sparse and t in ("gate_proj", "up_proj", "down_proj"):
                continue
            total += x.lora_rank * ((d_in + d_out / x.tp) if column else (d_in / x.tp + d_out))
    return total


def vllm_adapter_slot_params(x: Inputs) -> float:
    """The whole model's adapter at vLLM's max_lora_rank (the next rank vLLM takes: compat/vllm.lora_rank_slot), the
    one slot a LoRA engine allocates (max_loras=1)."""
    from rltrain.compat.vllm import lora_rank_slot

    return lora_params(replace(x, lora_rank=lora_rank_slot(x.lora_rank), tp=1), x.shape.sparse)
