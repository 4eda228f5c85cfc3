"""CuTe-DSL backend of the fused head (Hopper): the logits GEMM is quack-kernels' persistent, warp-specialized
SM90 GEMM (TMA loads, producer/consumer warp groups, ping-pong consumers), and the softmax statistics are its
epilogue, so the [T, V] logits never reach memory.

Forward, per row chunk, one GEMM z = (hidden @ weight.T) * inv_temp whose epilogue folds every (row, vocab
tile) into

    lse_tile = log sum_j exp(z_j)          (_OnlineStatsReduce below, one pass with one exp per element: running
    mean_tile = sum_j p_j z_j / sum_j p_j   max m, s = sum of exp(z - m), t = sum of exp(z - m) (z - m))
    z_label                                 (quack's ColVecSelect: the label's fp32 logit, this shard only)

and one Triton launch merges a row's tiles (`merge_tiles`): lse = logsumexp(lse_tile), mean_z = sum w mean_tile /
sum w with w = exp(lse_tile - max) (dividing by sum w keeps lse's rounding, ~1 ulp of |lse| times |mean_z|, out of
the entropy lse - mean_z). The statistics go back as (m, s, t) = (lse, 1, mean_z), which the tensor-parallel combine
of ops/logprob.py merges as it does the other backends'.

Backward, per (token chunk, vocab slice), one GEMM recomputes z and its epilogue writes

    dz_j = p_j (grad_ent (mean_z - z_j) - grad_lp) * inv_temp,   p_j = exp(z_j - lse)

in the input dtype, the label's fp32 logit beside it (ColVecSelect); the label column is then set on the host
to its exact fp32 value grad_lp (1 - p_y) + grad_ent p_y (mean_z - z_y) (times inv_temp), and dz feeds the
dHidden GEMM (fp32 accumulator) and the dWeight GEMM (into the weight gradient) through the blocking both
backends share, `head_blocking.chunked_grads`, with the same working-memory budget (256 MiB, under 0.25 GiB with
everything the backward holds).

Requirements, checked by `supports` (the caller falls back to Triton otherwise, and says so once): an SM90
device, bf16 or fp16 operands, H a multiple of 8 (TMA's 16-byte row alignment). quack-kernels and
nvidia-cutlass-dsl are optional: without them this module imports and `is_available()` is False.
Tested pair: quack-kernels 0.6.5 with nvidia-cutlass-dsl 4.8.1 (pyproject's `cute` extra).
"""

from __future__ import annotations

import collections
import functools
import logging

import torch

from rltrain.compat.torch import optional_triton, triton_interpreting
from rltrain.ops.head_blocking import BWD_BUDGET_BYTES, ROW_BYTES, bwd_sizes, chunked_grads

log = logging.getLogger(__name__)

#: (tile_M, tile_N, cluster_M, cluster_N, pingpong) of the forward (statistics) and backward (dlogits) GEMMs.
FWD_TILE = (128, 192, 2, 1, True)
BWD_TILE = (128, 192, 2, 1, True)
#: bytes of fp32 tile partials (one [rows, 2 * V / tile_N] buffer: means and log-sum-exps) one forward chunk may hold.
FWD_PARTIALS_BUDGET = 128 * 1024 * 1024

triton, tl = optional_triton()
#: the most vocab tiles `merge_tiles` folds in one Triton program (a row's tiles held at once); more: torch ops.
MERGE_MAX_TILES = 8192

_IMPORT_ERROR: Exception | None = None
try:
    import cutlass
    import cutlass.cute as cute
    from cutlass import Float32, const_expr
    from quack import layout_utils
    from quack.epilogue.frontend import gemm_epilogue
    from quack.epilogue.math import pexp
    from quack.epilogue.ops import ColVecLoad, ColVecReduce, ColVecSelect, OnlineLSEReduce, Scalar
    from quack.gemm_runtime.host import run_gemm_epi_plan
except Exception as exc:  # ImportError, or the DSL failing to initialise
    _IMPORT_ERROR = exc



