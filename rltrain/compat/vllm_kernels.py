"""vLLM 0.26's batch-invariant forward (VLLM_BATCH_INVARIANT=1, CUDA) as plain functions, so that the Megatron actor
computes each op with the very kernel the rollout engine ran (rollout.true_on_policy with rollout.engine=vllm;
models/megatron/invariant.py wraps them with a backward). Forward only, no autograd, no engine started here.

What vLLM 0.26 runs for a Qwen3 decoder in that mode (custom ops on, no torch.compile, eager or the decode replayed
from CUDA graphs: rollout/vllm_args.py's `true_on_policy_kwargs`), and the function here that runs the same kernel
with the same arguments:
- every linear layer and the LM head: `batch_invariant.linear_batch_invariant` (its persistent Triton matmul, one
  fixed tile config per dtype: a row's result does not depend on the others) -> `linear`;
- every RMSNorm (the first layer's input norm, the q/k norms, and the norms after a residual add):
  `rms_norm_batch_invariant` (Triton, one program per row) -> `rms_norm`. After a residual add vLLM 0.26 runs its
  CUDA `fused_add_rms_norm`, whose rows are not independent of the batch: on one H200 (2026-11-29) 41 of 9,408 rows
  of one call differed by one bf16 ulp from the same rows in calls of 16 (the Triton norm: 0 of 150,528), which
  parted vLLM's decode from its own prefill. `enable` routes those norms through the add in the model dtype and the
  Triton norm (`route_residual_norms`); the actor adds the residual as Megatron does (the same rounding), then
  `rms_norm`;
- rotary: `_custom_ops.rotary_embedding` on the cos/sin cache vLLM builds (fp32 on the GPU, then the model dtype)
  -> `rope`;
- SiLU(gate) * up: `torch.ops._C.silu_and_mul` -> `silu_and_mul`;
- a Qwen3-MoE block: the router is a linear layer (`linear` above, logits in the model dtype); `FusedTopKRouter` picks
  the experts and their weights with `fused_topk` (the CUDA `topk_softmax`: fp32 softmax of the model-dtype logits,
  the top k, renormalized over them under norm_topk_prob) -> `moe_topk`; the experts run as `TritonExperts` (what
  the unquantized oracle picks on Hopper, the one kernel set it allows in batch-invariant mode): the fused-MoE
  Triton GEMM into the gate/up projections at batch-invariant mode's fixed tile config, `silu_and_mul`, the fused-MoE
  GEMM into the down projection with each row multiplied by its routing weight in fp32, then `moe_sum` over the k;
  `fused_experts` runs that sequence with the same kernels and config -> `fused_moe` (a row's result depends on
  its own token only: batches of 1 to 1,024 rows of a Qwen3-30B-A3B layer's shape gave the first row the same bits,
  H200, 2026-11-28);
- attention: FlashAttention 3 (`vllm_flash_attn.flash_attn_varlen_func`, num_splits=1, no scheduler metadata) over a
  paged KV cache of BLOCK_SIZE-token pages in vLLM's NHD layout -> `attention` (the same call on a cache built alike);
- the sampler's log-probs ("processed_logprobs"; vLLM 0.26 runs a dense model on its V2 model runner,
  `vllm/v1/worker/gpu/sample/`): the logits in the model dtype, divided in place by the temperature (its Triton
  kernel: fp32 division, the result stored back in the model dtype; skipped at temperature 1), then
  `compute_token_logprobs` (Triton: the row's max and fp32 log-sum-exp, the label's logit minus both) ->
  `token_logprobs` (the value only: the actor's entropy and gradient are its fused head's). Not the V1 sampler's
  `log_softmax`: on an H200 (docs/vllm.md) the log-probs vLLM reported differed from both torch's and vLLM's
  batch-invariant log-softmax by one ulp on 2.5% of tokens, with the logits bitwise equal
  (`tools/bench_true_on_policy.py --check`, its "head" entry).
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

BLOCK_SIZE = 16  # tokens per KV-cache page: the engine is started with it (rollout/vllm_args.true_on_policy_kwargs)
# vllm.LLM(worker_extension_cls=...): its import routes the residual norms of every engine process (named here, not
# imported: the module imports vLLM)
WORKER_EXTENSION = "rltrain.compat.vllm_worker_ext.RoutedNormsWorker"


def enable() -> None:
    """vLLM's batch-invariant mode for this process, before any engine starts or any GEMM runs: its environment
    (cuBLAS workspace, NCCL) and its aten overrides (log_softmax, softmax, mean, bmm), its V2 model runner, and its
    residual norms routed through the row-independent Triton norm (route_residual_norms). An engine in a process of
    its own gets the environment, and the routing from the worker extension it is started with (WORKER_EXTENSION)."""
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # its sampler's kernels are token_logprobs' (a dense model's default)
    from vllm.model_executor.layers import layernorm
    from vllm.model_executor.layers.batch_invariant import init_batch_invariance

    init_batch_invariance()
    route_residual_norms(layernorm)


def route_residual_norms(layernorm) -> None:
    """Make vLLM's RMSNorm (module `layernorm`, whose forward calls its `rms_norm_batch_invariant(input, weight, eps,
    residual=None)` in batch-invariant mode) compute a residual norm as input + residual in the model dtype, then the
    Triton norm of that sum, returning (normed, sum) as the fused kernel does; without a residual it is unchanged.
    Once per process."""
    norm = layernorm.rms_norm_batch_invariant
    if getattr(norm, "_rltrain_routed", False):
        return

    def rms_norm_batch_invariant(input, weight, eps=1e-6, residual=None):
        if residual is None:
            return norm(input, weight, eps)
        total = input + residual
        return norm(total, weight, eps), total

    rms_norm_batch_invariant._rltrain_routed = True
    layernorm.rms_norm_batch_invariant = rms_norm_batch_invariant


@functools.cache
def _vllm() -> SimpleNamespace:
    """The vLLM entry points this module calls, in one place (the CPU tests give reference ones)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers import batch_invariant as bi
    from vllm.model_executor.layers.fused_moe.fused_moe import fused_experts
    from vllm.model_executor.layers.fused_moe.router.fused_topk_router import fused_topk
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version
    from vllm.v1.worker.gpu.sample.gumbel import apply_temperature
    from vllm.v1.worker.gpu.sample.logprob import compute_token_logprobs
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    return SimpleNamespace(linear=bi.linear_batch_invariant, rms_norm=bi.rms_norm_batch_invariant,
                           apply_temperature=apply_temperature,
                           compute_token_logprobs=compute_token_logprobs,
                           rotary_embedding=ops.rotary_embedding, silu_and_mul=torch.ops._C.silu_and_mul,
                           fused_topk=fused_topk, fused_experts=fused_experts,
                           flash_attn_varlen_func=flash_attn_varlen_func, fa_version=get_flash_attn_version,
                           rotary_class=RotaryEmbedding)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias): vLLM's linear layers' kernel."""
    return _vllm().linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim without a residual (vLLM's first input norm, q/k norms)."""
    return _vllm().rms_norm(x, weight, eps)


@functools.lru_cache(maxsize=8)
def _cos_sin_cache(head_dim: int, max_position: int, theta: float, dtype: torch.dtype, device: str,
                   inverse: bool = False) -> torch.Tensor:
    """vLLM's RotaryEmbedding cache: its own _compute_cos_sin_cache, on the GPU (as vLLM builds it inside the model's
    device context), then in the model dtype. inverse: the sin half negated (the rotation by minus the angle, the
    transpose of the forward's map: its gradient)."""
    if inverse:
        cache = _cos_sin_cache(head_dim, max_position, theta, dtype, device).clone()
        cache[:, head_dim // 2:].neg_()
        return cache
    rotary = _vllm().rotary_class
    ns = SimpleNamespace(rotary_dim=head_dim, max_position_embeddings=max_position, base=theta)
    ns._compute_inv_freq = functools.partial(rotary._compute_inv_freq, ns)
    with torch.device(device):
        return rotary._compute_cos_sin_cache(ns).to(dtype)


@functools.lru_cache(maxsize=16)
def sequence_major_positions(s: int, b: int, device: str) -> torch.Tensor:
    """Positions 0..s-1 of megatron's sequence-major tokens [s, b] flattened (each position b times), int64."""
    return torch.arange(s, device=device).repeat_interleave(b)


def rope(t: torch.Tensor, positions: torch.Tensor, theta: float, max_position: int,
         inverse: bool = False) -> torch.Tensor:
    """Rotary (neox style) of t [tokens, heads, head_dim] at integer positions [tokens]: vLLM's in-place kernel, on
    a copy. inverse: the rotation back (the gradient of the forward's, which is linear in t)."""
    tokens, heads, d = t.shape
    out = t.reshape(tokens, heads * d).clone(memory_format=torch.contiguous_format)
    cache = _cos_sin_cache(d, max_position, float(theta), t.dtype, str(t.device), inverse)
    _vllm().rotary_embedding(positions.to(torch.int64).contiguous(), out, None, d, cache, True)
    return out.view(tokens, heads, d)


def silu_and_mul(h: torch.Tensor) -> torch.Tensor:
    """silu(h[..., :I]) * h[..., I:] for h [..., 2I]: vLLM's SiluAndMul kernel."""
    d = h.shape[-1] // 2
    flat = h.reshape(-1, 2 * d).contiguous()
    out = torch.empty(flat.shape[0], d, dtype=h.dtype, device=h.device)
    _vllm().silu_and_mul(out, flat)
    return out.view(*h.shape[:-1], d)


def moe_topk(x: torch.Tensor, logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A Qwen3-MoE router's choice from its logits [T, E] (model dtype) for the tokens x [T, H]: (weights [T, k] fp32,
    experts [T, k] int32), vLLM's fused top-k softmax (renormalize: over the k, Qwen3-MoE's norm_topk_prob)."""
    weights, experts, _ = _vllm().fused_topk(hidden_states=x, gating_output=logits, topk=int(top_k),
                                             renormalize=bool(renormalize))
    return weights, experts


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
              experts: torch.Tensor) -> torch.Tensor:
    """sum_k weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) over the experts e = experts[t, k], for x [T, H]
    (contiguous, model dtype), w13 [E, 2I, H] (each expert's gate rows, then its up rows), w2 [E, H, I]: vLLM's
    fused-MoE Triton kernels (module docstring). Model dtype [T, H]; no autograd."""
    return _vllm().fused_experts(x.contiguous(), w13, w2, weights.float(), experts.to(torch.int32))


@functools.lru_cache(maxsize=4)
def _fa_version(head_dim: int) -> int:
    return _vllm().fa_version(head_size=head_dim) or 3


@functools.lru_cache(maxsize=16)
def _paged_meta(b: int, s: int, hkv: int, device: str) -> tuple[torch.Tensor, ...]:
    """The FlashAttention call's metadata for b rows of s tokens in runs of pages (read-only, kept per shape)."""
    i32 = dict(dtype=torch.int32, device=device)
    pages = -(-s // BLOCK_SIZE)
    return (torch.arange(0, (b + 1) * s, s, **i32), torch.full((b,), s, **i32),
            torch.arange(b * pages, **i32).view(b, pages),
            torch.ones(1, dtype=torch.float32, device=device).expand(b, hkv))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of rows that start at position 0: q [b, h, s, d], k/v [b, hkv, s, d] -> [b, h, s, d], by
    vLLM's FlashAttention call (num_splits=1) over a paged cache laid out as vLLM's: memory [pages, BLOCK_SIZE, hkv,
    2d] holding K then V per head (logical (pages, hkv, BLOCK_SIZE, 2d), NHD), one row per run of pages."""
    b, h, s, d = q.shape
    hkv = k.shape[1]
    pages = -(-s // BLOCK_SIZE)
    mem = torch.zeros(b * pages, BLOCK_SIZE, hkv, 2 * d, dtype=q.dtype, device=q.device)
    rows = mem.view(b, pages * BLOCK_SIZE, hkv, 2 * d)  # each row's pages in order; the last page's tail stays 0
    rows[:, :s, :, :d] = k.permute(0, 2, 1, 3)
    rows[:, :s, :, d:] = v.permute(0, 2, 1, 3)
    cu_q, used_k, block_table, ones = _paged_meta(b, s, hkv, str(q.device))
    query = q.permute(0, 2, 1, 3).reshape(b * s, h, d).contiguous()
    out = torch.empty_like(query)
    # the unit K/V scales as vLLM passes its layer's (expanded), for a bf16 cache too
    _vllm().flash_attn_varlen_func(
        q=query, k=mem[..., :d], v=mem[..., d:], out=out, cu_seqlens_q=cu_q, max_seqlen_q=s, seqused_k=used_k,
        max_seqlen_k=s, softmax_scale=scale, causal=True, block_table=block_table, fa_version=_fa_version(d),
        num_splits=1, k_descale=ones, v_descale=ones)
    return out.view(b, s, h, d).permute(0, 2, 1, 3)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                   temperature: float) -> torch.Tensor:
    """The sampler's log-prob of labels [c] after the LM head of hidden [c, H] (weight [V, H], the real vocab):
    vLLM's lm-head kernel (logits in the model dtype), its temperature kernel in place (the quotient rounded to the
    model dtype) and its token log-prob kernel. fp32 [c]; no autograd (the fused head gives the gradient and the
    entropy: ops.logprobs_from_hidden(exact_logprob=...))."""
    vllm = _vllm()
    logits = linear(hidden, weight)
    if temperature != 1.0:
        vllm.apply_temperature(logits, torch.zeros(logits.shape[0], dtype=torch.int32, device=logits.device),
                               torch.full((1,), float(temperature), dtype=torch.float32, device=logits.device))
    return vllm.compute_token_logprobs(logits, labels.long()[:, None])[:, 0]
