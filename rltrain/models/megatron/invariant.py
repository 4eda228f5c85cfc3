"""True on-policy for the Megatron actor (rollout.true_on_policy): `setup` routes every computing step of a built
GPTModel's forward through the kernels the rollout engine runs, so a token's logits are the engine's to the bit; the
head then computes the sampled distribution's log-prob the engine's way (head.py, ops/logprob_invariant.py). One
kernel set per engine: `ExactKernels` (ops/invariant.py, which the hf engine's model runs: models/invariant_hf.py)
and `VllmKernels` (vLLM 0.26's batch-invariant CUDA kernels: compat/vllm_kernels.py). Nothing else of the engine.

Routed (instance forwards replaced; modules, names and weights unchanged; one rank: a reduction split over ranks is
refused by config validation):
- ColumnParallelLinear / RowParallelLinear (fused QKV, output projection, fused gate/up, down): `linear` (a fused
  or reordered weight changes nothing: each output is its own row's and column's);
- torch.nn.RMSNorm: `norm` (after a residual add as well: the add is Megatron's, in the model dtype, as the engine's
  routed norm adds first; compat/vllm_kernels.py);
- rotary: megatron's `apply_rotary_pos_emb` as imported by its attention module, wrapped once per process
  (`_install_rope`): models marked here get `rope` (positions 0..s-1: rows start at 0), others megatron's function;
- core attention (build.SDPACoreAttention): causal `attention`;
- the dense MLP: fc1 -> `glu` (silu(gate) * up) -> fc2; residual adds are single additions on both sides;
- MoE layers: megatron's router still runs (aux loss, statistics, routing replay's targets), its gating on the kernel
  set's linear; the experts are the top-k of those logits (or the replayed ones) with the kernel set's weights
  (ExactKernels: ops.invariant.moe_route / moe_experts, as the hf engine's Qwen3-MoE block does; VllmKernels: vLLM's
  fused top-k softmax and fused-MoE kernels over the stacked experts), weighted and summed; the weights' gradient is
  the router's own (added as `p - p.detach()`, exactly 0 in value).
Every op's backward is the plain formula's at the same inputs: recomputed under autograd (ops.invariant.
with_plain_backward), or in a direct form where one exists (VllmKernels: the linear layers' products, the norm's
gradient kernel ops/norm_grad.py, rotary's rotation back, SiLU-and-mul's two products; ops.invariant.with_backward).
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from rltrain.ops import invariant as inv
from rltrain.ops.norm_grad import rms_norm_backward

_ROPE_ATTR = "_rltrain_true_on_policy"  # on a TransformerConfig: the kernel set of a routed model
# FlashAttention 3 on Hopper (its hopper/tile_size.h, tile_size_fwd_sm90): over a paged KV cache of 16-token pages a
# causal call (a prefill) and a non-causal one (a decode step: FA drops causal for a single query) read the keys in
# tiles of one size above head_dim 64 (128 up to 128, 96 up to 192, 80 above), of two at head_dim <= 64 (128, 160)
FA3_TILES_DIFFER_UP_TO_HEAD_DIM = 64
log = logging.getLogger(__name__)


def _causal(s: int, device) -> torch.Tensor:
    pos = torch.arange(s, device=device)
    return (pos[None, :] <= pos[:, None])[None, None]  # [1, 1, s, s]


def _plain_attention(q, k, v, scale):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True,
                                          scale=scale)


class ExactKernels:
    """ops/invariant.py: the hf engine's arithmetic (any device, any dtype)."""

    exact_logprob = None  # the head's own exact path (ops/logprob_invariant.py)

    def __init__(self, theta: float):
        self.theta = theta

    def linear(self, x, w, b=None):
        return inv.linear(x, w, b)

    def norm(self, x, w, eps):
        return inv.rms_norm(x, w, eps)

    def rope(self, t):  # t [s, b, heads, hn]
        cos, sin = inv.rope_cos_sin(torch.arange(t.shape[0], device=t.device), t.shape[-1], self.theta, t.dtype)
        return inv.apply_rope(t, cos[:, None, None, :], sin[:, None, None, :])

    def attention(self, q, k, v, scale):  # [b, heads, s, hn]
        return inv.attention(q, k, v, _causal(q.shape[2], q.device), scale)

    def glu(self, h):
        gate, up = h.chunk(2, dim=-1)
        return inv.silu(gate) * up

    def moe_route(self, x, logits, top_k, normalize, experts=None):
        return inv.moe_route(logits, top_k, normalize, experts=experts)

    def moe_experts(self, x, experts, weights, gate_up, down):
        return inv.moe_experts(x, experts, weights, gate_up, down)


