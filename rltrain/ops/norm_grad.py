"""The gradient of RMSNorm, y = w * (x * rsqrt(mean(x^2) + eps)), without recomputing the forward: one Triton
kernel on CUDA (each program walks a run of rows, writes their input gradient and keeps a partial weight gradient
in fp32; the partials are summed once), the same formula in torch elsewhere.

For forwards computed by another engine's kernel (models/megatron/invariant.py under rollout.true_on_policy), whose
backward is this plain formula's: with r = rsqrt(mean(x^2) + eps), n = x * r, gn = g * w (all fp32),

    dx = r * (gn - n * mean(gn * n)),        dw = sum over rows of g * n.

Agrees with autograd through the plain torch formula to the rounding of the inputs' dtype (tests/ops/test_norm_grad.py).
Pure tensor math.
"""

from __future__ import annotations

import torch

from rltrain.compat.torch import multiprocessor_count, optional_triton, triton_interpreting

triton, tl = optional_triton()  # optional: the torch path runs without it
_HAVE_TRITON = triton is not None

__all__ = ["rms_norm_backward"]

_TILE_ELEMENTS = 4096  # elements of one [rows, BLOCK] tile a program holds at once


def rms_norm_backward(x: torch.Tensor, weight: torch.Tensor, grad: torch.Tensor, eps: float,
                      need_weight_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., H] (the norm's input), weight [H], grad [..., H] (of the output) -> (dx in x's dtype, dw in the
    weight's dtype, or None when not needed)."""
    if x.shape != grad.shape or x.shape[-1] != weight.shape[-1] or weight.dim() != 1:
        raise ValueError(f"rms_norm_backward: x {list(x.shape)}, grad {list(grad.shape)} and weight "
                         f"{list(weight.shape)} disagree")
    h = x.shape[-1]
    x2, g2 = x.reshape(-1, h), grad.reshape(-1, h)
    use_triton = _HAVE_TRITON and (x.is_cuda or triton_interpreting())
    if use_triton and x2.shape[0] > 0:
        dx, dw = _triton(x2.contiguous(), weight.contiguous(), g2.contiguous(), eps, need_weight_grad)
    else:
        dx, dw = _torch(x2, weight, g2, eps, need_weight_grad)
    return dx.view(x.shape), (dw.to(weight.dtype) if dw is not None else None)


def _torch(x, w, g, eps, need_w):
    x32, g32 = x.float(), g.float()
    r = torch.rsqrt(x32.square().sum(-1, keepdim=True) / x.shape[-1] + eps)
    n = x32 * r
    gn = g32 * w.float()
    dx = (gn - n * ((gn * n).sum(-1, keepdim=True) / x.shape[-1])) * r
    return dx.to(x.dtype), ((g32 * n).sum(0) if need_w else None)


def _triton(x, w, g, eps, need_w):
    rows, h = x.shape
    block = triton.next_power_of_2(h)
    block_r = max(1, min(64, _TILE_ELEMENTS // block))
    tiles = triton.cdiv(rows, block_r)
    programs = min(tiles, 4 * multiprocessor_count(x.device))
    tiles_per_program = triton.cdiv(tiles, programs)
    programs = triton.cdiv(tiles, tiles_per_program)
    dx = torch.empty_like(x)
    partial = torch.empty(programs if need_w else 1, h, dtype=torch.float32, device=x.device)
    _rms_norm_bwd_kernel[(programs,)](
        x, w, g, dx, partial, rows, h, float(eps), tiles_per_program,
        NEED_W=need_w, BLOCK_R=block_r, BLOCK=block, num_warps=4 if block * block_r <= 2048 else 8)
    return dx, (partial.sum(0) if need_w else None)


if _HAVE_TRITON:

    @triton.jit
    def _rms_norm_bwd_kernel(x_ptr, w_ptr, g_ptr, dx_ptr, dw_ptr, n_rows, n_cols, eps, tiles_per_program,
                             NEED_W: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        col_ok = cols < n_cols
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        for t in range(tiles_per_program):
            rows = (pid * tiles_per_program + t) * BLOCK_R + tl.arange(0, BLOCK_R)
            ok = (rows < n_rows)[:, None] & col_ok[None, :]
            offs = rows.to(tl.int64)[:, None] * n_cols + cols[None, :]
            x = tl.load(x_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + offs, mask=ok, other=0.0).to(tl.float32)
            r = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / n_cols + eps)
            n = x * r[:, None]
            gn = g * w[None, :]
            dot = tl.sum(gn * n, axis=1) / n_cols
            dx = (gn - n * dot[:, None]) * r[:, None]
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=ok)
            if NEED_W:
                dw += tl.sum(g * n, axis=0)
        if NEED_W:
            tl.store(dw_ptr + pid * n_cols + cols, dw, mask=col_ok)
