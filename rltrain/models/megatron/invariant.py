"""True on-policy for the Megatron actor (rollout.true_on_policy): `make_invariant(model, theta)` routes every
computing step of a built GPTModel's forward through ops/invariant.py, the functions the hf rollout engine's model
runs (models/invariant_hf.py), so a token's logits are the engine's to the bit; the head then computes the sampled
distribution's log-prob with the same function (head.py, ops/logprob_invariant.py). Nothing else of the engine here.

Routed (instance forwards replaced; modules, names and weights unchanged; one rank: tensor parallelism splits a
reduction over ranks and is refused by config validation):
- ColumnParallelLinear / RowParallelLinear (fused QKV, output projection, fused gate/up, down, the experts'):
  ops.invariant.linear (a fused weight changes nothing: each output is its own exact dot product);
- torch.nn.RMSNorm (layer, q/k and final norms): ops.invariant.rms_norm;
- rotary: megatron's `apply_rotary_pos_emb` as imported by its attention module, wrapped once per process
  (`_install_rope`); it applies ops.invariant's table by position (0..s-1: rows start at 0) to models marked here and
  calls megatron's own function for every other model;
- core attention (build.SDPACoreAttention): ops.invariant.attention, causal;
- the MLP's SiLU: the config's activation_func (megatron's glu calls it, then multiplies by the up half);
- MoE layers: megatron's router still runs (aux loss, router statistics, routing replay's targets), its gating on
  the exact linear; the experts are the top-k of those logits (or the replayed ones), weighted and summed by
  ops.invariant.moe_route / moe_experts as the engine's Qwen3-MoE block does. The weights' gradient is the router's
  own (added as `p - p.detach()`, exactly 0 in value).
"""

from __future__ import annotations

import types

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from rltrain.ops import invariant as inv

_ROPE_ATTR = "_rltrain_true_on_policy_rope"  # on a TransformerConfig: (head_dim, theta) of a routed model


def _column_forward(self, input_, weight=None, runtime_gather_output=None):
    weight = self.weight if weight is None else weight
    bias = None if self.skip_bias_add else self.bias
    return inv.linear(input_, weight, bias), (self.bias if self.skip_bias_add else None)


def _row_forward(self, input_):
    bias = None if self.skip_bias_add else self.bias
    return inv.linear(input_, self.weight, bias), (self.bias if self.skip_bias_add else None)


def _norm_forward(self, x):
    return inv.rms_norm(x, self.weight, self.eps)


def _core_attention_forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                            packed_seq_params=None):
    """query [s, b, np, hn], key/value [s, b, ng, hn] -> [s, b, np*hn], causal (rows start at position 0)."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
    s = q.shape[2]
    pos = torch.arange(s, device=q.device)
    valid = (pos[None, :] <= pos[:, None])[None, None]  # [1, 1, s, s]
    scale = self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5
    ctx = inv.attention(q, k, v, valid, scale)  # [b, np, s, hn]
    return ctx.permute(2, 0, 1, 3).reshape(s, q.shape[0], -1)


def _install_rope() -> None:
    """Wrap megatron's apply_rotary_pos_emb (as its attention module calls it) once per process: models marked by
    make_invariant get ops.invariant's rotary table, every other model megatron's own function."""
    import megatron.core.transformer.attention as attention

    if getattr(attention.apply_rotary_pos_emb, "_rltrain_wrapped", False):
        return
    original = attention.apply_rotary_pos_emb

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        rope = getattr(config, _ROPE_ATTR, None)
        if rope is None or cu_seqlens is not None:
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        head_dim, theta = rope
        cos, sin = inv.rope_cos_sin(torch.arange(t.shape[0], device=t.device), head_dim, theta, t.dtype)
        return inv.apply_rope(t, cos[:, None, None, :], sin[:, None, None, :])  # t [s, b, heads, hn]

    apply_rotary_pos_emb._rltrain_wrapped = True
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb


def _gating(self, input):
    """TopKRouter.gating on the exact linear; the logits are kept for the layer's forward."""
    logits = inv.linear(input.reshape(-1, input.shape[-1]).to(self.weight.dtype), self.weight)
    self._rltrain_logits = logits.detach()
    return logits