class VllmKernels:
    """vLLM 0.26's batch-invariant CUDA kernels (compat/vllm_kernels.py), each with its plain formula's backward."""

    def __init__(self, theta: float, max_position: int):
        from rltrain.compat import vllm_kernels

        self.k, self.theta, self.max_position = vllm_kernels, theta, max_position
        self.exact_logprob = vllm_kernels.token_logprobs  # the sampler's kernels; the fused head's gradient

    def linear(self, x, w, b=None):
        return inv.linear_with_plain_backward(self.k.linear, x, w, b)

    def norm(self, x, w, eps):
        def grad(need, x, w, g):
            return rms_norm_backward(x, w, g, eps, need_weight_grad=need[1])

        return inv.with_backward(lambda x, w: self.k.rms_norm(x, w, eps), grad, x, w)

    def rope(self, t):  # t [s, b, heads, hn]; the gradient is the rotation back (the forward is linear in t)
        s, b, h, d = t.shape
        pos = self.k.sequence_major_positions(s, b, str(t.device))  # megatron's tokens are sequence-major

        def turn(t, inverse=False):
            return self.k.rope(t.reshape(s * b, h, d), pos, self.theta, self.max_position, inverse).view(s, b, h, d)

        return inv.with_backward(turn, lambda need, t, g: (turn(g, inverse=True),), t, save=False)

    def attention(self, q, k, v, scale):
        return inv.with_plain_backward(lambda q, k, v: self.k.attention(q, k, v, scale),
                                       lambda q, k, v: _plain_attention(q, k, v, scale), q, k, v)

    def glu(self, h):
        return inv.with_backward(self.k.silu_and_mul, lambda need, h, g: (_glu_grad(h, g),), h)

    def moe_route(self, x, logits, top_k, normalize, experts=None):
        """(weights [T, k] fp32, experts [T, k] int64) as vLLM's router computes them from the same logits. With
        replayed experts: vLLM's weights on the rows where its choice is the replayed one (every row, when the
        weights are the rollout's), the plain formula's on the others (their values are then not the engine's)."""
        with torch.no_grad():
            weights, chosen = self.k.moe_topk(x, logits, top_k, normalize)
            chosen = chosen.long()
            if experts is None:
                return weights, chosen
            experts = experts.long()
            same = (chosen == experts).all(-1, keepdim=True)
            if not bool(same.all()):
                plain = inv.moe_route(logits, top_k, normalize, experts=experts)[0].float()
                weights = torch.where(same, weights, plain)
            return weights, experts

    def moe_experts(self, x, experts, weights, gate_up, down):
        """vLLM's fused-MoE kernels over all local experts at once (their weights stacked once per call unless
        they already share one [E, 2I, H] / [E, H, I] storage: models/megatron/moe.stack_expert_weights); the
        gradient is the plain expert loop's, recomputed (every expert's weights, the routing weights, x)."""
        n = len(gate_up)

        def exact(x, w, *mats):
            return self.k.fused_moe(x, _stacked(mats[:n]), _stacked(mats[n:]), w, experts)

        def plain(x, w, *mats):
            return _plain_moe(x, experts, w, mats[:n], mats[n:])

        return inv.with_plain_backward(exact, plain, x, weights, *gate_up, *down)


def _stacked(mats) -> torch.Tensor:
    """[E, ...] of equal-shaped matrices: a view when they lie back to back in one storage, in order (the layout
    stack_expert_weights gives an MoE layer's experts), a copy otherwise."""
    first = mats[0]
    step = first.numel()
    if first.is_contiguous() and all(m.is_contiguous() and m.shape == first.shape and m.dtype == first.dtype
                                     and m.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
                                     and m.storage_offset() == first.storage_offset() + i * step
                                     for i, m in enumerate(mats)):
        return first.detach().as_strided((len(mats), *first.shape), (step, *first.stride()))
    return torch.stack([m.detach() for m in mats])


