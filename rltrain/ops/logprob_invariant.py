"""The fused LM head's batch-invariant mode on the torch backend (`logprobs_from_hidden(batch_invariant=True)`): each
token's log-prob and entropy from ops/invariant.py (exact logits, the log-softmax of the distribution sampled from,
with temperature, top-k and top-p), the same bits the rollout engine's sampler computes (rollout.true_on_policy),
whatever the chunking or the number of rows. It must not know tensor parallelism (one vocab shard; logprob.py refuses
a group of more than one rank).

Chunked over tokens like logprob_torch (one chunk's [chunk, V] logits at a time, fp64 scratch). The backward is
logprob_torch's (the plain logits' gradient at the forward's lse and mean_z); with a top-k / top-p set, the logits
outside it are masked (recomputed with the exact forward, so the set is the forward's), as they do not count.
"""

from __future__ import annotations

import torch

from rltrain.ops import invariant as inv
from rltrain.ops import logprob_torch
from rltrain.ops.chunking import pick_chunk_size

_PAD_LOGIT = -1e30  # finite: p = 0 there and 0 * logit stays 0 in the entropy gradient


def _chunk(n: int, v: int, chunk_size: int | None, device) -> int:
    # the exact path holds ~8 fp64 [chunk, V] buffers: a quarter of the plain path's rows per budget
    return chunk_size or max(1, pick_chunk_size(n, v, torch.float64, device=device) // 4)


def _filtered(sampling: tuple[float, int, float]) -> bool:
    _, top_k, top_p = sampling
    return top_k > 0 or top_p < 1.0


class InvariantLinearLogprob(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], labels [N]) -> (logprob fp32 [N], entropy fp32 [N]); sampling = (temperature,
    top_k, top_p). Saves the inputs and fp32 [N] lse / mean_z."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, sampling, with_entropy, entropy_grad, chunk_size):
        n = hidden.shape[0]
        chunk = _chunk(n, weight.shape[0], chunk_size, hidden.device)
        out = torch.zeros(4, n, dtype=torch.float32, device=hidden.device)  # logprob, entropy, lse, mean_z
        for start in range(0, n, chunk):
            stop = min(start + chunk, n)
            stats = inv.token_stats(inv.linear(hidden[start:stop], weight), labels[start:stop], *sampling)[:4]
            for i, value in enumerate(stats):
                out[i, start:stop] = value
        logprob, entropy, lse, mean_z = out
        logprob_torch.save_for_head_backward(ctx, entropy, with_entropy, entropy_grad, hidden, weight, labels, lse, mean_z)
        ctx.sampling, ctx.chunk = sampling, chunk
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, labels, lse, mean_z = ctx.saved_tensors
        grads = logprob_torch.head_output_grads(ctx, grad_lp, grad_ent, lse)
        if grads is None:
            return (None,) * 7
        grad_lp, grad_ent = grads
        temperature = ctx.sampling[0]
        if not _filtered(ctx.sampling):
            gh, gw = logprob_torch.backward(hidden, weight, labels, lse, mean_z, grad_lp, grad_ent, 1.0 / temperature,
                                            ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.chunk)
        else:
            gh, gw = _filtered_backward(hidden, weight, labels, lse, mean_z, grad_lp, grad_ent, ctx)
        return (None if gh is None else gh.to(hidden.dtype), None if gw is None else gw.to(weight.dtype),
                None, None, None, None, None)


def _filtered_backward(hidden, weight, labels, lse, mean_z, grad_lp, grad_ent, ctx):
    """logprob_torch's chunk gradient with the logits outside each row's top-k / top-p set masked out."""
    n, h = hidden.shape
    inv_temp = 1.0 / ctx.sampling[0]
    grad_hidden = torch.empty(n, h, dtype=torch.float32, device=hidden.device) if ctx.needs_input_grad[0] else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=hidden.device) if ctx.needs_input_grad[1] \
        else None
    w32 = weight.float()
    for start in range(0, n, ctx.chunk):
        stop = min(start + ctx.chunk, n)
        h_c = hidden[start:stop].float()
        keep = inv.token_stats(inv.linear(hidden[start:stop], weight), labels[start:stop], *ctx.sampling)[4]
        z = (h_c @ w32.T) * inv_temp
        z = z.masked_fill(~keep, _PAD_LOGIT)
        dz = logprob_torch.grad_logits_inplace(z, True, labels[start:stop], lse[start:stop], mean_z[start:stop],
                                               grad_lp[start:stop],
                                               None if grad_ent is None else grad_ent[start:stop])
        dz.mul_(inv_temp)
        if grad_hidden is not None:
            grad_hidden[start:stop] = dz @ w32
        if grad_weight is not None:
            grad_weight.addmm_(dz.T, h_c)
    return grad_hidden, grad_weight


def invariant_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *, temperature: float,
                       top_k: int, top_p: float, with_entropy: bool, entropy_grad: bool,
                       chunk_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob fp32 [N], entropy fp32 [N]) of labels [N] (in [0, V)) under the sampled distribution of
    hidden [N, H] @ weight [V, H].T (logprobs_from_hidden's batch-invariant torch path)."""
    return InvariantLinearLogprob.apply(hidden, weight, labels, (float(temperature), int(top_k), float(top_p)),
                                        with_entropy, entropy_grad, chunk_size)
