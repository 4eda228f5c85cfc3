"""The Triton backend of the fused LM-head log-prob: tiled kernels that produce per-shard softmax
statistics and the logits gradient without ever writing a [N, V_local] logits tensor to memory.
It must not know about tensor parallelism or autograd (`logprob.py` combines shards and owns the Function).

Interface (the contract shared with `logprob_torch.py`):

- `forward_stats(hidden, weight, labels_local, inv_temp, with_entropy, chunk_size)` -> four fp32 [N]:
  `m` (max logit of the shard), `s = sum_j exp(z_j - m)`, `t = sum_j exp(z_j - m) * z_j`, `z_label`.
- `backward(hidden, weight, labels_local, lse, mean_z, grad_lp, grad_ent, inv_temp, need_hidden_grad,
  need_weight_grad, chunk_size)` -> (grad_hidden [N, H] | None, grad_weight [V_local, H] | None), in the
  input dtype.

Algorithm.
Forward: one kernel, grid = (token blocks of BLOCK_M) x (vocab splits). Each program walks its range of
vocab tiles of BLOCK_N (`tl.range(flatten=True)`: the K-loops of consecutive tiles are pipelined as one
loop, so the copy engine keeps loading across tile boundaries); per tile it runs the K-loop GEMM
`a = hidden @ weight.T` in fp32 registers and updates an online max / sum-exp / sum(p * a) in units of the
unscaled product (z = a * inv_temp): per element one max, one FFMA + exp2 (`2^(a * inv_temp * log2 e - c)`),
one add, and with entropy one FMA. Only the last tile of an odd vocab is masked (columns >= V_local set
to -1e30: finite, so p = 0 and p * a = 0 there, where -inf would give 0 * -inf = NaN); the label logit is
a separate O(N * H) gather (`_label_logit_kernel`), not a compare-and-select over every tile. Both keep
the epilogue in registers (an H100 build of the earlier -inf mask + label select spilled at 255
registers). The host scales the statistics by inv_temp and merges the splits' partials ([S, N] each,
O(N)) with a log-sum-exp combine. The split index is the fastest grid dimension, so the ~132 programs that
run together share a few hidden blocks and a few weight tiles in L2; the split count (`_fwd_splits`) is
the one, between half and all of ~4 programs per multiprocessor, whose last wave leaves the fewest
multiprocessors idle. On Hopper with bf16/fp16 inputs the GEMM tiles are loaded through TMA tensor
descriptors (-14% forward time vs pointer loads on an H100); fp32 inputs use exact fp32 dots
(input_precision="ieee").

Backward (design "a" of issue 4, the 4-GEMM floor: forward GEMM, recompute, dHidden, dWeight; the blocking and
the two gradient GEMMs are ops/head_blocking.py's, shared with the CuTe backend): per token chunk
(fp32 dHidden accumulator [Ts, H], dlogits buffer [Ts, Vs]) and vocab slice, a Triton kernel recomputes the logit
tiles and writes `dlogits = inv_temp * (grad_lp * (1[j == label] - p_j) + grad_ent * p_j * (mean_z - z_j))` in
the input dtype as `p * (A - B * a)`, the label term only in tiles that hold a label; cuBLAS then does
`dH += dlogits @ W[slice]` into the accumulator (fp32 out; the first product overwrites it) and `dW[slice] (+)=
dlogits.T @ h[chunk]` straight into the weight gradient (its dtype, fp32 inside: no fp32 dWeight buffer, no copy
pass). dHidden is rounded once, dWeight once per token chunk. The working memory, `TritonTuning.bwd_budget_bytes`
(256 MiB with the per-row vectors), is independent of N and V. Tuning: one frozen `TritonTuning` (tiles, the
forward's minimum split count, loop flattening, TMA loads, the budget; defaults tuned on an H100) passed to the
launchers; no module-global knobs. Without `grad_ent` no entropy-gradient arithmetic is compiled in.
Measured: docs/benchmarks/kernel.md.
"""

from __future__ import annotations

import dataclasses

import torch

from rltrain.compat.torch import multiprocessor_count, optional_triton, triton_tensor_descriptor
from rltrain.ops.head_blocking import BWD_BUDGET_BYTES, ROW_BYTES, bwd_sizes, chunked_grads