def _plain_moe(x, experts, weights, gate_up, down):
    """sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)), e = experts[t, k], by plain ops (what the
    routed MoE layer's gradient is computed from)."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(experts).tolist():
        tok, slot = (experts == e).nonzero(as_tuple=True)
        gate, up = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e])
        out = out.index_add(0, tok, y.float() * weights[tok, slot].float().unsqueeze(-1))
    return out.to(x.dtype)


def _glu_grad(h, g):
    """The gradient of silu(gate) * up (h = [gate | up] on the last dim) for the output's gradient g, as autograd
    gives it in h's dtype: [silu'(gate) * g * up | g * silu(gate)]."""
    gate, up = h.chunk(2, dim=-1)
    dh = torch.empty_like(h)
    half = gate.shape[-1]
    torch.mul(g, F.silu(gate), out=dh[..., half:])
    dh[..., :half] = torch.ops.aten.silu_backward(g * up, gate)
    return dh


def _column_forward(self, input_, weight=None, runtime_gather_output=None):
    weight = self.weight if weight is None else weight
    bias = None if self.skip_bias_add else self.bias
    return self._rltrain_kernels.linear(input_, weight, bias), (self.bias if self.skip_bias_add else None)


def _row_forward(self, input_):
    bias = None if self.skip_bias_add else self.bias
    return self._rltrain_kernels.linear(input_, self.weight, bias), (self.bias if self.skip_bias_add else None)


def _norm_forward(self, x):
    return self._rltrain_kernels.norm(x, self.weight, self.eps)


def _mlp_forward(self, hidden_states, *args, **kwargs):
    h, _ = self.linear_fc1(hidden_states)
    return self.linear_fc2(self._rltrain_kernels.glu(h))


def _core_attention_forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                            packed_seq_params=None):
    """query [s, b, np, hn], key/value [s, b, ng, hn] -> [s, b, np*hn], causal (rows start at position 0)."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
    scale = self.softmax_scale if self.softmax_scale is not None else q.shape[-1] ** -0.5
    ctx = self._rltrain_kernels.attention(q, k, v, scale)  # [b, np, s, hn]
    return ctx.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def _install_rope() -> None:
    """Wrap megatron's apply_rotary_pos_emb (as its attention module calls it) once per process: models marked by
    make_invariant get their kernel set's rotary, every other model megatron's own function."""
    import megatron.core.transformer.attention as attention

    if getattr(attention.apply_rotary_pos_emb, "_rltrain_wrapped", False):
        return
    original = attention.apply_rotary_pos_emb

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        kernels = getattr(config, _ROPE_ATTR, None)
        if kernels is None or cu_seqlens is not None:
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        return kernels.rope(t)  # t [s, b, heads, hn]

    apply_rotary_pos_emb._rltrain_wrapped = True
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb


def _gating(self, input):
    """TopKRouter.gating on the kernel set's linear (the engine's router); the logits are kept for the layer's
    forward."""
    logits = self._rltrain_kernels.linear(input.reshape(-1, input.shape[-1]).to(self.weight.dtype), self.weight)
    self._rltrain_logits = logits.detach()
    return logits


def _moe_forward(self, hidden_states, intermediate_tensors=None, padding_mask=None):
    """MoELayer.forward on one rank (expert and tensor parallel size 1): [s, b, H] -> ([s, b, H], None)."""
    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    router = self.router
    probs, routing_map = router(hidden_states)  # megatron's: aux loss, statistics, replayed targets
    replay = router.router_replay
    replayed = None
    if replay is not None and replay.target_topk_idx is not None:
        replayed = replay.target_topk_idx.to(x.device).long()
    kernels = self._rltrain_kernels
    weights, experts = kernels.moe_route(x, router._rltrain_logits, router.topk,
                                         not self.config.moe_router_pre_softmax, experts=replayed)
    p = probs.gather(1, experts)
    weights = weights + (p - p.detach())  # the value of the kernel set's weights, the router's gradient
    local = self.experts.local_experts
    out = kernels.moe_experts(x, experts, weights, [e.linear_fc1.weight for e in local],
                              [e.linear_fc2.weight for e in local])
    return out.reshape(shape), None