def _moe_forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
    """MoELayer.forward on one rank (expert and tensor parallel size 1): [s, b, H] -> ([s, b, H], None)."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    router = self.router
    probs, routing_map = router(hidden_states)  # megatron's: aux loss, statistics, replayed targets
    replay = router.router_replay
    if replay is not None and replay.target_topk_idx is not None:
        experts = replay.target_topk_idx.to(x.device).long()
    else:
        experts = torch.topk(router._rltrain_logits, router.topk, dim=-1).indices
    weights, experts = inv.moe_route(router._rltrain_logits, router.topk, not self.config.moe_router_pre_softmax,
                                     experts=experts)
    p = probs.gather(1, experts)
    weights = weights + (p - p.detach())  # the value of ops.invariant's weights, the router's gradient
    local = self.experts.local_experts
    out = inv.moe_experts(x, experts, weights, [e.linear_fc1.weight for e in local],
                          [e.linear_fc2.weight for e in local])
    return out.reshape(shape), None


def make_invariant(model: torch.nn.Module, theta: float) -> torch.nn.Module:
    """Route a built GPTModel's forward through ops/invariant.py (module docstring); theta: the rotary base.
    The output layer is left alone (the engine's head computes the log-probs). Returns the model."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    from rltrain.models.megatron.build import SDPACoreAttention

    _install_rope()
    cfg = model.config
    cfg.activation_func = inv.silu
    setattr(cfg, _ROPE_ATTR, (cfg.kv_channels, float(theta)))
    output_layer = getattr(model, "output_layer", None)
    for m in model.modules():
        if m is output_layer:
            continue
        if isinstance(m, ColumnParallelLinear):
            m.forward = types.MethodType(_column_forward, m)
        elif isinstance(m, RowParallelLinear):
            m.forward = types.MethodType(_row_forward, m)
        elif isinstance(m, torch.nn.RMSNorm):
            m.forward = types.MethodType(_norm_forward, m)
        elif isinstance(m, SDPACoreAttention):
            m.forward = types.MethodType(_core_attention_forward, m)
        elif isinstance(m, TopKRouter):
            m.gating = types.MethodType(_gating, m)
        elif isinstance(m, MoELayer):
            m.forward = types.MethodType(_moe_forward, m)
    for m in model.modules():  # every layer config is the model's (one TransformerConfig object)
        if hasattr(m, "config") and m.config is not cfg and hasattr(m.config, "activation_func"):
            m.config.activation_func = inv.silu
            setattr(m.config, _ROPE_ATTR, getattr(cfg, _ROPE_ATTR))
    return model


def setup(model: torch.nn.Module, hf_config, config) -> tuple[int, float] | None:
    """The engine's rollout.true_on_policy step (config: its EngineConfig): route the model (make_invariant) and
    return the head's (top_k, top_p); None when the mode is off. ValueError for an engine it cannot make exact."""
    sampled = config.true_on_policy
    if sampled is None:
        return None
    par, comp, head = config.parallel, config.compute, config.head
    why = []
    if par.tensor_parallel_size != 1 or par.expert_parallel_size != 1:
        why.append("tensor and expert parallel size 1 (a split reduction adds its partial sums across ranks)")
    if comp.elementwise_fusion != "none":
        why.append("elementwise_fusion=none (fused kernels compute the SiLU and the adds their own way)")
    if head.fused_linear_logprob_backend not in ("auto", "torch"):
        why.append("the torch head backend (the Triton and CuTe heads tile the vocab their own way)")
    if why:
        raise ValueError("rollout.true_on_policy needs " + "; ".join(why))
    from rltrain.models.megatron.build import rope_theta

    make_invariant(model, rope_theta(hf_config))
    return sampled.top_k, sampled.top_p
