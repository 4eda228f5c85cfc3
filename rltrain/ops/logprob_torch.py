"""The plain-torch backend of the fused LM-head log-prob: per-shard softmax statistics and gradients,
chunked over tokens. Runs anywhere (CPU and CUDA). It must not hold more than one chunk's
`[chunk, V_local]` logits at a time, and it knows nothing about tensor parallelism (the autograd
Function in `logprob.py` combines the per-shard statistics).

Interface (shared with `logprob_triton.py`, see the contract in `logprob.py`):

- `forward_stats(hidden, weight, labels_local, inv_temp, with_entropy, chunk_size)` -> fp32 [N] each:
  `m` (max logit of the shard), `s = sum exp(z - m)`, `t = sum exp(z - m) * z`, `z_label`.
- `backward(hidden, weight, labels_local, lse, mean_z, grad_lp, grad_ent, inv_temp, need_hidden_grad,
  need_weight_grad, chunk_size)` -> (grad_hidden [N, H] | None, grad_weight [V_local, H] | None).

Precision: logits are fp32 (GEMMs on low-precision inputs accumulate and return fp32: `out_dtype` on
CUDA, an fp32 upcast of the operands on CPU), and all softmax math is fp32.

The chunk helpers `logit_stats` and `grad_logits_inplace` are shared with `logprobs_from_logits`.
"""

from __future__ import annotations

import torch

from rltrain.compat.torch import cuda_mm_out_dtype
from rltrain.ops.chunking import pick_chunk_size

__all__ = ["forward_stats", "backward", "logit_stats", "grad_logits_inplace", "is_available", "save_for_head_backward",
           "head_output_grads"]


def is_available() -> bool:
    """The torch backend runs on every device torch runs on."""
    return True


def _mm_operand(weight: torch.Tensor) -> torch.Tensor:
    """The weight as used by the chunk GEMMs: an fp32 copy for low-precision weights where GEMMs cannot
    return fp32 (CPU, old torch), the weight itself otherwise. O(V_local x H), once per call."""
    if weight.dtype != torch.float32 and not (weight.is_cuda and cuda_mm_out_dtype()):
        return weight.float()
    return weight


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with an fp32 result and fp32 accumulation, for any float dtypes of a and b."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return a @ b
    if a.is_cuda and cuda_mm_out_dtype():
        low = b.dtype if b.dtype != torch.float32 else a.dtype
        return torch.mm(a.to(low), b.to(low), out_dtype=torch.float32)
    return a.float() @ b.float()


