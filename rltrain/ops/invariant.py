"""Batch- and position-invariant layer ops (rollout.true_on_policy): linear, RMSNorm, SiLU, rotary tables, causal
attention, the log-softmax of the distribution actually sampled from (temperature, top-k, top-p) and the MoE router
and combine. The rollout engine and the actor call these same functions (models/invariant_hf.py,
models/megatron/invariant.py), so a token's log-prob is the same bits on both sides, in any batch, padding, chunking
or prefix layout. Pure tensor math: it must not import the rest of rltrain.

Every reduction goes through ops/exact.py (order-free sums and products), so each output element depends on its own
inputs only; elementwise steps are single IEEE operations (identical in every code path) and transcendental ones are
exact.exp / exact.log. Values agree with the plain ops to fp32 rounding (they are more accurate: sums are exact before
one final rounding). Only the forward is invariant: under autograd each op's backward is the gradient of its plain
torch formula at the same inputs (`_plain_backward`), exact up to fp32 rounding.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from rltrain.ops.exact import exact_cumsum, exact_matmul, exact_sum, exp, log

__all__ = ["attention", "apply_rope", "linear", "log_softmax", "moe_experts", "moe_route", "rms_norm", "rope_cos_sin",
           "silu", "token_stats", "with_backward", "with_plain_backward", "linear_with_plain_backward"]

_ELEMENTS_PER_CHUNK = 1 << 22  # fp64 scratch per chunk of the row-chunked ops (32 MiB)


class _PlainBackward(torch.autograd.Function):
    """Forward: exact_fn(*tensors); backward: the gradient of plain_fn(*tensors), recomputed at the same inputs."""

    @staticmethod
    def forward(ctx, exact_fn, plain_fn, *tensors):
        ctx.plain_fn = plain_fn
        ctx.save_for_backward(*tensors)
        return exact_fn(*tensors)

    @staticmethod
    def backward(ctx, grad):
        need = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            xs = [t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, need)]
            out = ctx.plain_fn(*xs)
        # allow_unused: an input the plain formula does not reach (an MoE expert no token was routed to) has none
        grads = iter(torch.autograd.grad(out, [x for x, n in zip(xs, need) if n], grad, allow_unused=True))
        return (None, None, *(next(grads) if n else None for n in need))


def with_plain_backward(exact_fn: Callable, plain_fn: Callable, *tensors: torch.Tensor) -> torch.Tensor:
    """exact_fn(*tensors), whose gradient (under autograd) is plain_fn's at the same inputs: for forwards that are
    another arithmetic of the same function (here, and another engine's kernels: models/megatron/invariant.py)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _PlainBackward.apply(exact_fn, plain_fn, *tensors)
    return exact_fn(*tensors)


class _GivenBackward(torch.autograd.Function):
    """Forward: exact_fn(*tensors); backward: grad_fn(needs, *tensors, grad), the gradients of the plain formula
    computed directly (needs: which inputs want one)."""

    @staticmethod
    def forward(ctx, exact_fn, grad_fn, save, *tensors):
        ctx.grad_fn, ctx.n = grad_fn, len(tensors)
        ctx.save_for_backward(*(tensors if save else ()))
        return exact_fn(*tensors)

    @staticmethod
    def backward(ctx, grad):
        need = ctx.needs_input_grad[3:]
        grads = ctx.grad_fn(need, *(ctx.saved_tensors or (None,) * ctx.n), grad)
        return (None, None, None, *(g if n else None for g, n in zip(grads, need)))


def with_backward(exact_fn: Callable, grad_fn: Callable, *tensors: torch.Tensor, save: bool = True) -> torch.Tensor:
    """exact_fn(*tensors), whose gradient under autograd is grad_fn(needs, *tensors, grad) -> one gradient (or None)
    per tensor: with_plain_backward where the plain formula's gradient has a direct form (no recomputed forward).
    save=False: the gradient needs no input (a linear map's), grad_fn gets None for each and nothing is kept."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return _GivenBackward.apply(exact_fn, grad_fn, save, *tensors)
    return exact_fn(*tensors)


def _linear_grads(need, x, weight, *bias_and_grad):
    """The linear layer's gradients (grad @ weight, grad.T @ x, the sum of grad), which need no recomputed output, in
    x's and the weight's dtypes (with_backward's grad_fn for linear_with_plain_backward)."""
    *bias, grad = bias_and_grad
    g2 = grad.reshape(-1, grad.shape[-1])
    gx = (g2 @ weight.to(g2.dtype)).reshape(x.shape).to(x.dtype) if need[0] else None
    gw = (g2.t() @ x.reshape(-1, x.shape[-1]).to(g2.dtype)).to(weight.dtype) if need[1] else None
    return (gx, gw, *((g2.sum(0),) if bias else ()))


def linear_with_plain_backward(exact_fn: Callable, x: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    """exact_fn(x, weight[, bias]) (x [..., K], weight [N, K]): another arithmetic of F.linear, whose gradient under
    autograd is F.linear's (with_backward: no recomputed forward)."""
    tensors = (x, weight) if bias is None else (x, weight, bias)
    return with_backward(exact_fn, _linear_grads, *tensors)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias [N]) in x's dtype, each output rounded once from its exact value."""
    def exact(x, w, *b):
        k, n = x.shape[-1], w.shape[0]
        flat = x.reshape(-1, k)
        rows = max(1, _ELEMENTS_PER_CHUNK // max(n, k))
        out = torch.cat([exact_matmul(flat[i:i + rows], w.t()).to(x.dtype) for i in range(0, flat.shape[0], rows)]
                        ) if flat.shape[0] else flat.new_zeros(0, n)
        out = out.reshape(*x.shape[:-1], n)
        return out + b[0] if b else out

    return linear_with_plain_backward(exact, x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / sqrt(mean(x^2) + eps)) over the last dim: the mean exact, the division one fp64 rounding, then
    x's dtype (as transformers' Qwen3RMSNorm orders it: the normalized x in x's dtype, times the weight)."""
    def exact(x, w):
        x64 = x.double()
        ms = exact_sum(x64 * x64, -1, keepdim=True) / x.shape[-1]
        return w * (x64 / torch.sqrt(ms + eps)).to(x.dtype)

    def plain(x, w):
        x32 = x.float()
        return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    return with_plain_backward(exact, plain, x, weight)


def silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) = x / (1 + e^-x), in fp64 then x's dtype."""
    return with_plain_backward(lambda t: (t.double() / (1.0 + exp(-t.double()))).to(t.dtype), F.silu, x)


_ROPE_LOCK = threading.Lock()
_ROPE_TABLES: dict[tuple[int, float], tuple[torch.Tensor, torch.Tensor]] = {}


def _rope_table(head_dim: int, theta: float, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 cos and sin [P >= positions, head_dim // 2] of position * theta^(-2i/head_dim), from Python's math
    (one libm call per value: no vector code path), grown by doubling and kept per (head_dim, theta)."""
    with _ROPE_LOCK:
        cos, sin = _ROPE_TABLES.get((head_dim, theta), (torch.zeros(0, head_dim // 2, dtype=torch.float64),) * 2)
        if cos.shape[0] < positions:
            have, size = cos.shape[0], max(64, 1 << (positions - 1).bit_length())
            inv_freq = [1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)]
            angles = [[p * f for f in inv_freq] for p in range(have, size)]
            cos = torch.cat([cos, torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float64)])
            sin = torch.cat([sin, torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float64)])
            _ROPE_TABLES[(head_dim, theta)] = (cos, sin)
        return cos, sin


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [*positions.shape, head_dim] (each half repeated: the rotate-half layout) in `dtype` for integer
    positions, looked up in one table: the same position gets the same values in every call."""
    n = int(positions.max()) + 1 if positions.numel() else 1
    cos, sin = _rope_table(head_dim, float(theta), n)
    idx = positions.long().cpu()
    cos, sin = cos[idx].to(dtype), sin[idx].to(dtype)
    return (torch.cat([cos, cos], -1).to(positions.device), torch.cat([sin, sin], -1).to(positions.device))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1] (transformers' and megatron's formula, term
    for term); cos/sin broadcast to x."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention of q [B, H, Lq, D] over k, v [B, Hkv, Lk, D] (H a multiple of Hkv, grouped-query), keys
    where `valid` (bool, broadcastable to [B, H, Lq, Lk]) holds -> [B, H, Lq, D] in q's dtype; a query with no valid
    key gets 0. Each query's result depends on its valid keys only (not on their places, the padding or the other
    queries): scores are exact dot products; the softmax's numerator sum_j p_j v_j is summed exactly per query."""
    rep = q.shape[1] // k.shape[1]

    def exact(q, k, v):
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        b, h, lq, d = q.shape
        mask = valid.expand(b, h, lq, k.shape[2])
        rows = max(1, _ELEMENTS_PER_CHUNK // max(1, b * h * k.shape[2] * d))
        return torch.cat([_attend(q[:, :, i:i + rows], k, v, mask[:, :, i:i + rows], scale)
                          for i in range(0, lq, rows)], dim=2).to(q.dtype)

    def plain(q, k, v):
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=valid, scale=scale)

    return with_plain_backward(exact, plain, q, k, v)


_P_SIGMA = 1.5 * 2.0 ** 23  # ulp 2^-29


def _attend(q, k, v, valid, scale: float) -> torch.Tensor:
    """fp64 attention of a block of queries (attention's docstring); k, v already repeated to q's heads."""
    s = exact_matmul(q, k.transpose(-1, -2)) * scale  # [B, H, lq, Lk] exact dot products, then one rounding
    s = s.masked_fill(~valid, -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a query without keys: p = 0 everywhere
    p = exp(s - m)  # [B, H, lq, Lk], 0 on masked keys, max 1
    p = (p + _P_SIGMA) - _P_SIGMA  # on the grid 2^-29 (p <= 1): a product with an fp32 value is exact in fp64
    denom = exact_sum(p, -1, keepdim=True)
    num = exact_sum(p.unsqueeze(-1) * v.double().unsqueeze(2), -2)  # [B, H, lq, D]: exact terms, summed per query
    return num / torch.where(denom > 0, denom, torch.ones_like(denom))


def _keep(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor | None:
    """Bool [N, V] of the tokens top-k (ties at the k-th value kept) then top-p (the smallest set, best first, with
    mass >= top_p; the best token always) leave in, on fp64 logits z; None when neither filters."""
    keep = None
    if 0 < top_k < z.shape[-1]:
        kth = torch.topk(z, top_k, dim=-1).values[:, -1:]
        keep = z >= kth
        z = z.masked_fill(~keep, -math.inf)
    if top_p < 1.0:
        e = exp(z - z.amax(-1, keepdim=True))
        e_sorted, order = torch.sort(e, dim=-1, descending=True, stable=True)
        before = (exact_cumsum(e_sorted, -1) - e_sorted) / exact_sum(e, -1, keepdim=True)  # mass of better tokens
        drop = before >= top_p
        drop[:, 0] = False
        nucleus = torch.ones_like(drop).scatter(-1, order, ~drop)
        keep = nucleus if keep is None else keep & nucleus
    return keep


def log_softmax(logits: torch.Tensor, temperature: float = 1.0, top_k: int = -1, top_p: float = 1.0) -> torch.Tensor:
    """fp64 [N, V] log-probs of the distribution sampled from: softmax(logits / temperature) restricted to the
    top-k / top-p set (_keep) and renormalized; -inf outside it."""
    z = logits.double() / temperature
    keep = _keep(z, top_k, top_p)
    if keep is not None:
        z = z.masked_fill(~keep, -math.inf)
    zm = z - z.amax(-1, keepdim=True)
    return zm - log(exact_sum(exp(zm), -1, keepdim=True))


def token_stats(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, top_k: int = -1,
                top_p: float = 1.0) -> tuple[torch.Tensor, ...]:
    """For logits [N, V] and labels [N]: fp32 [N] log p(label), entropy, lse and mean_z of the sampled distribution
    (log_softmax's), where lse and mean_z are of the scaled logits z = logits / temperature over the kept set (what a
    backward of the plain log-softmax needs), and the kept set as bool [N, V] (None when nothing is filtered)."""
    z = logits.double() / temperature
    keep = _keep(z, top_k, top_p)
    if keep is not None:
        z = z.masked_fill(~keep, -math.inf)
    m = z.amax(-1, keepdim=True)
    zm = z - m
    e = exp(zm)
    s = exact_sum(e, -1, keepdim=True)
    log_s = log(s)
    lp = (zm.gather(-1, labels.long()[:, None]) - log_s).squeeze(-1)
    mean_zm = exact_sum(torch.where(e > 0, e * zm, torch.zeros_like(e)), -1, keepdim=True) / s  # E_p[z - m]
    entropy = (log_s - mean_zm).squeeze(-1)
    return (lp.float(), entropy.float(), (m + log_s).squeeze(-1).float(), (m + mean_zm).squeeze(-1).float(), keep)


def moe_route(logits: torch.Tensor, top_k: int, normalize: bool,
              experts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """MoE routing from router logits [T, E]: (weights [T, k] in logits' dtype, experts [T, k] int64). The experts
    are the top-k logits (or `experts`, given: routing replay); their weights the full softmax's probabilities at
    them, renormalized over the k when `normalize` (Qwen3-MoE's norm_topk_prob). No gradient."""
    with torch.no_grad():
        if experts is None:
            experts = torch.topk(logits, top_k, dim=-1).indices
        z = logits.double()
        e = exp(z - z.amax(-1, keepdim=True))
        picked = e.gather(-1, experts.long())
        total = exact_sum(picked if normalize else e, -1, keepdim=True)
        return (picked / total).to(logits.dtype), experts.long()


def moe_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: Sequence[torch.Tensor],
                down: Sequence[torch.Tensor]) -> torch.Tensor:
    """sum_k weights[t, k] * expert_{experts[t, k]}(x[t]) for x [T, H], each expert silu(gate) * up -> down with
    gate_up[e] [2I, H] (gate rows first) and down[e] [H, I]; the k products are formed in fp64 and summed exactly,
    in any order of the experts or the slots."""
    out = torch.zeros(x.shape[0], experts.shape[1], x.shape[1], dtype=x.dtype, device=x.device)  # [T, k, H]
    for e in torch.unique(experts).tolist():
        tok, slot = (experts == e).nonzero(as_tuple=True)
        gate, up = linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        out = out.index_put((tok, slot), linear(silu(gate) * up, down[e]))
    return with_plain_backward(lambda o, w: exact_sum(o.double() * w.double().unsqueeze(-1), 1).to(x.dtype),
                           lambda o, w: (o * w.unsqueeze(-1)).sum(1), out, weights)