triton, tl = optional_triton()  # optional: the torch path runs without it
_HAVE_TRITON = triton is not None
_TensorDescriptor = triton_tensor_descriptor()  # None: pointer loads only

__all__ = ["forward_stats", "backward", "is_available", "TritonTuning", "DEFAULT_TUNING"]

Tile = tuple[int, int, int, int, int]  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)


@dataclasses.dataclass(frozen=True)
class TritonTuning:
    """The kernels' tuning knobs; the defaults were tuned on an H100 (docs/benchmarks/kernel.md). No knob changes a
    result beyond floating-point reassociation (tile shapes, split counts and chunk sizes reorder sums)."""

    # tile configs; fp32 inputs use exact fp32 dot products (input_precision="ieee"), which need smaller tiles
    fwd_lowp: Tile = (256, 128, 64, 8, 3)
    bwd_lowp: Tile = (128, 256, 64, 8, 4)
    fwd_fp32: Tile = (64, 64, 32, 4, 2)
    bwd_fp32: Tile = (64, 64, 32, 4, 2)
    fwd_min_splits: int = 8  # see the L2 note in the module docstring
    fwd_flatten: bool = True  # pipeline the K-loops of consecutive vocab tiles as one loop (tl.range(flatten=True))
    use_desc: bool = True  # load GEMM tiles with TMA descriptors where possible (Hopper); False: pointer loads
    # working memory of the backward pass (ops/head_blocking.py: the dHidden fp32 accumulator [Ts, H], the dlogits
    # chunk [Ts, Vs] and the per-row vectors)
    bwd_budget_bytes: int = BWD_BUDGET_BYTES

    def tile(self, kind: str, dtype: torch.dtype) -> Tile:
        """The tile config of `kind` ("fwd" | "bwd") for inputs of `dtype`."""
        return getattr(self, f"{kind}_{'fp32' if dtype == torch.float32 else 'lowp'}")


DEFAULT_TUNING = TritonTuning()

_LOG2E = 1.4426950408889634


def _tuning(tuning: TritonTuning | None) -> TritonTuning:
    """`tuning`, or DEFAULT_TUNING when none is given."""
    return DEFAULT_TUNING if tuning is None else tuning


def is_available() -> bool:
    """True when triton imports and a CUDA device is present."""
    return _HAVE_TRITON and torch.cuda.is_available()