def _addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b in place for an fp32 acc [M, N], without an [M, N] temporary when possible."""
    if a.dtype == b.dtype and a.dtype != torch.float32 and a.is_cuda and cuda_mm_out_dtype():
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        acc.addmm_(a.float(), b.float())


def _chunk_logits(hidden_c: torch.Tensor, weight_mm: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """fp32 [c, V_local] logits of one chunk in a fresh buffer that the caller owns."""
    z = _mm_f32(hidden_c, weight_mm.T)
    if inv_temp != 1.0:
        z.mul_(inv_temp)
    return z


def logit_stats(
    z: torch.Tensor, labels_local: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shard statistics of fp32 logits z [c, V_local] (z is only read). labels_local [c] in [0, V_local)
    or -1. Returns fp32 [c] m, s, t, z_label as in `forward_stats`."""
    m = z.amax(dim=-1)  # [c]
    e = torch.sub(z, m.unsqueeze(-1)).exp_()  # [c, V_local]
    s = e.sum(dim=-1)
    if with_entropy:
        t = torch.linalg.vecdot(e, z)  # sum_j e_j z_j (pairwise-accurate; a bmm loses ~1e-4 at V=152k)
    else:
        t = torch.zeros_like(s)
    del e
    valid = labels_local >= 0
    z_label = z.gather(-1, labels_local.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    z_label = torch.where(valid, z_label, torch.zeros_like(z_label))
    return m, s, t, z_label


def grad_logits_inplace(
    z: torch.Tensor,
    z_owned: bool,
    labels_local: torch.Tensor,
    lse: torch.Tensor,
    mean_z: torch.Tensor,
    grad_lp: torch.Tensor,
    grad_ent: torch.Tensor | None,
) -> torch.Tensor:
    """d(loss)/dz for fp32 logits z [c, V_local] (before the 1/temperature factor).

    dz_j = grad_lp * (1[j == label] - p_j) + grad_ent * p_j * (mean_z - z_j),  p_j = exp(z_j - lse).
    The probabilities buffer becomes the gradient buffer in place; the chosen-token term is added with
    `scatter_add_` (no one-hot). z is overwritten only when `z_owned` (a buffer nobody else saved).
    """
    p = torch.sub(z, lse.unsqueeze(-1)).exp_()  # [c, V_local] probabilities, becomes dz
    if grad_ent is None:
        p.mul_(grad_lp.neg().unsqueeze(-1))
    else:
        w = z.neg_() if z_owned else z.neg()  # [c, V_local]
        w.add_(mean_z.unsqueeze(-1)).mul_(grad_ent.unsqueeze(-1)).sub_(grad_lp.unsqueeze(-1))
        p.mul_(w)  # p * (grad_ent * (mean_z - z) - grad_lp)
        del w
    valid = labels_local >= 0
    src = torch.where(valid, grad_lp, torch.zeros_like(grad_lp))
    p.scatter_add_(-1, labels_local.clamp(min=0).unsqueeze(-1), src.unsqueeze(-1))
    return p


def save_for_head_backward(ctx, entropy: torch.Tensor, with_entropy: bool, entropy_grad: bool, *saved) -> None:
    """The head Functions' end of forward (logprob.py, logprob_invariant.py): save `saved`; the entropy carries a
    gradient only when asked for (with_entropy and entropy_grad), else it is marked non-differentiable."""
    ctx.save_for_backward(*saved)
    ctx.entropy_has_grad = with_entropy and entropy_grad
    if not ctx.entropy_has_grad:
        ctx.mark_non_differentiable(entropy)
    ctx.set_materialize_grads(False)


def head_output_grads(ctx, grad_lp, grad_ent, like: torch.Tensor):
    """The head Functions' incoming gradients as fp32 [N] (grad_lp zeros when absent, grad_ent None when the
    entropy has none), or None when neither output has one."""
    if not ctx.entropy_has_grad:
        grad_ent = None
    if grad_lp is None and grad_ent is None:
        return None
    return (torch.zeros_like(like) if grad_lp is None else grad_lp.float(),
            None if grad_ent is None else grad_ent.float())


def forward_stats(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels_local: torch.Tensor,
    inv_temp: float,
    with_entropy: bool,
    chunk_size: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden [N, H] (already in weight.dtype), weight [V_local, H], labels_local [N] int64 in
    [0, V_local) or -1. Returns fp32 [N] m, s, t (zeros without entropy), z_label (0 where -1).
    Holds at most one chunk's fp32 [chunk, V_local] logits (+ one exp buffer)."""
    n = hidden.shape[0]
    chunk = chunk_size or pick_chunk_size(n, weight.shape[0], weight.dtype, device=weight.device)
    weight_mm = _mm_operand(weight)
    out = torch.empty(4, n, dtype=torch.float32, device=hidden.device)  # m, s, t, z_label
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        z = _chunk_logits(hidden[start:stop], weight_mm, inv_temp)
        stats = logit_stats(z, labels_local[start:stop], with_entropy)
        del z
        for i, value in enumerate(stats):
            out[i, start:stop] = value
    return out[0], out[1], out[2], out[3]


def backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels_local: torch.Tensor,
    lse: torch.Tensor,
    mean_z: torch.Tensor,
    grad_lp: torch.Tensor,
    grad_ent: torch.Tensor | None,
    inv_temp: float,
    need_hidden_grad: bool,
    need_weight_grad: bool,
    chunk_size: int | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Recompute each chunk's logits and return (grad_hidden fp32 [N, H] | None,
    grad_weight fp32 [V_local, H] | None) for GLOBAL lse / mean_z fp32 [N]. grad_ent None: no entropy
    gradient work at all."""
    n, h = hidden.shape
    v_local = weight.shape[0]
    chunk = chunk_size or pick_chunk_size(n, v_local, weight.dtype, device=weight.device)
    weight_mm = _mm_operand(weight)
    grad_hidden = torch.empty(n, h, dtype=torch.float32, device=hidden.device) if need_hidden_grad else None
    grad_weight = torch.zeros(v_local, h, dtype=torch.float32, device=hidden.device) if need_weight_grad else None
    for start in range(0, n, chunk):
        stop = min(start + chunk, n)
        hidden_c = hidden[start:stop]
        z = _chunk_logits(hidden_c, weight_mm, inv_temp)
        dz = grad_logits_inplace(
            z,
            True,
            labels_local[start:stop],
            lse[start:stop],
            mean_z[start:stop],
            grad_lp[start:stop],
            None if grad_ent is None else grad_ent[start:stop],
        )
        del z
        if inv_temp != 1.0:
            dz.mul_(inv_temp)  # dlogits [c, V_local]
        if weight_mm.dtype != torch.float32:
            dz = dz.to(weight_mm.dtype)  # CUDA low precision: GEMMs take bf16/fp16, return fp32
        if grad_hidden is not None:
            grad_hidden[start:stop] = _mm_f32(dz, weight_mm)
        if grad_weight is not None:
            _addmm_f32_(grad_weight, dz.T, hidden_c)
        del dz
    return grad_hidden, grad_weight
