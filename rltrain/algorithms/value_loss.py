"""The critic's clipped value loss on `[B, L]` response tokens.
Pure tensor math: it must not import the rest of rltrain, read the config or touch torch.distributed.

l = 0.5 * max((v - R)^2, (clip(v, old - c, old + c) - R)^2): the new value may not move more than c
from the value at rollout time without paying for it (PPO's value clipping). Positions outside
`response_mask` are set to 0 before any math, so padding gives neither values nor gradients.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from rltrain.algorithms.aggregation import aggregate_loss, masked_mean

__all__ = ["value_loss"]


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, response_mask: Tensor, *,
               clip: Optional[float] = 0.2, agg: str = "token-mean") -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss and its metrics.

    values:        [B, L] V(s_t) of the critic being trained, requires grad
    old_values:    [B, L] V(s_t) at rollout time (no grad)
    returns:       [B, L] the regression targets R_t (no grad)
    response_mask: [B, L] 0/1 or bool
    clip:          c >= 0, or None for the plain 0.5 (v - R)^2
    agg:           an `AGG_MODES` name

    Returns (loss 0-dim, {"vf_clipfrac": fraction of tokens where the clipped term is the larger}).
    """
    shape = values.shape
    for name, t in (("old_values", old_values), ("returns", returns), ("response_mask", response_mask)):
        if t.shape != shape:
            raise ValueError(f"{name} {tuple(t.shape)} must have the shape of values {tuple(shape)}")
    if clip is not None and clip < 0:
        raise ValueError(f"clip={clip} must be >= 0 (or None to disable value clipping)")
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    v = torch.where(mask, values, zero)
    old = torch.where(mask, old_values.to(values.dtype), zero)
    ret = torch.where(mask, returns.to(values.dtype), zero)

    unclipped = (v - ret).square()
    if clip is None:
        per_token = 0.5 * unclipped
        clip_active = torch.zeros_like(mask)
    else:
        v_clipped = old + (v - old).clamp(-clip, clip)
        clipped = (v_clipped - ret).square()
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clip_active = clipped > unclipped
    loss = aggregate_loss(per_token, mask, agg)
    with torch.no_grad():
        metrics = {"vf_clipfrac": masked_mean(clip_active.to(values.dtype), mask).detach()}
    return loss, metrics
