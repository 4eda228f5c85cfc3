"""True on-policy for a transformers causal LM (the hf rollout engine, rollout.true_on_policy): `make_invariant(model)`
routes every computing step of its forward through ops/invariant.py, the functions the Megatron actor's forward calls
too (models/megatron/invariant.py), so both give a token the same logits to the bit. It must not sample (the engine
does, with ops.invariant.log_softmax) and it changes no weight.

What is routed, per module (instance forwards replaced; the modules, their names and weights stay):
- nn.Linear (projections, router gate, lm_head): ops.invariant.linear;
- *RMSNorm (layer, q/k and final norms): ops.invariant.rms_norm;
- the rotary embedding: cos/sin looked up by position in ops.invariant's table (transformers' own rotate-half
  application, `q * cos + rotate_half(q) * sin`, is ops.invariant.apply_rope term for term);
- attention: a registered attention implementation (`ATTENTION`) on ops.invariant.attention, with transformers'
  boolean mask (left padding and causality, from its sdpa mask builder);
- SiLU activations: ops.invariant.silu; the residual adds are single fp32 additions on both sides;
- Qwen3-MoE routers and experts: ops.invariant.moe_route / moe_experts (top-k of the logits, the full softmax's
  probabilities at them, renormalized when norm_topk_prob; the k expert outputs summed exactly).
Families: those the Megatron backend builds (Qwen3, Qwen3-MoE, Qwen2, Llama) with the default rotary embedding.
"""

from __future__ import annotations

import types

import torch

from rltrain.ops import invariant as inv

ATTENTION = "rltrain_true_on_policy"


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-interface signature: query [B, H, Lq, D], key/value [B, Hkv, Lk, D], a boolean
    mask [B, 1, Lq, Lk] (True: attend) or None (causal, the queries last) -> ([B, Lq, H, D], None)."""
    lq, lk = query.shape[2], key.shape[2]
    if attention_mask is None:
        q_pos = torch.arange(lk - lq, lk, device=query.device)
        valid = (torch.arange(lk, device=query.device)[None, :] <= q_pos[:, None])[None, None]
    else:
        valid = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    return inv.attention(query, key, value, valid, scale).transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    def mask(*args, **kwargs):  # always a boolean tensor (sdpa's builder may return None for "plain causal")
        kwargs["allow_is_causal_skip"] = False
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(ATTENTION, _attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, mask)


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if params.get("rope_type", "default") != "default" or theta is None:
        raise ValueError(f"rollout.true_on_policy supports the default rotary embedding only, got {params!r}")
    return float(theta)


def _linear_forward(self, x):
    return inv.linear(x, self.weight, self.bias)


def _rms_norm_forward(self, x):
    return inv.rms_norm(x, self.weight, self.variance_epsilon)


def _silu_forward(self, x):
    return inv.silu(x)


def _rotary_forward(self, x, position_ids):
    return inv.rope_cos_sin(position_ids, self.inv_freq.numel() * 2, self._rltrain_theta, x.dtype)


def _router_forward(self, hidden_states):
    x = hidden_states.reshape(-1, self.hidden_dim)
    logits = inv.linear(x, self.weight)
    weights, experts = inv.moe_route(logits, self.top_k, self.norm_topk_prob)
    return logits, weights, experts


def _experts_forward(self, hidden_states, top_k_index, top_k_weights):
    return inv.moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj)


def make_invariant(model: torch.nn.Module) -> torch.nn.Module:
    """Route `model`'s forward through ops/invariant.py (module docstring); returns the model. Refuses (ValueError)
    a module it would leave computing on its own: an attention module outside the registered implementation, a
    non-default rotary embedding, an activation other than SiLU."""
    _register_attention()
    theta = _rope_theta(model.config)
    model.set_attn_implementation(ATTENTION)
    for name, m in model.named_modules():
        kind = type(m).__name__
        if isinstance(m, torch.nn.Linear):
            m.forward = types.MethodType(_linear_forward, m)
        elif kind.endswith("RMSNorm"):
            m.forward = types.MethodType(_rms_norm_forward, m)
        elif kind.endswith("RotaryEmbedding"):
            if getattr(m, "rope_type", "default") != "default" or float(getattr(m, "attention_scaling", 1.0)) != 1.0:
                raise ValueError(f"rollout.true_on_policy: {name} is a scaled rotary embedding; not supported")
            m._rltrain_theta = theta
            m.forward = types.MethodType(_rotary_forward, m)
        elif kind in ("SiLUActivation", "SiLU"):
            m.forward = types.MethodType(_silu_forward, m)
        elif kind.endswith("TopKRouter"):
            m.forward = types.MethodType(_router_forward, m)
        elif kind.endswith("MoeExperts"):
            m.forward = types.MethodType(_experts_forward, m)
        elif hasattr(m, "act_fn") and type(m.act_fn).__name__ not in ("SiLUActivation", "SiLU"):
            raise ValueError(f"rollout.true_on_policy: {name} uses {type(m.act_fn).__name__}; only SiLU is supported")
    return model
