"""Loss aggregation: reduce a per-token loss matrix `[B, L]` under `response_mask` to one scalar.
Pure tensor math: it must not import the rest of rltrain, read the config or touch torch.distributed.

Modes (the config string is the registry key, `AGG_MODES` lists them):

- `token-mean`               sum(l m) / sum(m)                      every token weighs the same
- `seq-mean-token-sum`       mean_i sum_t l m                       every sequence weighs the same
- `seq-mean-token-mean`      mean_i (sum_t l m / sum_t m)           GSPO's and the original GRPO's choice
- `seq-mean-token-sum-norm`  sum(l m) / (B * L), L = max_len or the tensor's length (Dr. GRPO: a
                             constant normalizer, so long answers are not down-weighted)

Sequences whose mask is empty are ignored (B counts only sequences with at least one token), and an
all-empty batch gives exactly 0 (still attached to the graph, with zero gradients), never NaN.
Positions outside the mask are replaced by 0 with `torch.where` before anything is summed, so NaN or
inf there (padding garbage) cannot leak into the result or its gradient.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

__all__ = ["aggregate_loss", "masked_mean", "AGG_MODES"]


def _token_mean(loss: Tensor, mask: Tensor, max_len: Optional[int]) -> Tensor:
    return loss.sum() / mask.sum().clamp(min=1)


def _seq_mean_token_sum(loss: Tensor, mask: Tensor, max_len: Optional[int]) -> Tensor:
    nonempty = (mask.sum(-1) > 0).sum()
    return loss.sum(-1).sum() / nonempty.clamp(min=1)


def _seq_mean_token_mean(loss: Tensor, mask: Tensor, max_len: Optional[int]) -> Tensor:
    tokens = mask.sum(-1)  # [B]
    per_seq = loss.sum(-1) / tokens.clamp(min=1)  # [B]; 0 for an empty sequence
    return per_seq.sum() / (tokens > 0).sum().clamp(min=1)


def _seq_mean_token_sum_norm(loss: Tensor, mask: Tensor, max_len: Optional[int]) -> Tensor:
    length = loss.shape[-1] if max_len is None else max_len
    nonempty = (mask.sum(-1) > 0).sum()
    return loss.sum() / (nonempty.clamp(min=1) * length)


_AGGREGATORS: dict[str, Callable[[Tensor, Tensor, Optional[int]], Tensor]] = {
    "token-mean": _token_mean,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}
AGG_MODES: tuple[str, ...] = tuple(_AGGREGATORS)


def aggregate_loss(loss_mat: Tensor, response_mask: Tensor, mode: str, max_len: Optional[int] = None) -> Tensor:
    """Reduce `loss_mat` [B, L] over the tokens where `response_mask` [B, L] (0/1 or bool) is set.

    `mode` is one of `AGG_MODES`; `max_len` (tokens, > 0) is the constant length of
    `seq-mean-token-sum-norm` and ignored by the other modes. Returns a 0-dim tensor of
    `loss_mat.dtype`.
    """
    fn = _AGGREGATORS.get(mode)
    if fn is None:
        raise ValueError(f"loss aggregation mode {mode!r} is unknown; allowed: {', '.join(AGG_MODES)}")
    if loss_mat.shape != response_mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat {tuple(loss_mat.shape)} and response_mask {tuple(response_mask.shape)} must both be [B, L]"
        )
    if max_len is not None and max_len <= 0:
        raise ValueError(f"max_len={max_len} must be a positive number of tokens (or None for the tensor's length)")
    keep = response_mask.bool()
    loss = torch.where(keep, loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    mask = keep.to(loss_mat.dtype)
    return fn(loss, mask, max_len)


def masked_mean(x: Tensor, response_mask: Tensor) -> Tensor:
    """Mean of `x` [B, L] over the set tokens of `response_mask`; 0 when the mask is empty."""
    return aggregate_loss(x, response_mask, "token-mean")