if _HAVE_TRITON:

    @triton.jit
    def _logit_tile(h_ptr, w_ptr, rows, cols, H, stride_h, stride_w,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    EVEN_K: tl.constexpr, IEEE: tl.constexpr):
        """fp32 [BLOCK_M, BLOCK_N] tile of h[rows] @ w[cols].T (not yet scaled by 1/temperature); rows/cols
        already clamped in range (the caller masks the clamped ones out)."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_h + ks[None, :]
        b_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_w + ks[:, None]
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            if EVEN_K:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = ks + k * BLOCK_K < H
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        return acc

    @triton.jit
    def _logit_tile_desc(h_desc, w_desc, row0, col0, H,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Same tile through Hopper's bulk tensor copies (TMA descriptors); rows/cols past the tensor are
        zero-filled by the copy engine, so no clamping is needed."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(H, BLOCK_K)):
            a = h_desc.load([row0, k * BLOCK_K])
            b = w_desc.load([col0, k * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        return acc

    @triton.jit
    def _fwd_stats_kernel(h_ptr, w_ptr, h_desc, w_desc, m_ptr, s_ptr, t_ptr,
                          N, V, H, stride_h, stride_w, scale2, tiles_per_split, num_splits,
                          WITH_ENT: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                          USE_DESC: tl.constexpr, FLATTEN: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Partial statistics of token block pid // num_splits over vocab split pid % num_splits, in units
        of the unscaled product a = h @ w.T (z = a * inv_temp, scale2 = inv_temp * log2(e) > 0): writes
        max a, sum 2^((a - max a) * scale2) and sum 2^(...) * a at [split, row] of the [num_splits, N] outputs.
        Per element: one max, one FFMA + exp2, one add (and one FMA-add pair with entropy); the label logit
        is a separate gather (`_label_logit_kernel`) and only the last, partial vocab tile is masked."""
        pid = tl.program_id(0)
        split = pid % num_splits
        pid_m = pid // num_splits
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < N
        rows_c = tl.minimum(rows, N - 1)

        m = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        s = tl.zeros((BLOCK_M,), dtype=tl.float32)
        t = tl.zeros((BLOCK_M,), dtype=tl.float32)
        tile_lo = split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, tl.cdiv(V, BLOCK_N))
        for tile in tl.range(tile_lo, tile_hi, flatten=FLATTEN):
            if USE_DESC:
                a = _logit_tile_desc(h_desc, w_desc, pid_m * BLOCK_M, tile * BLOCK_N, H, BLOCK_M, BLOCK_N, BLOCK_K)
            else:
                cols_c = tl.minimum(tile * BLOCK_N + tl.arange(0, BLOCK_N), V - 1)
                a = _logit_tile(h_ptr, w_ptr, rows_c, cols_c, H, stride_h, stride_w, BLOCK_M, BLOCK_N, BLOCK_K,
                                EVEN_K, IEEE)
            if (tile + 1) * BLOCK_N > V:  # the last tile of an odd vocab: its columns >= V never count
                cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
                # finite, not -inf: 2^(...) is still exactly 0 there and p * a stays 0 (0 * -inf would be NaN)
                a = tl.where((cols < V)[None, :], a, -1.0e30)
            m_new = tl.maximum(m, tl.max(a, axis=1))
            alpha = tl.exp2((m - m_new) * scale2)
            p = tl.exp2(a * scale2 - (m_new * scale2)[:, None])
            s = s * alpha + tl.sum(p, axis=1)
            if WITH_ENT:
                t = t * alpha + tl.sum(p * a, axis=1)
            m = m_new
        out = split * N + rows
        tl.store(m_ptr + out, m, mask=row_ok)
        tl.store(s_ptr + out, s, mask=row_ok)
        tl.store(t_ptr + out, t, mask=row_ok)

    @triton.jit
    def _label_logit_kernel(h_ptr, w_ptr, lab_ptr, out_ptr, N, V, H, stride_h, stride_w, inv_temp,
                            BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        """out[i] = (h[i] . w[label_i]) * inv_temp in fp32 (exact products of the inputs), 0 where label_i is
        not in [0, V) (-1: the label is in another vocab shard); never reads outside w."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        row_ok = rows < N
        lab = tl.load(lab_ptr + rows, mask=row_ok, other=-1)
        ok = row_ok & (lab >= 0) & (lab < V)
        lab_c = tl.where(ok, lab, 0)
        ks = tl.arange(0, BLOCK_H)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_H):
            k_ok = (ks + k0) < H
            msk = ok[:, None] & k_ok[None, :]
            a = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + (ks + k0)[None, :], mask=msk, other=0.0)
            b = tl.load(w_ptr + lab_c[:, None].to(tl.int64) * stride_w + (ks + k0)[None, :], mask=msk, other=0.0)
            acc += tl.sum(a.to(tl.float32) * b.to(tl.float32), axis=1)
        tl.store(out_ptr + rows, acc * inv_temp, mask=row_ok)

    @triton.jit
    def _dlogits_kernel(h_ptr, w_ptr, h_desc, w_desc, lab_ptr, lse_ptr, mz_ptr, glp_ptr, gent_ptr, dz_ptr,
                        N, V, H, col_offset, stride_h, stride_w, stride_dz, inv_temp,
                        HAS_ENT: tl.constexpr, EVEN_K: tl.constexpr, IEEE: tl.constexpr,
                        USE_DESC: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr):
        """dz[N, V] (V = this vocab slice, global column = col + col_offset) for one [BLOCK_M, BLOCK_N]
        tile, tiles ordered in groups of GROUP_M token blocks for L2 reuse of the weight tiles.

        With a = h @ w.T (unscaled), z = a * inv_temp, p = exp(z - lse):
        dz = inv_temp * (glp * (1[label] - p) + gent * p * (mz - z)) = p * (A - B * a) + 1[label] * glp * inv_temp,
        A = inv_temp * (gent * mz - glp), B = gent * inv_temp^2 (per row): an FFMA, an exp2 and two multiplies
        per element; the label term is added only in tiles that hold a row's label (~1 in 5 at 128 x 256)."""
        pid = tl.program_id(0)
        n_m = tl.cdiv(N, BLOCK_M)
        n_n = tl.cdiv(V, BLOCK_N)
        per_group = GROUP_M * n_n
        group = pid // per_group
        first_m = group * GROUP_M
        size_m = tl.minimum(n_m - first_m, GROUP_M)
        pid_m = first_m + (pid % per_group) % size_m
        pid_n = (pid % per_group) // size_m

        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        col_ok = cols < V
        rows_c = tl.minimum(rows, N - 1)
        if USE_DESC:
            a = _logit_tile_desc(h_desc, w_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, H, BLOCK_M, BLOCK_N, BLOCK_K)
        else:
            a = _logit_tile(h_ptr, w_ptr, rows_c, tl.minimum(cols, V - 1), H, stride_h, stride_w, BLOCK_M,
                            BLOCK_N, BLOCK_K, EVEN_K, IEEE)
        lse = tl.load(lse_ptr + rows_c)
        glp = tl.load(glp_ptr + rows_c)
        labels = tl.load(lab_ptr + rows_c)
        p = tl.exp2(a * (inv_temp * 1.4426950408889634) - (lse * 1.4426950408889634)[:, None])
        if HAS_ENT:
            mz = tl.load(mz_ptr + rows_c)
            gent = tl.load(gent_ptr + rows_c)
            coef_a = inv_temp * (gent * mz - glp)
            coef_b = gent * (inv_temp * inv_temp)
            dz = p * (coef_a[:, None] - coef_b[:, None] * a)
        else:
            dz = p * (-glp * inv_temp)[:, None]
        lab_col = labels - col_offset - pid_n * BLOCK_N  # the label's column in this tile, per row
        hit = row_ok & (lab_col >= 0) & (lab_col < BLOCK_N)
        if tl.max(hit.to(tl.int32), axis=0) > 0:
            is_label = tl.arange(0, BLOCK_N)[None, :] == tl.where(hit, lab_col, -1)[:, None]
            dz = tl.where(is_label, dz + (glp * inv_temp)[:, None], dz)
        ptrs = dz_ptr + rows[:, None].to(tl.int64) * stride_dz + cols[None, :]
        tl.store(ptrs, dz.to(dz_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _check(hidden: torch.Tensor, weight: torch.Tensor, labels_local: torch.Tensor) -> None:
    if not _HAVE_TRITON:
        raise RuntimeError("rltrain.ops.logprob_triton needs the 'triton' package (pip install triton)")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, H] and weight [V_local, H] must share H, got {tuple(hidden.shape)} "
                         f"and {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden ({hidden.dtype}) must already be cast to weight.dtype ({weight.dtype})")
    if labels_local.shape != (hidden.shape[0],):
        raise ValueError(f"labels_local must be [N]={hidden.shape[0]}, got {tuple(labels_local.shape)}")


def _descs(hidden: torch.Tensor, weight: torch.Tensor, bm: int, bn: int, bk: int, use_desc: bool = True):
    """TMA descriptors for the two GEMM operands, or (hidden, weight) as unused placeholders when the
    copy engine can't be used (CPU/interpreter, fp32 inputs, pre-Hopper GPU, rows not 16-byte aligned)."""
    ok = (use_desc and _TensorDescriptor is not None and hidden.is_cuda and hidden.dtype != torch.float32
          and torch.cuda.get_device_capability(hidden.device)[0] >= 9
          and all(x.stride(0) * x.element_size() % 16 == 0 and x.data_ptr() % 16 == 0 for x in (hidden, weight)))
    if not ok:
        return hidden, weight, False
    return (_TensorDescriptor.from_tensor(hidden, [bm, bk]), _TensorDescriptor.from_tensor(weight, [bn, bk]),
            True)


def forward_stats(hidden: torch.Tensor, weight: torch.Tensor, labels_local: torch.Tensor, inv_temp: float,
                  with_entropy: bool, chunk_size: int | None = None, *, num_splits: int | None = None,
                  tuning: TritonTuning | None = None):
    """Per-shard statistics of z = (hidden @ weight.T) * inv_temp, never writing z to memory.

    hidden [N, H] (weight's dtype), weight [V_local, H], labels_local [N] int64 in [0, V_local) or -1.
    Returns fp32 [N] tensors (m, s, t, z_label) as in the module docstring; t is 0 when with_entropy is
    False. `chunk_size` is accepted for the shared interface and unused (the kernel tiles by itself);
    `num_splits` overrides the number of vocab splits (benchmark sweeps); `tuning`: the kernels' knobs (module
    docstring)."""
    _check(hidden, weight, labels_local)
    tuning = _tuning(tuning)
    n, h = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    if n == 0:
        z = torch.zeros(0, device=dev, dtype=torch.float32)
        return z, z.clone(), z.clone(), z.clone()
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    labels_local = labels_local.to(torch.int64).contiguous()
    if not inv_temp > 0:
        raise ValueError(f"inv_temp must be > 0, got {inv_temp}")
    bm, bn, bk, warps, stages = tuning.tile("fwd", hidden.dtype)
    n_m = triton.cdiv(n, bm)
    n_tiles = triton.cdiv(v, bn)
    if num_splits is None:
        num_splits = _fwd_splits(n_m, n_tiles, multiprocessor_count(dev), tuning.fwd_min_splits)
    num_splits = min(num_splits, n_tiles)
    tiles_per_split = triton.cdiv(n_tiles, num_splits)
    num_splits = triton.cdiv(n_tiles, tiles_per_split)  # no empty split
    part = torch.empty((3, num_splits, n), device=dev, dtype=torch.float32)
    h_desc, w_desc, use_desc = _descs(hidden, weight, bm, bn, bk, tuning.use_desc)
    _fwd_stats_kernel[(n_m * num_splits,)](
        hidden, weight, h_desc, w_desc, part[0], part[1], part[2],
        n, v, h, hidden.stride(0), weight.stride(0), float(inv_temp) * _LOG2E, tiles_per_split, num_splits,
        WITH_ENT=bool(with_entropy), EVEN_K=(h % bk == 0), IEEE=(hidden.dtype == torch.float32),
        USE_DESC=use_desc, FLATTEN=tuning.fwd_flatten, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
        num_stages=stages)
    z_label = torch.empty(n, device=dev, dtype=torch.float32)
    _label_logit_kernel[(triton.cdiv(n, 32),)](hidden, weight, labels_local, z_label, n, v, h, hidden.stride(0),
                                               weight.stride(0), float(inv_temp), BLOCK_R=32, BLOCK_H=128,
                                               num_warps=4)
    m_p, s_p, t_p = part  # in units of the unscaled product (see the kernel)
    if num_splits == 1:
        m, s, t = m_p[0], s_p[0], t_p[0]
    else:
        m = m_p.max(dim=0).values
        scale = torch.exp((m_p - m) * inv_temp)  # [S, N]; every split has >= 1 in-range column: m_p is finite
        s, t = (s_p * scale).sum(0), (t_p * scale).sum(0)
    return m * inv_temp, s, t * inv_temp, z_label


def _fwd_splits(n_m: int, n_tiles: int, sms: int, min_splits: int | None = None) -> int:
    """Vocab splits of the forward grid: at least `min_splits` (TritonTuning.fwd_min_splits; L2 reuse of the weight tiles) and
    enough for ~4 programs per multiprocessor; among half that count up to it, the one whose last wave of
    programs leaves the fewest multiprocessors idle (e.g. 8,192 tokens on 132 SMs: 16 splits = 3.9 waves
    instead of 17 = 4.1, whose fifth wave runs 16 programs on an otherwise idle chip)."""
    min_splits = DEFAULT_TUNING.fwd_min_splits if min_splits is None else min_splits
    want = max(min_splits, triton.cdiv(4 * sms, n_m))
    want = max(1, min(want, n_tiles // 4 if n_tiles >= 4 else 1))

    def busy(splits: int) -> float:
        programs = n_m * splits
        return programs / (triton.cdiv(programs, sms) * sms)

    # splits as the grid gets them: no empty split (tiles_per_split = cdiv(n_tiles, splits))
    options = {triton.cdiv(n_tiles, triton.cdiv(n_tiles, sp)) for sp in range(max(1, (want + 1) // 2), want + 1)}
    return max(options, key=lambda sp: (round(busy(sp), 3), sp))


def backward(hidden: torch.Tensor, weight: torch.Tensor, labels_local: torch.Tensor, lse: torch.Tensor,
             mean_z: torch.Tensor, grad_lp: torch.Tensor | None, grad_ent: torch.Tensor | None,
             inv_temp: float, need_hidden_grad: bool, need_weight_grad: bool, chunk_size: int | None = None, *,
             tuning: TritonTuning | None = None):
    """Gradients of sum(grad_lp * logprob + grad_ent * entropy) w.r.t. hidden [N, H] and weight [V_local, H].

    lse, mean_z: fp32 [N] global statistics; grad_lp fp32 [N]; grad_ent fp32 [N] or None (no entropy
    gradient work). Returns (grad_hidden | None, grad_weight | None) in hidden's dtype. `chunk_size`
    (tokens per dlogits chunk) overrides the budget-derived chunk; `tuning`: the kernels' knobs."""
    _check(hidden, weight, labels_local)
    tuning = _tuning(tuning)
    n, h = hidden.shape
    v = weight.shape[0]
    dev, dtype = hidden.device, hidden.dtype
    if not (need_hidden_grad or need_weight_grad):
        return None, None
    grad_h = torch.empty_like(hidden) if need_hidden_grad else None
    grad_w = torch.empty_like(weight) if need_weight_grad else None
    if n == 0:
        return (grad_h, grad_w)
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    labels_local = labels_local.to(torch.int64).contiguous()
    lse = lse.float().contiguous()
    mean_z = mean_z.float().contiguous()
    grad_lp = torch.zeros(n, device=dev) if grad_lp is None else grad_lp.float().contiguous()
    has_ent = grad_ent is not None
    grad_ent = grad_ent.float().contiguous() if has_ent else grad_lp  # placeholder pointer, never read
    bm, bn, bk, warps, stages = tuning.tile("bwd", dtype)
    sizes = bwd_sizes(n, v, h, need_hidden_grad, chunk_size, bm, bn, tuning.bwd_budget_bytes,
                      hidden.element_size())

    def fill_dz(dz: torch.Tensor, c0: int, c1: int, v0: int, v1: int) -> None:
        rows, cols = c1 - c0, v1 - v0
        w_sl = weight[v0:v1]
        grid = (triton.cdiv(rows, bm) * triton.cdiv(cols, bn),)
        h_desc, w_desc, use_desc = _descs(hidden[c0:c1], w_sl, bm, bn, bk, tuning.use_desc)
        _dlogits_kernel[grid](
            hidden[c0:c1], w_sl, h_desc, w_desc, labels_local[c0:c1], lse[c0:c1], mean_z[c0:c1], grad_lp[c0:c1],
            grad_ent[c0:c1], dz, rows, cols, h, v0, hidden.stride(0), weight.stride(0), dz.stride(0),
            float(inv_temp), HAS_ENT=has_ent, EVEN_K=(h % bk == 0), IEEE=(dtype == torch.float32),
            USE_DESC=use_desc, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps,
            num_stages=stages)

    chunked_grads(hidden, weight, grad_h, grad_w, sizes, fill_dz)
    return grad_h, grad_w


def _bwd_extra_bytes(n: int, v: int, h: int, dtype: torch.dtype, tuning: TritonTuning | None = None) -> int:
    """Working memory `backward` allocates beyond its outputs (for docs and the memory test): the dHidden
    accumulator, the dlogits chunk and the fp32 copies of the four per-row vectors."""
    tuning = _tuning(tuning)
    bm, bn = tuning.tile("bwd", dtype)[:2]
    itemsize = torch.tensor([], dtype=dtype).element_size()
    ts, vs = bwd_sizes(n, v, h, True, None, bm, bn, tuning.bwd_budget_bytes, itemsize)
    return ts * h * 4 + ts * vs * itemsize + ROW_BYTES * n
