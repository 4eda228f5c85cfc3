"""The fused head's backward blocking, shared by the Triton and CuTe backends (ops/logprob_triton.py,
ops/logprob_cute.py): each fills a dlogits chunk its own way (`fill_dz`), and this module decides the chunks and
slices from the working-memory budget and does the two gradient GEMMs on cuBLAS. Pure torch: no Triton, no CuTe.

Per token chunk [c0, c1) (an fp32 dHidden accumulator [Ts, H]) and vocab slice [v0, v1): dz = dlogits of the chunk
on the slice (hidden's dtype), dHidden += dz @ W[slice] and dWeight[slice] (+)= dz^T @ h[chunk], straight into the
weight gradient in its dtype. Token chunk outside vocab slice: dHidden is rounded once, dWeight once a token chunk.
"""

from __future__ import annotations

import torch

#: the backward's working memory (the dHidden fp32 accumulator, the dlogits chunk, the per-row vectors), both
#: backends' default: at most 0.25 GiB at any shape; 384 MiB was at most 3% faster in one H200 run
#: (docs/benchmarks/kernel.md). At 65,536 x 2,560 x 151,936, bf16: 6 token chunks of Ts = 11,008, Vs = 6,912.
BWD_BUDGET_BYTES = 256 * 2**20

#: bytes of the backward's per-row fp32 vectors a token (lse, mean_z, grad_lp, grad_ent, CuTe's label logit)
ROW_BYTES = 20


def balanced(total: int, most: int, step: int) -> int:
    """A block size <= max(most, step), a multiple of `step` unless it is `total`, splitting `total` into as few
    near-equal blocks as `most` allows (65,536 rows, at most 13,056: 6 of 11,008, not 5 of 13,056 and 1 of 256)."""
    most = max(step, most // step * step)
    if total <= most:
        return total
    count = -(-total // most)
    size = -(-(-(-total // count)) // step) * step
    return min(size, most)


def bwd_sizes(n: int, v: int, h: int, need_hidden_grad: bool, chunk_size: int | None,
              bm: int, bn: int, budget_bytes: int = BWD_BUDGET_BYTES, itemsize: int = 2) -> tuple[int, int]:
    """(Ts token rows per chunk, Vs vocab columns per slice) of the backward for bm x bn GEMM tiles, from
    `budget_bytes`: half for the fp32 dHidden accumulator [Ts, H] (when dHidden is wanted), the rest, after the
    per-row fp32 vectors (ROW_BYTES a token), for the dlogits chunk [Ts, Vs] in the input dtype (`itemsize` bytes).
    `chunk_size` caps Ts."""
    ts = balanced(n, (budget_bytes // 2) // (4 * h), bm)
    if chunk_size is not None:
        ts = max(1, min(ts, int(chunk_size)))
    left = budget_bytes - ROW_BYTES * n - (4 * h * ts if need_hidden_grad else 0)
    vs = balanced(v, left // (itemsize * ts), bn)
    return ts, vs


def mm_acc(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, overwrite: bool = False) -> None:
    """acc (fp32) += a @ b (or acc = a @ b when `overwrite`: no zero-fill pass) with fp32 accumulation and no
    rounding of a low-precision product."""
    if not acc.is_cuda:  # CPU (interpreter tests): upcast; CPU GEMMs have no fp32-output mode for bf16 operands
        a, b = a.float(), b.float()
    if a.dtype == torch.float32:
        torch.mm(a, b, out=acc) if overwrite else acc.addmm_(a, b)
    else:
        torch.mm(a, b, out_dtype=torch.float32, out=acc) if overwrite else torch.addmm(
            acc, a, b, out_dtype=torch.float32, out=acc)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out = a @ b, or out += a @ b when `accumulate`, in out's dtype: one GEMM with fp32 accumulation (cuBLAS adds
    beta * out in fp32 too), so each call rounds the result to out's dtype once."""
    if out.is_cuda or a.dtype == torch.float32:
        out.addmm_(a, b) if accumulate else torch.mm(a, b, out=out)
    else:  # CPU: no fp32-accumulating bf16 GEMM; upcast, add in fp32, round once
        prod = torch.mm(a.float(), b.float())
        out.copy_(prod + out.float() if accumulate else prod)


def chunked_grads(hidden: torch.Tensor, weight: torch.Tensor, grad_h: torch.Tensor | None,
                  grad_w: torch.Tensor | None, sizes: tuple[int, int], fill_dz, *,
                  row_stride: int | None = None) -> None:
    """The backward's blocking. `sizes` = (Ts, Vs) of bwd_sizes: for each token chunk [c0, c1) (one fp32 dHidden
    accumulator [Ts, H]) and vocab slice [v0, v1), `fill_dz(dz, c0, c1, v0, v1)` writes the chunk's dlogits into dz [c1 - c0, v1 - v0] (hidden's dtype; contiguous, or rows `row_stride`
    elements apart when given), then dz @ weight[v0:v1] goes into the dHidden accumulator and dz^T @ hidden[c0:c1]
    straight into grad_w[v0:v1] (one cuBLAS GEMM in its dtype: written by the first token chunk, added to by the
    next ones; there is no fp32 dWeight buffer and no copy pass). dHidden is rounded once, dWeight once per token
    chunk. The results land in grad_h / grad_w (None: not computed), which must not alias hidden / weight."""
    n, h = hidden.shape
    v = weight.shape[0]
    ts, vs = sizes
    dev = hidden.device
    dz_buf = torch.empty(ts * (row_stride or vs), device=dev, dtype=hidden.dtype)
    dh_acc = torch.empty((ts, h), device=dev, dtype=torch.float32) if grad_h is not None else None
    for c0 in range(0, n, ts):  # token chunk: one fp32 dHidden accumulator, one dlogits buffer
        c1 = min(n, c0 + ts)
        rows = c1 - c0
        for v0 in range(0, v, vs):  # vocab slice
            v1 = min(v, v0 + vs)
            cols = v1 - v0
            dz = (dz_buf[: rows * cols].view(rows, cols) if row_stride is None
                  else dz_buf[: rows * row_stride].view(rows, row_stride)[:, :cols])
            fill_dz(dz, c0, c1, v0, v1)
            if dh_acc is not None:  # the first product overwrites the accumulator (no zero-fill pass)
                mm_acc(dh_acc[:rows], dz, weight[v0:v1], overwrite=(v0 == 0))
            if grad_w is not None:
                mm_into(grad_w[v0:v1], dz.t(), hidden[c0:c1], accumulate=(c0 > 0))
        if dh_acc is not None:
            grad_h[c0:c1].copy_(dh_acc[:rows])