def make_invariant(model: torch.nn.Module, kernels) -> torch.nn.Module:
    """Route a built GPTModel's forward through `kernels` (ExactKernels or VllmKernels; module docstring). The
    output layer is left alone (the engine's head computes the log-probs). Returns the model."""
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.router import TopKRouter

    from rltrain.models.megatron.build import SDPACoreAttention

    _install_rope()
    output_layer = getattr(model, "output_layer", None)
    forwards = {ColumnParallelLinear: _column_forward, RowParallelLinear: _row_forward,
                torch.nn.RMSNorm: _norm_forward, SDPACoreAttention: _core_attention_forward, MLP: _mlp_forward,
                MoELayer: _moe_forward}
    for m in model.modules():
        if m is output_layer:
            continue
        if hasattr(m, "config") and hasattr(m.config, "kv_channels"):  # one config object, or a layer's own copy
            setattr(m.config, _ROPE_ATTR, kernels)
        m._rltrain_kernels = kernels
        kind = next((k for k in forwards if type(m) is k or (k is not MLP and isinstance(m, k))), None)
        if kind is not None:
            m.forward = types.MethodType(forwards[kind], m)
        elif isinstance(m, TopKRouter):
            m.gating = types.MethodType(_gating, m)
    return model


def setup(model: torch.nn.Module, hf_config, config) -> tuple | None:
    """The engine's rollout.true_on_policy step (config: its EngineConfig): route the model through the rollout
    engine's kernels (make_invariant) and return the head's (top_k, top_p, exact_logprob); None when the mode is off.
    ValueError for an engine it cannot make exact."""
    sampled = config.true_on_policy
    if sampled is None:
        return None
    from rltrain.models.megatron.build import rope_theta
    from rltrain.utils.flops import head_dim

    par, comp, head = config.parallel, config.compute, config.head
    why = []
    if par.tensor_parallel_size != 1 or par.expert_parallel_size != 1:
        why.append("tensor and expert parallel size 1 (a split reduction adds its partial sums across ranks)")
    if comp.elementwise_fusion != "none":
        why.append("elementwise_fusion=none (fused kernels compute the SiLU and the adds their own way)")
    if not head.fused_linear_logprob:
        why.append("the fused head (the engine's log-prob kernels give its value, the fused head its gradient)")
    elif sampled.engine != "vllm" and head.fused_linear_logprob_backend not in ("auto", "torch"):
        why.append("the fused head on the torch backend with the hf engine (its batch-invariant mode; the Triton and "
                   "CuTe heads tile the vocab their own way)")
    if getattr(config, "lora", None) is not None and int(config.lora.rank) > 0:
        why.append("no LoRA (its adapters' products are plain GEMMs)")
    if sampled.engine == "vllm" and (sampled.top_k > 0 or sampled.top_p < 1.0):
        why.append("top_k=-1 and top_p=1 with rollout.engine=vllm (vLLM's top-k / top-p mask takes a path chosen by "
                   "the batch size: a Triton kernel for 8 rows or more, a sort below)")
    if why:
        raise ValueError("rollout.true_on_policy needs " + "; ".join(why))
    if sampled.engine == "vllm" and head_dim(hf_config) <= FA3_TILES_DIFFER_UP_TO_HEAD_DIM:
        log.warning(
            "rollout.true_on_policy with head_dim %d: vLLM's FlashAttention 3 reads the keys of a decode step (one "
            "query, non-causal) in tiles of another size than a prefill's (causal) at head_dim <= 64, so from the "
            "129th key on the engine's log-probs and the actor's differ (about one fp32 ulp in a trained model), not "
            "bit for bit (docs/vllm.md, issue 60); above head_dim 64 the two tiles are one", head_dim(hf_config))
    theta = rope_theta(hf_config)
    kernels = (VllmKernels(theta, int(hf_config.max_position_embeddings)) if sampled.engine == "vllm"
               else ExactKernels(theta))
    make_invariant(model, kernels)
    return sampled.top_k, sampled.top_p, kernels.exact_logprob