def _source_digest(cls) -> str:
    import hashlib
    import inspect

    return hashlib.sha256(inspect.getsource(cls).encode()).hexdigest()[:16]


if _IMPORT_ERROR is None:

    class _OnlineStatsReduce(OnlineLSEReduce):
        """Per (row, N tile), from one pass over the tile's elements: its log-sum-exp m + log s and its softmax
        mean of z, m + t / s, with e_j = exp(z_j - m), s = sum_j e_j, t = sum_j e_j (z_j - m) and m the running
        max: one exp per element serves both. t is taken relative to the running max, so the mean's large part m
        is exact and only the small correction t / s carries the exps' rounding (sum e z would lose |z| /
        |z - m| times more to cancellation against the log-sum-exp). A new max m' rebases t:
        t' = exp(m - m') (t + (m - m') s). Ragged last tiles: out-of-range elements are masked to -inf; their
        t term is selected to 0 (0 * -inf would be NaN).

        The sink buffer is [rows, 2 * n_tiles]: the means in its first n_tiles columns (the write quack's
        ColVecReduce does, through `_finalize`), the log-sum-exps in the last n_tiles (`end_loop_finish`)."""

        reduce_planes = 3

        def config_key(self):
            # quack keys compiled kernels by the op's type, name and config_key, not by its code: the digest of
            # this class's source makes an edited op compile anew instead of reusing a cached kernel
            return (*super().config_key(), _source_digest(type(self)))

        def sink_alloc_shape(self, lead, n, tile_m, tile_n, num_seqs=None):
            return (*lead, 2 * -(-n // tile_n))

        def host_finalize(self, partials):  # the caller passes and reads the raw per-tile buffer
            return partials

        @cute.jit
        def end_loop_finish(self, gemm, param, staged, tile_coord_mnkl, varlen_manager):
            """quack's merge across lanes and warps and its write of the mean (which leaves the merged (m, s, t)
            in the owning lanes' registers), then the log-sum-exp from the same lanes, n_tiles columns on."""
            ColVecReduce.end_loop_finish(self, gemm, param, staged, tile_coord_mnkl, varlen_manager)
            vals_m, t_dcd_m = staged[0], staged[1]
            warps_in_n, warp_n_idx, is_lane_n_leader = staged[3], staged[4], staged[5]
            use_swap_shuffle, num_slices, slice_elems, lane_g = staged[6], staged[7], staged[8], staged[9]
            tile_m = gemm.cta_tile_shape_mnk[0]
            batch_idx = tile_coord_mnkl[3]
            limit_m = min(varlen_manager.len_m(batch_idx) - tile_coord_mnkl[0] * tile_m, tile_m)
            n_tiles = param.shape[2] // 2
            g_lse = cute.local_tile(param[batch_idx, None, n_tiles + tile_coord_mnkl[1]], (tile_m,),
                                    (tile_coord_mnkl[0],))
            if const_expr(use_swap_shuffle):
                in_warp0 = True if const_expr(warps_in_n == 1) else warp_n_idx == 0
                if tile_coord_mnkl[1] < n_tiles and in_warp0 and lane_g < num_slices:
                    for j in cutlass.range_constexpr(slice_elems):
                        row_idx = t_dcd_m[lane_g * slice_elems + j][0]
                        if row_idx < limit_m:
                            g_lse[row_idx] = cute.math.log(vals_m[1][j], fastmath=True) + vals_m[0][j]
            else:
                writer = is_lane_n_leader if const_expr(warps_in_n == 1) else warp_n_idx == 0 and is_lane_n_leader
                if tile_coord_mnkl[1] < n_tiles and writer:
                    for m in cutlass.range(cute.size(t_dcd_m, mode=[0])):
                        row_idx = t_dcd_m[m][0]
                        if row_idx < limit_m:
                            g_lse[row_idx] = cute.math.log(vals_m[1][m], fastmath=True) + vals_m[0][m]

        @cute.jit
        def _end_loop_values(self, state, epi_coord):
            return (
                state[0][None, None, None, epi_coord[0], epi_coord[1]],
                state[1][None, None, None, epi_coord[0], epi_coord[1]],
                state[2][None, None, None, epi_coord[0], epi_coord[1]],
            )

        @cute.jit
        def _end_loop_smem(self, state):
            return state[3]

        @cute.jit
        def _merge(self, vals, others):
            m, s, t = vals
            om, os_, ot = others
            m_new = cute.arch.fmax(m, om)
            m_sub = self._guard_neg_inf(m_new)
            a = cute.math.exp(m - m_sub, fastmath=True)
            b = cute.math.exp(om - m_sub, fastmath=True)
            return (m_new, s * a + os_ * b, a * self._rebase(t, s, m - m_sub) + b * self._rebase(ot, os_, om - m_sub))

        @cute.jit
        def _rebase(self, t, s, shift):
            """t + shift * s, the sum of e (z - m) moved to a new max m - shift; 0 for an empty slot (s = 0,
            shift = -inf)."""
            return t + Float32(cutlass.select_(s > Float32(0.0), shift * s, Float32(0.0)))

        @cute.jit
        def _finalize(self, vals):
            return vals[0] + vals[2] / vals[1]

        @cute.jit
        def begin(self, gemm, param, smem_tensor, ctx):
            vec_mma_layout = cute.make_layout((ctx.tile_M, ctx.tile_N), stride=self._broadcast_stride())
            acc_layout = ctx.partition_for_epilogue_fn(cute.make_rmem_tensor(vec_mma_layout, Float32)).layout
            r_max = cute.make_rmem_tensor(acc_layout, Float32)
            r_sum = cute.make_rmem_tensor(acc_layout, Float32)
            r_t = cute.make_rmem_tensor(acc_layout, Float32)
            t_cd = ctx.partition_for_epilogue_fn(cute.make_identity_tensor((ctx.tile_M, ctx.tile_N)))
            limit_n = ctx.varlen_manager.len_n() - ctx.tile_coord_mnkl[1] * ctx.tile_N
            return (r_max, r_sum, r_t, smem_tensor, t_cd, limit_n)

        @cute.jit
        def begin_loop(self, gemm, state, epi_coord):
            m_cur = state[0][None, None, None, epi_coord[0], epi_coord[1]]
            s_cur = state[1][None, None, None, epi_coord[0], epi_coord[1]]
            t_cur = state[2][None, None, None, epi_coord[0], epi_coord[1]]
            if const_expr(epi_coord[self._reduce_dim()] == 0):
                cute.filter_zeros(m_cur).fill(self._NEG_INF)
                cute.filter_zeros(s_cur).fill(0.0)
                cute.filter_zeros(t_cur).fill(0.0)
            c_cur = state[4][None, None, None, epi_coord[0], epi_coord[1]]
            return (m_cur, s_cur, t_cur, c_cur, state[5])

        @cute.jit
        def _fold3(self, m_acc, s_acc, t_acc, frag, coords, limit_n, tile_shape_mn):
            lay_n = cute.composition(cute.make_layout(tile_shape_mn, stride=(0, 1)), coords.layout)
            limit_rel = limit_n - coords[0][1]
            for i in cutlass.range(cute.size(frag), unroll_full=True):
                off_n = cute.crd2idx(i, lay_n)
                frag[i] = frag[i] if off_n < limit_rel else self._NEG_INF
            ref = m_acc.layout
            frag_g = layout_utils.convert_layout_zero_stride(frag, ref)
            m_g = layout_utils.convert_layout_zero_stride(m_acc, ref)[None, 0]
            s_g = layout_utils.convert_layout_zero_stride(s_acc, ref)[None, 0]
            t_g = layout_utils.convert_layout_zero_stride(t_acc, ref)[None, 0]
            n_aliased = const_expr(cute.size(frag_g, mode=[1]))
            for si in cutlass.range(cute.size(m_g), unroll_full=True):
                m_old = m_g[si]
                vmax = frag_g[si, 0]
                for j in cutlass.range_constexpr(1, n_aliased):
                    vmax = cute.arch.fmax(vmax, frag_g[si, j])
                m_new = cute.arch.fmax(m_old, vmax)
                m_sub = self._guard_neg_inf(m_new)
                rescale = cute.math.exp(m_old - m_sub, fastmath=True)
                s_old = s_g[si]
                s_new = s_old * rescale
                t_new = rescale * self._rebase(t_g[si], s_old, m_old - m_sub)
                for j in cutlass.range_constexpr(n_aliased):
                    x = frag_g[si, j] - m_sub
                    e = cute.math.exp(x, fastmath=True)
                    s_new = s_new + e
                    t_new = t_new + Float32(cutlass.select_(e > Float32(0.0), e * x, Float32(0.0)))
                s_g[si] = s_new
                t_g[si] = t_new
                m_g[si] = m_new

        @cute.jit
        def fn_sink_flush(self, gemm, state, frag):
            self._fold3(state[0], state[1], state[2], frag, state[3], state[4],
                        tile_shape_mn=gemm.cta_tile_shape_mnk[:2])

    _fwd_label = ColVecLoad("label")

    @gemm_epilogue(
        ops={"inv_temp": Scalar("inv_temp")},
        outs={
            "stats": _OnlineStatsReduce("stats"),
            "zy": ColVecSelect("zy", idx_op=_fwd_label),
        },
        extra_ops=(_fwd_label,),
    )
    def _stats_epi(acc, inv_temp):
        """Forward: per-tile log-sum-exp and softmax mean of z = acc * inv_temp, and the label's z."""
        z = acc * inv_temp
        return {"stats": z, "zy": z}

    _bwd_label = ColVecLoad("label")

    @gemm_epilogue(
        ops={"inv_temp": Scalar("inv_temp"), "lse": ColVecLoad("lse"), "mean": ColVecLoad("mean"),
             "glp": ColVecLoad("glp"), "gent": ColVecLoad("gent")},
        outs={"zy": ColVecSelect("zy", idx_op=_bwd_label)},
        extra_ops=(_bwd_label,),
    )
    def _dlogits_epi(acc, inv_temp, lse, mean, glp, gent):
        """Backward: dz = p (grad_ent (mean - z) - grad_lp) inv_temp without the label term (set on the host
        from the exact fp32 label logit written beside it)."""
        z = acc * inv_temp
        p = pexp(z - lse)
        return {"D": p * (gent * (mean - z) - glp) * inv_temp, "zy": z}


def is_available() -> bool:
    """True when quack-kernels and the CuTe DSL import and a Hopper (SM90) GPU is present."""
    return _IMPORT_ERROR is None and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def unavailable_reason() -> str:
    if _IMPORT_ERROR is not None:
        return (f"quack-kernels / nvidia-cutlass-dsl do not import ({type(_IMPORT_ERROR).__name__}: "
                f"{_IMPORT_ERROR}); pip install 'rltrain[cute]'")
    if not torch.cuda.is_available():
        return "no CUDA device"
    return f"CUDA capability {torch.cuda.get_device_capability()} is not SM90 (Hopper)"


def supports(hidden: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why these operands cannot take the CuTe kernels (None when they can): the GEMMs need 16-bit operands
    and 16-byte-aligned rows (TMA)."""
    if hidden.dtype not in (torch.bfloat16, torch.float16) or weight.dtype != hidden.dtype:
        return f"needs bf16/fp16 operands of one dtype, got hidden {hidden.dtype}, weight {weight.dtype}"
    if hidden.shape[1] % 8:
        return f"needs the hidden size a multiple of 8 (TMA row alignment), got {hidden.shape[1]}"
    if hidden.device.type != "cuda" or torch.cuda.get_device_capability(hidden.device)[0] != 9:
        return "needs an SM90 (Hopper) CUDA device"
    return None


@functools.cache
def _fallback():
    from rltrain.ops import logprob_triton

    return logprob_triton


def _warn_fallback(why: str) -> None:
    _warn_once(f"fused_linear_logprob_backend=cute falls back to triton: {why}")


@functools.cache
def _warn_once(msg: str) -> None:
    log.warning(msg)


def _gemm_kwargs(tile) -> dict:
    tile_m, tile_n, cluster_m, cluster_n, pingpong = tile
    return dict(tile_M=tile_m, tile_N=tile_n, cluster_M=cluster_m, cluster_N=cluster_n, pingpong=pingpong)


#: launch plans of the GEMMs, by operand metadata (the most recent PLAN_CACHE_SIZE)
PLAN_CACHE_SIZE = 256
_PLANS: collections.OrderedDict = collections.OrderedDict()


def _meta(value):
    if isinstance(value, torch.Tensor):
        return value.dtype, tuple(value.shape), value.stride(), value.device.index
    return type(value).__name__, value  # a scalar: 1.0 and other values compile to different kernels


def _launch(epi, a: torch.Tensor, b: torch.Tensor, d: torch.Tensor | None, epi_args: dict, tile) -> None:
    """The GEMM a @ b.T with epilogue `epi` (d: its output, or None). quack's plan (kernel and launch recipe) is
    resolved once per operand metadata -- compiling on the first call -- and then launched directly: quack's
    `gemm` rebuilds its cache key (some 40 fields, every operand's metadata) and looks the plan up on every call,
    host time before the kernel is queued that an idle GPU waits out at the start of a forward. The plan is
    quack's own, so the kernel and its arguments are the ones its `gemm` would launch."""
    key = (id(epi), tile, _meta(a), _meta(b), None if d is None else _meta(d),
           tuple((name, _meta(v)) for name, v in epi_args.items()))
    plan = _PLANS.get(key)
    if plan is None:
        plan = epi.gemm(a, b, d, epi_args=epi_args, _launch=False, **_gemm_kwargs(tile))
        _PLANS[key] = plan
        if len(_PLANS) > PLAN_CACHE_SIZE:
            _PLANS.popitem(last=False)
    else:
        _PLANS.move_to_end(key)
    run_gemm_epi_plan(plan, a, b, d, None, epi_args)


def _fwd_chunk(n: int, v: int, tile_n: int, chunk_size: int | None) -> int:
    """Rows per forward GEMM: the fp32 [rows, 2 * ceil(V / tile_N)] partial buffer within FWD_PARTIALS_BUDGET
    (a multiple of 128 rows, the M tile), or `chunk_size` when given."""
    if chunk_size:
        return max(1, min(n, chunk_size))
    per_row = 2 * 4 * -(-v // tile_n)
    rows = max(128, (FWD_PARTIALS_BUDGET // per_row) // 128 * 128)
    return max(1, min(n, rows))


if triton is not None:

    @triton.jit
    def _merge_tiles_kernel(stats_ptr, out_ptr, n_tiles, stride_row, stride_out, WITH_ENT: tl.constexpr,
                            BLOCK_T: tl.constexpr):
        """One row: lse = logsumexp(lse_tile) and mean = sum w mean_tile / sum w, w = exp(lse_tile - max)."""
        r = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_T)
        inside = cols < n_tiles
        lse_t = tl.load(stats_ptr + r * stride_row + n_tiles + cols, mask=inside, other=float("-inf"))
        mx = tl.max(lse_t, axis=0)
        w = tl.where(inside, tl.exp(lse_t - mx), 0.0)
        sw = tl.sum(w, axis=0)
        tl.store(out_ptr + r, mx + tl.log(sw))
        tl.store(out_ptr + stride_out + r, 1.0)
        if WITH_ENT:
            mean_t = tl.load(stats_ptr + r * stride_row + cols, mask=inside, other=0.0)
            tl.store(out_ptr + 2 * stride_out + r, tl.sum(w * mean_t, axis=0) / sw)
        else:
            tl.store(out_ptr + 2 * stride_out + r, 0.0)


def merge_tiles(stats: torch.Tensor, out: torch.Tensor, with_entropy: bool) -> None:
    """Fold the forward's per-tile statistics into the head's (m, s, t) = (lse, 1, mean_z), written into out[0:3]
    ([rows] each). stats: fp32 [rows, 2 * n_tiles], the tiles' softmax means then their log-sum-exps. The mean
    is normalized by the weights' own sum, so lse's rounding (~1 ulp of |lse|) cancels out of it. One Triton
    launch per call (the torch ops below are 17 launches, whose host time the GPU waits out after a synchronize);
    those torch ops where Triton is missing or the row is too long for one program."""
    rows, n_tiles = stats.shape[0], stats.shape[1] // 2
    if rows == 0:
        return
    if (triton is not None and (stats.is_cuda or triton_interpreting()) and n_tiles <= MERGE_MAX_TILES
            and stats.stride(1) == 1 and out.stride(1) == 1):
        _merge_tiles_kernel[(rows,)](stats, out, n_tiles, stats.stride(0), out.stride(0),
                                     WITH_ENT=bool(with_entropy), BLOCK_T=triton.next_power_of_2(n_tiles),
                                     num_warps=4)
        return
    mp, lp = stats[:, :n_tiles], stats[:, n_tiles:]
    lse = torch.logsumexp(lp, dim=1)
    out[0] = lse
    out[1] = 1.0
    if with_entropy:
        w = torch.exp(lp - lse[:, None])
        out[2] = (w * mp).sum(dim=1) / w.sum(dim=1)
    else:
        out[2] = 0.0


def forward_stats(hidden: torch.Tensor, weight: torch.Tensor, labels_local: torch.Tensor, inv_temp: float,
                  with_entropy: bool, chunk_size: int | None):
    """Per-shard statistics as the other backends return them: fp32 [N] (m, s, t, z_label) with
    lse = m + log s and mean_z = t / s (here m = lse, s = 1, t = mean_z; zeros for t without entropy)."""
    why = supports(hidden, weight)
    if why is not None:
        _warn_fallback(why)
        return _fallback().forward_stats(hidden, weight, labels_local, inv_temp, with_entropy, chunk_size)
    n, v = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    # m, s, t, z_label; z_label stays 0 where the label is on another shard (-1: never selected)
    out = torch.zeros(4, n, dtype=torch.float32, device=dev)
    if n == 0:
        return out[0], out[1], out[2], out[3]
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    labels = labels_local.contiguous()  # int32 or int64: the epilogue's select reads either
    n_tiles = -(-v // FWD_TILE[1])
    rows = _fwd_chunk(n, v, FWD_TILE[1], chunk_size)
    stats = torch.empty(rows, 2 * n_tiles, dtype=torch.float32, device=dev)  # per-tile means, then lse's
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        st = stats[: r1 - r0]
        _launch(_stats_epi, hidden[r0:r1], weight, None,
                dict(inv_temp=float(inv_temp), label=labels[r0:r1], stats=st, zy=out[3, r0:r1]), FWD_TILE)
        merge_tiles(st, out[:3, r0:r1], with_entropy)
    return out[0], out[1], out[2], out[3]


def backward(hidden: torch.Tensor, weight: torch.Tensor, labels_local: torch.Tensor, lse: torch.Tensor,
             mean_z: torch.Tensor, grad_lp: torch.Tensor | None, grad_ent: torch.Tensor | None,
             inv_temp: float, need_hidden_grad: bool, need_weight_grad: bool, chunk_size: int | None = None, *,
             budget_bytes: int = BWD_BUDGET_BYTES):
    """Gradients of sum(grad_lp * logprob + grad_ent * entropy) w.r.t. hidden [N, H] and weight [V_local, H]
    (the Triton backend's contract and chunking; the dlogits chunk comes from the CuTe GEMM's epilogue).
    `budget_bytes`: the working memory of the chunks."""
    why = supports(hidden, weight)
    if why is not None:
        _warn_fallback(why)
        return _fallback().backward(hidden, weight, labels_local, lse, mean_z, grad_lp, grad_ent, inv_temp,
                                    need_hidden_grad, need_weight_grad, chunk_size)
    n, h = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    if not (need_hidden_grad or need_weight_grad):
        return None, None
    grad_h = torch.empty_like(hidden) if need_hidden_grad else None
    grad_w = torch.empty_like(weight) if need_weight_grad else None
    if n == 0:
        return grad_h, grad_w
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    labels = labels_local.to(torch.int32).contiguous()
    lse = lse.float().contiguous()
    mean_z = mean_z.float().contiguous()
    glp = torch.zeros(n, device=dev) if grad_lp is None else grad_lp.float().contiguous()
    gent = torch.zeros(n, device=dev) if grad_ent is None else grad_ent.float().contiguous()
    sizes = bwd_sizes(n, v, h, need_hidden_grad, chunk_size, BWD_TILE[0], BWD_TILE[1], budget_bytes,
                      hidden.element_size())
    vs_pad = -(-sizes[1] // 8) * 8  # dz rows 16-byte aligned for the TMA store
    zy = torch.empty(sizes[0], device=dev, dtype=torch.float32)

    def fill_dz(dz: torch.Tensor, c0: int, c1: int, v0: int, v1: int) -> None:
        _dlogits_chunk(hidden[c0:c1], weight[v0:v1], dz, zy[:c1 - c0], labels[c0:c1], v0, lse[c0:c1],
                       mean_z[c0:c1], glp[c0:c1], gent[c0:c1], inv_temp)

    chunked_grads(hidden, weight, grad_h, grad_w, sizes, fill_dz, row_stride=vs_pad)
    return grad_h, grad_w


def _dlogits_chunk(hidden, w_sl, dz, zy, labels, v0, lse, mean_z, glp, gent, inv_temp) -> None:
    """dz [rows, cols] of the vocab slice starting at v0: the epilogue's value everywhere, then the label
    column (where the label falls in this slice) set to its exact fp32 value."""
    cols = w_sl.shape[0]
    local = labels - v0
    in_slice = (local >= 0) & (local < cols)
    idx = torch.where(in_slice, local, torch.full_like(local, -1))
    _launch(_dlogits_epi, hidden, w_sl, dz,
            dict(inv_temp=float(inv_temp), lse=lse, mean=mean_z, glp=glp, gent=gent, label=idx, zy=zy), BWD_TILE)
    r = torch.arange(hidden.shape[0], device=dz.device)
    col = local.clamp(0, cols - 1).long()
    p = torch.exp(zy - lse)  # zy is unwritten (garbage) off the slice: masked by the where below
    d = (glp * (1.0 - p) + gent * p * (mean_z - zy)) * inv_temp
    dz[r, col] = torch.where(in_slice, d.to(dz.dtype), dz[r, col])


def _bwd_extra_bytes(n: int, v: int, h: int, dtype: torch.dtype, budget_bytes: int = BWD_BUDGET_BYTES) -> int:
    """Working memory `backward` allocates beyond its outputs: the chunks, the label column, the fp32 copies of
    the four per-row vectors."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    ts, vs = bwd_sizes(n, v, h, True, None, BWD_TILE[0], BWD_TILE[1], budget_bytes, itemsize)
    return 4 * ts * h + itemsize * ts * (-(-vs // 8) * 8) + ROW_BYTES * n


def _fwd_extra_bytes(n: int, v: int) -> int:
    """Working memory `forward_stats` allocates beyond its [4, N] output."""
    rows = _fwd_chunk(n, v, FWD_TILE[1], None)
    return 2 * 4 * rows * -(-v // FWD_TILE[1])


__all__ = ["backward", "forward_stats", "is_available", "supports", "unavailable_reason"]
